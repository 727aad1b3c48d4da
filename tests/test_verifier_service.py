"""The verify endpoint against a plain forward of the same tiny target (fp32, no cache), with
and without the session's KV cache; the session protocol (follow-ups, rejections, 409 resyncs,
retries, deletion); seeds; metrics; and concurrent sessions on a real server.

Greedy blocks are built from the target's own greedy continuation with one token corrupted at
a random position, so full acceptances and rejections at every position both occur.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from servers import serve, wait_until
from spade_core.params import SamplingConfig
from spade_core.sampling import position_uniforms, processed_probs, sample_from
from verifier_service.kv_budget import kv_bytes_per_token
from verifier_service.protocol import SESSION_RESYNC_CODE, WIRE_VERSION, VerifierHealth
from verifier_support import (
    ENVELOPE_KEYS,
    MAX_DRAFT,
    committed_after,
    error_of,
    greedy_block,
    greedy_continuation,
    new_session_id,
    open_session,
    plain_forward_logits,
    post_verify,
    random_tokens,
    reference_verdict,
    running_verifier,
    verdict,
    verifier_app,
    verify,
    verify_body,
)

# --- answers equal a plain forward ------------------------------------------------------------


def test_random_blocks_on_fresh_sessions_match_a_plain_forward(client, model, vocab_size):
    rng = random.Random(0)
    for _ in range(12):
        context = random_tokens(rng, rng.randrange(1, 40), vocab_size)
        block = random_tokens(rng, rng.randrange(1, MAX_DRAFT + 1), vocab_size)
        answer = verify(client, verify_body(new_session_id(), [], block, new_tokens=context))
        assert verdict(answer) == reference_verdict(model, context, block)


def test_corrupted_greedy_blocks_on_fresh_sessions_match_a_plain_forward(client, model, vocab_size):
    rng = random.Random(1)
    num_accepted_seen = set()
    for _ in range(16):
        context = random_tokens(rng, rng.randrange(1, 40), vocab_size)
        length = rng.randrange(1, MAX_DRAFT + 1)
        block = greedy_block(model, context, length, rng.randrange(0, length + 1), vocab_size, rng)
        answer = verify(client, verify_body(new_session_id(), [], block, new_tokens=context))
        assert verdict(answer) == reference_verdict(model, context, block)
        num_accepted_seen.add(answer["num_accepted"] == len(block))
    assert num_accepted_seen == {True, False}  # both full acceptance and rejections happened


def test_follow_up_calls_through_the_cache_match_a_plain_forward(client, model, vocab_size):
    rng = random.Random(2)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, greedy_block(model, context, 4, 2, vocab_size, rng))
    for _ in range(10):
        length = rng.randrange(1, 6)
        block = greedy_block(model, session.committed, length, rng.randrange(0, length + 1), vocab_size, rng)
        answer = verify(client, verify_body(session.session_id, session.committed, block))
        assert verdict(answer) == reference_verdict(model, session.committed, block)
        session.committed = committed_after(session.committed, block, answer)


def test_call_after_a_rejection_matches_a_plain_forward(client, model, vocab_size):
    rng = random.Random(3)
    context = random_tokens(rng, 10, vocab_size)
    session = open_session(client, context, greedy_block(model, context, 5, 1, vocab_size, rng))
    block = greedy_block(model, session.committed, 3, 3, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, session.committed, block))
    assert verdict(answer) == reference_verdict(model, session.committed, block)


def test_logprobs_are_the_raw_target_log_probabilities_of_the_emitted_tokens(client, model, vocab_size):
    rng = random.Random(4)
    context = random_tokens(rng, 9, vocab_size)
    block = greedy_block(model, context, 4, 2, vocab_size, rng)
    answer = verify(client, verify_body(new_session_id(), [], block, new_tokens=context) | {"num_top_logprobs": 0})
    emitted = block[:2] + [answer["next_token"]]
    log_probs = plain_forward_logits(model, context + block)[len(context) - 1 :].log_softmax(dim=-1)
    expected = [float(log_probs[row, token]) for row, token in enumerate(emitted)]
    assert answer["logprobs"] == pytest.approx(expected, abs=1e-4)
    assert answer["top_logprobs"] == [{"token_ids": [], "logprobs": []}] * 3


def test_a_call_that_does_not_ask_gets_no_logprobs(client, model, vocab_size):
    rng = random.Random(4)
    context = random_tokens(rng, 9, vocab_size)
    answer = verify(client, verify_body(new_session_id(), [], greedy_block(model, context, 4, 2, vocab_size, rng), new_tokens=context))
    assert (answer["logprobs"], answer["top_logprobs"]) == ([], None)


def test_context_length_counts_context_accepted_and_next(client, model, vocab_size):
    rng = random.Random(5)
    context = random_tokens(rng, 9, vocab_size)
    block = greedy_block(model, context, 4, 2, vocab_size, rng)
    answer = verify(client, verify_body(new_session_id(), [], block, new_tokens=context))
    assert answer["context_length"] == 9 + 2 + 1


def test_next_token_kind_is_bonus_after_full_acceptance_and_correction_otherwise(client, model, vocab_size):
    rng = random.Random(6)
    context = random_tokens(rng, 9, vocab_size)
    blocks = [greedy_block(model, context, 3, corrupt_at, vocab_size, rng) for corrupt_at in (3, 1)]
    answers = [verify(client, verify_body(new_session_id(), [], block, new_tokens=context)) for block in blocks]
    assert [answer["next_token_kind"] for answer in answers] == ["bonus", "correction"]


# --- the empty block: the prompt alone, answered with the target's next token -----------------


def test_an_empty_block_answers_the_targets_greedy_next_token_as_a_bonus(client, model, vocab_size):
    rng = random.Random(30)
    context = random_tokens(rng, 17, vocab_size)
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context))
    argmax = int(plain_forward_logits(model, context)[-1].argmax())
    assert (answer["num_accepted"], answer["next_token"], answer["next_token_kind"]) == (0, argmax, "bonus")
    assert (answer["context_length"], answer["num_target_tokens"]) == (len(context) + 1, len(context))


def test_after_an_empty_block_the_session_holds_the_prompt_and_its_next_token(client, model, vocab_size):
    rng = random.Random(31)
    context = random_tokens(rng, 14, vocab_size)
    session = open_session(client, context, [])
    assert session.committed == context + [int(plain_forward_logits(model, context)[-1].argmax())]
    block = greedy_block(model, session.committed, 4, 2, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, session.committed, block))
    assert verdict(answer) == reference_verdict(model, session.committed, block)
    assert answer["num_target_tokens"] == 1 + 4  # the prompt is cached: only the next token and the block


def test_an_empty_block_asking_for_logprobs_gets_those_of_its_one_token(client, model, vocab_size):
    context = random_tokens(random.Random(32), 11, vocab_size)
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=context) | {"num_top_logprobs": 3})
    row = plain_forward_logits(model, context)[-1].log_softmax(dim=-1)
    assert answer["logprobs"] == pytest.approx([float(row[answer["next_token"]])], abs=1e-4)
    assert [top["token_ids"] for top in answer["top_logprobs"]] == [row.topk(3).indices.tolist()]


def test_a_sampled_empty_block_draws_its_positions_target_token(client, model, vocab_size):
    """What holds for seeds: the token is sample_from(p_n, u_n), p_n the target's distribution at
    the context's end and u_n position n's seeded token draw, the very draw a target-only step
    makes there. ``draft_probs`` may be [] for an empty block."""
    context = random_tokens(random.Random(33), 12, vocab_size)
    sampling = SamplingConfig(temperature=1.0, top_k=40)
    probs = processed_probs(plain_forward_logits(model, context)[-1], sampling)
    drawn = []
    for seed in range(8):
        body = verify_body(new_session_id(), [], [], new_tokens=context, sampling={"temperature": 1.0, "top_k": 40, "seed": seed})
        answer = verify(client, body | {"draft_probs": []})
        expected = sample_from(probs, float(position_uniforms(seed, len(context), 1)[0, 1]))
        assert (answer["num_accepted"], answer["next_token"]) == (0, expected)
        drawn.append(expected)
    assert len(set(drawn)) > 1


def test_health_states_the_wire_version_and_the_draft_length_limit_under_one_name_each(client):
    health = client.get("/health").json()
    assert (health["wire_version"], health["max_draft_length"]) == (WIRE_VERSION, client.app.state.settings.max_draft_length)
    assert VerifierHealth.model_validate(health).model_dump() == health
    assert set(health) == set(VerifierHealth.model_fields)


# --- the cache: no re-prefill -----------------------------------------------------------------


def test_first_call_feeds_the_whole_context_and_block(client, model, vocab_size):
    rng = random.Random(7)
    context = random_tokens(rng, 15, vocab_size)
    answer = verify(client, verify_body(new_session_id(), [], random_tokens(rng, 4, vocab_size), new_tokens=context))
    assert answer["num_target_tokens"] == 15 + 4


@pytest.mark.parametrize("corrupt_at", [0, 2, 3], ids=["rejected_first", "rejected_third", "all_accepted"])
def test_follow_up_call_feeds_only_the_next_token_and_the_block(client, model, vocab_size, corrupt_at):
    rng = random.Random(8)
    context = random_tokens(rng, 15, vocab_size)
    session = open_session(client, context, greedy_block(model, context, 3, corrupt_at, vocab_size, rng))
    answer = verify(client, verify_body(session.session_id, session.committed, random_tokens(rng, 5, vocab_size)))
    assert answer["num_target_tokens"] == 1 + 5


# --- the session protocol ---------------------------------------------------------------------


def test_unknown_session_is_answered_409_resync_required(client, vocab_size):
    response = post_verify(client, verify_body(new_session_id(), [5, 6, 7], [8]))
    assert error_of(response) == (409, ENVELOPE_KEYS, "conflict_error", "session_id", SESSION_RESYNC_CODE)


def test_resync_after_409_with_the_full_context_matches_a_plain_forward(client, model, vocab_size):
    rng = random.Random(9)
    session_id, context = new_session_id(), random_tokens(rng, 12, vocab_size)
    block = greedy_block(model, context, 4, 2, vocab_size, rng)
    assert post_verify(client, verify_body(session_id, context, block)).status_code == 409
    answer = verify(client, verify_body(session_id, [], block, new_tokens=context))
    assert verdict(answer) == reference_verdict(model, context, block)


def test_digest_mismatch_is_answered_409_resync_required(client, model, vocab_size):
    rng = random.Random(10)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    wrong = session.committed[:-1] + [session.committed[-1] + 1]
    response = post_verify(client, verify_body(session.session_id, wrong, [5]))
    assert error_of(response) == (409, ENVELOPE_KEYS, "conflict_error", "prefix_digest", SESSION_RESYNC_CODE)


def test_prefix_length_short_of_the_session_is_answered_409(client, model, vocab_size):
    rng = random.Random(11)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    response = post_verify(client, verify_body(session.session_id, session.committed[:-1], [5]))
    assert error_of(response)[0] == 409


def test_call_after_a_409_digest_mismatch_still_works_with_the_right_prefix(client, model, vocab_size):
    rng = random.Random(12)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    post_verify(client, verify_body(session.session_id, session.committed[:-1] + [3], [5]))
    block = greedy_block(model, session.committed, 4, 1, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, session.committed, block))
    assert verdict(answer) == reference_verdict(model, session.committed, block)


def test_resync_of_a_known_session_reuses_its_cache(client, model, vocab_size):
    rng = random.Random(13)
    context = random_tokens(rng, 20, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    answer = verify(client, verify_body(session.session_id, [], [7, 8, 9], new_tokens=session.committed))
    assert answer["num_target_tokens"] == 1 + 3


def test_new_tokens_beyond_the_prefix_extend_the_context(client, model, vocab_size):
    rng = random.Random(14)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    new_tokens = random_tokens(rng, 3, vocab_size)
    block = greedy_block(model, session.committed + new_tokens, 4, 2, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, session.committed, block, new_tokens=new_tokens))
    assert verdict(answer) == reference_verdict(model, session.committed + new_tokens, block)


def test_new_tokens_beyond_the_prefix_are_fed_without_re_prefill(client, model, vocab_size):
    rng = random.Random(15)
    context = random_tokens(rng, 12, vocab_size)
    session = open_session(client, context, random_tokens(rng, 2, vocab_size))
    answer = verify(client, verify_body(session.session_id, session.committed, [9, 9], new_tokens=[5, 6, 7]))
    assert answer["num_target_tokens"] == 1 + 3 + 2


def test_deleted_session_is_answered_409(client, vocab_size):
    rng = random.Random(16)
    session = open_session(client, random_tokens(rng, 8, vocab_size), [5])
    client.delete(f"/v1/sessions/{session.session_id}")
    response = post_verify(client, verify_body(session.session_id, session.committed, [6]))
    assert error_of(response) == (409, ENVELOPE_KEYS, "conflict_error", "session_id", SESSION_RESYNC_CODE)


def test_delete_reports_whether_the_session_existed(client, vocab_size):
    session = open_session(client, random_tokens(random.Random(17), 8, vocab_size), [5])
    answers = [client.delete(f"/v1/sessions/{session.session_id}").json() for _ in range(2)]
    assert answers == [{"session_id": session.session_id, "deleted": deleted} for deleted in (True, False)]


def test_deleted_session_resyncs_with_a_full_prefill(client, model, vocab_size):
    rng = random.Random(18)
    session = open_session(client, random_tokens(rng, 8, vocab_size), [5])
    client.delete(f"/v1/sessions/{session.session_id}")
    answer = verify(client, verify_body(session.session_id, [], [6, 7], new_tokens=session.committed))
    assert answer["num_target_tokens"] == len(session.committed) + 2


# --- retries and seeds ------------------------------------------------------------------------

SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 1234}


def test_retried_call_returns_the_same_answer_marked_replayed(client, vocab_size):
    rng = random.Random(19)
    session = open_session(client, random_tokens(rng, 8, vocab_size), [5])
    body = verify_body(session.session_id, session.committed, random_tokens(rng, 4, vocab_size), sampling=SAMPLED)
    first, retried = verify(client, body), verify(client, body)
    assert (retried["replayed"], retried | {"replayed": False}) == (True, first)


def test_retried_call_does_not_advance_the_session(client, model, vocab_size):
    rng = random.Random(20)
    session = open_session(client, random_tokens(rng, 8, vocab_size), [5])
    block = random_tokens(rng, 4, vocab_size)
    body = verify_body(session.session_id, session.committed, block, sampling=SAMPLED)
    answer = verify(client, body)
    verify(client, body)
    committed = committed_after(session.committed, block, answer)
    follow_up = greedy_block(model, committed, 3, 1, vocab_size, rng)
    answer = verify(client, verify_body(session.session_id, committed, follow_up))
    assert verdict(answer) == reference_verdict(model, committed, follow_up)


def test_retried_first_call_is_replayed_too(client, vocab_size):
    body = verify_body(new_session_id(), [], [5, 6], new_tokens=random_tokens(random.Random(21), 8, vocab_size))
    verify(client, body)
    assert verify(client, body)["replayed"] is True


def sampled_verdict(client, context: list[int], block: list[int], seed: int) -> tuple[int, int]:
    body = verify_body(new_session_id(), [], block, new_tokens=context, sampling=SAMPLED | {"seed": seed})
    return verdict(verify(client, body))


def test_same_seed_gives_the_same_sampled_answer_on_any_session(client, vocab_size):
    rng = random.Random(22)
    context, block = random_tokens(rng, 10, vocab_size), random_tokens(rng, 3, vocab_size)
    assert [sampled_verdict(client, context, block, seed) for seed in range(6)] == [
        sampled_verdict(client, context, block, seed) for seed in range(6)
    ]


def test_different_seeds_give_different_sampled_answers(client, vocab_size):
    rng = random.Random(23)
    context, block = random_tokens(rng, 10, vocab_size), random_tokens(rng, 3, vocab_size)
    assert len({sampled_verdict(client, context, block, seed) for seed in range(8)}) > 1


# --- metrics of the verify path ---------------------------------------------------------------


@pytest.fixture(scope="module")
def verify_metrics(tiny_pair, target_model) -> dict[str, float]:
    """Counters of a fresh verifier after: one call (15-token context, 3 drafted, 1 accepted),
    its retry, and a call on an unknown session."""
    model = target_model.model
    vocab_size = model.get_output_embeddings().weight.shape[0]
    rng = random.Random(33)
    with running_verifier(tiny_pair) as client:
        context = random_tokens(rng, 15, vocab_size)
        block = greedy_block(model, context, 3, 1, vocab_size, rng)
        body = verify_body(new_session_id(), [], block, new_tokens=context)
        verify(client, body)
        verify(client, body)
        post_verify(client, verify_body(new_session_id(), [1, 2], [5]))
        text = client.get("/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.parametrize(
    "name,value",
    [
        ("spade_verifier_verify_calls_total", 1),
        ("spade_verifier_replayed_calls_total", 1),
        ("spade_verifier_resyncs_total", 1),
        ("spade_verifier_drafted_tokens_total", 3),
        ("spade_verifier_accepted_tokens_total", 1),
        ("spade_verifier_generated_tokens_total", 2),
        ("spade_verifier_target_tokens_total", 15 + 3),
        ("spade_verifier_forward_passes_total", 1),
        ("spade_verifier_sessions", 1),
    ],
)
def test_verify_metrics_count_exactly(verify_metrics, name, value):
    assert verify_metrics[name] == value


def test_kv_cache_bytes_are_the_held_session_s_tokens_at_the_model_s_bytes_per_token(verify_metrics, target_model):
    per_token = kv_bytes_per_token(target_model.model.config, torch.float32)
    # The one session holds its 17 committed tokens: the 15 of context, the accepted draft and the
    # verdict's next token (the 2 rejected drafts were cut); the unknown session holds nothing.
    assert verify_metrics["spade_verifier_kv_cache_bytes"] == (15 + 1 + 1) * per_token


# --- concurrent sessions on a real server -----------------------------------------------------


@dataclass(frozen=True)
class ChainPlan:
    """A session's calls, fixed in advance: every block is a slice of the context's greedy
    continuation (so the committed context stays on it) with one token maybe corrupted."""

    context: list[int]
    greedy: list[int]
    steps: list[tuple[int, int, int]]  # (draft length, corrupt position, replacement token)


def chain_plan(model, rng: random.Random, vocab_size: int) -> ChainPlan:
    context = random_tokens(rng, rng.randrange(4, 20), vocab_size)
    lengths = [rng.randrange(1, 5) for _ in range(6)]
    steps = [(length, rng.randrange(0, length + 1), rng.randrange(3, vocab_size)) for length in lengths]
    return ChainPlan(context, greedy_continuation(model, context, 6 * 5), steps)


@dataclass(frozen=True)
class ChainStep:
    committed: list[int]
    block: list[int]
    verdict: tuple[int, int]


async def run_chain(http: httpx.AsyncClient, session_id: str, plan: ChainPlan) -> list[ChainStep]:
    """The plan's calls, each block cut to the last answer's advice as an edge cuts it (a block
    longer than the advice would be cut by the verifier, and the advice follows the verifier's
    measured load): what each call held, sent and got."""
    committed, position, advice, steps = list(plan.context), 0, None, []
    for step, (length, corrupt_at, replacement) in enumerate(plan.steps):
        length = length if advice is None else min(length, advice)
        block = plan.greedy[position : position + length]
        if corrupt_at < length and replacement != block[corrupt_at]:
            block[corrupt_at] = replacement
        held, new_tokens = (committed, []) if step else ([], committed)
        response = await http.post("/v1/verify", json=verify_body(session_id, held, block, new_tokens=new_tokens))
        answer = response.json()
        steps.append(ChainStep(list(committed), block, verdict(answer)))
        committed = committed_after(committed, block, answer)
        position += answer["num_accepted"] + 1
        advice = answer["advised_draft_length"]
    return steps


@pytest.fixture(scope="module")
def server_url(tiny_pair):
    with serve(verifier_app(tiny_pair)) as url:
        yield url


async def test_concurrent_sessions_answer_as_sequential_ones(server_url, model, vocab_size):
    rng = random.Random(34)
    plans = [chain_plan(model, rng, vocab_size) for _ in range(6)]
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as http:
        sequential = [await run_chain(http, f"sequential-{i}", plan) for i, plan in enumerate(plans)]
        concurrent = await asyncio.gather(*(run_chain(http, f"concurrent-{i}", plan) for i, plan in enumerate(plans)))
    for plan, alone, shared in zip(plans, sequential, concurrent, strict=True):
        for steps in (alone, shared):  # every committed token is the target's own
            last = steps[-1]
            committed = last.committed + last.block[: last.verdict[0]] + [last.verdict[1]]
            assert committed == (plan.context + plan.greedy)[: len(committed)]
        for one, other in zip(alone, shared, strict=True):  # the same call gets the same verdict, alone or sharing forwards
            if (one.committed, one.block) != (other.committed, other.block):
                break  # the advice cut the two runs' blocks differently from here on
            assert one.verdict == other.verdict


async def test_racing_calls_of_one_session_commit_once(server_url, vocab_size):
    """Two different calls from the same prefix: the session's lock lets one commit, and the
    other then finds the prefix moved on (409)."""
    context = random_tokens(random.Random(35), 10, vocab_size)
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as http:
        first = await http.post("/v1/verify", json=verify_body("racing", [], [5], new_tokens=context))
        committed = committed_after(context, [5], first.json())
        racing = [http.post("/v1/verify", json=verify_body("racing", committed, [token])) for token in (6, 7)]
        statuses = sorted(response.status_code for response in await asyncio.gather(*racing))
    assert statuses == [200, 409]


# --- target-only decoding frees its cache -----------------------------------------------------


@pytest.mark.parametrize("stops_early", [False, True], ids=["runs_to_max_tokens", "stopped_by_a_stop_string"])
def test_target_only_request_releases_its_cache(tiny_pair, target_model, stops_early):
    tokenizer = target_model.tokenizer
    prompt_ids = tokenizer.encode("def add(a, b):")
    first_character = tokenizer.decode(greedy_continuation(target_model.model, prompt_ids, 1))[0]
    body = {"model": "target", "prompt": prompt_ids, "max_tokens": 6, "temperature": 0.0}
    with running_verifier(tiny_pair) as client:
        response = client.post("/v1/completions", json=body | ({"stop": first_character} if stops_early else {}))
        assert response.json()["choices"][0]["finish_reason"] == ("stop" if stops_early else "length")
        assert wait_until(lambda: client.app.state.service.backend.num_cached_sessions == 0)
