"""How much a long prompt arriving at the verifier delays the blocks of the sessions it serves.

``num_sessions`` emulated edges (``emulated_edge``, their policy, no advice) generate; once each
has had ``warm_calls`` blocks verified, one more session sends a prompt of ``prompt_tokens``
tokens alone (the prompt-only first call of a new edge: the target's whole prefill). The edges'
blocks are then compared: the verify time of each call (sent -> answered, what the edge waits
beyond the link) answered before the prompt arrived against those in flight while it was
prefilled. Issue 21's goal: the prompt delays a block by at most one chunk's forward.

    before   drafted calls answered before the prompt was sent
    during   drafted calls whose time overlaps the prompt's (sent -> answered)
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

import httpx

from spade_bench.capacity.emulated_edge import CallRecord, EdgePolicy, EmulatedEdge, EmulatedRun
from spade_bench.capacity.report import percentile
from spade_bench.capacity.sessions import RecordedSession
from verifier_service.protocol import VerifyRequest, WireSampling, context_digest

POLL_S = 0.01


@dataclass(frozen=True)
class InterferenceSetup:
    prompt_tokens: int = 2000
    num_sessions: int = 4
    warm_calls: int = 2
    """Blocks each edge has had verified before the prompt is sent."""
    rtt_s: float = 0.0
    policy: EdgePolicy = EdgePolicy()


@dataclass(frozen=True)
class InterferenceResult:
    prompt_tokens: int
    num_sessions: int
    prefill_s: float
    """The long prompt's call: sent -> answered (its first token)."""
    before_ms: list[float]
    during_ms: list[float]
    num_mismatches: int

    @property
    def delay_ms(self) -> float | None:
        """The worst block in flight during the prefill against the typical block before it."""
        if not self.before_ms or not self.during_ms:
            return None
        return max(self.during_ms) - statistics.median(self.before_ms)

    def to_dict(self) -> dict:
        return asdict(self) | {"delay_ms": self.delay_ms}


def long_prompt(sessions: list[RecordedSession], num_tokens: int) -> list[int]:
    """``num_tokens`` real token ids: the recorded prompts and outputs, repeated as needed (a
    prefill's cost does not depend on which tokens it reads)."""
    pool = [token for session in sessions if session.trace for token in session.trace.prompt_token_ids + session.trace.target_token_ids]
    if not pool:
        raise ValueError("no traced session to take the long prompt's tokens from")
    return (pool * (num_tokens // len(pool) + 1))[:num_tokens]


def split_calls(runs: list[EmulatedRun], sent_at: float, answered_at: float) -> tuple[list[float], list[float]]:
    """The drafted calls' verify times (ms), answered before ``sent_at`` and overlapping
    [sent_at, answered_at]."""
    calls: list[CallRecord] = [call for run in runs for call in run.calls if call.num_drafted > 0]
    before = [(c.answered_at - c.sent_at) * 1e3 for c in calls if c.answered_at <= sent_at]
    during = [(c.answered_at - c.sent_at) * 1e3 for c in calls if c.sent_at < answered_at and c.answered_at > sent_at]
    return before, during


async def send_prompt(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, float]:
    """The long prompt's prompt-only call; (sent, answered) times."""
    session_id = f"prefill-{uuid.uuid4().hex[:12]}"
    request = VerifyRequest(
        session_id=session_id,
        prefix_length=0,
        prefix_digest=context_digest([]),
        new_tokens=prompt,
        draft_tokens=[],
        sampling=WireSampling(temperature=0.0),
        cache_salt=session_id,  # never served from a prefix cached earlier in the run
    )
    sent_at = time.perf_counter()
    response = await client.post(
        "/v1/verify", content=request.model_dump_json(exclude_none=True), headers={"content-type": "application/json"}
    )
    answered_at = time.perf_counter()
    response.raise_for_status()
    await client.delete(f"/v1/sessions/{session_id}")
    return sent_at, answered_at


async def measure_interference(verifier_url: str, sessions: list[RecordedSession], setup: InterferenceSetup) -> InterferenceResult:
    traced = [session for session in sessions if session.trace is not None]
    traces = [session.trace for session in traced if session.trace is not None]
    if not traces:
        raise ValueError("the prefill scenario needs traced sessions")
    runs = [EmulatedRun(f"emu-{uuid.uuid4().hex[:12]}", time.perf_counter()) for _ in range(setup.num_sessions)]
    async with httpx.AsyncClient(
        base_url=verifier_url, timeout=1800.0, limits=httpx.Limits(max_connections=setup.num_sessions + 4)
    ) as client:
        edges = [
            EmulatedEdge(traces[k % len(traces)], setup.policy, setup.rtt_s).run(client, asyncio.sleep, run) for k, run in enumerate(runs)
        ]
        generating = asyncio.gather(*edges)
        while not generating.done() and min(sum(call.num_drafted > 0 for call in run.calls) for run in runs) < setup.warm_calls:
            await asyncio.sleep(POLL_S)
        sent_at, answered_at = await send_prompt(client, long_prompt(traced, setup.prompt_tokens))
        await generating
    before, during = split_calls(runs, sent_at, answered_at)
    return InterferenceResult(
        setup.prompt_tokens, setup.num_sessions, answered_at - sent_at, before, during, sum(run.num_mismatches for run in runs)
    )


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _row(name: str, values: list[float]) -> str:
    return f"| {name} | {len(values)} | {_ms(percentile(values, 50))} | {_ms(max(values, default=None))} |"


def interference_table(result: InterferenceResult) -> str:
    return "\n".join(
        [
            f"A {result.prompt_tokens}-token prompt arriving while {result.num_sessions} sessions verify "
            f"(its prefill: {result.prefill_s:.2f} s; {result.num_mismatches} mismatches):",
            "",
            "| blocks | calls | verify ms p50 | verify ms max |",
            "|---|---|---|---|",
            _row("before the prompt", result.before_ms),
            _row("during its prefill", result.during_ms),
            "",
            f"Delay of the worst block in flight (max during - p50 before): {_ms(result.delay_ms)} ms.",
        ]
    )
