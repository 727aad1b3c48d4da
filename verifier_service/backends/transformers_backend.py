"""The reference verifier backend: any causal LM transformers loads, on CPU, CUDA or MPS.

Per session it keeps the target's KV cache over the committed context (and accepted drafts),
so each verify call runs ONE forward over only the tokens the cache lacks: normally the
previous call's next token plus the drafted block. Rejected drafts are cropped off the cache.

Forwards run on a single worker thread, off the event loop, in arrival order (first come,
first served across sessions). Cache maintenance also runs on that thread, so a session is
never released while its forward is in flight.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from gateway.engine import TopLogprobs
from gateway.model import ModelDescription
from spade_core.acceptance import accept_block
from spade_core.sampling import emitted_logprobs, position_uniforms, processed_probs, reported_logprobs
from spade_models.kv_cache import TokenCache, cache_argument_name
from spade_models.loader import LoadedModel, tokenizer_fingerprint
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend
from verifier_service.backends.batching import BatchGatherer, verify_batch
from verifier_service.backends.cpu_kernels import prepare_cpu_kernels
from verifier_service.backends.growing_cache import growing_cache
from verifier_service.kv_budget import kv_bytes_per_token


class TransformersBackend(VerifierBackend):
    """The reference verifier backend (the default): the target as any causal LM transformers
    loads, with a KV cache per session so each verify call runs one forward over only the tokens
    that cache lacks, calls of several sessions batched into one forward, and on a float32 CPU
    the verifier's own kernels. Runs on CPU, CUDA or MPS; tested on CPU."""

    name = "transformers"

    def __init__(
        self,
        loaded: LoadedModel,
        max_context_length: int | None = None,
        *,
        served_model_name: str | None = None,
        fast_kernels: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        """``fast_kernels`` / ``batch_invariant``: see ``cpu_kernels`` (CPU float32 only; the
        model is patched in place, and the target-only route runs the same patched model)."""
        self._model = loaded.model
        self._tokenizer = loaded.tokenizer
        self.cpu_kernels = prepare_cpu_kernels(loaded.model, fast_kernels, batch_invariant)
        self._device = torch.device(loaded.device)
        native_context_length: int = getattr(loaded.model.config, "max_position_embeddings", 4096)
        self._description = ModelDescription(
            model_id=served_model_name or loaded.model_id,
            vocab_size=loaded.model.get_output_embeddings().weight.shape[0],
            max_context_length=max_context_length or native_context_length,
            eos_token_ids=loaded.eos_token_ids,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
        )
        self._cache_argument = cache_argument_name(loaded.model)
        self._caches: dict[str, TokenCache] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-forward")
        self._gatherer: BatchGatherer | None = None

    def enable_batching(self, max_batch_sessions: int, batch_wait_s: float) -> None:
        """Run calls of different sessions that arrive together as one forward (``batching``)."""
        if max_batch_sessions > 1:
            run_batch = partial(verify_batch, self)
            self._gatherer = BatchGatherer(run_batch, self._executor, max_batch_sessions, batch_wait_s, self._rows_to_feed)

    @property
    def model(self) -> ModelDescription:
        return self._description

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_cached_sessions(self) -> int:
        return len(self._caches)

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes per token, for the session registry's KV budget."""
        return kv_bytes_per_token(self._model.config, self._model.dtype)

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        queued_at = time.perf_counter()
        if self._gatherer is not None:
            return await self._gatherer.submit(block, queued_at)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._verify, block, queued_at)

    def release_session(self, session_id: str) -> None:
        """Free the session's cache after any forward already submitted for it (same worker
        thread); a call of the session still waiting for a batch keeps no cache when it runs."""
        if self._gatherer is not None:
            self._gatherer.forget_session(session_id)
        self._executor.submit(self._caches.pop, session_id, None)

    async def aclose(self) -> None:
        if self._gatherer is not None:
            await self._gatherer.aclose()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._caches.clear()

    def _rows_to_feed(self, block: BlockToVerify) -> int:
        """The rows a call will feed (uncached context + drafted block), read on the event loop
        for batching: an estimate, exact unless the session's cache changes before it runs."""
        entry = self._caches.get(block.session_id)
        context = block.context_token_ids
        cached = 0 if entry is None else entry.reusable_length(context)
        return len(context) - cached + block.num_drafted

    def _verify(self, block: BlockToVerify, queued_at: float, keep_cache: bool = True) -> BlockVerdict:
        started = time.perf_counter()
        entry = self._caches.pop(block.session_id, None) or self._new_cache()
        num_input_tokens, logits = self._forward(entry, block)
        model_s = time.perf_counter() - started
        return self._conclude(entry, block, num_input_tokens, logits, queued_at, started, model_s=model_s, keep_cache=keep_cache)

    def _new_cache(self) -> TokenCache:
        """With the CPU kernels, a cache that appends in place (``growing_cache``)."""
        if self.cpu_kernels is None:
            return TokenCache.empty(self._model)
        return TokenCache(growing_cache(self._model.config))

    def _conclude(
        self,
        entry: TokenCache,
        block: BlockToVerify,
        num_input_tokens: int,
        logits: torch.Tensor,
        queued_at: float,
        started: float,
        num_batched: int = 1,
        model_s: float | None = None,
        keep_cache: bool = True,
    ) -> BlockVerdict:
        """Acceptance over the block's logits [d + 1, vocab]; the cache keeps what is committed
        (unless ``keep_cache`` is False: the session was released meanwhile)."""
        target_probs = processed_probs(logits, block.sampling)  # [d + 1, vocab]
        uniforms = position_uniforms(block.sampling.seed, block.first_draft_position, block.num_drafted + 1)
        draft_ids = torch.tensor(block.draft_token_ids, dtype=torch.long)
        draft_probs = None if block.draft_probs is None else block.draft_probs.to(self._device)
        acceptance = accept_block(draft_ids, draft_probs, target_probs, uniforms)
        # Keep the cache over the context and the accepted drafts; the rejected ones go.
        entry.token_ids = block.context_token_ids + block.draft_token_ids
        entry.crop_to(len(block.context_token_ids) + acceptance.num_accepted)
        if keep_cache:
            self._caches[block.session_id] = entry
        emitted = block.draft_token_ids[: acceptance.num_accepted] + [acceptance.next_token_id]
        logprobs, top_logprobs = asked_logprobs(logits, emitted, block)
        return BlockVerdict(
            num_accepted=acceptance.num_accepted,
            next_token_id=acceptance.next_token_id,
            is_bonus=acceptance.is_bonus,
            logprobs=logprobs,
            num_target_tokens=num_input_tokens,
            queue_s=started - queued_at,
            forward_s=time.perf_counter() - started,
            num_batched=num_batched,
            model_s=model_s,
            top_logprobs=top_logprobs,
        )

    def _forward(self, entry: TokenCache, block: BlockToVerify) -> tuple[int, torch.Tensor]:
        """One forward over what the cache lacks; returns (tokens fed, logits [d + 1, vocab]).
        The last context token is always fed: its logits score the first drafted token."""
        input_ids = entry.reuse_for(block.context_token_ids) + block.draft_token_ids
        with torch.inference_mode():
            output = self._model(
                input_ids=torch.tensor([input_ids], device=self._device),
                use_cache=True,
                logits_to_keep=block.num_drafted + 1,
                **{self._cache_argument: entry.cache},
            )
        return len(input_ids), output.logits[0].float()


def asked_logprobs(logits: torch.Tensor, emitted: list[int], block: BlockToVerify) -> tuple[list[float] | None, list[TopLogprobs] | None]:
    """The emitted tokens' logprobs and alternatives from their rows of the block's logits
    [d + 1, vocab], or (None, None) when the block did not ask: no log-softmax then."""
    if block.num_top_logprobs is None:
        return None, None
    rows = reported_logprobs(logits[: len(emitted)], block.sampling)
    return emitted_logprobs(rows, emitted, block.num_top_logprobs)
