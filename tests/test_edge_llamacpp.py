"""The edge drafting with llama.cpp, end to end: a real GGUF (SmolLM2-135M Q4_1) drafts in
llama.cpp for a verifier serving the same file through transformers (fp32). At temperature 0
the edge's output equals the verifier's own target-only output, token for token, for every
draft length; ``--draft-backend auto`` picks llama.cpp for the GGUF and transformers for a
checkpoint directory, and /health says which one drafts."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest

from edge_agent.app import create_app as create_edge_app
from edge_agent.settings import EdgeSettings
from edge_support import edge_app
from edge_support import verifier_app as tiny_verifier_app
from greedy_support import Case, Output, generate
from servers import serve
from verifier_service.app import create_app as create_verifier_app
from verifier_service.settings import VerifierSettings

EDGE_VARIANTS = [("1", "llamacpp"), ("3", "llamacpp"), ("5", "auto"), ("8", "llamacpp"), ("auto", "llamacpp")]
"""(draft length, --draft-backend): 'auto' must pick llama.cpp for the GGUF draft. All draft
the next block while the current one is verified (--overlap, the default)."""


CASES = [
    Case("completions", "The capital of France is", 24),
    Case("completions", "def fibonacci(n):", 24, stream=True),
    Case("chat", "What is speculative decoding?", 24),
    Case("chat", "Write a haiku about the sea.", 16, stream=True),
    Case("chat", "hi", 12),
]


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def verifier_url(small_gguf):
    """The same GGUF through transformers, fp32 (converted once into the spade cache)."""
    with serve(create_verifier_app(VerifierSettings(model=small_gguf, dtype="float32")), timeout_s=900) as url:
        yield url


@pytest.fixture(scope="module")
def target_outputs(verifier_url, small_gguf) -> dict[str, Output]:
    client = _client(verifier_url)
    return {case.id: generate(client, case, small_gguf, stream=False) for case in CASES}


@dataclass(frozen=True)
class Edge:
    url: str
    draft_length: str


@pytest.fixture(scope="module", params=EDGE_VARIANTS, ids=[f"draft-{length}-{backend}" for length, backend in EDGE_VARIANTS])
def edge(request, small_gguf, verifier_url) -> Edge:
    draft_length, backend = request.param
    settings = EdgeSettings(draft_model=small_gguf, verifier_url=verifier_url, draft_length=draft_length, draft_backend=backend, threads=1)
    with serve(create_edge_app(settings), timeout_s=300) as url:
        yield Edge(url, draft_length)


def test_the_reference_outputs_are_not_trivial(target_outputs):
    assert all(output.completion_tokens >= 8 for output in target_outputs.values())


def test_the_edge_drafts_with_llama_cpp(edge):
    assert httpx.get(edge.url + "/health", timeout=10).json()["draft_backend"] == "llamacpp"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_greedy_output_equals_the_target_only_output(edge, target_outputs, small_gguf, case):
    assert generate(_client(edge.url), case, small_gguf) == target_outputs[case.id]


def test_a_seeded_sampled_request_repeats_exactly_at_a_fixed_draft_length(edge, small_gguf):
    """Drafted tokens and acceptance draws are seeded by position, so the same request gives the
    same text, as long as the blocks are cut the same way: an adaptive length follows measured
    times, so there only the budget is checked."""
    case = Case("chat", "Tell me a story about a robot.", 10)
    first, second = (generate(_client(edge.url), case, small_gguf, temperature=0.9, top_p=0.95, seed=7) for _ in range(2))
    assert (first.completion_tokens, second.completion_tokens) == (10, 10)
    if edge.draft_length != "auto":
        assert first == second


def test_auto_drafts_with_transformers_for_a_checkpoint_directory(tiny_pair):
    with serve(tiny_verifier_app(tiny_pair)) as verifier_url:
        with serve(edge_app(tiny_pair, verifier_url, draft_backend="auto")) as url:
            assert httpx.get(url + "/health", timeout=10).json()["draft_backend"] == "transformers"
