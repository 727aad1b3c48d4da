"""Sampling exactness end to end: the edge's speculative output follows the target's distribution.

Over the 12-token ``letters`` vocabulary the first two generated tokens have 144 possible
outcomes (fewer: EOS first ends the output), so their exact distribution under the target,
P(t1) * P(t2 | t1) after the request's sampling transform, is computed from the target model
directly and compared with thousands of seeded generations of the edge's speculative engine
(draft length 3, verify calls through the verifier app in-process; the first call carrying the
prompt alone, the default, and, for one setting, a drafted block). A chi-square
goodness-of-fit test must accept it (p > 0.001), and must reject the draft model's own
distribution (p < 1e-6): the negative control that shows the test can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import openai
import pytest
import torch
from scipy.stats import chisquare

from edge_support import edge_app, in_process_engine, verifier_app
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from servers import serve
from spade_core.params import SamplingConfig
from spade_core.sampling import processed_probs
from spade_models.loader import LoadedModel, ModelSource, load_model

PROMPT = "b b c c"
"""A prompt whose first two tokens are spread over many outcomes (13 cells of >= 5 expected draws
at temperature 1), where draft and target disagree clearly."""
MIN_EXPECTED = 5.0
SETTINGS = {
    "temperature-1": SamplingConfig(temperature=1.0),
    "temperature-0.7-top-k-5": SamplingConfig(temperature=0.7, top_k=5),
    "top-p-0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "temperature-1-block-first": SamplingConfig(temperature=1.0),
}
NUM_SEEDS = {"temperature-1": 4000, "temperature-0.7-top-k-5": 2000, "top-p-0.8": 2000, "temperature-1-block-first": 2000}
"""Seeds drawn per setting: 4000 where the outcomes spread widest, 2000 for the two truncated
settings (fewer outcomes) and the block-first one, which still reject the draft's distribution
by far."""
EDGE_SETTINGS = {"temperature-1-block-first": {"prefill_first": False}}
"""The edge runs with its defaults (the first call carries the prompt alone, so the first token
is drawn by the target and the second goes through the acceptance rule), except here, where
the first call carries a drafted block and both tokens go through the acceptance rule."""

Outcome = tuple[int, ...]

STATISTICAL = pytest.mark.slow
"""The draws take minutes of CPU (10,000 generations): the slow suite, which .ci/run runs after
the default one (``scripts/test -m slow``). The seeded-request tests below stay in the default suite."""

XDIST_SPLIT_BY = "setting"
"""Each setting's draws take a minute: the settings run on different workers (conftest.py)."""
XDIST_HEAVY = True


def exact_first_two(
    model: LoadedModel,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    eos_token_ids: frozenset[int],
) -> dict[Outcome, float]:
    """P(t1) * P(t2 | t1) for every outcome of non-zero probability; EOS first is the outcome (eos,)."""
    first = _next_token_probs(model, prompt_ids, sampling)
    joint: dict[Outcome, float] = {}
    for t1 in torch.nonzero(first).flatten().tolist():
        if t1 in eos_token_ids:
            joint[(t1,)] = float(first[t1])
            continue
        second = _next_token_probs(model, prompt_ids + [t1], sampling)
        for t2 in torch.nonzero(second).flatten().tolist():
            joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def _next_token_probs(model: LoadedModel, token_ids: list[int], sampling: SamplingConfig) -> torch.Tensor:
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([token_ids])).logits[0, -1]
    return processed_probs(logits, sampling).double()


def chi_square_p_value(observed: Counter, probs: dict[Outcome, float]) -> float:
    """Goodness of fit of ``observed`` to ``probs``. Outcomes expected fewer than 5 times
    (and observed outcomes of probability 0) share one merged cell, itself merged with the next
    rarest cells until it is expected 5 times too."""
    num_draws = sum(observed.values())
    by_rarity = sorted(probs, key=probs.get)
    merged_observed = sum(count for outcome, count in observed.items() if outcome not in probs)
    merged_expected = 0.0
    while by_rarity and (probs[by_rarity[0]] * num_draws < MIN_EXPECTED or 0 < merged_expected < MIN_EXPECTED):
        outcome = by_rarity.pop(0)
        merged_observed += observed[outcome]
        merged_expected += probs[outcome] * num_draws
    cells_observed = [observed[outcome] for outcome in by_rarity]
    cells_expected = [probs[outcome] * num_draws for outcome in by_rarity]
    if merged_expected > 0:
        cells_observed.append(merged_observed)
        cells_expected.append(merged_expected)
    elif merged_observed > 0:
        return 0.0  # outcomes the distribution cannot produce at all
    scale = num_draws / sum(cells_expected)
    return float(chisquare(cells_observed, [expected * scale for expected in cells_expected]).pvalue)


async def _draw_first_two(pair, sampling: SamplingConfig, num_seeds: int, edge_settings: dict) -> Counter:
    async with in_process_engine(pair, draft_length="3", edge_settings=edge_settings) as stack:
        engine = stack.engine
        prompt_ids = engine.tokenizer.encode(PROMPT)
        outcomes = Counter()
        for seed in range(num_seeds):
            # A budget of 4: a drafted first block holds 3 tokens; after the prompt-only call
            # (the first token) the next block holds 2. Only the first 2 tokens are kept.
            request = GenerationRequest(
                f"draw-{seed}",
                prompt_ids,
                4,
                SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed),
                engine.model.eos_token_ids,
            )
            outcomes[await _first_two(engine, request)] += 1
        return outcomes


async def _first_two(engine, request: GenerationRequest) -> Outcome:
    token_ids: list[int] = []
    batches = engine.generate(request, SpadeStats())
    async with contextlib.aclosing(batches):
        async for batch in batches:
            token_ids += batch.token_ids
            if len(token_ids) >= 2:
                break
    return tuple(token_ids[:2])


@pytest.fixture(scope="module")
def letters_models(letters_pair) -> tuple[LoadedModel, LoadedModel]:
    return load_model(ModelSource(str(letters_pair.target_dir))), load_model(ModelSource(str(letters_pair.draft_dir)))


@pytest.fixture(scope="module")
def speculative_draws(letters_pair):
    """Counts of the first two tokens over NUM_SEEDS[setting] seeds (drawn once, on demand)."""
    cache: dict[str, Counter] = {}

    def draws(setting: str) -> Counter:
        if setting not in cache:
            cache[setting] = asyncio.run(
                _draw_first_two(letters_pair, SETTINGS[setting], NUM_SEEDS[setting], EDGE_SETTINGS.get(setting, {}))
            )
        return cache[setting]

    return draws


def _exact(model: LoadedModel, setting: str) -> dict[Outcome, float]:
    eos_token_ids = frozenset({model.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    return exact_first_two(model, model.tokenizer.encode(PROMPT), SETTINGS[setting], eos_token_ids)


@STATISTICAL
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_first_two_tokens_follow_the_exact_target_distribution(speculative_draws, letters_models, setting):
    target, _ = letters_models
    assert chi_square_p_value(speculative_draws(setting), _exact(target, setting)) > 1e-3


@STATISTICAL
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_no_outcome_outside_the_target_support_is_ever_drawn(speculative_draws, letters_models, setting):
    target, _ = letters_models
    assert set(speculative_draws(setting)) - set(_exact(target, setting)) == set()


@STATISTICAL
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_same_draws_reject_the_draft_model_distribution(speculative_draws, letters_models, setting):
    _, draft = letters_models
    assert chi_square_p_value(speculative_draws(setting), _exact(draft, setting)) < 1e-6


@STATISTICAL
@pytest.mark.xdist_group("test_edge_sampling-temperature-1")  # with the tests that draw these
def test_the_draws_cover_many_outcomes(speculative_draws):
    """The test has something to compare: at temperature 1 at least 10 outcomes are seen 5 times."""
    assert sum(count >= 5 for count in speculative_draws("temperature-1").values()) >= 10


# Seeds through the served API -------------------------------------------------------------


@pytest.fixture(scope="module")
def edge_client(tiny_pair):
    with serve(verifier_app(tiny_pair)) as verifier_url, serve(edge_app(tiny_pair, verifier_url, draft_length="3")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _sampled_text(client: openai.OpenAI, seed: int) -> str:
    response = client.completions.create(model="target", prompt="The edge drafts", max_tokens=40, temperature=1.0, seed=seed)
    return response.choices[0].text


def test_the_same_seed_gives_the_same_text(edge_client):
    assert _sampled_text(edge_client, 1234) == _sampled_text(edge_client, 1234)


def test_different_seeds_give_different_texts(edge_client):
    assert len({_sampled_text(edge_client, seed) for seed in range(5)}) == 5
