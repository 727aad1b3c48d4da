"""An emulated edge that drafts any length: a recorded session's ``DraftTrace`` (the draft's greedy
proposals along the target's output) stands in for the draft model, so N edges run on a box that
cannot run N draft models, and each can follow a draft-length policy and the verifier's advice.

A block of d at committed position i is [g_i, g_(i+1), ...] while each g equals the target's
y (the draft, fed y, proposes the next g), then the first mismatching g, then filler: the
verdict is decided at that mismatch (the filler is rejected; only its rows cost the verifier):

    y = [5, 9, 2, 7, 1],  g = [5, 9, 4, 7, 3]
    d = 4 at i = 0  ->  [5, 9, 4, 7]: 2 accepted, next 2 (the 7 is filler, rejected unread)

Before each call the edge waits d x the draft's recorded time per token + the link's RTT (one
RTT per call, as ``levels.replay_user``). The first call carries the prompt alone (the
real edge's --prefill-first); the draft's own prefill runs meanwhile, so the second call waits
only for what of it outlasted the first call. Every verdict is checked against y (greedy: 0
mismatches); a verdict may accept only a prefix of the block when the verifier cut it to its
advice, and its ``context_length`` then says so.

Like the real edge (``--overlap``, ``--edge-power performance``, its defaults), an emulated edge
drafts ahead while each call is in flight (``drafted_ahead``): the draft's guess of the target's
next token, then the next block, one draft forward each (the first, under the prompt-only call,
is the draft's prefill). Where the verdict runs through the guess (a hit), the tokens after it
start the next block; hit or miss, the forward still running when the verdict landed is waited
for first:

    block [5, 9] at 0, the call in flight 3.5 draft forwards -> [g, a1, a2] drafted, a3 running
    verdict "2 accepted, next g"  ->  the next block starts with [a1, a2, a3] after 0.5 forwards

An edge with ``max_continued_tokens`` lets a saturated verifier continue its session by itself
(the wire's continuation, as the real edge's ``--max-continued-tokens``): the verdict's
``continued_tokens`` are checked against y too, and the next call starts after them.

The draft length comes from the edge's own policies (``edge_agent.draft_length``, fed with each
call's outcome), capped, when the edge follows advice, by the verdict's
``advised_draft_length`` (every verdict carries one: the verifier's limit while it has idle time).
"""

from __future__ import annotations

import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import httpx

from edge_agent.draft_length import DraftLengthPolicy, draft_length_policy
from edge_agent.engine import continued_allowance
from edge_agent.estimates import BlockOutcome, EdgeEstimates
from edge_agent.generation import ahead_length
from spade_bench.capacity.sessions import DraftTrace
from verifier_service.protocol import VerifyRequest, VerifyResponse, WireSampling, context_digest

ADVICE_FIELD = "advised_draft_length"


@dataclass(frozen=True)
class EdgePolicy:
    """How an emulated edge chooses its blocks."""

    draft_length: int | Literal["auto"] = "auto"
    max_draft_length: int = 16
    follows_advice: bool = False
    """Cap each block at the last verdict's ``advised_draft_length`` (an edge that ignores it is
    still verified exactly; the verifier may cut its blocks)."""
    max_continued_tokens: int = 0
    """Each call lets a saturated verifier continue this many tokens by itself (the edge's
    ``--max-continued-tokens``); 0: none."""
    lead_tokens: int = 0
    """Draft this many more than the draft-length policy and the advice choose (an edge of a
    verifier that steps its session ahead between calls: a block's first drafts meet the tokens
    decided meanwhile and are checked free; the choice, which counts rows, applies to the drafts
    after them)."""
    drafts_ahead: bool = True
    """Draft ahead under every call (the real edge's defaults, ``--overlap`` with ``--edge-power
    performance``); False: draft each block only once the last verdict is in."""

    def build(self) -> DraftLengthPolicy:
        """The service-wide draft-length policy (its estimates are each run's own). Its speed model
        counts drafting as hidden under the calls where the edge drafts ahead under every call,
        as the real edge's settings choose it."""
        return draft_length_policy(self.draft_length, self.max_draft_length, self.drafts_ahead)

    @property
    def label(self) -> str:
        continues = f" + continue {self.max_continued_tokens}" if self.max_continued_tokens else ""
        ahead = "" if self.drafts_ahead else " (not drafting ahead)"
        lead = f" + lead {self.lead_tokens}" if self.lead_tokens else ""
        return f"{self.draft_length}" + (" + advice" if self.follows_advice else "") + lead + continues + ahead

    def followed_advice(self, advice: int | None) -> int | None:
        """The cap a block keeps from the last advice (None: none), lead included."""
        return None if advice is None or not self.follows_advice else advice + self.lead_tokens


@dataclass(frozen=True)
class CallRecord:
    """One verify call of an emulated edge."""

    sent_at: float
    answered_at: float
    num_drafted: int
    num_accepted: int
    num_expected: int
    """Leading drafted tokens equal to the target's (what a whole block's verdict accepts)."""
    queue_ms: float
    verifier_ms: float
    advised: int | None
    num_continued: int = 0
    """Tokens the verifier continued with after the call's next token."""
    num_ready: int = 0
    """Of the block, the leading tokens drafted ahead under the call before (a hit)."""

    @property
    def is_cut(self) -> bool:
        """The verifier verified a prefix of the block only (its advice was shorter)."""
        return self.num_accepted < self.num_expected


@dataclass
class EmulatedRun:
    """What one emulated edge did over its session."""

    session_id: str
    started_at: float
    finished_at: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    num_mismatches: int = 0
    calls: list[CallRecord] = field(default_factory=list)


def leading_matches(trace: DraftTrace, position: int, num_drafted: int) -> int:
    """Drafted tokens from ``position`` on that equal the target's (at most ``num_drafted``)."""
    matched = 0
    while matched < num_drafted and position + matched < len(trace.proposals):
        if trace.proposals[position + matched] != trace.target_token_ids[position + matched]:
            break
        matched += 1
    return matched


def drafted_block(trace: DraftTrace, position: int, num_drafted: int) -> list[int]:
    """The block the draft proposes at ``position``: proposals while they match, the first
    mismatch, then filler (the proposals at the following positions, any tokens would do)."""
    last = len(trace.proposals) - 1
    return [trace.proposals[min(position + offset, last)] for offset in range(num_drafted)]


def verdict_error(trace: DraftTrace, position: int, block: list[int], verdict: VerifyResponse) -> str | None:
    """Why a verdict on ``block`` at ``position`` is not the target's greedy one (None: it is).
    Accepting fewer than the matching drafts is allowed (a block cut to the advice) if the next
    token is then the target's own at that position; the tokens the verifier continued with
    must be the target's own that follow."""
    accepted = verdict.num_accepted
    if accepted > leading_matches(trace, position, len(block)):
        return f"accepted {accepted} drafted tokens at {position}, of which some differ from the target's"
    emitted = block[:accepted] + [verdict.next_token] + verdict.continued_tokens
    expected = trace.target_token_ids[position : position + len(emitted)]
    if emitted[: len(expected)] != expected:
        return f"emitted {emitted} at {position}, the target's output has {expected}"
    committed = len(trace.prompt_token_ids) + position + len(emitted)
    if verdict.context_length != committed:
        return f"context_length {verdict.context_length} after {committed} committed tokens"
    return None


@dataclass(frozen=True)
class DraftedAhead:
    """What drafting ahead under one call leaves for the next block."""

    num_drafted: int
    """Tokens drafted ahead, the forward running when the verdict landed included."""
    num_ready: int
    """Of them, those after the committed context: the next block's first tokens (0: a miss)."""
    settle_s: float
    """What was left of the forward running when the verdict landed: the next block waits for it."""


NOTHING_AHEAD = DraftedAhead(0, 0, 0.0)


def ahead_limit(chosen: int, num_left: int, num_drafted: int, advice: int | None) -> int:
    """Tokens worth drafting ahead under a call, as the real edge counts them
    (``generation.ahead_length``), the context's room unbounded. Example: 10 left, a block of 4,
    chosen 5 -> the guess + 4."""
    return ahead_length(chosen, num_left, num_drafted, sys.maxsize, advice)


def drafted_ahead(
    trace: DraftTrace,
    position: int,
    num_drafted: int,
    num_accepted: int,
    num_emitted: int,
    window_s: float,
    limit: int,
    first_forward_s: float,
) -> DraftedAhead:
    """What the draft drafted past a block of ``num_drafted`` at ``position`` while its call was
    in flight for ``window_s`` (the link's round trip and the verifier's answer), at most
    ``limit`` tokens, one draft forward each (the first takes ``first_forward_s``: the draft's
    prefill under the prompt-only call), and which of them start the next block. The verdict
    committed ``num_emitted`` tokens (accepted, next, continued). A forward running when the
    verdict lands is finished and its token kept (the drafting thread cannot be interrupted).

    A hit (``draft_ahead.DraftAhead.is_continued_by``): the whole block accepted and everything
    committed after it equal to what was drafted ahead, which is the draft's own proposals there
    (fed the target's tokens, as the trace's are). The tokens after the committed ones are the
    proposals at the next position on: ``drafted_block``'s first tokens there."""
    if limit < 1:
        return NOTHING_AHEAD
    per_token_s = trace.draft_s_per_token
    if window_s < first_forward_s:
        finished = 0
    elif per_token_s <= 0:
        finished = limit
    else:
        finished = min(limit, 1 + math.floor((window_s - first_forward_s) / per_token_s))
    settle_s = 0.0 if finished == limit else first_forward_s + finished * per_token_s - window_s
    num_ahead = min(limit, finished + 1)
    is_hit = (
        num_accepted == num_drafted
        and num_drafted < num_emitted <= num_drafted + num_ahead
        and leading_matches(trace, position, num_emitted) == num_emitted
    )
    return DraftedAhead(num_ahead, num_drafted + num_ahead - num_emitted if is_hit else 0, settle_s)


def advised_length(payload: dict) -> int | None:
    """The verdict's advice, read defensively: absent or not a non-negative int -> no cap."""
    value = payload.get(ADVICE_FIELD)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def block_length(chosen: int, remaining: int, advice: int | None) -> int:
    """The policy's choice within the budget (a block of d yields up to d + 1 tokens; never
    below 1, as the real edge), then within the advice (which may ask for an empty block)."""
    length = max(1, min(chosen, remaining - 1))
    return length if advice is None else min(length, advice)


@dataclass
class EmulatedEdge:
    """One emulated edge replaying ``trace`` against a verifier through ``client``."""

    trace: DraftTrace
    policy: EdgePolicy
    rtt_s: float
    first_call_think_s: float = 0.0
    """The edge's own time before its first call (tokenizing; from the recording)."""

    async def run(self, client: httpx.AsyncClient, sleep, into: EmulatedRun | None = None) -> EmulatedRun:
        """Generate the trace's output; ``sleep`` is ``asyncio.sleep`` (tests may pass another).
        ``into``: the run to fill as calls are answered (others may watch it meanwhile)."""
        run = into if into is not None else EmulatedRun(f"emu-{uuid.uuid4().hex[:12]}", time.perf_counter())
        run.started_at = time.perf_counter()
        estimate = EdgeEstimates().for_request()  # every emulated edge is a box of its own
        policy = self.policy.build().for_request(estimate)
        position, advice, first_sent_at, ahead = 0, None, 0.0, None
        target_length = len(self.trace.target_token_ids)
        try:
            while position < target_length and run.num_mismatches == 0:
                is_first = not run.calls
                chosen = policy.next_length() + self.policy.lead_tokens
                followed = self.policy.followed_advice(advice)
                num_drafted = 0 if is_first else block_length(chosen, target_length - position, followed)
                num_ready = 0 if ahead is None else min(num_drafted, ahead.num_ready)
                await sleep(self._think_s(num_drafted, len(run.calls), time.perf_counter() - first_sent_at, ahead) + self.rtt_s)
                first_sent_at = first_sent_at or time.perf_counter()
                block = drafted_block(self.trace, position, num_drafted)
                max_continued = continued_allowance(
                    self.policy.max_continued_tokens, target_length - position, num_drafted, brings_first_token=not run.calls
                )
                limit = (
                    ahead_limit(policy.next_length(), target_length - position, num_drafted, followed) if self.policy.drafts_ahead else 0
                )
                record, payload = await self._call(client, run, position, block, max_continued, num_ready)
                if payload is None:
                    break
                verdict = VerifyResponse.model_validate(payload)
                error = verdict_error(self.trace, position, block, verdict)
                run.num_mismatches += error is not None
                run.ttft_s = run.ttft_s if run.ttft_s is not None else record.answered_at - run.started_at
                advice = record.advised
                estimate.observe(self._outcome(record, verdict, drafted_before=len(run.calls) > 2))
                num_emitted = verdict.num_accepted + 1 + len(verdict.continued_tokens)
                window_s = record.answered_at - record.sent_at + self.rtt_s
                first_forward_s = self.trace.draft_prefill_s if is_first else self.trace.draft_s_per_token
                drafted = drafted_ahead(
                    self.trace, position, num_drafted, verdict.num_accepted, num_emitted, window_s, limit, first_forward_s
                )
                ahead = drafted if limit else None
                position += num_emitted
                run.tokens = min(position, target_length)
        finally:
            run.finished_at = time.perf_counter()
            await client.delete(f"/v1/sessions/{run.session_id}")
        return run

    def _think_s(self, num_drafted: int, num_calls: int, since_first_call_s: float, ahead: DraftedAhead | None) -> float:
        """The edge's time before a call: tokenizing before the first; before the others, the
        forward drafting ahead was still running when the last verdict landed, then the block's
        tokens not drafted ahead. Without drafting ahead under the last call: its drafting,
        plus for the second call what of the draft's prefill outlasted the first call."""
        if num_calls == 0:
            return self.first_call_think_s
        if ahead is not None:
            return ahead.settle_s + max(0, num_drafted - ahead.num_ready) * self.trace.draft_s_per_token
        drafting_s = num_drafted * self.trace.draft_s_per_token
        if num_calls == 1:
            drafting_s += max(0.0, self.trace.draft_prefill_s - since_first_call_s)
        return drafting_s

    async def _call(
        self, client: httpx.AsyncClient, run: EmulatedRun, position: int, block: list[int], max_continued_tokens: int, num_ready: int = 0
    ) -> tuple[CallRecord, dict | None]:
        committed = self.trace.prompt_token_ids + self.trace.target_token_ids[:position]
        known = 0 if not run.calls else len(committed)  # the verifier appended every earlier verdict itself
        request = VerifyRequest(
            session_id=run.session_id,
            prefix_length=known,
            prefix_digest=context_digest(committed[:known]),
            new_tokens=committed[known:],
            draft_tokens=block,
            sampling=WireSampling(temperature=0.0),
            cache_salt=run.session_id,  # a prompt of its own: no prefix cached by another run or mode
            max_continued_tokens=max_continued_tokens,
        )
        sent_at = time.perf_counter()
        response = await client.post(
            "/v1/verify", content=request.model_dump_json(exclude_none=True), headers={"content-type": "application/json"}
        )
        answered_at = time.perf_counter()
        if response.status_code != 200:  # a refused call (e.g. 409): the session cannot go on
            run.num_mismatches += 1
            return CallRecord(sent_at, answered_at, len(block), 0, 0, 0.0, 0.0, None), None
        payload = response.json()
        timings = payload["timings"]
        record = CallRecord(
            sent_at,
            answered_at,
            len(block),
            payload["num_accepted"],
            leading_matches(self.trace, position, len(block)),
            timings["queue_ms"],
            timings["total_ms"],
            advised_length(payload),
            len(payload.get("continued_tokens", [])),
            num_ready,
        )
        run.calls.append(record)
        return record, payload

    def _outcome(self, record: CallRecord, verdict: VerifyResponse, drafted_before: bool) -> BlockOutcome:
        """What the call teaches the policy, as the real edge reports it (``engine.block_outcome``):
        no drafting time for the prompt-only call or the first block (it included the draft's prefill)."""
        round_trip_s = record.answered_at - record.sent_at + self.rtt_s
        draft_s = self.trace.draft_s_per_token if drafted_before and record.num_drafted else None
        return BlockOutcome(
            record.num_drafted, verdict.num_accepted, draft_s, round_trip_s, record.verifier_ms / 1e3, verdict.num_target_tokens
        )
