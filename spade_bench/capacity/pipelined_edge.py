"""An emulated edge on the pipelined-session wire (``verifier_service.pipeline_protocol``): the
capacity replay's ``spade+pipe`` users.

Like ``emulated_edge``, a session's ``DraftTrace`` stands in for the draft model (a draft at
position i is the trace's proposal there, ``drafted_block``; past a wrong one, filler), one
drafted token takes the trace's time per token, and the link's round trip is emulated: each
message up (the open, each proposal) leaves half an RTT late, each decided event is seen half an
RTT after the verifier sent it.

Unlike it, the edge never waits for an answer. It drafts on continuously after what it has
seen decided, up to ``lead_tokens`` ahead of it, and proposes after every ``proposal_every``
drafted tokens, at most once a verifier step as it sees the decided events come (each proposal
the whole run of drafts from what it has seen, numbered; a forward reads one); when
decided tokens arrive it keeps the drafts they confirm and drafts on after them, or, at a
contradiction, starts again after the decided tokens (a rolled-back draft):

    seen [a, b], drafted [c, d, e]; decided c', c' != c  ->  seen [a, b, c'], drafting from there
    seen [a, b], drafted [c, d, e]; decided c, d          ->  seen [a, b, c, d], drafted [e, ...]

It acknowledges what it has seen with each proposal, and by an acknowledgement alone when it
has nothing to propose and the verifier would otherwise reach its window. Every decided token is
checked against the trace's target tokens (greedy: 0 mismatches), after its digest: an event
whose digest does not match what the edge holds is dropped and the stream read again from there.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import httpx

from edge_agent.pipeline_client import PipelineClient, RemoteSession
from spade_bench.capacity.emulated_edge import drafted_block
from spade_bench.capacity.sessions import DraftTrace
from spade_core.proposals import rebased_drafts
from verifier_service.pipeline_protocol import DecidedTokens, PipelineOpen
from verifier_service.protocol import WireSampling

STEP_WEIGHT = 0.25
"""The weight of the newest gap in the edge's average of the verifier's step."""


@dataclass(frozen=True)
class PipelinePolicy:
    lead_tokens: int = 8
    """Drafts ahead of the decided tokens the edge has seen, at most."""
    proposal_every: int = 1
    """Propose after this many new drafted tokens (and at every rollback), at most once a
    verifier step (the gap between decided events, as the edge sees it)."""


@dataclass
class PipelinedRun:
    tokens: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    ttft_s: float | None = None
    num_proposals: int = 0
    num_drafted: int = 0
    num_rollbacks: int = 0
    num_mismatches: int = 0
    num_from_proposal: int = 0
    finish_reason: str | None = None
    num_bad_events: int = 0
    """Decided events dropped for a digest that did not match what the edge holds."""


@dataclass
class _Seen:
    """What the edge has seen decided, and a wake-up for the drafting loop."""

    tokens: list[int] = field(default_factory=list)
    num_from_proposal: int = 0
    finish_reason: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    step_s: float = 0.0
    """The verifier's step as the edge sees it: an average of the gaps between decided events."""
    last_event_at: float | None = None


class PipelinedEdge:
    def __init__(self, trace: DraftTrace, policy: PipelinePolicy, rtt_s: float) -> None:
        self.trace = trace
        self.policy = policy
        self.rtt_s = rtt_s

    async def run(self, client: httpx.AsyncClient) -> PipelinedRun:
        trace, run = self.trace, PipelinedRun(started_at=time.perf_counter())
        session_id = f"pipe-{uuid.uuid4().hex[:12]}"
        prompt_length, target = len(trace.prompt_token_ids), trace.target_token_ids
        await asyncio.sleep(self.rtt_s / 2)
        opening = PipelineOpen(
            session_id=session_id,
            prompt_tokens=list(trace.prompt_token_ids),
            max_tokens=len(target),
            sampling=WireSampling(temperature=0.0),
            cache_salt=session_id,  # nothing cached by another level or mode
        )
        opened = await client.post("/v1/pipeline/sessions", content=opening.model_dump_json(), headers={"content-type": "application/json"})
        opened.raise_for_status()
        window = opened.json()["window_tokens"]
        seen = _Seen()
        reader = asyncio.create_task(self._read(client, RemoteSession(opening), seen, run))
        senders: set[asyncio.Task] = set()
        sequence, last_sent_at = 0, 0.0

        def propose(base: int, drafts: list[int], now: bool = False) -> bool:
            """Send the proposal, unless one left less than the verifier's step ago (a forward
            reads one proposal: more would only load the link and the verifier); ``now``: a
            rollback's, which replaces a stale one at once."""
            nonlocal sequence, last_sent_at
            sent_at = time.perf_counter()
            if not now and sent_at - last_sent_at < seen.step_s:
                return False
            last_sent_at = sent_at
            sequence += 1
            run.num_proposals += 1
            message = {"start": prompt_length + base, "draft_tokens": drafts, "seen": len(seen.tokens), "sequence": sequence}
            task = asyncio.create_task(self._send(client, session_id, message))
            senders.add(task)
            task.add_done_callback(senders.discard)
            return True

        try:
            drafts: list[int] = []
            base, since_proposed, acknowledged = 0, 0, 0
            first_draft = True
            while seen.finish_reason is None:
                if len(seen.tokens) != base:  # decided tokens arrived: keep what they confirm
                    kept = rebased_drafts(seen.tokens, base, drafts)
                    if drafts and not kept and len(seen.tokens) - base <= len(drafts):
                        run.num_rollbacks += 1
                    base, drafts = len(seen.tokens), kept
                    if drafts and propose(base, drafts, now=True):
                        acknowledged, since_proposed = base, 0
                position = base + len(drafts)
                if position < len(target) and len(drafts) < self.policy.lead_tokens:
                    draft_s = trace.draft_prefill_s if first_draft else trace.draft_s_per_token
                    first_draft = False
                    await asyncio.sleep(draft_s)
                    run.num_drafted += 1
                    drafts = drafts + drafted_block(trace, position, 1)
                    since_proposed += 1
                    if len(seen.tokens) != base:  # decided tokens came mid-draft: rebase first (the draft
                        continue  # stands where they confirm the drafts before it, as a drafter's cache would)
                    if since_proposed >= self.policy.proposal_every and propose(base, drafts):
                        acknowledged, since_proposed = base, 0
                    continue
                if since_proposed and propose(base, drafts, now=True):  # the drafts held back by the rate
                    acknowledged, since_proposed = base, 0
                elif len(seen.tokens) - acknowledged >= window // 2 and propose(base, [], now=True):
                    acknowledged = len(seen.tokens)
                changed = seen.changed
                await changed.wait()
        finally:
            reader.cancel()
            for task in list(senders):
                task.cancel()
            await client.delete(f"/v1/pipeline/sessions/{session_id}")
        run.finished_at = time.perf_counter()
        run.tokens = len(seen.tokens)
        run.num_from_proposal = seen.num_from_proposal
        run.finish_reason = seen.finish_reason
        run.num_mismatches = sum(token != expected for token, expected in zip(seen.tokens, target, strict=False))
        run.num_mismatches += abs(len(seen.tokens) - len(target)) if seen.finish_reason == "length" else 0
        return run

    async def _send(self, client: httpx.AsyncClient, session_id: str, message: dict) -> None:
        await asyncio.sleep(self.rtt_s / 2)
        response = await client.post(f"/v1/pipeline/sessions/{session_id}/proposals", json=message)
        response.raise_for_status()

    async def _read(self, client: httpx.AsyncClient, session: RemoteSession, seen: _Seen, run: PipelinedRun) -> None:
        """The decided stream as the edge's ``PipelineClient`` reads it (each event checked
        against what the edge holds, the stream read again from there after one that fails),
        each event seen half an RTT after it left."""
        loop = asyncio.get_running_loop()
        pipe = PipelineClient(client)

        def arrive(event: DecidedTokens) -> None:
            now = time.perf_counter()
            if run.ttft_s is None and event.token_ids:
                run.ttft_s = now - run.started_at
            if seen.last_event_at is not None:
                seen.step_s += STEP_WEIGHT * (now - seen.last_event_at - seen.step_s)
            seen.last_event_at = now
            seen.tokens.extend(event.token_ids)
            seen.num_from_proposal += event.num_from_proposal
            seen.finish_reason = event.finish_reason
            seen.changed.set()
            seen.changed = asyncio.Event()

        try:
            async for event in pipe.decided(session):
                run.num_bad_events = session.num_bad_events
                loop.call_later(self.rtt_s / 2, arrive, event)
                if event.finish_reason is not None:
                    return
            raise RuntimeError(f"session {session.session_id}: the decided stream ended before the session finished")
        except Exception:  # the drafting loop must not wait for tokens that will not come
            seen.finish_reason = "error"
            seen.changed.set()
            raise
