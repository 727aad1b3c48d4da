"""Stepping ahead (``--step-ahead-tokens``, the continuous-sessions spike on today's wire): the
verifier decodes a session on by itself between its edge's calls, and settles the next call's
block against the tokens it decided (``verifier_service.steps_ahead``). Greedy output stays the
target's, sampled output stays the target's distribution (a chi-square test through the mixed
path: a decided token confirming a draft, the rest verified by the rule), the stepping stops at
its window, and a session's end or a call of other sampling drops what it decided."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import torch

from spade_bench.loopback import wait_until
from spade_core.params import SamplingConfig
from spade_core.sampling import processed_probs
from test_edge_sampling import chi_square_p_value
from verifier_service.steps_ahead import DecidedAnswer, answer_from_decided
from verifier_support import greedy_continuation, new_session_id, plain_forward_logits, random_tokens, running_verifier, verify, verify_body

# --- settling a block against decided tokens (pure) --------------------------------------------


def test_a_contradicted_block_is_answered_from_the_decided_tokens():
    assert answer_from_decided([7, 8, 9], [7, 5, 6, 4], max_continued=1) == DecidedAnswer(num_accepted=1, num_used=3)
    assert answer_from_decided([7, 8, 9], [7, 5, 6, 4], max_continued=8) == DecidedAnswer(1, 4)
    assert answer_from_decided([7, 8, 9], [1], max_continued=0) == DecidedAnswer(0, 1)


def test_a_block_shorter_than_the_decided_tokens_is_accepted_whole_and_they_go_on():
    assert answer_from_decided([7, 8], [7, 8, 9, 10], max_continued=1) == DecidedAnswer(2, 4)
    assert answer_from_decided([], [4, 5], max_continued=0) == DecidedAnswer(0, 1)  # a block-less call


def test_nothing_decided_or_every_decided_token_confirmed_leaves_the_block_to_a_forward():
    assert answer_from_decided([7, 8, 9], [], max_continued=8) is None
    assert answer_from_decided([7, 8, 9], [7, 8], max_continued=8) is None
    assert answer_from_decided([7, 8], [7, 8], max_continued=8) is None  # the next token is a forward's


# --- through a verifier on the tiny target ----------------------------------------------------

WINDOW = 4


@pytest.fixture(scope="module")
def stepping(tiny_pair):
    with running_verifier(tiny_pair, step_ahead_tokens=WINDOW) as client:
        yield client


def metric(client, name: str, labels: str = "") -> float:
    prefix = f"{name}{{{labels}}} " if labels else name + " "
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def steps(client) -> float:
    return metric(client, "spade_verifier_ahead_steps_total")


def quiet_steps(client) -> float:
    """The steps count once no session steps on (an earlier test's may, up to its window)."""
    last = steps(client)
    while wait_until(lambda last=last: steps(client) != last, timeout_s=0.2):
        last = steps(client)
    return last


def test_greedy_text_is_the_targets_whatever_the_drafts_and_the_timing(stepping, target_model):
    """An edge that drafts right, wrong and not at all, waiting between calls so the verifier
    decides tokens ahead: every call's tokens are the target's greedy ones."""
    client, rng = stepping, random.Random(3)
    prompt = random_tokens(rng, 7, 300)
    expected = greedy_continuation(target_model.model, prompt, 40)
    answers_before, confirmed_before = (
        metric(client, "spade_verifier_ahead_answers_total"),
        metric(client, "spade_verifier_ahead_drafts_total", 'outcome="confirmed"'),
    )
    session_id, held = new_session_id(), []
    first = verify(client, verify_body(session_id, held, [], new_tokens=prompt) | {"max_continued_tokens": WINDOW})
    generated = [first["next_token"]]
    held = prompt + generated
    while len(generated) < len(expected):
        time.sleep(rng.choice([0.0, 0.02, 0.05]))  # the verifier decides on meanwhile (a tiny step: ~ms)
        truth = expected[len(generated) : len(generated) + 5]
        drafts = truth[: rng.randint(0, len(truth))]
        if drafts and rng.random() < 0.5:  # a wrong draft somewhere in the block
            wrong_at = rng.randrange(len(drafts))
            drafts = drafts[:wrong_at] + [(drafts[wrong_at] + 1) % 300]
        answer = verify(client, verify_body(session_id, held, drafts) | {"max_continued_tokens": WINDOW})
        tokens = drafts[: answer["num_accepted"]] + [answer["next_token"]] + answer["continued_tokens"]
        assert answer["context_length"] == len(held) + len(tokens)
        generated += tokens
        held = held + tokens
    assert generated[: len(expected)] == expected
    assert metric(client, "spade_verifier_ahead_answers_total") > answers_before  # some calls never reached a forward
    assert metric(client, "spade_verifier_ahead_drafts_total", 'outcome="confirmed"') > confirmed_before


def test_it_stops_at_its_window_and_a_call_takes_what_it_allows(stepping, target_model):
    """A request's first call allows no continued tokens, but the steps ahead delay nothing: the
    verifier steps its whole window, then waits; the next call takes what it allows of them."""
    client, prompt = stepping, random_tokens(random.Random(4), 6, 300)
    before = quiet_steps(client)
    session_id = new_session_id()
    first = verify(client, verify_body(session_id, [], [], new_tokens=prompt) | {"max_continued_tokens": 0})
    assert wait_until(lambda: steps(client) >= before + WINDOW, timeout_s=10)
    assert not wait_until(lambda: steps(client) > before + WINDOW, timeout_s=0.5)  # then it waits for the edge
    held = prompt + [first["next_token"]]
    answer = verify(client, verify_body(session_id, held, []) | {"max_continued_tokens": 1})  # block-less: two decided tokens
    assert [answer["next_token"], *answer["continued_tokens"]] == greedy_continuation(target_model.model, held, 2)
    assert answer["timings"]["queue_ms"] == 0.0  # no forward of its own
    client.delete(f"/v1/sessions/{session_id}")


def test_a_session_s_end_drops_what_it_decided(stepping):
    client, prompt = stepping, random_tokens(random.Random(5), 6, 300)
    before = quiet_steps(client)
    dropped = metric(client, "spade_verifier_ahead_tokens_total", 'outcome="dropped"')
    session_id = new_session_id()
    verify(client, verify_body(session_id, [], [], new_tokens=prompt) | {"max_continued_tokens": 0})
    assert wait_until(lambda: steps(client) >= before + WINDOW, timeout_s=10)
    assert client.delete(f"/v1/sessions/{session_id}").json()["deleted"]
    assert metric(client, "spade_verifier_ahead_tokens_total", 'outcome="dropped"') == dropped + WINDOW


def test_a_call_of_other_sampling_drops_the_decided_tokens_and_is_verified_as_it_came(stepping, target_model):
    client, prompt = stepping, random_tokens(random.Random(6), 6, 300)
    before = steps(client)
    session_id = new_session_id()
    sampled = {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "seed": 11}
    first = verify(client, verify_body(session_id, [], [], new_tokens=prompt, sampling=sampled) | {"max_continued_tokens": 3})
    assert wait_until(lambda: steps(client) >= before + 3, timeout_s=10)
    held = prompt + [first["next_token"]]
    answer = verify(client, verify_body(session_id, held, []) | {"max_continued_tokens": 0})  # greedy now
    assert (answer["next_token"], answer["continued_tokens"]) == (greedy_continuation(target_model.model, held, 1)[0], [])


def test_a_real_edge_streams_the_targets_greedy_text_from_a_verifier_stepping_ahead(tiny_pair):
    """The shipped edge (continuation allowed, drafting ahead) against a stepping verifier: the
    streamed text is the verifier's own target-only text, and some tokens came from steps ahead."""
    import httpx

    from edge_support import edge_app, json_chunks, stream_payloads
    from servers import serve
    from verifier_support import verifier_app

    body = {"messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": 40, "temperature": 0}
    with serve(verifier_app(tiny_pair, step_ahead_tokens=WINDOW)) as verifier_url:
        body["model"] = httpx.get(verifier_url + "/v1/models").json()["data"][0]["id"]
        expected = httpx.post(verifier_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]
        with serve(edge_app(tiny_pair, verifier_url, draft_length="auto")) as edge_url:
            texts = [
                "".join(
                    chunk["choices"][0]["delta"].get("content") or ""
                    for chunk in json_chunks(stream_payloads(edge_url, "/v1/chat/completions", body))
                )
                for _ in range(3)
            ]
        used = [
            line
            for line in httpx.get(verifier_url + "/metrics").text.splitlines()
            if line.startswith('spade_verifier_ahead_tokens_total{outcome="used"}')
        ]
    assert texts == [expected] * 3
    assert float(used[0].split()[-1]) > 0


# --- exactness at temperature > 0 ---------------------------------------------------------------

SAMPLED = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
NUM_SEEDS = 600


def target_probs(model, context: list[int]) -> torch.Tensor:
    return processed_probs(plain_forward_logits(model, context)[-1], SAMPLED)


def support(probs: torch.Tensor) -> list[int]:
    return [int(token) for token in torch.nonzero(probs > 0).flatten()]


def uniform_row(token_ids: list[int]) -> dict:
    return {"token_ids": token_ids, "probs": [1 / len(token_ids)] * len(token_ids)}


@pytest.fixture(scope="module")
def stepping_one(tiny_pair):
    """A verifier that decides one token ahead: the next call's block meets one decided token."""
    with running_verifier(tiny_pair, step_ahead_tokens=1) as client:
        yield client


@pytest.mark.slow
def test_sampled_text_is_the_targets_distribution_through_decided_and_verified_tokens(stepping_one, target_model):
    """Per seed: the prompt-only call samples n0, and the verifier decides one token a1 ahead;
    the next call drafts [x, y] from q (uniform over the target's top 3 after each prefix, so
    x == a1 a third of the time): a confirmed x sends y to the rule's forward after a1, a
    contradicted x is answered from a1 alone and the token after comes from the call after.
    The joint (n0, a1, t2) must be the target's: p(n0) p(a1 | n0) p(t2 | n0, a1)."""
    client, model, prompt = stepping_one, target_model.model, random_tokens(random.Random(7), 6, 300)
    exact: dict[tuple[int, ...], float] = {}
    first_probs = target_probs(model, prompt)
    for n0 in support(first_probs):
        second = target_probs(model, prompt + [n0])
        for a1 in support(second):
            third = target_probs(model, prompt + [n0, a1])
            for t2 in support(third):
                exact[(n0, a1, t2)] = float(first_probs[n0] * second[a1] * third[t2])
    rng, observed, cached = random.Random(8), Counter(), {}

    def top(context: list[int]) -> list[int]:
        if tuple(context) not in cached:
            cached[tuple(context)] = support(target_probs(model, context))
        return cached[tuple(context)]

    for seed in range(NUM_SEEDS):
        sampling = {"temperature": SAMPLED.temperature, "top_k": SAMPLED.top_k, "top_p": 1.0, "seed": seed}
        session_id, before = new_session_id(), steps(client)
        first = verify(client, verify_body(session_id, [], [], new_tokens=prompt, sampling=sampling) | {"max_continued_tokens": 1})
        held = prompt + [first["next_token"]]
        assert wait_until(lambda before=before: steps(client) >= before + 1, timeout_s=10, interval_s=0.002)
        x = rng.choice(top(held))
        y = rng.choice(top(held + [x]))
        rows = [uniform_row(top(context)) for context in (held, held + [x])]
        answer = verify(client, verify_body(session_id, held, [x, y], sampling=sampling, draft_probs=rows) | {"max_continued_tokens": 1})
        tokens = [x, y][: answer["num_accepted"]] + [answer["next_token"]] + answer["continued_tokens"]
        if len(tokens) < 2:  # answered from a1 alone: the call after brings the next token
            more = verify(client, verify_body(session_id, held + tokens, [], sampling=sampling) | {"max_continued_tokens": 0})
            tokens.append(more["next_token"])
        observed[(first["next_token"], *tokens[:2])] += 1
        client.delete(f"/v1/sessions/{session_id}")
    assert chi_square_p_value(observed, exact) > 1e-3
