"""``spade-bench capacity``: how many edges one verifier serves, against target-only serving the
same users.

    record        one real spade-edge (draft model, pinned to the edge's core) generates each
                  prompt through a recording proxy in front of the verifier (``record``);
                  then one teacher-forced pass of the edge's own drafter along each output keeps
                  the draft's proposals and its time per token (``draft_trace``)
    spade         N emulated edges at once (``emulated_edge``): each drafts any length from its
                  session's trace with the edges' policy (--edge-draft-length), waits its
                  drafting (less what it drafted ahead under the last call, as the real edge,
                  --edge-draft-ahead) + the link's RTT before each real /v1/verify call, ignores
                  the advice
    spade+advice  the same, each block capped at the verifier's advised_draft_length
    spade+continue  the same, each call letting a saturated verifier (advice 0) continue up to
                  --max-continued-tokens tokens by itself (the real edge's default)
    replay        N edges replaying the recorded verify calls as they were (fixed blocks)
    target        N users at once stream the same prompts from the verifier's own
                  /v1/chat/completions (one RTT per request)

The verifier does all its real work in every mode; only the edges are emulated (a box with two
cores cannot run 32 draft models). Every verdict is checked against the target's recorded
output (greedy fp32: 0 mismatches expected); mismatches are counted. Then a 2,000-token prompt
arrives while 4 sessions verify (``prefill_interference``): how much it delays their blocks.

Two mixes (--mix): ``short`` (short prompts, 128-token answers; Spec-Bench) and ``long`` (CNN/DM
articles of ~900-1,400 tokens, 32-token answers); the data paths are arguments:

    python -m spade_bench.capacity --mix short --data $DATA/spec_bench/question_dev.jsonl --limit 1 \
        --users 1,2,4,8 --rtt-ms 20 --output bench_results/capacity_short
    python -m spade_bench.capacity --mix long --data $DATA/cnndm/test_dev.jsonl --limit 6 \
        --users 1,2,4,8 --rtt-ms 20 --output bench_results/capacity_long
    python -m spade_bench.capacity --quick --data spec_bench/question.jsonl   # tiny pair
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from edge_agent.draft_length import parse_draft_length
from spade_bench.capacity.draft_trace import run_pinned_trace
from spade_bench.capacity.emulated_edge import EdgePolicy
from spade_bench.capacity.levels import QUIET_PAUSE_S, LevelSetup, measure_levels
from spade_bench.capacity.prefill_interference import InterferenceResult, InterferenceSetup, interference_table, measure_interference
from spade_bench.capacity.record import ThreadServer, VerifyRecorder, recording_app
from spade_bench.capacity.report import ADVICE, CONTINUE, EMULATED_MODES, PIPE, REPLAY, SPADE, TARGET, LevelRow, markdown_table, write_plots
from spade_bench.capacity.sessions import RecordedSession, read_sessions, write_sessions
from spade_bench.client import Generation, make_client, served_model, stream_chat
from spade_bench.config import DEFAULT_DRAFT, DEFAULT_TARGET, Placement
from spade_bench.data import BenchItem, DataSelection, conversation, load_items
from spade_bench.services import ServiceSpec, console_command, edge_command, start_service, verifier_command

MODES = (TARGET, SPADE, ADVICE, CONTINUE, PIPE, REPLAY)
MIXES = {
    "short": {"max_tokens": 128},
    "long": {"max_tokens": 32, "max_article_chars": 8000, "min_prompt_chars": 4500},
}
"""--mix: short prompts with long answers; long prompts with short answers: CNN/DM articles of at
least 4,500 characters (the dev split's 24 longest: 906-1,402 tokens with Qwen2.5's chat template;
none is longer than 5,700 characters), cut at 8,000."""


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
    """The recording edge's --draft-length."""
    edge_policy: EdgePolicy = EdgePolicy()
    """The emulated edges' draft length (spade modes)."""
    user_counts: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = (TARGET, SPADE, ADVICE)
    batch_sessions: tuple[int, ...] = (8,)
    """The verifier's own default (--max-batch-sessions 8); 1 = one call at a time."""
    rtt_ms: float = 20.0
    max_continued_tokens: int = 8
    """What the ``spade+continue`` edges' calls let the verifier continue."""
    pause_s: float = QUIET_PAUSE_S
    """The verifier's rest between levels, and before the prefill scenario."""
    user_tokens_per_s: float = 1.0
    placement: Placement = field(default_factory=Placement.default)
    verifier_args: tuple[str, ...] = ()
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Verifiers with extra flags (label, flags) whose SPADE modes run beside the main one's,
    per N, in the same run (``--variant``)."""
    edge_args: tuple[str, ...] = ()
    recording: Path | None = None
    startup_timeout_s: float = 900.0
    prefill: InterferenceSetup | None = InterferenceSetup()
    """The prefill-interference scenario (None: skipped)."""
    mix: str = ""


def _verifier_spec(config: CapacityConfig, batch: int, variant: tuple[str, tuple[str, ...]] = ("", ())) -> ServiceSpec:
    """The verifier of ``batch`` (``variant``: a label and the flags it adds)."""
    label, extra = variant
    command = verifier_command(config.target, None, config.dtype, config.placement.threads)
    pipelined = ("--pipelined-sessions", "true") if PIPE in config.modes else ()  # the wire spade+pipe's edges speak
    command += ("--max-batch-sessions", str(batch), *pipelined, *config.verifier_args, *extra)
    name = f"verifier-batch{batch}" + (f"-{label}" if label else "")
    return ServiceSpec(name, command, config.placement.verifier_cores, config.placement.threads, config.output_dir / "logs")


def _edge_flags(config: CapacityConfig, verifier_url: str) -> tuple[str, ...]:
    """The recording edge's spade-edge flags (without the program)."""
    command = edge_command(config.draft, None, config.dtype, config.placement.threads, verifier_url, config.draft_length)
    # A long prompt's prefill on one CPU core can outlast the edge's default 60 s per call; a
    # retried call would be recorded twice. --edge-args may still set its own (the last flag wins).
    patient = ("--verify-timeout-s", str(config.startup_timeout_s))
    return command[len(console_command("spade-edge", "edge_agent.cli")) :] + patient + config.edge_args


def traced(config: CapacityConfig, sessions: list[RecordedSession], verifier_url: str) -> list[RecordedSession]:
    """The sessions with the draft's teacher-forced proposals, from the edge's own drafter on
    the edge's cores (``verifier_url``: whose /health bounds the drafter, as the edge's)."""
    if all(session.trace is not None for session in sessions):
        return sessions
    untraced, traced_path = config.output_dir / "recording-calls.jsonl", config.output_dir / "recording-traced.jsonl"
    write_sessions(sessions, untraced)
    run_pinned_trace(untraced, traced_path, _edge_flags(config, verifier_url), config.placement.edge_cores, config.placement.threads)
    return read_sessions(traced_path)


def record_phase(config: CapacityConfig) -> list[RecordedSession]:
    """The real edge against the verifier (batching off), through the recording proxy; then the
    draft's teacher-forced pass along each recorded output."""
    recorder = VerifyRecorder()
    with (
        start_service(_verifier_spec(config, 1), config.startup_timeout_s) as verifier,
        ThreadServer(recording_app(verifier.url, recorder)) as proxy_url,
    ):
        spec = ServiceSpec(
            "edge-record",
            console_command("spade-edge", "edge_agent.cli") + _edge_flags(config, proxy_url),
            config.placement.edge_cores,
            config.placement.threads,
            config.output_dir / "logs",
        )
        with start_service(spec, config.startup_timeout_s) as edge:
            sessions = record_sessions(edge.url, recorder, config.items, Generation(config.max_tokens))
        return traced(config, sessions, verifier.url)


@dataclass
class CapacityRun:
    sessions: list[RecordedSession]
    rows: list[LevelRow] = field(default_factory=list)
    interference: dict[int, InterferenceResult] = field(default_factory=dict)
    """Per verifier --max-batch-sessions."""


def run_capacity(config: CapacityConfig) -> CapacityRun:
    config.output_dir.mkdir(parents=True, exist_ok=True)
    sessions = read_sessions(config.recording) if config.recording else record_phase(config)
    needs_traces = bool({*EMULATED_MODES, PIPE} & set(config.modes)) or config.prefill is not None
    run = CapacityRun(sessions)
    setup = LevelSetup(config.rtt_ms / 1e3, config.edge_policy, config.max_continued_tokens, pause_s=config.pause_s)
    for batch in config.batch_sessions:
        with contextlib.ExitStack() as services:
            verifier = services.enter_context(start_service(_verifier_spec(config, batch), config.startup_timeout_s))
            variants = tuple(
                (variant[0], services.enter_context(start_service(_verifier_spec(config, batch, variant), config.startup_timeout_s)))
                for variant in config.variants
            )
            if needs_traces:
                run.sessions = traced(config, run.sessions, verifier.url)
            write_sessions(run.sessions, config.output_dir / "recording.jsonl")
            label = f"-b{batch}" if len(config.batch_sessions) > 1 else ""
            run.rows += measure_levels(verifier, run.sessions, config.user_counts, config.modes, setup, label, variants)
            if config.prefill is not None:
                time.sleep(config.pause_s)
                prefill = replace(config.prefill, rtt_s=setup.rtt_s, policy=config.edge_policy)
                run.interference[batch] = asyncio.run(measure_interference(verifier.url, run.sessions, prefill))
    return run


def write_outputs(config: CapacityConfig, run: CapacityRun) -> str:
    sessions = run.sessions
    table = markdown_table(run.rows, config.user_tokens_per_s)
    edges = (
        f"replaying {config.recording}"
        if config.recording
        else f"draft {config.draft} (recorded with --draft-length {config.draft_length})"
    )
    prompt_tokens = [len(s.trace.prompt_token_ids) for s in sessions if s.trace]
    setup = (
        f"target {config.target}, {edges}, emulated edges' draft length {config.edge_policy.draft_length}, {config.dtype}, "
        f"{config.max_tokens} tokens per user{f' (mix {config.mix})' if config.mix else ''}, RTT {config.rtt_ms:g} ms, "
        f"{len(sessions)} recorded session(s)"
        + (f" with prompts of {min(prompt_tokens)}-{max(prompt_tokens)} tokens" if prompt_tokens else "")
        + f", verifier on cores {list(config.placement.verifier_cores)} with {config.placement.threads} thread(s)"
    )
    interference = "\n\n".join(
        f"Verifier --max-batch-sessions {batch}. {interference_table(result)}" for batch, result in run.interference.items()
    )
    markdown = f"# Capacity\n\n{setup}\n\n{table}\n" + (f"\n## Prefill interference\n\n{interference}\n" if interference else "")
    (config.output_dir / "capacity.md").write_text(markdown)
    (config.output_dir / "capacity.json").write_text(json.dumps(_json_report(setup, run), indent=2))
    try:
        write_plots(run.rows, config.output_dir / "plots", title=setup[:90])
    except ImportError as error:  # e.g. the vLLM environment, which has no matplotlib
        print(f"plots NOT written ({error}); the tables are in {config.output_dir}", file=sys.stderr)
    return markdown


def _json_report(setup: str, run: CapacityRun) -> dict:
    recorded = []
    for session in run.sessions:
        trace = session.trace
        described = {
            "item_id": session.item_id,
            "calls": len(session.calls),
            "tokens": session.completion_tokens,
            "clean": session.is_clean,
        }
        if trace is not None:
            accepted = sum(g == y for g, y in zip(trace.proposals, trace.target_token_ids, strict=True))
            described |= {
                "prompt_tokens": len(trace.prompt_token_ids),
                "draft_ms_per_token": trace.draft_s_per_token * 1e3,
                "draft_prefill_ms": trace.draft_prefill_s * 1e3,
                "proposal_match_rate": accepted / max(1, len(trace.proposals)),
            }
        recorded.append(described)
    return {
        "setup": setup,
        "rows": [row.to_dict() for row in run.rows],
        "prefill_interference": {str(batch): result.to_dict() for batch, result in run.interference.items()},
        "recorded": recorded,
    }


def _variant(text: str) -> tuple[str, tuple[str, ...]]:
    label, separator, flags = text.partition("=")
    if not separator or not label.strip() or not label.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected LABEL=FLAGS with a word for LABEL, got {text!r}")
    return label.strip(), tuple(shlex.split(flags))


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
    parser.add_argument(
        "--mix", choices=sorted(MIXES), help="short: 128-token answers; long: CNN/DM articles of 900-1,400 tokens, 32-token answers"
    )
    parser.add_argument("--max-tokens", type=int, help="tokens per user (default: the mix's, else 32)")
    parser.add_argument("--users", type=_ints, default=(1, 2, 4, 8), help="comma list of N (default 1,2,4,8)")
    parser.add_argument(
        "--modes", default="target,spade,spade+advice", help=f"comma list of {', '.join(MODES)} (default target,spade,spade+advice)"
    )
    parser.add_argument("--edge-draft-length", default="auto", help="the emulated edges' --draft-length: an integer or auto (default auto)")
    parser.add_argument("--max-draft-length", type=int, default=16, help="the emulated edges' --max-draft-length (default 16)")
    parser.add_argument(
        "--prefill-tokens", type=int, default=2000, help="the prefill-interference prompt's tokens; 0 skips it (default 2000)"
    )
    parser.add_argument("--prefill-sessions", type=int, default=4, help="sessions verifying while that prompt arrives (default 4)")
    parser.add_argument(
        "--batch-sessions",
        type=_ints,
        default=CapacityConfig.batch_sessions,
        help="comma list of verifier --max-batch-sessions values, one verifier each (default 8, the verifier's own)",
    )
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="link round trip per verify call / target request (default 20)")
    parser.add_argument(
        "--max-continued-tokens",
        type=int,
        default=CapacityConfig.max_continued_tokens,
        help=f"what each call of spade+continue's edges lets the verifier continue (default {CapacityConfig.max_continued_tokens})",
    )
    parser.add_argument(
        "--level-pause-s",
        type=float,
        default=QUIET_PAUSE_S,
        help=f"seconds the verifier rests between levels, so each starts unsaturated (default {QUIET_PAUSE_S:g})",
    )
    parser.add_argument(
        "--edge-draft-ahead",
        choices=("on", "off"),
        default="on",
        help="the emulated edges draft ahead under each call, as the real edge's defaults (default on)",
    )
    parser.add_argument("--user-tokens-per-s", type=float, default=1.0, help="per-user speed target (default 1.0)")
    parser.add_argument(
        "--draft-length", default="8", help="the recording edge's --draft-length (default 8; spade/spade+advice do not depend on it)"
    )
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    parser.add_argument("--dtype", default="float32", help="both services' --dtype (default float32)")
    parser.add_argument("--threads", type=int, default=1, help="threads per service (default 1)")
    parser.add_argument("--verifier-args", type=shlex.split, default=(), help="extra spade-verifier flags, one quoted string")
    parser.add_argument("--edge-args", type=shlex.split, default=(), help="extra spade-edge flags, one quoted string")
    parser.add_argument(
        "--variant",
        type=_variant,
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="a second verifier with these extra spade-verifier flags, its SPADE modes run beside the main one's per N "
        "(rows MODE@LABEL); repeatable. Example: --variant 'ahead=--step-ahead-tokens 8'",
    )
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
    mix = MIXES.get(args.mix or "", {})
    selection = DataSelection(
        categories=tuple(c for c in args.categories.split(",") if c), limit=None, max_article_chars=mix.get("max_article_chars")
    )
    items = [item for path in args.data for item in load_items(path, selection) if len(item.turns[0]) >= mix.get("min_prompt_chars", 0)]
    items = _limited(items, args.limit)
    modes = tuple(m for m in args.modes.split(",") if m)
    if set(modes) - set(MODES):
        raise ValueError(f"--modes: choose among {', '.join(MODES)}, got {args.modes!r}")
    draft_length = parse_draft_length(args.edge_draft_length)
    config = CapacityConfig(
        items=items,
        output_dir=args.output,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        max_tokens=args.max_tokens or mix.get("max_tokens", 32),
        draft_length=args.draft_length,
        edge_policy=EdgePolicy(draft_length, args.max_draft_length, drafts_ahead=args.edge_draft_ahead == "on"),
        user_counts=args.users,
        modes=modes,
        batch_sessions=args.batch_sessions,
        rtt_ms=args.rtt_ms,
        max_continued_tokens=args.max_continued_tokens,
        pause_s=args.level_pause_s,
        user_tokens_per_s=args.user_tokens_per_s,
        placement=Placement.default(args.threads),
        verifier_args=tuple(args.verifier_args),
        variants=tuple(args.variant),
        edge_args=tuple(args.edge_args),
        recording=args.recording,
        startup_timeout_s=args.startup_timeout_s,
        prefill=InterferenceSetup(args.prefill_tokens, args.prefill_sessions) if args.prefill_tokens > 0 else None,
        mix=args.mix or "",
    )
    if args.quick:
        from spade_models.tiny import build_tiny_pair

        target, draft = build_tiny_pair(args.output / "tiny-models")
        config = replace(config, target=str(target), draft=str(draft), max_tokens=min(config.max_tokens, 16))
    return config


def _limited(items: list[BenchItem], limit: int) -> list[BenchItem]:
    """At most ``limit`` items per category, in file order (after the mix's length filter)."""
    counts: dict[str, int] = {}
    kept = []
    for item in items:
        counts[item.category] = counts.get(item.category, 0) + 1
        if counts[item.category] <= limit:
            kept.append(item)
    return kept


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(build_parser().parse_args(argv))
    except ValueError as error:
        print(f"spade-bench capacity: {error}", file=sys.stderr)
        return 2
    print(write_outputs(config, run_capacity(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
