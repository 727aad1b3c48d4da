"""Greedy equality: at temperature 0 the edge's output is the target's own output.

For every draft length (fixed 1, 2, 3, 5, 8 and adaptive), drafting ahead or in turn, with the
prompt-only first call (prefill first) or a drafted first block, each case's text, token count and
finish reason from the edge equal what the verifier answers with target-only decoding (its own
/v1/completions and /v1/chat/completions), through real servers, the openai client and fp32
tiny models. The cases mix both endpoints, streamed and not, budgets from 1 to 100 tokens, and
prompts whose greedy output ends at EOS (before, exactly at, and just after the budget).
"""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest

from edge_agent.edge_power import DEFAULT_EDGE_POWER
from edge_support import edge_app, verifier_app
from greedy_support import TINY_PAIR_CASES, Output, generate
from servers import serve

DRAFT_LENGTHS = ["1", "2", "3", "5", "8", "auto"]


@pytest.fixture(scope="module")
def verifier_url(tiny_pair):
    with serve(verifier_app(tiny_pair)) as url:
        yield url


@pytest.fixture(scope="module")
def target_outputs(verifier_url) -> dict[str, Output]:
    """Target-only decoding by the verifier itself, never streamed: the reference."""
    client = openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)
    return {case.id: generate(client, replace(case, stream=False)) for case in TINY_PAIR_CASES}


EDGE_VARIANTS = (
    [(length, True, True, DEFAULT_EDGE_POWER) for length in DRAFT_LENGTHS]
    + [(length, False, True, DEFAULT_EDGE_POWER) for length in ("1", "5", "auto")]
    + [("3", True, False, DEFAULT_EDGE_POWER), ("5", False, False, DEFAULT_EDGE_POWER)]
    + [
        (length, True, prefill_first, power)
        for length in ("2", "auto")
        for prefill_first in (True, False)
        for power in ("balanced", "saver")
    ]
)
"""(draft length, overlap, prefill first, edge power): every length drafting ahead while verifying,
with the prompt-only first call (the defaults); some in turn; some whose first call carries a
block; the other --edge-power modes, which change only when the edge drafts ahead."""


def _variant_id(length: str, overlap: bool, prefill_first: bool, power: str) -> str:
    mode = f"{'overlap' if overlap else 'in-turn'}{'' if prefill_first else '-block-first'}"
    return f"draft-{length}-{mode}" + ("" if power == DEFAULT_EDGE_POWER else f"-{power}")


@pytest.fixture(scope="module", params=EDGE_VARIANTS, ids=[_variant_id(*variant) for variant in EDGE_VARIANTS])
def edge_client(request, tiny_pair, verifier_url):
    draft_length, overlap, prefill_first, power = request.param
    settings = dict(overlap=overlap, prefill_first=prefill_first, edge_power=power)
    with serve(edge_app(tiny_pair, verifier_url, draft_length=draft_length, **settings)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_the_cases_marked_ends_at_eos_are_those_whose_target_output_ends_at_eos(target_outputs):
    ended_at_eos = {case_id for case_id, output in target_outputs.items() if output.finish_reason == "stop"}
    assert ended_at_eos == {case.id for case in TINY_PAIR_CASES if case.ends_at_eos}


def test_the_other_cases_use_their_whole_budget_on_the_target(target_outputs):
    lengths = {case.id: target_outputs[case.id].completion_tokens for case in TINY_PAIR_CASES if not case.ends_at_eos}
    assert lengths == {case.id: case.max_tokens for case in TINY_PAIR_CASES if not case.ends_at_eos}


@pytest.mark.parametrize("case", TINY_PAIR_CASES, ids=[case.id for case in TINY_PAIR_CASES])
def test_greedy_output_equals_the_target_only_output(edge_client, target_outputs, case):
    assert generate(edge_client, case) == target_outputs[case.id]
