"""The edge on the pipelined-session wire (``--verifier-wire pipelined``,
``edge_agent.pipelined_engine``) against a verifier with ``--pipelined-sessions``, real servers.

Specification:
- Greedy output equals the target's own on every case of the tiny pair (both endpoints, streamed
  and not, budgets 1 to 100, outputs ending at EOS before, at and after the budget), while the
  edge's drafts are taken as proposals.
- A request asking for logprobs is served on the verify wire (this wire carries none), and a
  verifier without the wire serves every request on the verify wire; both exact.
- A request ended early (a stop string) closes its session on the verifier.
- At temperature 1 the first two tokens follow the target's distribution, and not the draft's
  (chi-square, slow suite).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace

import httpx
import openai
import pytest

from edge_agent.app import build_engine
from edge_agent.metrics import EdgeMetrics
from edge_agent.pipelined_engine import PipelinedEngine
from edge_agent.settings import EdgeSettings
from edge_support import edge_app, metric_value, verifier_app
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from greedy_support import TINY_PAIR_CASES, Case, Output, generate, user
from servers import serve
from spade_bench.loopback import wait_until
from spade_core.params import SamplingConfig
from spade_models.loader import ModelSource, load_model
from test_edge_sampling import PROMPT, chi_square_p_value, exact_first_two


@pytest.fixture(scope="module")
def verifier_url(tiny_pair):
    with serve(verifier_app(tiny_pair, pipelined_sessions=True)) as url:
        yield url


@pytest.fixture(scope="module")
def target_outputs(verifier_url) -> dict[str, Output]:
    client = openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)
    return {case.id: generate(client, replace(case, stream=False)) for case in TINY_PAIR_CASES}


@pytest.fixture(scope="module")
def edge_url(tiny_pair, verifier_url):
    with serve(edge_app(tiny_pair, verifier_url, verifier_wire="pipelined")) as url:
        yield url


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("case", TINY_PAIR_CASES, ids=[case.id for case in TINY_PAIR_CASES])
def test_greedy_output_equals_the_target_only_output(edge_url, target_outputs, case):
    assert generate(client_of(edge_url), case) == target_outputs[case.id]


def test_the_edges_drafts_were_taken_as_proposals(edge_url, verifier_url):
    before = _pipeline_tokens(verifier_url, "proposal")
    generate(client_of(edge_url), Case("completions", "x", 100))
    assert _pipeline_tokens(verifier_url, "proposal") > before
    assert metric_value(edge_url, "spade_edge_accepted_tokens_total") > 0


def _pipeline_tokens(url: str, source: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'spade_verifier_pipeline_tokens_total{{source="{source}"}}'):
            return float(line.split()[-1])
    raise AssertionError("no pipeline tokens metric")


def test_a_request_for_logprobs_is_served_on_the_verify_wire(edge_url, verifier_url, target_outputs):
    case = Case("completions", "Tokens are", 7)
    verify_calls = metric_value(verifier_url, "spade_verifier_verify_calls_total")
    response = client_of(edge_url).completions.create(model="target", prompt=case.prompt, max_tokens=7, temperature=0, logprobs=2)
    assert response.choices[0].text == target_outputs[case.id].text
    assert len(response.choices[0].logprobs.token_logprobs) == 7
    assert metric_value(verifier_url, "spade_verifier_verify_calls_total") > verify_calls


def test_a_verifier_without_the_wire_serves_every_request_on_the_verify_wire(tiny_pair, target_outputs):
    case = Case("chat", user("What is speculative decoding?"), 50, stream=True)
    with serve(verifier_app(tiny_pair)) as plain_url, serve(edge_app(tiny_pair, plain_url, verifier_wire="pipelined")) as url:
        assert generate(client_of(url), case) == target_outputs[case.id]
        assert generate(client_of(url), case) == target_outputs[case.id]  # the second without asking again


def test_an_edge_of_another_wire_version_serves_on_the_verify_wire(tiny_pair, verifier_url, target_outputs, monkeypatch):
    import edge_agent.pipelined_engine

    monkeypatch.setattr(edge_agent.pipelined_engine, "PIPELINE_WIRE_VERSION", "pipeline-0")  # an older edge
    case = Case("completions", "Tokens are", 7)
    with serve(edge_app(tiny_pair, verifier_url, verifier_wire="pipelined")) as url:
        verify_calls = metric_value(verifier_url, "spade_verifier_verify_calls_total")
        assert generate(client_of(url), case) == target_outputs[case.id]
        assert metric_value(verifier_url, "spade_verifier_verify_calls_total") > verify_calls
    assert wait_until(lambda: metric_value(verifier_url, "spade_verifier_pipeline_sessions") == 0, timeout_s=10)


def test_a_request_ended_by_a_stop_string_closes_its_session(edge_url, verifier_url, target_outputs):
    text = target_outputs[Case("completions", "x", 100).id].text
    stop = text[10:14]
    response = client_of(edge_url).completions.create(model="target", prompt="x", max_tokens=100, temperature=0, stop=[stop])
    assert response.choices[0].finish_reason == "stop" and response.choices[0].text == text[: text.index(stop)]
    assert wait_until(lambda: metric_value(verifier_url, "spade_verifier_pipeline_sessions") == 0, timeout_s=10)


NUM_SEEDS = 1500


@pytest.mark.slow
def test_sampled_first_two_tokens_follow_the_target_and_not_the_draft(letters_pair):
    """Seeded requests at temperature 1 through the edge's pipelined engine, their first two
    tokens counted: the target's joint distribution fits (p > 1e-3), the draft's does not
    (p < 1e-6, the test's negative control)."""
    target, draft = (load_model(ModelSource(str(directory))) for directory in (letters_pair.target_dir, letters_pair.draft_dir))
    eos = frozenset({target.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    prompt_ids = target.tokenizer.encode(PROMPT)
    sampling = SamplingConfig(temperature=1.0)

    async def draw(verifier: str) -> Counter:
        settings = EdgeSettings(draft_model=str(letters_pair.draft_dir), verifier_url=verifier, verifier_wire="pipelined")
        engine = await build_engine(settings, EdgeMetrics())
        assert isinstance(engine, PipelinedEngine)

        async def first_two(seed: int) -> tuple[int, ...]:
            # A budget of 3: the second token is decided by a forward that verifies the edge's
            # proposal (the last token of a budget never is: it leaves no room for a draft).
            request = GenerationRequest(f"draw-{seed}", prompt_ids, 3, replace(sampling, seed=seed), engine.model.eos_token_ids)
            return tuple(token for batch in [b async for b in engine.generate(request, SpadeStats())] for token in batch.token_ids)[:2]

        try:
            outcomes: Counter = Counter()
            for first in range(0, NUM_SEEDS, 16):
                outcomes.update(await asyncio.gather(*(first_two(seed) for seed in range(first, min(first + 16, NUM_SEEDS)))))
            return outcomes
        finally:
            await engine.aclose()

    # A window of one token: the verifier waits for the edge after each token, so the second is
    # decided with the edge's proposal in the forward (the tiny target outruns any edge).
    with serve(verifier_app(letters_pair, pipelined_sessions=True, pipeline_window_tokens=1)) as verifier:
        observed = asyncio.run(draw(verifier))
        num_from_proposals = _pipeline_tokens(verifier, "proposal")
    assert num_from_proposals > NUM_SEEDS / 20, "too few tokens came through the acceptance rule to test it"
    assert chi_square_p_value(observed, exact_first_two(target, prompt_ids, sampling, eos)) > 1e-3
    assert chi_square_p_value(observed, exact_first_two(draft, prompt_ids, sampling, eos)) < 1e-6


def test_many_streams_with_half_cut_leave_the_rest_exact_and_no_session_behind(edge_url, verifier_url, target_outputs):
    """16 streamed requests at once; every other one is closed by its client after its first
    chunks. The rest get the target's text, and every session is closed on the verifier."""
    case = Case("completions", "x", 100)
    expected = target_outputs[case.id].text

    async def one(http: httpx.AsyncClient, cut: bool) -> str | None:
        body = {"model": "target", "prompt": "x", "max_tokens": 100, "temperature": 0, "stream": True}
        text, chunks = "", 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choices = json.loads(line.removeprefix("data:"))["choices"]
                text += choices[0]["text"] if choices else ""
                chunks += 1
                if cut and chunks >= 2:
                    return None
        return text

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(base_url=edge_url, timeout=60) as http:
            return await asyncio.gather(*(one(http, cut=index % 2 == 1) for index in range(16)))

    texts = asyncio.run(run())
    assert [text for text in texts if text is not None] == [expected] * 8
    assert wait_until(lambda: metric_value(verifier_url, "spade_verifier_pipeline_sessions") == 0, timeout_s=10)
    assert wait_until(lambda: metric_value(edge_url, "spade_edge_active_requests") == 0, timeout_s=10)
