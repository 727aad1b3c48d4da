"""Greedy equality: at temperature 0 the edge's output is the target's own output.

For every draft length (fixed 1, 2, 3, 5, 8 and adaptive), drafting ahead or in turn, with the
prompt-only first call (prefill first) or a drafted first block, each case's text, token count and
finish reason from the edge equal what the verifier answers with target-only decoding (its own
/v1/completions and /v1/chat/completions), through real servers, the openai client and fp32
tiny models. The cases mix both endpoints, streamed and not, budgets from 1 to 100 tokens, and
prompts whose greedy output ends at EOS (before, exactly at, and just after the budget).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import openai
import pytest

from edge_support import edge_app, verifier_app
from servers import serve

DRAFT_LENGTHS = ["1", "2", "3", "5", "8", "auto"]


@dataclass(frozen=True)
class Case:
    api: str  # "completions" or "chat"
    prompt: str | list[dict]
    max_tokens: int
    stream: bool = False
    ends_at_eos: bool = False
    """The target's greedy output ends with EOS within the budget (checked below)."""

    @property
    def id(self) -> str:
        text = self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]
        return f"{self.api}-{text[:16]}-{self.max_tokens}{'-stream' if self.stream else ''}"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CASES = [
    Case("completions", "The edge drafts", 40),
    Case("completions", "def add(a, b):", 64, stream=True),
    Case("completions", "print(", 32, ends_at_eos=True),  # EOS is the 8th token
    Case("completions", "print(", 7),  # the budget ends one token before EOS
    Case("completions", "The cloud", 48, stream=True, ends_at_eos=True),
    Case("completions", "verify the block", 24, ends_at_eos=True),
    Case("completions", "z", 16, ends_at_eos=True),
    Case("completions", "Tell me a joke", 64, ends_at_eos=True),
    Case("completions", "hello world", 1),
    Case("completions", "Speculative decoding", 2, stream=True),
    Case("completions", "Tokens are", 7),
    Case("completions", "x", 100),
    Case("completions", "東京", 30),
    Case("chat", _user("A small model"), 32, ends_at_eos=True),
    Case("chat", _user("café"), 16, stream=True, ends_at_eos=True),
    Case("chat", _user("naïve"), 40, ends_at_eos=True),
    Case("chat", _user("hi"), 64, ends_at_eos=True),
    Case("chat", _user("What is speculative decoding?"), 50, stream=True),
    Case("chat", _user("Write a poem"), 20),
    Case("chat", _user("SELECT * FROM"), 19, ends_at_eos=True),  # EOS is the 19th token: the last one allowed
    Case("chat", _user("<html>"), 8, stream=True, ends_at_eos=True),  # EOS is the 8th token: the last one allowed
    Case("chat", _user("List three colours"), 3),
    Case("chat", [{"role": "system", "content": "Answer briefly."}] + _user("# comment"), 33),
    Case("chat", _user("hi") + [{"role": "assistant", "content": "hello"}] + _user("and now?"), 45),
]


@dataclass(frozen=True)
class Output:
    text: str
    completion_tokens: int
    finish_reason: str


def generate(client: openai.OpenAI, case: Case) -> Output:
    common = dict(model="target", max_tokens=case.max_tokens, temperature=0)
    if case.stream:
        return _generate_streamed(client, case, common)
    if case.api == "chat":
        response = client.chat.completions.create(messages=case.prompt, **common)
        choice = response.choices[0]
        return Output(choice.message.content, response.usage.completion_tokens, choice.finish_reason)
    response = client.completions.create(prompt=case.prompt, **common)
    choice = response.choices[0]
    return Output(choice.text, response.usage.completion_tokens, choice.finish_reason)


def _generate_streamed(client: openai.OpenAI, case: Case, common: dict) -> Output:
    options = dict(stream=True, stream_options={"include_usage": True}, **common)
    if case.api == "chat":
        chunks = list(client.chat.completions.create(messages=case.prompt, **options))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        chunks = list(client.completions.create(prompt=case.prompt, **options))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finish_reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    return Output(text, chunks[-1].usage.completion_tokens, finish_reasons[-1])


@pytest.fixture(scope="module")
def verifier_url(tiny_pair):
    with serve(verifier_app(tiny_pair)) as url:
        yield url


@pytest.fixture(scope="module")
def target_outputs(verifier_url) -> dict[str, Output]:
    """Target-only decoding by the verifier itself, never streamed: the reference."""
    client = openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)
    return {case.id: generate(client, replace(case, stream=False)) for case in CASES}


EDGE_VARIANTS = (
    [(length, True, True) for length in DRAFT_LENGTHS]
    + [(length, False, True) for length in ("1", "5", "auto")]
    + [("3", True, False), ("5", False, False)]
)
"""(draft length, overlap, prefill first): every length drafting ahead while verifying, with the
prompt-only first call (the defaults); some in turn; some whose first call carries a block."""


def _variant_id(length: str, overlap: bool, prefill_first: bool) -> str:
    return f"draft-{length}-{'overlap' if overlap else 'in-turn'}{'' if prefill_first else '-block-first'}"


@pytest.fixture(scope="module", params=EDGE_VARIANTS, ids=[_variant_id(*variant) for variant in EDGE_VARIANTS])
def edge_client(request, tiny_pair, verifier_url):
    draft_length, overlap, prefill_first = request.param
    with serve(edge_app(tiny_pair, verifier_url, draft_length=draft_length, overlap=overlap, prefill_first=prefill_first)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_the_cases_marked_ends_at_eos_are_those_whose_target_output_ends_at_eos(target_outputs):
    ended_at_eos = {case_id for case_id, output in target_outputs.items() if output.finish_reason == "stop"}
    assert ended_at_eos == {case.id for case in CASES if case.ends_at_eos}


def test_the_other_cases_use_their_whole_budget_on_the_target(target_outputs):
    lengths = {case.id: target_outputs[case.id].completion_tokens for case in CASES if not case.ends_at_eos}
    assert lengths == {case.id: case.max_tokens for case in CASES if not case.ends_at_eos}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_greedy_output_equals_the_target_only_output(edge_client, target_outputs, case):
    assert generate(edge_client, case) == target_outputs[case.id]
