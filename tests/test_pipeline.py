"""Pipelined sessions (``--pipelined-sessions``, ``verifier_service.pipeline``): the verifier
decodes a session in every forward and reads the edge's proposals as they arrive. Greedy text is
the target's whatever the proposals (right, wrong, stale, none) and their timing; sampled text is
the target's distribution through proposals verified with a one-hot q (a chi-square test); the
session stops at its window until its edge acknowledges, and ends at max_tokens, on close and
with the errors a client can act on."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from servers import serve
from spade_bench.loopback import wait_until
from spade_core.params import SamplingConfig
from test_edge_sampling import chi_square_p_value
from test_steps_ahead import metric, support, target_probs
from verifier_service.backends.base import BlockVerdict
from verifier_service.kv_budget import kv_bytes_per_token
from verifier_service.pipeline import decided_events, decided_tokens
from verifier_service.pipeline_protocol import DecidedTokens, checked_event
from verifier_support import ENVELOPE_KEYS, greedy_continuation, new_session_id, random_tokens, verifier_app

# --- pure parts ---------------------------------------------------------------------------------


def event(start: int, tokens: list[int], from_proposal: int = 0, finish=None) -> DecidedTokens:
    return DecidedTokens(start=start, token_ids=tokens, num_from_proposal=from_proposal, finish_reason=finish)


def test_a_stream_resumed_mid_event_starts_at_the_token_asked_for():
    events = [event(0, [4, 5, 6], 2), event(3, [7])]
    assert decided_events(events, 0) == events
    assert decided_events(events, 1) == [event(1, [5, 6], 1), event(3, [7])]
    assert decided_events(events, 3) == [event(3, [7])]
    assert decided_events(events, 4) == []
    finished = [*events, event(4, [], finish="closed")]
    assert decided_events(finished, 4) == [event(4, [], finish="closed")]  # the end is always told


def verdict(num_accepted: int, next_token: int) -> BlockVerdict:
    return BlockVerdict(num_accepted, next_token, False, None, 1, 0.0, 0.0)


def test_a_forwards_tokens_stop_after_an_end_token_and_at_the_room_left():
    assert decided_tokens([4, 5, 6], verdict(2, 9), frozenset({0}), room=8) == ([4, 5, 9], 2, None)
    assert decided_tokens([4, 5, 6], verdict(2, 9), frozenset({0}), room=2) == ([4, 5], 2, "length")
    assert decided_tokens([4, 0, 6], verdict(3, 9), frozenset({0}), room=8) == ([4, 0], 2, "stop")
    assert decided_tokens([], verdict(0, 0), frozenset({0}), room=1) == ([0], 0, "stop")


# --- through a verifier on the tiny target ------------------------------------------------------

WINDOW = 4
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def pipelined(tiny_pair) -> Iterator[httpx.Client]:
    app = verifier_app(tiny_pair, pipelined_sessions=True, pipeline_window_tokens=WINDOW)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def open_session(client: httpx.Client, prompt: list[int], max_tokens: int = 64, sampling: dict | None = None) -> str:
    session_id = new_session_id()
    body = {"session_id": session_id, "prompt_tokens": prompt, "max_tokens": max_tokens, "sampling": sampling or GREEDY}
    response = client.post("/v1/pipeline/sessions", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["window_tokens"] == WINDOW
    return session_id


def read_decided(client: httpx.Client, session_id: str, after: int, at_least: int) -> list[DecidedTokens]:
    """Events from ``after`` until ``at_least`` tokens came or the session finished."""
    events, count = [], 0
    with client.stream("GET", f"/v1/pipeline/sessions/{session_id}/decided", params={"after": after}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(DecidedTokens.model_validate_json(line.removeprefix("data:")))
            count += len(events[-1].token_ids)
            if count >= at_least or events[-1].finish_reason is not None:
                break
    return events


def propose(client: httpx.Client, session_id: str, start: int, drafts: list[int], seen: int) -> None:
    response = client.post(f"/v1/pipeline/sessions/{session_id}/proposals", json={"start": start, "draft_tokens": drafts, "seen": seen})
    assert response.status_code == 204, response.text


def pipeline_tokens(client: httpx.Client, source: str) -> float:
    return metric(client, "spade_verifier_pipeline_tokens_total", f'source="{source}"')


def test_greedy_text_is_the_targets_whatever_the_proposals(pipelined, target_model):
    """Proposals right, wrong, stale (from a position already passed, contradicting what was
    decided) and none, acknowledging as it reads: every decided token is the target's."""
    client, rng = pipelined, random.Random(11)
    prompt = random_tokens(rng, 7, 300)
    expected = greedy_continuation(target_model.model, prompt, 48)
    from_proposal_before = pipeline_tokens(client, "proposal")
    stale_before = metric(client, "spade_verifier_pipeline_proposals_total", 'outcome="stale"')
    session_id = open_session(client, prompt, max_tokens=48)
    generated: list[int] = []
    while len(generated) < len(expected):
        events = read_decided(client, session_id, len(generated), at_least=1)
        for decided in events:
            assert decided.start == len(generated)
            generated += decided.token_ids
        if events[-1].finish_reason is not None:
            break
        choice = rng.random()
        if choice < 0.2:  # a stale proposal: from two tokens back, contradicting the last one
            start = len(generated) - 2
            drafts = expected[start : len(generated) - 1] + [(generated[-1] + 1) % 300, *expected[len(generated) : len(generated) + 3]]
        else:
            start = len(generated)
            drafts = expected[start : start + rng.randint(0, 6)]
            if drafts and choice < 0.5:
                wrong_at = rng.randrange(len(drafts))
                drafts = drafts[:wrong_at] + [(drafts[wrong_at] + 1) % 300]
        propose(client, session_id, len(prompt) + start, drafts, seen=len(generated))
    assert generated == expected
    assert pipeline_tokens(client, "proposal") > from_proposal_before
    assert metric(client, "spade_verifier_pipeline_proposals_total", 'outcome="stale"') > stale_before
    closed = client.delete(f"/v1/pipeline/sessions/{session_id}")
    assert closed.json() == {"session_id": session_id, "num_generated": 48}


def test_every_decided_event_is_sealed_to_the_context_after_it(pipelined, target_model):
    """Each event's digest checks against the prompt and the tokens before it (also an event cut
    by a read from mid-event); a token, a position or a finish changed on the way fails it."""
    client, prompt = pipelined, random_tokens(random.Random(19), 6, 300)
    session_id = open_session(client, prompt, max_tokens=WINDOW)
    events = read_decided(client, session_id, 0, at_least=WINDOW)
    held: list[int] = []
    for decided in events:
        assert checked_event(decided, prompt, held)
        held += decided.token_ids
    resumed = read_decided(client, session_id, 1, at_least=WINDOW - 1)
    assert resumed[0].start == 1 and checked_event(resumed[0], prompt, held[:1])
    first = events[0]
    spoilt = [
        first.model_copy(update={"token_ids": [(first.token_ids[0] + 1) % 300, *first.token_ids[1:]]}),
        first.model_copy(update={"start": 1}),
        first.model_copy(update={"finish_reason": "stop"}),
        first.model_copy(update={"digest": ""}),
    ]
    assert not any(checked_event(event, prompt, []) for event in spoilt)
    assert not checked_event(first, prompt[:-1], [])  # another context
    client.delete(f"/v1/pipeline/sessions/{session_id}")


def test_it_decodes_its_window_then_waits_for_the_edge(pipelined, target_model):
    client, prompt = pipelined, random_tokens(random.Random(12), 6, 300)
    before = pipeline_tokens(client, "verifier")
    session_id = open_session(client, prompt)
    assert wait_until(lambda: pipeline_tokens(client, "verifier") >= before + WINDOW, timeout_s=10)
    assert not wait_until(lambda: pipeline_tokens(client, "verifier") > before + WINDOW, timeout_s=0.5)
    propose(client, session_id, len(prompt) + WINDOW, [], seen=2)  # an acknowledgement alone: two more
    assert wait_until(lambda: pipeline_tokens(client, "verifier") >= before + WINDOW + 2, timeout_s=10)
    assert not wait_until(lambda: pipeline_tokens(client, "verifier") > before + WINDOW + 2, timeout_s=0.5)
    tokens = [token for decided in read_decided(client, session_id, 0, at_least=WINDOW + 2) for token in decided.token_ids]
    assert tokens == greedy_continuation(target_model.model, prompt, WINDOW + 2)
    client.delete(f"/v1/pipeline/sessions/{session_id}")


def test_a_proposal_overtaken_by_a_later_numbered_one_is_ignored(pipelined, target_model):
    client, prompt = pipelined, random_tokens(random.Random(17), 6, 300)
    expected = greedy_continuation(target_model.model, prompt, WINDOW + 4)
    session_id = open_session(client, prompt)
    read_decided(client, session_id, 0, at_least=WINDOW)  # it waits at its window now
    proposed_before, stale_before = (
        pipeline_tokens(client, "proposal"),
        metric(client, "spade_verifier_pipeline_proposals_total", 'outcome="superseded"'),
    )
    start = len(prompt) + WINDOW
    right, wrong = expected[WINDOW : WINDOW + 3], [(token + 1) % 300 for token in expected[WINDOW : WINDOW + 3]]
    for sequence, drafts in ((5, right), (3, wrong)):  # the older one arrives last
        body = {"start": start, "draft_tokens": drafts, "seen": 0, "sequence": sequence}
        assert client.post(f"/v1/pipeline/sessions/{session_id}/proposals", json=body).status_code == 204
    propose(client, session_id, start, [], seen=WINDOW)
    events = read_decided(client, session_id, WINDOW, at_least=4)
    assert [token for decided in events for token in decided.token_ids][:4] == expected[WINDOW:]
    assert events[0].num_from_proposal == 3
    assert pipeline_tokens(client, "proposal") == proposed_before + 3
    assert metric(client, "spade_verifier_pipeline_proposals_total", 'outcome="superseded"') == stale_before
    client.delete(f"/v1/pipeline/sessions/{session_id}")


def test_max_tokens_ends_the_stream_and_close_ends_a_reader(pipelined, target_model):
    client, prompt = pipelined, random_tokens(random.Random(13), 6, 300)
    session_id = open_session(client, prompt, max_tokens=3)
    events = read_decided(client, session_id, 0, at_least=100)
    assert [token for decided in events for token in decided.token_ids] == greedy_continuation(target_model.model, prompt, 3)
    assert events[-1].finish_reason == "length"
    client.delete(f"/v1/pipeline/sessions/{session_id}")
    other = open_session(client, prompt)
    assert wait_until(lambda: metric(client, "spade_verifier_pipeline_sessions") == 1, timeout_s=5)
    client.delete(f"/v1/pipeline/sessions/{other}")
    assert metric(client, "spade_verifier_pipeline_sessions") == 0


def error(response: httpx.Response) -> tuple[int, str | None, str | None]:
    body = response.json()["error"]
    assert set(body) == ENVELOPE_KEYS
    return response.status_code, body["param"], body["code"]


def test_bad_input_gets_openai_errors_and_changes_nothing(pipelined, target_model):
    client, prompt = pipelined, random_tokens(random.Random(14), 6, 300)
    unknown = new_session_id()
    assert error(client.post(f"/v1/pipeline/sessions/{unknown}/proposals", json={"start": 0, "seen": 0}))[0] == 404
    assert error(client.get(f"/v1/pipeline/sessions/{unknown}/decided"))[0] == 404
    assert error(client.delete(f"/v1/pipeline/sessions/{unknown}"))[0] == 404
    bad_prompt = {"session_id": unknown, "prompt_tokens": [1, 10**6], "max_tokens": 4}
    assert error(client.post("/v1/pipeline/sessions", json=bad_prompt)) == (400, "prompt_tokens", "invalid_token_id")
    assert error(client.post("/v1/pipeline/sessions", json=bad_prompt | {"prompt_tokens": []}))[0] == 400
    session_id = open_session(client, prompt, max_tokens=WINDOW)
    again = {"session_id": session_id, "prompt_tokens": prompt, "max_tokens": WINDOW}
    assert error(client.post("/v1/pipeline/sessions", json=again)) == (400, "session_id", "session_exists")
    proposals = f"/v1/pipeline/sessions/{session_id}/proposals"
    assert error(client.post(proposals, json={"start": 6, "draft_tokens": [10**6], "seen": 0}))[:2] == (400, "draft_tokens")
    too_long = {"start": 6, "draft_tokens": [1] * (WINDOW + 9), "seen": 0}
    assert error(client.post(proposals, json=too_long)) == (400, "draft_tokens", "proposal_too_long")
    assert error(client.get(f"/v1/pipeline/sessions/{session_id}/decided", params={"after": 99}))[:2] == (400, "after")
    events = read_decided(client, session_id, 0, at_least=100)  # none of it touched the session
    assert [token for decided in events for token in decided.token_ids] == greedy_continuation(target_model.model, prompt, WINDOW)
    client.delete(f"/v1/pipeline/sessions/{session_id}")


def test_a_full_verifier_refuses_a_new_session_at_once(tiny_pair):
    app = verifier_app(tiny_pair, pipelined_sessions=True, max_sessions=1)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"session_id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 4}
        assert client.post("/v1/pipeline/sessions", json=body).status_code == 201
        refused = client.post("/v1/pipeline/sessions", json=body | {"session_id": "b"})
        assert error(refused) == (429, None, "too_many_sessions")
        assert refused.headers["retry-after"] == "1"
        client.delete("/v1/pipeline/sessions/a")
        assert client.post("/v1/pipeline/sessions", json=body | {"session_id": "b"}).status_code == 201


def test_pipelined_sessions_count_against_the_kv_budget_and_give_it_back(tiny_pair, target_model):
    bytes_per_token = kv_bytes_per_token(target_model.model.config, target_model.model.dtype)
    app = verifier_app(tiny_pair, pipelined_sessions=True, max_kv_cache_bytes=2 * 96 * bytes_per_token)  # two 96-token contexts
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"session_id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 90}  # holds 93 tokens for its whole life
        assert client.post("/v1/pipeline/sessions", json=body).status_code == 201
        assert client.post("/v1/pipeline/sessions", json=body | {"session_id": "b"}).status_code == 201
        sessions = app.state.service.sessions
        assert sessions.kv_bytes == 2 * 93 * bytes_per_token
        refused = client.post("/v1/pipeline/sessions", json=body | {"session_id": "c"})
        assert error(refused) == (429, None, "kv_cache_full")
        assert refused.headers["retry-after"] == "1"
        assert "c" not in {key.rsplit("/", 1)[-1] for key in app.state.pipeline._sessions}  # a refused open holds nothing
        client.delete("/v1/pipeline/sessions/a")  # its hold goes (its cache may stay as a retained prefix, which gives way)
        assert client.post("/v1/pipeline/sessions", json=body | {"session_id": "c"}).status_code == 201
        for session_id in ("b", "c"):
            client.delete(f"/v1/pipeline/sessions/{session_id}")
        for session_id in ("d", "e"):  # the whole budget again
            assert client.post("/v1/pipeline/sessions", json=body | {"session_id": session_id}).status_code == 201


def test_the_routes_exist_only_when_asked_for(tiny_pair):
    with serve(verifier_app(tiny_pair)) as url:
        assert httpx.post(url + "/v1/pipeline/sessions", json={}).status_code == 404


# --- exactness at temperature > 0 ---------------------------------------------------------------

SAMPLED = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
NUM_SEEDS = 400


@pytest.fixture(scope="module")
def pipelined_one(tiny_pair) -> Iterator[httpx.Client]:
    """A window of one token: the test places each proposal between two forwards."""
    app = verifier_app(tiny_pair, pipelined_sessions=True, pipeline_window_tokens=1)
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.mark.slow
def test_sampled_text_is_the_targets_distribution_through_one_hot_proposals(pipelined_one, target_model):
    """Per seed: the verifier steps t0 alone; the edge proposes [x, y] after it, each drawn from
    the target's top 3 uniformly (x == the target's next token about a third of the time); the
    forward verifies them with a one-hot q, and steps alone after a rejection. The joint of the
    first three tokens must be the target's: p(t0) p(t1 | t0) p(t2 | t0, t1), or up to an end
    token where the session ends."""
    client, model, prompt = pipelined_one, target_model.model, random_tokens(random.Random(15), 6, 300)
    eos = target_model.eos_token_ids
    exact: dict[tuple[int, ...], float] = {}

    def add_outcomes(tokens: tuple[int, ...], prob: float) -> None:  # the session ends at an end token
        if len(tokens) == 3 or (tokens and tokens[-1] in eos):
            exact[tokens] = prob
            return
        probs = target_probs(model, prompt + list(tokens))
        for token in support(probs):
            add_outcomes((*tokens, token), prob * float(probs[token]))

    add_outcomes((), 1.0)
    rng, observed, cached = random.Random(16), Counter(), {}

    def top(context: list[int]) -> list[int]:
        if tuple(context) not in cached:
            cached[tuple(context)] = support(target_probs(model, context))
        return cached[tuple(context)]

    sampling = {"temperature": 1.0, "top_k": 3, "top_p": 1.0}
    for seed in range(NUM_SEEDS):
        session_id = open_session_with_window(client, prompt, sampling | {"seed": seed})
        generated = [token for decided in read_decided(client, session_id, 0, at_least=1) for token in decided.token_ids]
        finished = generated[-1] in eos
        if not finished:
            x = rng.choice(top(prompt + generated))
            y = rng.choice(top(prompt + generated + [x]))
            propose(client, session_id, len(prompt) + 1, [x, y], seen=1)
        while len(generated) < 3 and not finished:
            more = read_decided(client, session_id, len(generated), at_least=1)
            generated += [token for decided in more for token in decided.token_ids]
            finished = more[-1].finish_reason is not None
            propose(client, session_id, len(prompt) + len(generated), [], seen=len(generated))
        observed[tuple(generated[:3])] += 1
        client.delete(f"/v1/pipeline/sessions/{session_id}")
    assert set(observed) <= set(exact)
    assert chi_square_p_value(observed, exact) > 1e-3, observed


def open_session_with_window(client: httpx.Client, prompt: list[int], sampling: dict) -> str:
    session_id = new_session_id()
    body = {"session_id": session_id, "prompt_tokens": prompt, "max_tokens": 16, "sampling": sampling}
    response = client.post("/v1/pipeline/sessions", json=body)
    assert response.status_code == 201, response.text
    return session_id


def test_decided_events_are_json_the_edge_can_read():
    payload = json.loads(event(2, [5], 0, "stop").model_dump_json())
    assert payload == {"start": 2, "token_ids": [5], "num_from_proposal": 0, "finish_reason": "stop", "digest": ""}
