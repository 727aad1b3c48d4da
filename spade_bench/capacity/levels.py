"""One level of the capacity benchmark: N users at once against one verifier, in one mode.

    spade          N emulated edges (``emulated_edge``) drafting from each session's trace with
                   the edges' policy, ignoring the verifier's advice
    spade+advice   the same, each block capped at the verifier's last advice
    spade+continue the same, each call letting a saturated verifier continue up to
                   ``LevelSetup.max_continued_tokens`` tokens by itself (the real edge's default)
    replay         N edges replaying the recorded verify calls as they were (fixed blocks)
    spade+pipe     N emulated edges on the pipelined-session wire (``pipelined_edge``), drafting
                   continuously, proposing as they draft (the verifier needs --pipelined-sessions)
    target         N users streaming the same prompts from the verifier's /v1/chat/completions

Each user runs session k mod len(sessions). The verifier's /metrics are read before and after:
the level's row (``report.level_row``) takes their difference. Every user's calls carry
a ``cache_salt`` of their own: the verifier's prefix cache must not serve a prompt that an earlier
level or mode prefilled (the same recorded prompts come back at every level), or the mode run
second would skip prefills the first paid for. Nor may a level inherit the load of the one
before: the verifier judges its saturation over the last few seconds, so levels are
``LevelSetup.pause_s`` apart (``QUIET_PAUSE_S`` for the benchmark), and each starts from a quiet
verifier, as target-only's users do.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import httpx

from spade_bench.capacity.emulated_edge import EdgePolicy, EmulatedEdge, EmulatedRun
from spade_bench.capacity.pipelined_edge import PipelinedEdge, PipelinePolicy
from spade_bench.capacity.report import (
    ADVICE,
    AHEAD_DROPPED,
    AHEAD_USED,
    CONTINUE,
    EMULATED_MODES,
    PIPE,
    PIPE_PROPOSED,
    PIPE_STALE,
    QUEUE_HISTOGRAM,
    QUEUE_P50_MS,
    REPLAY,
    TARGET,
    VERIFIER_CPU,
    LevelRow,
    UserResult,
    histogram_buckets,
    histogram_quantile,
    level_row,
)
from spade_bench.capacity.sessions import RecordedSession
from spade_bench.services import Service, parse_prometheus
from verifier_service.tuning import TUNING

QUIET_PAUSE_S = 2 * TUNING.busy_window_s
"""A pause after which the verifier's busy fraction has decayed to about a tenth (its saturation
is judged over an exponential window of TUNING.busy_window_s): a level after it starts unsaturated."""

METRIC_NAMES = (
    "process_cpu_seconds_total",
    "spade_verifier_queue_seconds_sum",
    "spade_verifier_queue_seconds_count",
    "spade_verifier_batch_sessions_sum",
    "spade_verifier_batch_sessions_count",
    "spade_verifier_forward_passes_total",
    "spade_verifier_generated_tokens_total",
    "spade_verifier_model_forwards_total",
    "spade_verifier_model_forward_rows_total",
    "spade_verifier_prompt_tokens_total",
    "spade_verifier_prefix_hit_tokens_total",  # 0 at every level: each user's calls have a salt of their own
    "spade_verifier_ahead_steps_total",
)
LABELED_SERIES = (AHEAD_USED, AHEAD_DROPPED, PIPE_PROPOSED, PIPE_STALE)
"""Series of one label set each, read as they are (``parse_prometheus`` sums a name's label sets)."""


@dataclass(frozen=True)
class LevelSetup:
    """What every level of a run shares."""

    rtt_s: float = 0.0
    """One link round trip per verify call / target-only request."""
    policy: EdgePolicy = EdgePolicy()
    """The emulated edges' draft length (``spade`` modes; ``follows_advice`` is set per mode)."""
    max_continued_tokens: int = 8
    """What each call of ``spade+continue``'s edges allows the verifier to continue."""
    timeout_s: float = 1800.0
    pause_s: float = 0.0
    """Seconds the verifier rests between two levels (``measure_levels``)."""
    pipeline: PipelinePolicy = PipelinePolicy()
    """The ``spade+pipe`` edges' lead and proposal rate."""


# --- users ------------------------------------------------------------------------------------


def emulated_result(mode: str, run: EmulatedRun) -> UserResult:
    calls = run.calls
    return UserResult(
        mode,
        run.tokens,
        run.started_at,
        run.finished_at,
        run.ttft_s,
        num_calls=len(calls),
        num_mismatches=run.num_mismatches,
        queue_ms=tuple(call.queue_ms for call in calls),
        num_drafted=sum(call.num_drafted for call in calls),
        num_cut=sum(call.is_cut for call in calls),
        num_continued=sum(call.num_continued for call in calls),
    )


async def emulated_user(client: httpx.AsyncClient, mode: str, session: RecordedSession, setup: LevelSetup) -> UserResult:
    """One emulated edge drafting from the session's trace; ``spade+advice`` follows advice,
    ``spade+continue`` also lets the verifier continue (``setup.max_continued_tokens``)."""
    if session.trace is None:
        raise ValueError(f"session {session.item_id} has no draft trace: record again (or run the replay mode)")
    continues = setup.max_continued_tokens if mode == CONTINUE else 0
    policy = replace(setup.policy, follows_advice=mode in (ADVICE, CONTINUE), max_continued_tokens=continues)
    think_s = session.calls[0].think_s if session.calls and not session.calls[0].request["draft_tokens"] else 0.0
    edge = EmulatedEdge(session.trace, policy, setup.rtt_s, think_s)
    return emulated_result(mode, await edge.run(client, asyncio.sleep))


async def pipelined_user(client: httpx.AsyncClient, session: RecordedSession, setup: LevelSetup) -> UserResult:
    """One emulated edge on the pipelined-session wire (``pipelined_edge``); the verifier must
    serve it (``--pipelined-sessions``)."""
    if session.trace is None:
        raise ValueError(f"session {session.item_id} has no draft trace: record again")
    run = await PipelinedEdge(session.trace, setup.pipeline, setup.rtt_s).run(client)
    return UserResult(
        PIPE,
        run.tokens,
        run.started_at,
        run.finished_at,
        run.ttft_s,
        num_calls=run.num_proposals,
        num_mismatches=run.num_mismatches,
        num_drafted=run.num_drafted,
    )


async def replay_user(client: httpx.AsyncClient, session: RecordedSession, rtt_s: float) -> UserResult:
    """One replaying edge: the recorded calls, each after its drafting time + one RTT. The
    calls allow no continuation: a verifier under this level's load could continue other
    tokens than the recording's, and the next recorded call would no longer follow on."""
    session_id = f"cap-{uuid.uuid4().hex[:12]}"
    started_at = time.perf_counter()
    ttft_s, num_calls, mismatches, queue_ms, emitted, drafted = None, 0, 0, [], 0, 0
    for call in session.calls:
        await asyncio.sleep(call.think_s + rtt_s)
        response = await client.post(
            "/v1/verify", json=call.request | {"session_id": session_id, "cache_salt": session_id, "max_continued_tokens": 0}
        )
        num_calls += 1
        if response.status_code != 200:  # the session left the recorded path (409): stop here
            mismatches += 1
            break
        answer = response.json()
        ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_at
        queue_ms.append(answer["timings"]["queue_ms"])
        emitted += answer["num_accepted"] + 1 + len(answer.get("continued_tokens", []))
        drafted += len(call.request["draft_tokens"])
        mismatches += (answer["num_accepted"], answer["next_token"], answer.get("continued_tokens", [])) != (
            call.num_accepted,
            call.next_token,
            call.continued_tokens,
        )
    finished_at = time.perf_counter()
    await client.delete(f"/v1/sessions/{session_id}")
    tokens = session.completion_tokens if mismatches == 0 else min(emitted, session.completion_tokens)
    return UserResult(REPLAY, tokens, started_at, finished_at, ttft_s, num_calls, mismatches, tuple(queue_ms), num_drafted=drafted)


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
        "cache_salt": uuid.uuid4().hex,  # as the edges' sessions: no prefix cached by another run or mode
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


# --- a level ----------------------------------------------------------------------------------


async def run_level(
    verifier_url: str,
    mode: str,
    sessions: list[RecordedSession],
    num_users: int,
    setup: LevelSetup = LevelSetup(),
    cpu_seconds: Callable[[], float] | None = None,
) -> tuple[list[UserResult], dict[str, float]]:
    """N users at once (user k runs session k mod len); returns them and the /metrics delta,
    with ``cpu_seconds()``'s delta (the verifier's process tree) as VERIFIER_CPU when given."""
    limits = httpx.Limits(max_connections=num_users + 4)
    cpu_before = cpu_seconds() if cpu_seconds is not None else 0.0
    async with httpx.AsyncClient(base_url=verifier_url, timeout=setup.timeout_s, limits=limits) as client:
        before = await metrics_text(client)
        chosen = [sessions[k % len(sessions)] for k in range(num_users)]
        if mode in EMULATED_MODES:
            users = [emulated_user(client, mode, session, setup) for session in chosen]
        elif mode == PIPE:
            users = [pipelined_user(client, session, setup) for session in chosen]
        elif mode == REPLAY:
            users = [replay_user(client, session, setup.rtt_s) for session in chosen]
        elif mode == TARGET:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            users = [target_user(client, model, session, setup.rtt_s) for session in chosen]
        else:
            raise ValueError(f"unknown mode {mode!r}")
        results = await asyncio.gather(*users)
        after = await metrics_text(client)
    delta = metrics_delta(before, after)
    if cpu_seconds is not None:
        delta[VERIFIER_CPU] = cpu_seconds() - cpu_before
    return list(results), delta


async def metrics_text(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    response.raise_for_status()
    return response.text


def series_value(text: str, series: str) -> float | None:
    """The value of one exposed series (``name{label="x"}``) in /metrics text, or None."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return None


def metrics_delta(before: str, after: str) -> dict[str, float]:
    """The level's share of the verifier's counters (those it exposes), and its queue time p50
    from the queue histogram's buckets."""
    values_before, values_after = parse_prometheus(before), parse_prometheus(after)
    delta = {name: values_after[name] - values_before.get(name, 0.0) for name in METRIC_NAMES if name in values_after}
    for series in LABELED_SERIES:
        value_after = series_value(after, series)
        if value_after is not None:
            delta[series] = value_after - (series_value(before, series) or 0.0)
    buckets_before = histogram_buckets(before, QUEUE_HISTOGRAM)
    buckets = {bound: count - buckets_before.get(bound, 0.0) for bound, count in histogram_buckets(after, QUEUE_HISTOGRAM).items()}
    queue_p50_s = histogram_quantile(buckets, 0.5)
    if queue_p50_s is not None:
        delta[QUEUE_P50_MS] = queue_p50_s * 1e3
    return delta


def measure_levels(
    verifier: Service,
    sessions: list[RecordedSession],
    user_counts: tuple[int, ...],
    modes: tuple[str, ...],
    setup: LevelSetup,
    label: str = "",
    variants: tuple[tuple[str, Service], ...] = (),
    variant_modes: tuple[str, ...] | None = None,
    variant_setups: Mapping[str, LevelSetup] | None = None,
) -> list[LevelRow]:
    """Per N, each mode on ``verifier``, then each SPADE mode (of ``variant_modes``; None: all)
    on each variant verifier (its label joins the mode's: ``spade+continue@ahead``), side by
    side in the one run; a variant named in ``variant_setups`` runs with that setup (its edges'
    policy), the others with ``setup``."""
    variant_setups = variant_setups or {}
    rows: list[LevelRow] = []
    for num_users in user_counts:
        for mode in modes:
            on_variants = mode != TARGET and (variant_modes is None or mode in variant_modes)
            runs = [(label, verifier, setup)]
            runs += [(f"@{name}{label}", service, variant_setups.get(name, setup)) for name, service in variants if on_variants]
            for suffix, service, run_setup in runs:
                if rows:
                    time.sleep(setup.pause_s)  # the level before must not leave a verifier saturated
                level = run_level(service.url, mode, sessions, num_users, run_setup, cpu_seconds=service.tree_cpu_seconds)
                users, delta = asyncio.run(level)
                row = level_row(mode + suffix, users, delta)
                print(
                    f"  {row.mode} N={num_users}: {row.aggregate_tok_s:.2f} tok/s aggregate, "
                    f"{row.user_tok_s_p50:.2f} per user (p50), {row.num_mismatches} mismatches",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(row)
    return rows
