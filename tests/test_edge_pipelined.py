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
from edge_support import edge_app, generate_once, metric_value, verifier_app
from gateway.engine import GenerationRequest
from gateway.protocol import SpadeStats
from greedy_support import TINY_PAIR_CASES, Case, Output, generate, user
from servers import serve
from spade_bench.loopback import wait_until
from spade_core.params import SamplingConfig
from spade_models.loader import ModelSource, load_model
from test_edge_sampling import PROMPT, chi_square_p_value, exact_first_two
from verifier_support import greedy_continuation


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


class ProposalRecorder(httpx.AsyncHTTPTransport):
    """The edge's real HTTP transport; remembers every proposal it posts."""

    def __init__(self) -> None:
        super().__init__()
        self.proposals: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/proposals"):
            self.proposals.append(json.loads(request.content))
        return await super().handle_async_request(request)


def test_at_temperature_one_the_edge_proposes_its_drafters_greedy_tokens(tiny_pair, verifier_url, draft_model):
    """Proposals are verified one-hot, so any draft that does not depend on the target's p is
    exact; the greedy one is accepted more often than a sample of q (p(argmax q) against
    sum p.q). Every drafted token the edge posts at temperature 1 is the drafter's argmax after the
    tokens decided before the proposal and the drafts before it."""
    recorder = ProposalRecorder()

    settings = EdgeSettings(draft_model=str(tiny_pair.draft_dir), verifier_url=verifier_url, verifier_wire="pipelined")
    sampled = SamplingConfig(temperature=1.0, seed=5)
    generation = asyncio.run(generate_once(settings, "The edge drafts", 40, sampled, stop_ids=frozenset(), transport=recorder))
    prompt_ids, output = generation.prompt_ids, generation.token_ids
    drafted = [proposal for proposal in recorder.proposals if proposal["draft_tokens"]]
    assert len(drafted) >= 3
    for proposal in drafted:
        decided = output[: proposal["start"] - len(prompt_ids)]
        assert len(decided) == proposal["seen"]
        assert proposal["draft_tokens"] == greedy_continuation(draft_model.model, prompt_ids + decided, len(proposal["draft_tokens"]))


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


def test_auto_takes_the_wire_the_verifiers_health_prefers(verifier_url):
    """--verifier-wire auto (the default) follows /health's preferred_wire: a transformers verifier
    serving pipelined sessions still prefers the verify wire (Run AB: 1.99x against 1.85x); a vLLM
    one prefers the pipelined wire (the vLLM suite checks the engine it builds)."""
    from types import SimpleNamespace

    from edge_agent.pipelined_engine import chosen_wire
    from verifier_service.app import preferred_wire
    from verifier_service.protocol import VerifierHealth

    health = VerifierHealth.model_validate(httpx.get(verifier_url + "/health", timeout=10).json())
    assert (health.backend, health.preferred_wire) == ("transformers", "verify")
    assert [chosen_wire(setting, health) for setting in ("auto", "verify", "pipelined")] == ["verify", "verify", "pipelined"]
    prefers = SimpleNamespace(prefers_pipelined_sessions=True)
    assert [preferred_wire(serves, prefers) for serves in (True, False)] == ["pipelined", "verify"]
    assert chosen_wire("auto", health.model_copy(update={"preferred_wire": "pipelined"})) == "pipelined"
    older = {name: value for name, value in health.model_dump().items() if name != "preferred_wire"}
    assert chosen_wire("auto", VerifierHealth.model_validate(older)) == "verify"  # a verifier from before the field


class ClosingTransport(httpx.AsyncHTTPTransport):
    """The edge's real HTTP transport; before the first proposal acknowledging ``at_seen`` tokens
    it closes the session on the verifier behind the edge's back (as the verifier's idle TTL or
    its shutdown would): the verifier ends the stream with a ``closed`` event."""

    def __init__(self, at_seen: int) -> None:
        super().__init__()
        self.at_seen = at_seen
        self.closed_at: int | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.closed_at is None and request.method == "POST" and request.url.path.endswith("/proposals"):
            seen = json.loads(request.content)["seen"]
            if seen >= self.at_seen:
                self.closed_at = seen
                session_path = request.url.path.removesuffix("/proposals")
                async with httpx.AsyncClient(base_url=f"{request.url.scheme}://{request.url.netloc.decode()}") as client:
                    assert (await client.delete(session_path)).status_code == 200
        return await super().handle_async_request(request)


def test_a_session_the_verifier_closes_mid_stream_is_opened_again_from_the_tokens_held(tiny_pair, verifier_url, target_model):
    """A ``closed`` event the edge did not ask for (the verifier's TTL, its shutdown) is not the
    end of the request: the edge opens the session again from the prompt and every token it holds,
    and the text is the target's, nothing lost or doubled."""
    transport = ClosingTransport(at_seen=6)

    settings = EdgeSettings(draft_model=str(tiny_pair.draft_dir), verifier_url=verifier_url, verifier_wire="pipelined")
    generation = asyncio.run(generate_once(settings, "The edge drafts", 60, stop_ids=frozenset(), transport=transport))
    assert transport.closed_at is not None and transport.closed_at >= 6
    assert generation.token_ids == greedy_continuation(target_model.model, generation.prompt_ids, 60)
    assert generation.stats.resyncs == 1
    assert wait_until(lambda: metric_value(verifier_url, "spade_verifier_pipeline_sessions") == 0, timeout_s=10)
