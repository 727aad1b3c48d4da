"""The reference verifier backend: any causal LM transformers loads, on CPU, CUDA or MPS.

Three parts, each with one job (after nano-vllm's engine / scheduler / model runner):
``TransformersBackend`` (this module) is the contract's face: it loads, describes the model and
hands calls to the ``Scheduler``, which decides what shares each forward (several sessions'
blocks, chunks of long prompts) and what each session is advised to draft next; the
``ModelRunner`` owns the model and every session's KV cache and runs one ragged forward over
the rows it is handed (``ragged``: no padding, no copies of a cache). Per session the KV cache
covers the committed context (and accepted drafts), so a verify call normally feeds only the
previous next token plus its block; rejected drafts are cropped off.

Forwards run on one worker thread, off the event loop, one at a time. Cache maintenance runs on
that thread too, so a session is never released while its forward is in flight.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gateway.model import ModelDescription
from spade_models.loader import LoadedModel, tokenizer_fingerprint
from verifier_service.backends.base import BlockToVerify, BlockVerdict, ForwardObserver, VerifierBackend
from verifier_service.backends.transformers.cpu.kernels import BatchInvariance, prepare_cpu_kernels
from verifier_service.backends.transformers.plan import SchedulerLimits
from verifier_service.backends.transformers.prefix_store import PrefixStore
from verifier_service.backends.transformers.runner import ModelRunner
from verifier_service.backends.transformers.scheduler import Scheduler
from verifier_service.kv_budget import DEFAULT_KV_CACHE_BYTES, kv_bytes_per_token


class TransformersBackend(VerifierBackend):
    """The reference verifier backend (the default): the target as any causal LM transformers
    loads, with a KV cache per session so each verify call feeds only the tokens that cache
    lacks, the blocks of many sessions (and chunks of long prompts) sharing each forward, the
    draft length each session is advised next, and on a float32 CPU the verifier's own kernels.
    Runs on CPU, CUDA or MPS; tested on CPU."""

    name = "transformers"

    def __init__(
        self,
        loaded: LoadedModel,
        max_context_length: int | None = None,
        *,
        served_model_name: str | None = None,
        fast_kernels: bool = False,
        batch_invariant: bool | BatchInvariance = False,
        kernel_isa: str | None = None,
        max_retained_kv_bytes: int | None = DEFAULT_KV_CACHE_BYTES,
        packed_attention: bool | None = None,
    ) -> None:
        """``fast_kernels`` / ``batch_invariant``: see ``cpu.kernels`` (CPU float32 only; the
        model is patched in place, and the target-only route runs the same patched model);
        ``kernel_isa``: the kernel's ISA (None: the best this CPU runs).
        ``max_retained_kv_bytes``: KV of ended sessions kept as shared prefixes (the session
        registry's KV budget sets it as its room changes, ``limit_retained``); None: no prefix store,
        nothing shared (calls' ``cache_namespace`` is ignored). ``packed_attention``: all
        sessions' attention in one call per layer (``ragged``); None: off a CPU only."""
        self._tokenizer = loaded.tokenizer
        self.cpu_kernels = prepare_cpu_kernels(loaded.model, fast_kernels, batch_invariant, isa=kernel_isa)
        native_context_length: int = getattr(loaded.model.config, "max_position_embeddings", 4096)
        self._description = ModelDescription(
            model_id=served_model_name or loaded.model_id,
            vocab_size=loaded.model.get_output_embeddings().weight.shape[0],
            max_context_length=max_context_length or native_context_length,
            eos_token_ids=loaded.eos_token_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        )
        self._config = loaded.model.config
        self._dtype = loaded.model.dtype
        is_invariant = self.cpu_kernels is not None and self.cpu_kernels.mode == "batch_invariant"
        store = None if max_retained_kv_bytes is None else PrefixStore(max_retained_kv_bytes // self.kv_bytes_per_token)
        self._runner = ModelRunner(
            loaded.model, torch.device(loaded.device), batch_invariant=is_invariant, prefix_store=store, packed_attention=packed_attention
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-forward")
        self._scheduler = Scheduler(self._runner, self._executor, SchedulerLimits(max_batch_sessions=1))

    def configure(self, limits: SchedulerLimits) -> None:
        """How forwards are shared (sessions, rows, holding) and the advice's bound."""
        self._scheduler.limits = limits

    def observe_forwards(self, observer: ForwardObserver) -> None:
        self._scheduler.observe_forward = observer

    @property
    def model(self) -> ModelDescription:
        return self._description

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_cached_sessions(self) -> int:
        return self._runner.num_cached_sessions

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes per token, for the session registry's KV budget."""
        return kv_bytes_per_token(self._config, self._dtype)

    def advised_draft_length(self, session_id: str) -> int | None:
        return self._scheduler.advice_for(session_id)

    def is_in_forward(self, session_id: str) -> bool:
        return self._scheduler.is_in_forward(session_id)

    def call_arrived(self, session_id: str, arrived_at: float, num_drafted: int) -> None:
        self._scheduler.call_arrived(session_id, arrived_at, num_drafted)

    def answered_without_forward(self, session_id: str) -> None:
        self._scheduler.answered_without_forward(session_id)

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        return await self._scheduler.submit(block, time.perf_counter())

    def release_session(self, session_id: str, retain: bool = True) -> None:
        """Free the session's cache after any forward already submitted for it (same worker
        thread); with a call of the session still waiting, once that call is done with. With
        ``retain`` (and a prefix store) the cache stays a shared prefix's source while memory
        allows; a session evicted to make room is released with ``retain=False``."""
        if not self._scheduler.forget_session(session_id):
            self._executor.submit(self._runner.release, session_id, retain)

    @property
    def num_retained_tokens(self) -> int:
        """Tokens of ended sessions' caches kept as shared prefixes (part of the KV budget)."""
        return 0 if self._runner.prefixes is None else self._runner.prefixes.num_retained_tokens

    @property
    def num_retained(self) -> int:
        """Ended sessions' caches kept as shared prefixes."""
        return 0 if self._runner.prefixes is None else self._runner.prefixes.num_retained

    def limit_retained(self, max_tokens: int) -> None:
        """Retain at most ``max_tokens`` from now on, freeing the least recently used beyond
        at once (a copy in flight keeps its source alive until it is done)."""
        if self._runner.prefixes is not None:
            self._runner.prefixes.limit(max_tokens)

    async def aclose(self) -> None:
        await self._scheduler.aclose()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._runner.clear()
