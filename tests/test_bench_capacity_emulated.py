"""Emulated edges that draft any length: the draft's teacher-forced proposals along a recorded
output (tiny pair) predict every verdict of the real edge; edges drafting from them at fixed
lengths and ``auto`` stay exact against a real verifier; edges that follow the verifier's advice
never draft past it, and a verdict on a block the verifier cut is taken as exact; the report's
columns come from the verifier's counters; the prefill scenario splits calls around a long prompt."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from capacity_support import MAX_TOKENS
from servers import serve
from spade_bench.capacity.draft_trace import edge_drafter, recorded_output, recorded_prompt, trace_sessions
from spade_bench.capacity.emulated_edge import (
    NOTHING_AHEAD,
    DraftedAhead,
    EdgePolicy,
    EmulatedEdge,
    ahead_limit,
    drafted_ahead,
    drafted_block,
    leading_matches,
)
from spade_bench.capacity.levels import QUIET_PAUSE_S, LevelSetup, measure_levels, run_level
from spade_bench.capacity.pipelined_edge import PipelinedEdge, PipelinePolicy
from spade_bench.capacity.prefill_interference import InterferenceSetup, measure_interference
from spade_bench.capacity.report import (
    ADVICE,
    CONTINUE,
    MODEL_FORWARDS,
    MODEL_ROWS,
    PIPE,
    PIPE_PROPOSED,
    PIPE_STALE,
    QUEUE_P50_MS,
    SPADE,
    TARGET,
    UserResult,
    histogram_buckets,
    histogram_quantile,
    level_row,
    markdown_table,
)
from spade_bench.capacity.sessions import DraftTrace, RecordedCall, RecordedSession
from spade_core.proposals import rebased_drafts
from verifier_service.backends.transformers.advice import BusyFraction, Saturation


@pytest.fixture(scope="module")
def traced(tiny_pair, capacity_verifier_url, capacity_sessions):
    """The recorded sessions with the draft's proposals, from the drafter the edge's flags build."""
    drafter = edge_drafter(["--draft-model", str(tiny_pair.draft_dir), "--verifier-url", capacity_verifier_url, "--threads", "1"])
    try:
        traces = trace_sessions(drafter, capacity_sessions)
    finally:
        drafter.close()
    return [session.with_trace(trace) for session, trace in zip(capacity_sessions, traces, strict=True)]


def test_the_proposals_predict_every_verdict_of_the_real_edge(capacity_sessions, traced):
    """Each real block is the draft's proposals up to its first mismatch, and the real verdict
    accepted exactly the leading proposals that equal the target's output."""
    num_blocks = 0
    for session in traced:
        trace = session.trace
        assert trace is not None
        assert trace.target_token_ids == recorded_output(session.calls, session.completion_tokens)
        assert len(trace.target_token_ids) == MAX_TOKENS
        assert trace.prompt_token_ids == recorded_prompt(session.calls)
        assert trace.draft_s_per_token > 0 and trace.draft_prefill_s > 0
        position = 0
        for call in session.calls:
            block = call.request["draft_tokens"]
            if block and position + len(block) <= MAX_TOKENS:
                decided = block[: call.num_accepted + 1]
                assert decided == trace.proposals[position : position + len(decided)]
                assert call.num_accepted == leading_matches(trace, position, len(block))
                num_blocks += 1
            position += call.num_accepted + 1
    assert num_blocks >= 4


def test_a_retried_call_adds_nothing_to_the_recorded_output():
    """The edge's client repeated its prompt-only call (slow prefill); both answers were recorded."""
    prompt = {"prefix_length": 0, "new_tokens": [1, 2, 3], "draft_tokens": []}
    calls = [
        RecordedCall(prompt, 0.1, 200, 0, 7),
        RecordedCall(prompt, -5.0, 200, 0, 7),  # the retry, answered from the verifier's memory
        RecordedCall({"prefix_length": 4, "new_tokens": [], "draft_tokens": [8, 9, 5]}, 0.1, 200, 2, 4),
    ]
    assert recorded_output(calls, 10) == [7, 8, 9, 4]
    assert recorded_output(calls, 3) == [7, 8, 9]
    with pytest.raises(ValueError, match="starts at 2 with 1 tokens committed"):
        recorded_output([calls[0], RecordedCall({"prefix_length": 5, "new_tokens": [], "draft_tokens": []}, 0.1, 200, 0, 1)], 10)


def test_the_proposals_match_the_target_often_enough_to_test_anything(traced):
    matches = [sum(g == y for g, y in zip(s.trace.proposals, s.trace.target_token_ids, strict=True)) for s in traced if s.trace]
    assert 0 < sum(matches) < len(traced) * MAX_TOKENS


@pytest.mark.parametrize("draft_length", [1, 3, 8, "auto"])
def test_emulated_edges_stay_exact_at_any_draft_length(capacity_verifier_url, traced, draft_length):
    setup = LevelSetup(policy=EdgePolicy(draft_length, max_draft_length=8))
    users, delta = asyncio.run(run_level(capacity_verifier_url, SPADE, traced, 3, setup))
    assert [user.num_mismatches for user in users] == [0, 0, 0]
    assert [user.tokens for user in users] == [MAX_TOKENS] * 3
    assert delta["spade_verifier_queue_seconds_count"] == sum(user.num_calls for user in users)
    # every block but the prompt-only first call holds 1 to d tokens (d, or what the budget still uses)
    max_block = 8 if draft_length == "auto" else draft_length
    assert all(user.num_calls - 1 <= user.num_drafted <= max_block * (user.num_calls - 1) for user in users)


def test_edges_stay_exact_against_a_verifier_stepping_ahead_and_its_row_says_how_much_it_used(tiny_pair, traced):
    """``spade+continue`` against a verifier with ``--step-ahead-tokens`` (the capacity run's
    ``--variant``): every verdict still the target's, and the row counts the decided tokens."""
    from types import SimpleNamespace

    from verifier_support import verifier_app

    setup = LevelSetup(policy=EdgePolicy("auto", max_draft_length=8), max_continued_tokens=8, pause_s=0.0)
    app = verifier_app(tiny_pair, max_batch_sessions=4, batch_wait_ms=1.0, step_ahead_tokens=8)
    with serve(app) as url, serve(verifier_app(tiny_pair, max_batch_sessions=4, batch_wait_ms=1.0)) as lock_step_url:
        ahead = SimpleNamespace(url=url, tree_cpu_seconds=lambda: 0.0)
        lock_step = SimpleNamespace(url=lock_step_url, tree_cpu_seconds=lambda: 0.0)
        rows = measure_levels(lock_step, traced, (2,), (CONTINUE,), setup, variants=(("ahead", ahead),))
    assert [row.mode for row in rows] == [CONTINUE, CONTINUE + "@ahead"]
    assert [row.num_mismatches for row in rows] == [0, 0]
    assert rows[0].ahead_share is None or rows[0].ahead_share == 0
    assert rows[1].ahead_share is not None and rows[1].ahead_share > 0
    assert "@ahead" in markdown_table(rows, 1.0)


@pytest.mark.parametrize("policy", [PipelinePolicy(8, 1), PipelinePolicy(2, 3)])
def test_edges_on_the_pipelined_wire_stay_exact_and_their_row_says_what_they_proposed(tiny_pair, traced, policy):
    """``spade+pipe``: edges drafting continuously, proposing as they draft, the verifier
    decoding their sessions in every forward; every decided token is the target's. A window of
    one token makes the verifier wait for each proposal (the tiny target outruns any edge)."""
    from verifier_support import verifier_app

    setup = LevelSetup(rtt_s=0.004, pipeline=policy)
    app = verifier_app(tiny_pair, max_batch_sessions=4, batch_wait_ms=1.0, pipelined_sessions=True, pipeline_window_tokens=1)
    with serve(app) as url:
        users, delta = asyncio.run(run_level(url, PIPE, traced, 3, setup))
        row = level_row(PIPE, users, delta)
        assert httpx.get(url + "/metrics").text.count("spade_verifier_pipeline_sessions 0.0") == 1  # every session closed
    assert [user.num_mismatches for user in users] == [0, 0, 0]
    assert [user.tokens for user in users] == [MAX_TOKENS] * 3
    assert all(user.num_calls > 0 and user.num_drafted > 0 for user in users)
    assert row.proposal_share is not None and 0 < row.proposal_share < 1
    assert row.stale_proposals is not None


class SpoilingTransport(httpx.AsyncBaseTransport):
    """Loopback, except that the first decided event of each of the first ``streams`` decided
    streams comes spoilt (as a faulty link or proxy might): one token id changed, or (``garble``)
    its JSON broken."""

    def __init__(self, streams: int, garble: bool = False) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.left, self.garble = streams, garble

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/decided") or self.left == 0:
            return response
        self.left -= 1
        return httpx.Response(response.status_code, headers=response.headers, stream=SpoiledStream(response.stream, self.garble))

    async def aclose(self) -> None:
        await self.inner.aclose()


class SpoiledStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, garble: bool) -> None:
        self.inner, self.garble, self.spoilt = inner, garble, False

    async def __aiter__(self):
        async for chunk in self.inner:
            if not self.spoilt and b'"token_ids":[' in chunk:
                at = chunk.index(b'"token_ids":[') + len(b'"token_ids":[')
                digit = chunk[at : at + 1]
                if self.garble:
                    chunk, self.spoilt = chunk[:at] + b"x" + chunk[at:], True
                elif digit.isdigit():  # an event with tokens: change its first token's first digit
                    chunk, self.spoilt = chunk[:at] + (b"1" if digit != b"1" else b"2") + chunk[at + 1 :], True
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("garble", [False, True], ids=["changed-token", "broken-json"])
def test_a_pipelined_edge_drops_a_spoilt_decided_event_and_reads_on_from_what_it_holds(tiny_pair, traced, garble):
    """Two decided streams in a row bring a spoilt first event (a changed token: its digest
    fails; broken JSON: it does not parse): the edge reads the stream again from the tokens it
    holds, and emits only the target's."""
    from verifier_support import verifier_app

    app = verifier_app(tiny_pair, pipelined_sessions=True, pipeline_window_tokens=1)
    edge = PipelinedEdge(traced[0].trace, PipelinePolicy(4, 1), rtt_s=0.002)

    async def run():
        async with httpx.AsyncClient(base_url=url, transport=SpoilingTransport(streams=2, garble=garble), timeout=60) as client:
            return await edge.run(client)

    with serve(app) as url:
        result = asyncio.run(run())
    assert result.num_bad_events == 2
    assert (result.num_mismatches, result.tokens) == (0, len(traced[0].trace.target_token_ids))


def test_no_level_or_mode_is_served_a_prompt_another_prefilled(capacity_verifier_url, traced):
    # Every level re-sends the recorded prompts: without a salt per user, the verifier's prefix
    # cache would let the mode run second skip the prefills the first paid for.
    setup = LevelSetup(policy=EdgePolicy("auto", max_draft_length=8))
    for mode in (TARGET, SPADE, ADVICE, SPADE):
        users, delta = asyncio.run(run_level(capacity_verifier_url, mode, traced, 2, setup))
        assert [user.num_mismatches for user in users] == [0, 0]
        assert delta["spade_verifier_prompt_tokens_total"] > 0
        assert delta.get("spade_verifier_prefix_hit_tokens_total", 0) == 0


# --- advice -------------------------------------------------------------------------------------


def advising_proxy(upstream_url: str, advice: int, seen_blocks: list[int]) -> FastAPI:
    """In front of the real verifier: every verdict advises ``advice``, and a longer block is cut
    to it before the verifier sees it (as a verifier protecting its batch may)."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream_url, timeout=60)

    @app.get("/health")
    async def health() -> dict:
        return (await client.get("/health")).json()

    @app.get("/metrics")
    async def metrics() -> str:
        return (await client.get("/metrics")).text

    @app.post("/v1/verify")
    async def verify(request: Request) -> dict:
        body = await request.json()
        seen_blocks.append(len(body["draft_tokens"]))
        body["draft_tokens"] = body["draft_tokens"][:advice]
        verdict = (await client.post("/v1/verify", json=body)).json()
        return verdict | {"advised_draft_length": advice}

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str) -> dict:
        return (await client.delete(f"/v1/sessions/{session_id}")).json()

    return app


@pytest.mark.parametrize("mode", [SPADE, ADVICE])
def test_an_edge_following_advice_never_drafts_past_it_and_one_ignoring_it_is_cut(capacity_verifier_url, traced, mode):
    seen_blocks: list[int] = []
    with serve(advising_proxy(capacity_verifier_url, 2, seen_blocks)) as proxy_url:
        users, _ = asyncio.run(run_level(proxy_url, mode, traced, 2, LevelSetup(policy=EdgePolicy(6, max_draft_length=8))))
    assert [user.num_mismatches for user in users] == [0, 0]
    assert [user.tokens for user in users] == [MAX_TOKENS] * 2
    assert seen_blocks.count(0) == 2  # each edge's prompt-only first call, and no other empty block
    if mode == ADVICE:
        assert max(seen_blocks) == 2
        assert sum(user.num_cut for user in users) == 0
    else:  # blocks of 6 went out; the proxy cut them to 2, and verdicts that accepted both were cut short
        assert max(seen_blocks) == 6
        assert sum(user.num_cut for user in users) > 0


# A stub verifier over a known output: verdicts computed from it, blocks cut to its advice.
PROMPT, OUTPUT = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


MAX_ADVICE = 64
"""What a verifier with idle time advises: its --max-draft-length."""


def stub_verifier(advice: int | None, calls: list[dict], wrong_at: int | None = None) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/verify")
    async def verify(request: Request) -> dict:
        body = await request.json()
        calls.append(body)
        position = body["prefix_length"] + len(body["new_tokens"]) - len(PROMPT)
        block = body["draft_tokens"][: advice if advice is not None else None]
        accepted = 0
        while accepted < len(block) and block[accepted] == OUTPUT[position + accepted]:
            accepted += 1
        beyond = position + accepted >= len(OUTPUT)  # a last block of 1 with 1 token left: a bonus past the budget
        next_token = 0 if beyond else OUTPUT[position + accepted] + (1 if position + accepted == wrong_at else 0)
        answer = {
            "session_id": body["session_id"],
            "num_accepted": accepted,
            "next_token": next_token,
            "next_token_kind": "bonus" if accepted == len(block) else "correction",
            "context_length": len(PROMPT) + position + accepted + 1,
            "num_target_tokens": len(block) + 1,
            "timings": {"queue_ms": 0.0, "forward_ms": 1.0, "total_ms": 1.0},
        }
        return answer | {"advised_draft_length": MAX_ADVICE if advice is None else advice}  # an idle verifier advises its limit

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str) -> dict:
        return {"session_id": session_id, "deleted": True}

    return app


def run_stub(
    policy: EdgePolicy,
    advice: int | None,
    wrong_at: int | None = None,
    trace: DraftTrace | None = None,
    rtt_s: float = 0.0,
    slept: list[float] | None = None,
):
    """An emulated edge against the stub; by default its draft proposes the target's every token
    and drafts in no time. ``slept``: filled with the edge's waits (none is really waited)."""
    trace = trace or DraftTrace(PROMPT, OUTPUT, list(OUTPUT), 0.0, 0.0)
    calls: list[dict] = []
    waits = slept if slept is not None else []

    async def no_sleep(seconds: float) -> None:
        waits.append(seconds)

    async def go():
        transport = httpx.ASGITransport(app=stub_verifier(advice, calls, wrong_at))
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as client:
            return await EmulatedEdge(trace, policy, rtt_s).run(client, no_sleep)

    return asyncio.run(go()), calls


def test_an_edge_caps_its_blocks_at_the_advice():
    run, calls = run_stub(EdgePolicy(5, follows_advice=True), advice=2)
    assert [len(call["draft_tokens"]) for call in calls] == [0, 2, 2, 2]  # 1 + 3 + 3 + 3 tokens
    assert (run.tokens, run.num_mismatches, sum(call.is_cut for call in run.calls)) == (len(OUTPUT), 0, 0)


def test_an_edge_with_a_lead_drafts_that_many_more_than_its_policy_and_the_advice_choose():
    # For a verifier stepping ahead: the block's first drafts meet its decided tokens; the stub
    # (a lock-step verifier) cuts the rest to the advice, so the lead only costs drafting there.
    run, calls = run_stub(EdgePolicy(5, follows_advice=True, lead_tokens=1), advice=2)
    assert [len(call["draft_tokens"]) for call in calls][:3] == [0, 3, 3]
    assert run.num_mismatches == 0 and run.tokens == len(OUTPUT)
    assert EdgePolicy(5, follows_advice=True, lead_tokens=1).label == "5 + advice + lead 1"
    assert EdgePolicy(5, lead_tokens=1).followed_advice(2) is None  # an edge ignoring the advice has no cap to lead
    _, calls = run_stub(EdgePolicy(2, follows_advice=True, lead_tokens=2), advice=None)  # no advice: the policy's 2, plus 2
    assert [len(call["draft_tokens"]) for call in calls][:2] == [0, 4]


def test_an_edge_lets_the_verifier_continue_every_call_but_the_one_bringing_the_first_token():
    _, calls = run_stub(EdgePolicy(5, follows_advice=True, max_continued_tokens=4), advice=2)
    # The first token goes out at once; then within the budget: 9 left, a block of 2 -> 4; 6 -> 3; 3 -> 0.
    assert [call["max_continued_tokens"] for call in calls] == [0, 4, 3, 0]


def test_a_verdict_on_a_cut_block_is_exact_and_counted_as_cut():
    run, calls = run_stub(EdgePolicy(5), advice=2)  # the edge ignores the advice; the stub cuts to 2
    assert [len(call["draft_tokens"]) for call in calls] == [0, 5, 5, 2]  # the last block: the budget's rest
    assert [(call.num_accepted, call.is_cut) for call in run.calls] == [(0, False), (2, True), (2, True), (2, False)]
    assert (run.tokens, run.num_mismatches) == (len(OUTPUT), 0)
    assert [call["prefix_length"] for call in calls] == [0, 4, 7, 10]  # each call follows the cut verdict's context_length


def test_an_edge_without_advice_drafts_its_own_length():
    run, calls = run_stub(EdgePolicy(4, follows_advice=True), advice=None)
    assert [len(call["draft_tokens"]) for call in calls] == [0, 4, 3]  # 1 + 5 + 4 tokens: the last block within the budget
    assert (run.tokens, run.num_mismatches) == (len(OUTPUT), 0)


def test_a_wrong_verdict_is_a_mismatch():
    run, calls = run_stub(EdgePolicy(3), advice=None, wrong_at=4)  # the second call's next token
    assert (run.num_mismatches, len(calls)) == (1, 2)


# Drafting ahead under a call, as the real edge does by default.
DRAFT_S = 0.01
PREFILL_S = 0.05


def test_the_tokens_drafted_ahead_start_the_next_block_on_a_hit():
    """The docstring's example: block [5, 9] at 0, in flight 3.5 draft forwards, limit 5."""
    trace = DraftTrace([1], [5, 9, 2, 7, 1, 8, 6], [5, 9, 2, 7, 1, 8, 6], DRAFT_S, PREFILL_S)
    window = 3.5 * DRAFT_S
    hit = drafted_ahead(trace, 0, 2, num_accepted=2, num_emitted=3, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert (hit.num_drafted, hit.num_ready) == (4, 3)  # g = 2, then 7, 1 and the 8 still running
    assert hit.settle_s == pytest.approx(0.5 * DRAFT_S)
    continued = drafted_ahead(trace, 0, 2, 2, num_emitted=5, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert continued.num_ready == 1  # the verifier continued with 7, 1: only the 8 is left
    beyond = drafted_ahead(trace, 0, 2, 2, num_emitted=7, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert beyond.num_ready == 0  # committed past what was drafted ahead
    done = drafted_ahead(trace, 0, 2, 2, 3, window_s=1.0, limit=5, first_forward_s=DRAFT_S)
    assert (done.num_drafted, done.num_ready, done.settle_s) == (5, 4, 0.0)  # all drafted before the verdict


def test_nothing_drafted_ahead_is_used_on_a_miss_but_the_running_forward_is_waited_for():
    trace = DraftTrace([1], [5, 9, 2, 7, 1], [5, 9, 4, 7, 1], DRAFT_S, PREFILL_S)  # the guess at 2 is wrong
    window = 2.25 * DRAFT_S
    wrong_guess = drafted_ahead(trace, 0, 2, num_accepted=2, num_emitted=3, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert (wrong_guess.num_drafted, wrong_guess.num_ready) == (3, 0)
    assert wrong_guess.settle_s == pytest.approx(0.75 * DRAFT_S)
    rejected = drafted_ahead(trace, 0, 3, num_accepted=2, num_emitted=3, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert rejected.num_ready == 0
    cut = drafted_ahead(trace, 0, 2, num_accepted=1, num_emitted=2, window_s=window, limit=5, first_forward_s=DRAFT_S)
    assert cut.num_ready == 0  # the verifier verified a prefix only: the guess was never tried
    assert drafted_ahead(trace, 0, 2, 2, 3, window, limit=0, first_forward_s=DRAFT_S) == NOTHING_AHEAD


def test_under_the_prompt_only_call_the_first_forward_ahead_is_the_drafts_prefill():
    trace = DraftTrace([1], [5, 9, 2], [5, 9, 2], DRAFT_S, PREFILL_S)
    early = drafted_ahead(trace, 0, 0, num_accepted=0, num_emitted=1, window_s=0.02, limit=3, first_forward_s=PREFILL_S)
    assert early == DraftedAhead(1, 0, pytest.approx(PREFILL_S - 0.02))  # the guess, confirmed: nothing after it yet
    later = drafted_ahead(trace, 0, 0, 0, 1, window_s=PREFILL_S + 1.5 * DRAFT_S, limit=3, first_forward_s=PREFILL_S)
    assert (later.num_drafted, later.num_ready) == (3, 2)
    assert later.settle_s == pytest.approx(0.5 * DRAFT_S)


@pytest.mark.parametrize(
    ("chosen", "num_left", "num_drafted", "advice", "expected"),
    [
        (5, 10, 4, None, 5),  # the guess + 4 (a hit leaves 5 tokens: a block of 4 and its next token)
        (5, 20, 4, 2, 3),  # the guess + the advice
        (5, 20, 4, 0, 0),  # advised no block: the next call carries none
        (5, 6, 4, None, 1),  # a hit leaves one token: the guess alone
        (5, 5, 4, None, 0),  # a hit ends the request
        (5, 20, 0, None, 6),  # under the prompt-only call: the guess + a block of 5
    ],
)
def test_the_edge_drafts_ahead_as_far_as_the_real_edge(chosen, num_left, num_drafted, advice, expected):
    assert ahead_limit(chosen, num_left, num_drafted, advice) == expected


def test_an_edge_drafting_ahead_sends_a_hit_block_after_the_round_trip_alone():
    """A draft that proposes the target's every token hits every time: with a round trip long
    enough to draft the next block under it, no call waits for drafting; without drafting ahead
    each waits for its block (and the second for the draft's prefill)."""
    trace = DraftTrace(PROMPT, OUTPUT, list(OUTPUT), DRAFT_S, PREFILL_S)
    ahead_waits: list[float] = []
    run, calls = run_stub(EdgePolicy(3), advice=None, trace=trace, rtt_s=1.0, slept=ahead_waits)
    assert [len(call["draft_tokens"]) for call in calls] == [0, 3, 3, 1]
    assert [call.num_ready for call in run.calls] == [0, 3, 3, 0]
    # The round trip only (the first call's tokenizing is 0); under the third call, with one token
    # left after a hit, the guess alone was drafted ahead (as the real edge), so the last block of 1
    # is drafted in line.
    assert ahead_waits == pytest.approx([1.0, 1.0, 1.0, 1.0 + DRAFT_S])
    inline_waits: list[float] = []
    run, _ = run_stub(EdgePolicy(3, drafts_ahead=False), advice=None, trace=trace, rtt_s=1.0, slept=inline_waits)
    assert [call.num_ready for call in run.calls] == [0, 0, 0, 0]
    assert inline_waits[2:] == pytest.approx([1.0 + 3 * DRAFT_S, 1.0 + DRAFT_S])
    assert 1.0 + 3 * DRAFT_S < inline_waits[1] <= 1.0 + 3 * DRAFT_S + PREFILL_S
    assert run.num_mismatches == 0


def test_an_edge_drafting_ahead_drafts_a_missed_block_in_line():
    proposals = list(OUTPUT)
    proposals[4] = 0  # the guess under the second call (block [11, 12, 13] at 1; the target's next is 14)
    trace = DraftTrace(PROMPT, OUTPUT, proposals, DRAFT_S, PREFILL_S)
    waits: list[float] = []
    run, calls = run_stub(EdgePolicy(3), advice=None, trace=trace, rtt_s=1.0, slept=waits)
    assert [len(call["draft_tokens"]) for call in calls] == [0, 3, 3, 1]
    assert [call.num_ready for call in run.calls] == [0, 3, 0, 0]
    assert waits == pytest.approx([1.0, 1.0, 1.0 + 3 * DRAFT_S, 1.0 + DRAFT_S])
    assert run.num_mismatches == 0


def test_a_block_is_the_proposals_then_filler():
    trace = DraftTrace([1], [5, 9, 2, 7, 1], [5, 9, 4, 7, 3], 0.0, 0.0)
    assert (drafted_block(trace, 0, 4), leading_matches(trace, 0, 4)) == ([5, 9, 4, 7], 2)
    assert (drafted_block(trace, 3, 2), leading_matches(trace, 3, 2)) == ([7, 3], 1)


# --- levels apart ----------------------------------------------------------------------------------


def test_after_the_quiet_pause_a_saturated_verifier_is_no_longer_so():
    """What the pause between levels is for: 20 s of back-to-back forwards of 0.25 s saturate
    the verifier; after QUIET_PAUSE_S idle, its next forward finds it unsaturated (a level that
    followed at once would start saturated)."""

    def saturation_after(pause_s: float) -> bool:
        busy, saturation, now = BusyFraction(), Saturation(), 0.0
        while now < 20.0:
            busy.observe(now, now + 0.25)
            saturation.observe(busy.fraction)
            now += 0.26
        assert saturation.is_saturated
        busy.observe(now + pause_s, now + pause_s + 0.25)
        return saturation.observe(busy.fraction)

    assert saturation_after(0.3)
    assert not saturation_after(QUIET_PAUSE_S)


def test_levels_are_the_pause_apart():
    """measure_levels rests the verifier between levels: each level reads /metrics first and last."""
    import time
    from types import SimpleNamespace

    app, metrics_read = FastAPI(), []

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        metrics_read.append(time.perf_counter())
        return "spade_verifier_forward_passes_total 0.0\n"

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str) -> dict:
        return {"session_id": session_id, "deleted": True}

    session = RecordedSession("empty", [], 1, 1, "")  # replays no call
    with serve(app, ready_path=None) as url:
        verifier = SimpleNamespace(url=url, tree_cpu_seconds=lambda: 0.0)
        rows = measure_levels(verifier, [session], (1, 2), ("replay",), LevelSetup(pause_s=0.3))
    assert len(rows) == 2 and len(metrics_read) == 4
    assert metrics_read[2] - metrics_read[1] >= 0.3


# --- the report -----------------------------------------------------------------------------------

METRICS = """# HELP spade_verifier_queue_seconds Wait
spade_verifier_queue_seconds_bucket{le="0.01"} 2.0
spade_verifier_queue_seconds_bucket{le="0.1"} 6.0
spade_verifier_queue_seconds_bucket{le="+Inf"} 6.0
spade_verifier_queue_seconds_count 6.0
"""


def test_the_queue_p50_is_read_from_the_histogram_buckets():
    buckets = histogram_buckets(METRICS, "spade_verifier_queue_seconds")
    assert buckets == {0.01: 2.0, 0.1: 6.0, float("inf"): 6.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.0325)
    assert histogram_quantile({0.01: 0.0, float("inf"): 0.0}, 0.5) is None
    assert histogram_quantile({0.01: 1.0, float("inf"): 4.0}, 0.9) == 0.01


def test_a_pipelined_edge_keeps_the_drafts_the_decided_tokens_confirm():
    assert rebased_drafts([1, 2, 3, 4], 2, [3, 4, 5]) == [5]
    assert rebased_drafts([1, 2, 9], 2, [3, 4, 5]) == []
    assert rebased_drafts([1, 2, 3, 4, 5, 6], 2, [3, 4, 5]) == []  # passed them all
    assert rebased_drafts([1, 2], 2, [3]) == [3]


def test_sessions_per_forward_and_rows_per_token_come_from_the_verifier_counters():
    users = [
        UserResult(SPADE, 10, 0.0, 5.0, 1.0, num_calls=4, num_drafted=12, num_cut=1),
        UserResult(SPADE, 10, 0.0, 5.0, 1.0, num_calls=4),
    ]
    delta = {"spade_verifier_queue_seconds_count": 8.0, MODEL_FORWARDS: 5.0, MODEL_ROWS: 30.0, QUEUE_P50_MS: 12.0}
    row = level_row(SPADE, users, delta)
    assert (row.sessions_per_forward, row.rows_per_token, row.queue_ms_p50, row.mean_block, row.num_cut) == (1.6, 1.5, 12.0, 1.5, 1)
    without = level_row(TARGET, users, {"spade_verifier_queue_seconds_count": 8.0})
    assert (without.sessions_per_forward, without.rows_per_token, without.mean_block) == (None, None, None)
    table = markdown_table([row, without], 1.0)
    assert table.splitlines()[0].startswith("| N | mode | aggregate tok/s | × target | user tok/s p50 | user tok/s p99 | TTFT p50 s |")
    columns = (
        "verifier CPU s/tok",
        "sessions/forward",
        "rows/token",
        "queue ms p50",
        "block",
        "cut",
        "continued",
        "ahead used / dropped",
        "proposed / stale",
    )
    for column in (*columns, "mismatches"):
        assert f"| {column} |" in table.splitlines()[0] or table.splitlines()[0].endswith(f"| {column} |")
    assert "| 2 | target | 4.00 | 1.00× | 2.00 | 2.00 | 1.00 | 1.00 | – | n/a | n/a | n/a | – | – | – | – |" in table
    assert "| 2 | spade | 4.00 | 1.00× | 2.00 | 2.00 | 1.00 | 1.00 | – | 1.60 | 1.50 | 12 | 1.5 | 1 | 0.00 | – | – | 0 |" in table
    pipelined = level_row(PIPE, users, delta | {PIPE_PROPOSED: 8.0, PIPE_STALE: 2.0})
    assert (pipelined.proposal_share, pipelined.stale_proposals) == (0.4, 0.1)
    assert "| 0.40 / 0.10 | 0 |" in markdown_table([pipelined], 1.0)
    assert "Prefill bound (target-only's user time / its TTFT, p50s: SPADE's ceiling were decoding free) — N = 2: 5.00×." in table


def test_the_prefill_scenario_splits_the_blocks_around_a_long_prompt(capacity_verifier_url, traced):
    setup = InterferenceSetup(prompt_tokens=60, num_sessions=2, warm_calls=1, policy=EdgePolicy(2))
    result = asyncio.run(measure_interference(capacity_verifier_url, traced, setup))
    assert result.num_mismatches == 0
    assert len(result.before_ms) >= 2  # each edge had a block verified before the prompt was sent
    assert result.prefill_s > 0


@pytest.mark.slow
def test_the_capacity_command_records_traces_and_reports_on_the_tiny_pair(tmp_path):
    """``--quick`` end to end: a real edge records, the draft's pass runs pinned in its own
    process through the edge's flags, and the levels and the prefill scenario are reported."""
    import json
    import subprocess
    import sys

    data = tmp_path / "questions.jsonl"
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]},
        {"question_id": 2, "category": "writing", "turns": ["A haiku."]},
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out"
    command = [sys.executable, "-m", "spade_bench.capacity", "--quick", "--mix", "short", "--data", str(data), "--users", "1,2"]
    command += ["--rtt-ms", "0", "--prefill-tokens", "200", "--prefill-sessions", "2", "--level-pause-s", "1", "--output", str(output)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((output / "capacity.json").read_text())
    assert {(row["mode"], row["num_users"]) for row in report["rows"]} == {(m, n) for m in (TARGET, SPADE, ADVICE) for n in (1, 2)}
    assert all(row["num_mismatches"] == 0 for row in report["rows"])
    assert all(session["draft_ms_per_token"] > 0 and session["clean"] for session in report["recorded"])
    assert report["prefill_interference"]["8"]["num_mismatches"] == 0
    assert "## Prefill interference" in (output / "capacity.md").read_text()
