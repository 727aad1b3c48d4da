"""Target-only decoding on vLLM's own decode loop (``--target-route native``, the default with
``--backend vllm``): one vLLM request per generation, streamed as vLLM produces it, so users of
the verifier's OpenAI routes get vLLM's speed (continuous batching, one forward per step for all
running requests, no per-token request).

What the request carries to vLLM: the prompt's token ids, temperature / top-k / top-p, the
request's seed (vLLM's per-request generator, not our per-position draws: a sampled answer
differs from the verify-steps route's, drawn from the same distribution), max_tokens, the
model's end tokens as stop tokens, logprobs, and the cache salt of the request's prefix-sharing
namespace (``verifier_service.prefix_sharing``, as verify calls carry it). Stop strings stay with the gateway
(``gateway.serving``), which detokenizes: when it stops, or when the client goes, it closes the
stream and closing vLLM's stream aborts the request in vLLM (``AsyncLLM.generate``).

Logprobs: vLLM reports raw logprobs (the engine's logprobs_mode), which is our definition at
temperature 0 only (``spade_core.sampling.reported_logprobs``); above it they are refused with
400 before anything runs, as on the sample_match route.

What "greedy SPADE equals target-only" means here: SPADE's verify calls are scoring requests
(context + block, prompt logprobs) while this route decodes one token per step in vLLM's batch;
both are the same model in the same engine but not the same kernels' row shapes. The vLLM suite
tests the equality (tests/vllm/test_vllm_native.py); docs/runs/2026-12-04-vllm-target-routes.md says what it found.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

from gateway.engine import GeneratedTokens, GenerationRequest, TopLogprobs
from gateway.errors import InvalidRequestError, ServiceUnavailableError
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from verifier_service.backends.vllm.backend import VllmBackend
from verifier_service.backends.vllm.requests import chosen_logprob, engine_queue_seconds, token_prompt, top_entries, vllm_cache_salt
from verifier_service.metrics import VerifierMetrics
from verifier_service.prefix_sharing import PrefixSharing, prefix_namespace


def native_params(request: GenerationRequest) -> Any:
    """vLLM's SamplingParams for one whole generation, streamed in deltas."""
    from vllm.sampling_params import RequestOutputKind

    from vllm import SamplingParams

    sampling = request.sampling
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=None if sampling.is_greedy else sampling.seed,
        max_tokens=request.max_tokens,
        stop_token_ids=sorted(request.eos_token_ids),
        logprobs=request.num_top_logprobs,  # N: the chosen token's logprob and N alternatives
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def delta_tokens(completion: Any, num_top_logprobs: int | None) -> GeneratedTokens:
    """One DELTA CompletionOutput -> its new tokens, with logprobs when asked (each position of
    vLLM's FlatLogprobs lists the chosen token and the top-N in rank order: ``top_entries``)."""
    token_ids = list(completion.token_ids)
    if num_top_logprobs is None:
        return GeneratedTokens(token_ids)
    flat = completion.logprobs
    if flat is None or len(flat) != len(token_ids):
        raise RuntimeError("vLLM returned no logprobs, or not one position per token, for a request that asked for them")
    logprobs = [chosen_logprob(flat, index, token_id) for index, token_id in enumerate(token_ids)]
    top_logprobs: list[TopLogprobs] = [top_entries(flat, index, num_top_logprobs) for index in range(len(token_ids))]
    return GeneratedTokens(token_ids, logprobs, top_logprobs)


@dataclass
class NativeTally:
    """What one native request did, for its ``spade`` stats and the verifier's metrics."""

    started: float
    num_generated: int = 0
    num_prompt_computed: int = 0
    """Prompt tokens vLLM prefilled (not served by its prefix cache)."""
    num_prompt_cached: int = 0
    """Prompt tokens vLLM's prefix cache served."""
    queue_s: float = 0.0
    is_finished: bool = False

    def add(self, output: Any) -> None:
        self.num_generated += len(output.outputs[0].token_ids)
        self.num_prompt_cached = output.num_cached_tokens or 0
        self.num_prompt_computed = len(output.prompt_token_ids) - self.num_prompt_cached
        self.queue_s = engine_queue_seconds([output])
        self.is_finished = output.finished

    @property
    def num_target_tokens(self) -> int:
        """Tokens through the target's forwards: the uncached prompt, then each generated token
        but the last fed back once."""
        return self.num_prompt_computed + max(0, self.num_generated - 1)


class VllmNativeEngine:
    """The ``GenerationEngine`` of the native route, on the vLLM backend's engine."""

    def __init__(self, backend: VllmBackend, metrics: VerifierMetrics, prefix_sharing: PrefixSharing = "per-key") -> None:
        self._backend = backend
        self._metrics = metrics
        self._prefix_sharing: PrefixSharing = prefix_sharing
        # vLLM's logprobs are raw: exact for greedy requests only, whatever the exact route.
        self._description = replace(backend.model, logprobs_support="greedy")

    @property
    def model(self) -> ModelDescription:
        return self._description

    @property
    def tokenizer(self) -> Any:
        return self._backend.tokenizer

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        if request.max_tokens < 1:
            return
        tally = NativeTally(time.perf_counter())
        namespace = prefix_namespace(self._prefix_sharing, request.cache_owner, request.cache_salt)
        salt = vllm_cache_salt(namespace, request.request_id)
        prompt = token_prompt(request.prompt_token_ids, salt)
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        outputs = self._backend.engine.generate(prompt, native_params(request), request.request_id)
        stream = openai_errors(outputs)
        try:
            async with contextlib.aclosing(stream):  # closing it early aborts the request in vLLM
                async for output in stream:
                    tally.add(output)
                    batch = delta_tokens(output.outputs[0], request.num_top_logprobs)
                    if batch.token_ids:
                        yield batch
        finally:
            self._account(tally, stats)

    def _account(self, tally: NativeTally, stats: SpadeStats) -> None:
        elapsed_s = time.perf_counter() - tally.started
        queue_s = min(tally.queue_s, elapsed_s)
        # Each generated token is one vLLM forward this request took part in.
        stats.verify_calls += tally.num_generated
        stats.target_tokens += tally.num_target_tokens
        stats.verifier_forward_ms += (elapsed_s - queue_s) * 1e3
        stats.verifier_cached_tokens += tally.num_prompt_cached
        self._metrics.prefix_hit_tokens.inc(tally.num_prompt_cached)
        self._metrics.observe_native_request(tally.num_target_tokens, tally.num_generated, queue_s, is_aborted=not tally.is_finished)


async def openai_errors(outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """vLLM's outputs, its failures in the gateway's table: a request vLLM refuses is the
    client's (400), a dead engine an unavailable service (503); anything else stays ours (500)."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output
    except VLLMClientError as error:
        raise InvalidRequestError(f"vLLM refused the request: {error}") from error
    except EngineDeadError as error:
        raise ServiceUnavailableError("the vLLM engine has stopped; the verifier must be restarted") from error
