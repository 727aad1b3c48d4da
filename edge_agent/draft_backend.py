"""Which runtime drafts: llama.cpp (the GGUF file as it is) or transformers (any checkpoint,
GGUF dequantized), and the drafter each one builds.

``--draft-backend auto`` picks llama.cpp when the draft is a GGUF file (a registry name, a
.gguf path or --gguf-file), the device is the CPU (the cyllama build has no GPU backend) and
cyllama imports; otherwise transformers. The choice and its reason are logged.
"""

from __future__ import annotations

import logging

from edge_agent.drafter import DraftLimits, ModelDrafter
from edge_agent.llamacpp_drafter import LlamaCppDrafter, LlamaCppDraftModel, llamacpp_available, load_llamacpp_draft
from edge_agent.settings import EdgeSettings
from spade_models.loader import LoadedModel, ModelSource, load_model
from verifier_service.protocol import VerifierHealth

logger = logging.getLogger(__name__)

LLAMACPP, TRANSFORMERS = "llamacpp", "transformers"
CYLLAMA_REQUIREMENT = "cyllama==0.2.18 (wheels for CPython 3.11 on x86-64)"


def choose_draft_backend(requested: str, source: ModelSource, device: str, is_llamacpp_available: bool) -> tuple[str, str]:
    """(backend, why) for ``--draft-backend requested``; refuses an explicit llamacpp that cannot run."""
    if requested == TRANSFORMERS:
        return TRANSFORMERS, "--draft-backend transformers"
    if requested == LLAMACPP:
        if not source.is_gguf:
            raise ValueError(
                f"--draft-backend llamacpp needs a GGUF draft (a registry name, a .gguf path or --gguf-file), got {source.model!r}"
            )
        if not is_llamacpp_available:
            raise ValueError(f"--draft-backend llamacpp needs {CYLLAMA_REQUIREMENT}, which does not import here")
        return LLAMACPP, "--draft-backend llamacpp"
    if requested != "auto":
        raise ValueError(f"unknown draft backend {requested!r}; choose auto, llamacpp or transformers")
    if not source.is_gguf:
        return TRANSFORMERS, f"{source.model!r} is not a GGUF file"
    if device != "cpu":
        return TRANSFORMERS, f"the device is {device} and the llama.cpp build runs on the CPU only"
    if not is_llamacpp_available:
        return TRANSFORMERS, f"{CYLLAMA_REQUIREMENT} does not import here"
    return LLAMACPP, f"{source.model_id} is a GGUF file and llama.cpp is available"


def load_draft_model(settings: EdgeSettings) -> LoadedModel | LlamaCppDraftModel:
    """The draft, opened by the chosen runtime (blocking: run it off the event loop)."""
    source = ModelSource(settings.draft_model, settings.gguf_file)
    backend, why = choose_draft_backend(settings.draft_backend, source, settings.device, llamacpp_available())
    logger.info("draft backend: %s (%s)", backend, why)
    if backend == LLAMACPP:
        if settings.device != "cpu" or settings.dtype != "float32":
            logger.warning(
                "llama.cpp drafts on the CPU with the GGUF file's own types: --device %s / --dtype %s are ignored",
                settings.device,
                settings.dtype,
            )
        return load_llamacpp_draft(source)
    return load_model(source, settings.device, settings.dtype)


def draft_backend_name(draft: LoadedModel | LlamaCppDraftModel) -> str:
    return LLAMACPP if isinstance(draft, LlamaCppDraftModel) else TRANSFORMERS


def build_drafter(
    draft: LoadedModel | LlamaCppDraftModel,
    settings: EdgeSettings,
    health: VerifierHealth,
) -> ModelDrafter | LlamaCppDrafter:
    """The drafter for a loaded draft, within the verifier's limits: no token id beyond its
    vocabulary, no distribution wider than it accepts, no context longer than it serves."""
    limits = DraftLimits(min(settings.max_draft_support, health.max_draft_support), health.vocab_size)
    if isinstance(draft, LlamaCppDraftModel):
        return LlamaCppDrafter(
            draft, health.max_context_length, threads=settings.threads, max_sessions=settings.max_draft_sessions, limits=limits
        )
    return ModelDrafter(draft, limits)
