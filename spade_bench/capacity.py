"""``spade-bench capacity``: how many edges one verifier serves, against target-only serving the
same users.

    record   one real spade-edge (draft model, pinned to the edge's core) generates each prompt
             through a recording proxy in front of the verifier (``capacity_record``)
    spade    N emulated edges at once: each replays a recorded session against the verifier's
             /v1/verify, waiting the recorded drafting time + the link's RTT before each call
    target   N users at once stream the same prompts from the verifier's own
             /v1/chat/completions (one RTT per request)

The verifier does all its real work in both modes; only the edges are replayed (a box with two
cores cannot run 32 draft models). A replay is exact while the verifier's answers equal the
recorded ones (greedy: always, up to fp32 near-ties under batching); mismatches are counted.

    python -m spade_bench.capacity --data spec_bench/question.jsonl --limit 1 --max-tokens 32 \\
        --users 1,2,4,8 --rtt-ms 20 --user-tokens-per-s 1.0 --batch-sessions 1,8 --output cap
    python -m spade_bench.capacity --quick --data spec_bench/question.jsonl   # tiny pair
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from spade_bench.capacity_record import (
    RecordedSession,
    ThreadServer,
    VerifyRecorder,
    read_sessions,
    recording_app,
    write_sessions,
)
from spade_bench.capacity_report import (
    SPADE,
    TARGET,
    VERIFIER_CPU,
    LevelRow,
    UserResult,
    level_row,
    markdown_table,
    write_plots,
)
from spade_bench.client import Generation, make_client, served_model, stream_chat
from spade_bench.config import DEFAULT_DRAFT, DEFAULT_TARGET, Placement
from spade_bench.data import BenchItem, DataSelection, conversation, load_items
from spade_bench.services import Service, ServiceSpec, edge_command, parse_prometheus, start_service, verifier_command

METRIC_NAMES = (
    "process_cpu_seconds_total",
    "spade_verifier_queue_seconds_sum",
    "spade_verifier_queue_seconds_count",
    "spade_verifier_batch_sessions_sum",
    "spade_verifier_batch_sessions_count",
    "spade_verifier_forward_passes_total",
)


# --- record -----------------------------------------------------------------------------------


def record_sessions(
    edge_url: str, recorder: VerifyRecorder, items: list[BenchItem], generation: Generation, timeout_s: float = 1800.0
) -> list[RecordedSession]:
    """One chat request per item through the edge, one at a time; each becomes a session."""
    sessions = []
    with make_client(edge_url, timeout_s) as client:
        model = served_model(client)
        for item in items:
            messages = conversation(item, [])
            started_at = time.perf_counter()
            result = stream_chat(client, model, messages, generation)
            session_ids = recorder.sessions_since(started_at)
            if len(session_ids) != 1:
                raise RuntimeError(f"item {item.item_id}: expected one verify session, saw {len(session_ids)}")
            sessions.append(
                recorder.session(
                    session_ids[0], started_at, item.item_id, messages, generation.max_tokens, result.completion_tokens, result.text
                )
            )
    return sessions


# --- replay -----------------------------------------------------------------------------------


async def replay_user(client: httpx.AsyncClient, session: RecordedSession, rtt_s: float) -> UserResult:
    """One emulated edge: the recorded calls, each after its drafting time + one RTT."""
    session_id = f"cap-{uuid.uuid4().hex[:12]}"
    started_at = time.perf_counter()
    ttft_s, num_calls, mismatches, queue_ms, emitted = None, 0, 0, [], 0
    for call in session.calls:
        await asyncio.sleep(call.think_s + rtt_s)
        response = await client.post("/v1/verify", json=call.request | {"session_id": session_id})
        num_calls += 1
        if response.status_code != 200:  # the session left the recorded path (409): stop here
            mismatches += 1
            break
        answer = response.json()
        ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_at
        queue_ms.append(answer["timings"]["queue_ms"])
        emitted += answer["num_accepted"] + 1
        mismatches += (answer["num_accepted"], answer["next_token"]) != (call.num_accepted, call.next_token)
    finished_at = time.perf_counter()
    await client.delete(f"/v1/sessions/{session_id}")
    tokens = session.completion_tokens if mismatches == 0 else min(emitted, session.completion_tokens)
    return UserResult(SPADE, tokens, started_at, finished_at, ttft_s, num_calls, mismatches, tuple(queue_ms))


async def target_user(client: httpx.AsyncClient, model: str, session: RecordedSession, rtt_s: float) -> UserResult:
    """One target-only user: the same prompt streamed from the verifier's OpenAI route."""
    started_at = time.perf_counter()
    await asyncio.sleep(rtt_s)  # one round trip per streamed request
    body = {
        "model": model,
        "messages": session.messages,
        "max_tokens": session.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ttft_s, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            payload = line.removeprefix("data:").strip()
            if not line.startswith("data:") or payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_at
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return UserResult(TARGET, tokens, started_at, time.perf_counter(), ttft_s)


async def run_level(
    verifier_url: str,
    mode: str,
    sessions: list[RecordedSession],
    num_users: int,
    rtt_s: float,
    timeout_s: float = 1800.0,
    cpu_seconds: Callable[[], float] | None = None,
) -> tuple[list[UserResult], dict[str, float]]:
    """N users at once (user k replays session k mod len); returns them and the /metrics delta,
    with ``cpu_seconds()``'s delta (the verifier's process tree) as VERIFIER_CPU when given."""
    limits = httpx.Limits(max_connections=num_users + 4)
    cpu_before = cpu_seconds() if cpu_seconds is not None else 0.0
    async with httpx.AsyncClient(base_url=verifier_url, timeout=timeout_s, limits=limits) as client:
        before = await _metrics(client)
        if mode == SPADE:
            users = [replay_user(client, sessions[k % len(sessions)], rtt_s) for k in range(num_users)]
        else:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            users = [target_user(client, model, sessions[k % len(sessions)], rtt_s) for k in range(num_users)]
        results = await asyncio.gather(*users)
        after = await _metrics(client)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in METRIC_NAMES if name in after}
    if cpu_seconds is not None:
        delta[VERIFIER_CPU] = cpu_seconds() - cpu_before
    return list(results), delta


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_prometheus(response.text)


def measure_levels(
    verifier: Service, sessions: list[RecordedSession], user_counts: tuple[int, ...], modes: tuple[str, ...], rtt_s: float, label: str = ""
) -> list[LevelRow]:
    rows = []
    for num_users in user_counts:
        for mode in modes:
            level = run_level(verifier.url, mode, sessions, num_users, rtt_s, cpu_seconds=verifier.tree_cpu_seconds)
            users, delta = asyncio.run(level)
            row = level_row(mode + label, users, delta)
            print(
                f"  {row.mode} N={num_users}: {row.aggregate_tok_s:.2f} tok/s aggregate, "
                f"{row.user_tok_s_p50:.2f} per user (p50), {row.num_mismatches} mismatches",
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
    return rows


# --- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityConfig:
    items: list[BenchItem]
    output_dir: Path
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    dtype: str = "float32"
    max_tokens: int = 32
    draft_length: str = "8"
    user_counts: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = (SPADE, TARGET)
    batch_sessions: tuple[int, ...] = (8,)
    """The verifier's own default (--max-batch-sessions 8); 1 = one call at a time."""
    rtt_ms: float = 20.0
    user_tokens_per_s: float = 1.0
    placement: Placement = Placement.default()
    verifier_args: tuple[str, ...] = ()
    edge_args: tuple[str, ...] = ()
    recording: Path | None = None
    startup_timeout_s: float = 900.0


def _verifier_spec(config: CapacityConfig, batch: int) -> ServiceSpec:
    command = verifier_command(config.target, None, config.dtype, config.placement.threads)
    command += ("--max-batch-sessions", str(batch), *config.verifier_args)
    return ServiceSpec(
        f"verifier-batch{batch}", command, config.placement.verifier_cores, config.placement.threads, config.output_dir / "logs"
    )


def record_phase(config: CapacityConfig) -> list[RecordedSession]:
    """The real edge against the verifier (batching off), through the recording proxy."""
    recorder = VerifyRecorder()
    with (
        start_service(_verifier_spec(config, 1), config.startup_timeout_s) as verifier,
        ThreadServer(recording_app(verifier.url, recorder)) as proxy_url,
    ):
        command = (
            edge_command(config.draft, None, config.dtype, config.placement.threads, proxy_url, config.draft_length) + config.edge_args
        )
        spec = ServiceSpec("edge-record", command, config.placement.edge_cores, config.placement.threads, config.output_dir / "logs")
        with start_service(spec, config.startup_timeout_s) as edge:
            return record_sessions(edge.url, recorder, config.items, Generation(config.max_tokens))


def run_capacity(config: CapacityConfig) -> tuple[list[RecordedSession], list[LevelRow]]:
    config.output_dir.mkdir(parents=True, exist_ok=True)
    sessions = read_sessions(config.recording) if config.recording else record_phase(config)
    write_sessions(sessions, config.output_dir / "recording.jsonl")
    rows = []
    for batch in config.batch_sessions:
        with start_service(_verifier_spec(config, batch), config.startup_timeout_s) as verifier:
            label = f"-b{batch}" if len(config.batch_sessions) > 1 else ""
            rows += measure_levels(verifier, sessions, config.user_counts, config.modes, config.rtt_ms / 1e3, label)
    return sessions, rows


def write_outputs(config: CapacityConfig, sessions: list[RecordedSession], rows: list[LevelRow]) -> str:
    table = markdown_table(rows, config.user_tokens_per_s)
    edges = f"replaying {config.recording}" if config.recording else f"draft {config.draft} (--draft-length {config.draft_length})"
    setup = (
        f"target {config.target}, {edges}, {config.dtype}, "
        f"{config.max_tokens} tokens per user, RTT {config.rtt_ms:g} ms, {len(sessions)} recorded session(s), "
        f"verifier on cores {list(config.placement.verifier_cores)} with {config.placement.threads} thread(s)"
    )
    markdown = f"# Capacity\n\n{setup}\n\n{table}\n"
    (config.output_dir / "capacity.md").write_text(markdown)
    (config.output_dir / "capacity.json").write_text(
        json.dumps(
            {
                "setup": setup,
                "rows": [row.to_dict() for row in rows],
                "recorded": [
                    {"item_id": s.item_id, "calls": len(s.calls), "tokens": s.completion_tokens, "clean": s.is_clean} for s in sessions
                ],
            },
            indent=2,
        )
    )
    try:
        write_plots(rows, config.output_dir / "plots", title=setup[:90])
    except ImportError as error:  # e.g. the vLLM environment, which has no matplotlib
        print(f"plots NOT written ({error}); the tables are in {config.output_dir}", file=sys.stderr)
    return markdown


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    from gateway.cli import add_version_argument, plain_text

    doc = plain_text(__doc__)
    parser = argparse.ArgumentParser(
        prog="spade-bench capacity",
        description=doc.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n", 1)[1],
    )
    add_version_argument(parser)
    parser.add_argument("--data", action="append", default=[], metavar="PATH", help="Spec-Bench or CNN/DM .jsonl")
    parser.add_argument("--limit", type=int, default=1, help="items per category (default 1)")
    parser.add_argument("--categories", default="", help="comma list of categories to keep (default all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per user (default 32)")
    parser.add_argument("--users", type=_ints, default=(1, 2, 4, 8), help="comma list of N (default 1,2,4,8)")
    parser.add_argument("--modes", default="spade,target", help="comma list: spade and/or target (default spade,target)")
    parser.add_argument(
        "--batch-sessions",
        type=_ints,
        default=CapacityConfig.batch_sessions,
        help="comma list of verifier --max-batch-sessions values, one verifier each (default 8, the verifier's own)",
    )
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="link round trip per verify call / target request (default 20)")
    parser.add_argument("--user-tokens-per-s", type=float, default=1.0, help="per-user speed target (default 1.0)")
    parser.add_argument("--draft-length", default="8", help="the recording edge's --draft-length (default 8)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    parser.add_argument("--dtype", default="float32", help="both services' --dtype (default float32)")
    parser.add_argument("--threads", type=int, default=1, help="threads per service (default 1)")
    parser.add_argument("--verifier-args", type=shlex.split, default=(), help="extra spade-verifier flags, one quoted string")
    parser.add_argument("--edge-args", type=shlex.split, default=(), help="extra spade-edge flags, one quoted string")
    parser.add_argument(
        "--startup-timeout-s",
        "--startup-timeout",
        dest="startup_timeout_s",
        metavar="S",
        type=float,
        default=CapacityConfig.startup_timeout_s,
        help=f"seconds to wait for a service's /health (default {CapacityConfig.startup_timeout_s:g})",
    )
    parser.add_argument("--recording", type=Path, help="replay this recording.jsonl instead of recording")
    parser.add_argument("--quick", action="store_true", help="the tiny pair (built under --output), 16 tokens")
    parser.add_argument("--output", type=Path, default=Path("capacity_results"), help="results directory (default capacity_results)")
    return parser


def config_from_args(args: argparse.Namespace) -> CapacityConfig:
    if not args.data and not args.recording:
        raise ValueError("--data PATH (or --recording) is required")
    selection = DataSelection(categories=tuple(c for c in args.categories.split(",") if c), limit=args.limit)
    items = [item for path in args.data for item in load_items(path, selection)]
    config = CapacityConfig(
        items=items,
        output_dir=args.output,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        draft_length=args.draft_length,
        user_counts=args.users,
        modes=tuple(m for m in args.modes.split(",") if m),
        batch_sessions=args.batch_sessions,
        rtt_ms=args.rtt_ms,
        user_tokens_per_s=args.user_tokens_per_s,
        placement=Placement.default(args.threads),
        verifier_args=tuple(args.verifier_args),
        edge_args=tuple(args.edge_args),
        recording=args.recording,
        startup_timeout_s=args.startup_timeout_s,
    )
    if args.quick:
        from spade_models.tiny import build_tiny_pair

        target, draft = build_tiny_pair(args.output / "tiny-models")
        config = replace(config, target=str(target), draft=str(draft), max_tokens=min(args.max_tokens, 16))
    return config


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(build_parser().parse_args(argv))
    except ValueError as error:
        print(f"spade-bench capacity: {error}", file=sys.stderr)
        return 2
    sessions, rows = run_capacity(config)
    print(write_outputs(config, sessions, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
