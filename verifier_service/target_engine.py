"""Target-only decoding behind the verifier's OpenAI routes: the cloud-only baseline users
compare against, and the path an edge can fall back to.

Two routes (``--target-route``): ``verify-steps`` (this module's engine, the transformers
backend's only route) and ``native`` (``backends.vllm.native``: vLLM's own decode loop, the
default with ``--backend vllm``). On the verify-steps route each step is a verify call with an
empty block, so it runs the very code that verifies drafts: same cache, same sampling
transform, same seeded draws. At temperature 0 the speculative output must therefore equal this
route's output token for token.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from gateway.engine import GeneratedTokens, GenerationEngine, GenerationRequest
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from verifier_service.backends.base import BlockToVerify, VerifierBackend
from verifier_service.metrics import VerifierMetrics
from verifier_service.prefix_sharing import PrefixSharing, prefix_namespace


class TargetOnlyEngine:
    def __init__(self, backend: VerifierBackend, metrics: VerifierMetrics, prefix_sharing: PrefixSharing = "per-key") -> None:
        """``prefix_sharing``: which requests may share cached prefixes (``prefix_sharing``)."""
        self._backend = backend
        self._metrics = metrics
        self._prefix_sharing: PrefixSharing = prefix_sharing

    @property
    def model(self) -> ModelDescription:
        return self._backend.model

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        session_id = f"local-{request.request_id}"
        context = list(request.prompt_token_ids)
        namespace = prefix_namespace(self._prefix_sharing, request.cache_owner, request.cache_salt)
        self._metrics.prompt_tokens.inc(len(context))
        try:
            for _ in range(request.max_tokens):
                block = BlockToVerify(session_id, context, [], None, request.sampling, request.num_top_logprobs, namespace)
                verdict = await self._backend.verify_block(block)
                self._metrics.observe_forward(verdict)
                stats.verifier_cached_tokens += verdict.num_cached_tokens
                stats.verify_calls += 1
                stats.target_tokens += verdict.num_target_tokens
                stats.verifier_forward_ms += verdict.forward_s * 1e3
                context.append(verdict.next_token_id)
                yield GeneratedTokens([verdict.next_token_id], verdict.logprobs, verdict.top_logprobs)
                if verdict.next_token_id in request.eos_token_ids:
                    return
        finally:
            self._backend.release_session(session_id)


def create_target_engine(
    backend: VerifierBackend, route: str, metrics: VerifierMetrics, prefix_sharing: PrefixSharing = "per-key"
) -> GenerationEngine:
    """The engine behind the OpenAI routes for ``--target-route`` (settings refuse native on a
    backend other than vLLM); ``prefix_sharing`` isolates cached prefixes on either route."""
    if route == "verify-steps":
        return TargetOnlyEngine(backend, metrics, prefix_sharing)
    from verifier_service.backends.vllm.backend import VllmBackend
    from verifier_service.backends.vllm.native import VllmNativeEngine

    if not isinstance(backend, VllmBackend):
        raise ValueError(f"--target-route {route} needs --backend vllm, not {backend.name}")
    return VllmNativeEngine(backend, metrics, prefix_sharing)
