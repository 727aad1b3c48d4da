"""Greedy equality through the openai client: a request case, what a server answered (text,
token count, finish reason), and the tiny pair's cases, shared by the edge's greedy suites (the
tiny pair, llama.cpp, the batch-invariant verifier)."""

from __future__ import annotations

from dataclasses import dataclass

import openai


@dataclass(frozen=True)
class Case:
    api: str  # "completions" or "chat"
    prompt: str | list[dict]
    """The completion's prompt; for chat the messages, or one user message's text."""
    max_tokens: int
    stream: bool = False
    ends_at_eos: bool = False
    """The target's greedy output ends with EOS within the budget (checked where it matters)."""

    @property
    def id(self) -> str:
        text = self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]
        return f"{self.api}-{text[:16]}-{self.max_tokens}{'-stream' if self.stream else ''}"

    @property
    def messages(self) -> list[dict]:
        return user(self.prompt) if isinstance(self.prompt, str) else self.prompt


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@dataclass(frozen=True)
class Output:
    text: str
    completion_tokens: int
    finish_reason: str


def generate(client: openai.OpenAI, case: Case, model: str = "target", stream: bool | None = None, **sampling) -> Output:
    """The case's answer (at temperature 0 unless ``sampling`` says otherwise), streamed as the
    case says unless ``stream`` does."""
    common = dict(model=model, max_tokens=case.max_tokens, **({"temperature": 0} | sampling))
    if case.stream if stream is None else stream:
        return _generate_streamed(client, case, common)
    if case.api == "chat":
        response = client.chat.completions.create(messages=case.messages, **common)
        choice = response.choices[0]
        return Output(choice.message.content, response.usage.completion_tokens, choice.finish_reason)
    response = client.completions.create(prompt=case.prompt, **common)
    choice = response.choices[0]
    return Output(choice.text, response.usage.completion_tokens, choice.finish_reason)


def _generate_streamed(client: openai.OpenAI, case: Case, common: dict) -> Output:
    options = dict(stream=True, stream_options={"include_usage": True}, **common)
    if case.api == "chat":
        chunks = list(client.chat.completions.create(messages=case.messages, **options))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        chunks = list(client.completions.create(prompt=case.prompt, **options))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finish_reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    return Output(text, chunks[-1].usage.completion_tokens, finish_reasons[-1])


TINY_PAIR_CASES = [
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
    Case("chat", user("A small model"), 32, ends_at_eos=True),
    Case("chat", user("café"), 16, stream=True, ends_at_eos=True),
    Case("chat", user("naïve"), 40, ends_at_eos=True),
    Case("chat", user("hi"), 64, ends_at_eos=True),
    Case("chat", user("What is speculative decoding?"), 50, stream=True),
    Case("chat", user("Write a poem"), 20),
    Case("chat", user("SELECT * FROM"), 19, ends_at_eos=True),  # EOS is the 19th token: the last one allowed
    Case("chat", user("<html>"), 8, stream=True, ends_at_eos=True),  # EOS is the 8th token: the last one allowed
    Case("chat", user("List three colours"), 3),
    Case("chat", [{"role": "system", "content": "Answer briefly."}] + user("# comment"), 33),
    Case("chat", user("hi") + [{"role": "assistant", "content": "hello"}] + user("and now?"), 45),
]
"""The tiny pair's cases: both endpoints, streamed and not, budgets from 1 to 100 tokens, and
prompts whose greedy output ends at EOS (before, exactly at, and just after the budget)."""
