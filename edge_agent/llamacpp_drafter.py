"""Drafting with llama.cpp (the ``cyllama`` binding): the draft's GGUF file read as it is, several
times faster per token on a CPU than the dequantized model in transformers.

Same contract and semantics as ``ModelDraftSession``: a session keeps its KV cache across
blocks; each proposal reuses the longest prefix its cached tokens share with the context
(always re-feeding at least the last context token, whose logits start the block) and rolls
the rest back. A context that extends the cache costs one decode of the new tokens, so
``propose(context, 1)`` repeated with the drafted token appended decodes one token each time;
any other context (a verdict that rejected part of the block) is still drafted correctly.
Greedy drafts are llama.cpp's argmax (its greedy sampler: the logits never leave C; ties go to
the lowest id, as ``torch.argmax``). Sampled drafts go through ``sample_draft_token`` on the
logits row, exactly as the transformers drafter does.

Sessions are sequences of ONE llama.cpp context with a unified KV cache (``kv_unified``): one
pool of ``n_ctx`` cells for all sessions, each holding only what it uses, instead of one
context, and one full-size KV buffer, per session. A context's KV buffer, and the seconds to
create it (zeroing it), do not grow with its sequences, while each sequence adds little; one
context per session would cost the buffer and the seconds per concurrent request. The price of
sharing: a decode attends over the cells other sessions occupy (masked out), which costs little.
The mask keeps sessions apart exactly: one session's logits are bitwise the same with or without
another's tokens in the pool (SmolLM2, one thread; the tests check it). The figures, and the
cost per drafted token against transformers: docs/benchmarks.md, "Component measurements".
Bounds: at most ``max_sessions`` sessions at once (a further ``start_session`` is refused with
OverloadedError, HTTP 429); when a decode would not fit the free cells, the retained prefixes go
first (least recently used first), then the other sessions' caches (each re-feeds its context,
or copies a prefix again, on its next proposal).

Prefix reuse (``edge_agent.draft_prefixes``): a proposal whose context shares a longer prefix
with another sequence of the same owner (a live session's, or a finished one retained, up to
``max_retained``) than with its own cache starts from a copy of that prefix
(``llama_memory_seq_cp``: the cells are shared, not copied) and decodes only the rest. Sharing is
counted exactly against the bound: a cell held by k sequences counts once, and dropping one
sequence frees only the cells no other holds.

``n_ctx`` is the target's maximum context (the verifier's /health), which every context +
block the engine drafts for fits in. Threads: ``threads`` for both single-token and batch
decoding; by default half the cores, 1 to 4 (one on a 2-core box, where a second ggml thread
busy-waiting against other work made decoding many times slower). llama.cpp's own log goes to this
module's logger: errors as errors, warnings at info level, its chatter at debug level.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent.draft_prefixes import CellLedger, PrefixMatch, Retained, RetainedPrefixes, longest_prefix
from edge_agent.drafter import DraftBlock, DraftContexts, DraftLimits, draft_block, sample_draft_token
from gateway.errors import InvalidRequestError, OverloadedError
from spade_core.params import SamplingConfig
from spade_models.kv_cache import common_prefix_length
from spade_models.loader import ModelSource, gguf_file_path, load_tokenizer
from verifier_service.protocol import SparseDistribution

logger = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 512
"""Tokens per llama.cpp decode call; a longer context is fed in chunks of this many."""
MAX_DEFAULT_THREADS = 4
GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4
"""llama.cpp's log levels of interest (ggml_log_level)."""


def llamacpp_available() -> bool:
    """Whether the binding imports here (its wheels exist for CPython 3.11 on x86-64 only)."""
    try:
        _bindings()
    except ImportError:
        return False
    return True


def default_threads(cpu_count: int | None = None) -> int:
    """Half the cores, 1 to 4: a small model's decoding is memory-bound past a few threads, and
    the other cores serve HTTP, tokenize, and whatever else the device runs."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


def _bindings():
    import cyllama.llama.llama_cpp as llama_cpp

    return llama_cpp


def _forward_log(level: int, text: str) -> None:
    """llama.cpp's log callback: into Python logging instead of stderr. Its warnings are mostly
    benign notes (a small n_ctx, a token type it fixed up), so they go out at info level."""
    severity = {GGML_LOG_WARN: logging.INFO, GGML_LOG_ERROR: logging.ERROR}.get(level, logging.DEBUG)
    if text.strip():
        logger.log(severity, "llama.cpp: %s", text.rstrip())


@dataclass
class LlamaCppDraftModel:
    """A draft GGUF opened by llama.cpp, with its Hugging Face tokenizer (chat templates, and
    the tokenizer check against the verifier)."""

    model: Any = field(repr=False)
    """A cyllama ``LlamaModel`` (cyllama ships no type information)."""
    tokenizer: object = field(repr=False)
    model_id: str
    gguf_path: Path
    load_seconds: float

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab


def load_llamacpp_draft(source: ModelSource) -> LlamaCppDraftModel:
    """Open a GGUF source (a registry model is pulled first) and its tokenizer alone: nothing is
    dequantized or converted."""
    started = time.perf_counter()
    llama_cpp = _bindings()
    llama_cpp.set_log_callback(_forward_log)
    path = gguf_file_path(source)
    tokenizer = load_tokenizer(source)
    model = _model_class(llama_cpp)(str(path), llama_cpp.LlamaModelParams())
    loaded = LlamaCppDraftModel(model, tokenizer, source.model_id, path, time.perf_counter() - started)
    logger.info(
        "loaded %s into llama.cpp from %s in %.1f s (%.1f M parameters, vocabulary %d)",
        loaded.model_id,
        path,
        loaded.load_seconds,
        model.n_params / 1e6,
        loaded.vocab_size,
    )
    return loaded


def _model_class(llama_cpp: Any) -> type:
    base: Any = llama_cpp.LlamaModel  # a class of the untyped bindings, only known at run time

    class DraftLlamaModel(base):
        # cyllama 0.2.18's get_logits / get_logits_ith read ``model.n_vocab``, which LlamaModel lacks.
        @functools.cached_property
        def n_vocab(self) -> int:
            return self.get_vocab().n_vocab

    return DraftLlamaModel


class LlamaCppDrafter:
    """Drafts with llama.cpp; its sessions are sequences of one shared context."""

    def __init__(
        self,
        draft: LlamaCppDraftModel,
        n_ctx: int,
        *,
        threads: int | None = None,
        max_sessions: int = 16,
        limits: DraftLimits = DraftLimits(),
        max_retained: int | None = None,
    ) -> None:
        """``max_retained``: finished sequences kept as prefixes (default ``max_sessions``; 0
        turns prefix reuse off)."""
        retained_bound = max_sessions if max_retained is None else max_retained
        if n_ctx < 1 or max_sessions < 1 or retained_bound < 0:
            raise ValueError(f"n_ctx and max_sessions must be positive and max_retained >= 0, got {n_ctx}, {max_sessions}, {max_retained}")
        llama_cpp = _bindings()
        self.draft = draft
        self.limits = limits
        self.threads = threads or default_threads()
        self.max_sessions = max_sessions
        self.max_retained = retained_bound
        num_seq_ids = max_sessions + retained_bound
        self._context = llama_cpp.LlamaContext(draft.model, _context_params(llama_cpp, n_ctx, self.threads, num_seq_ids))
        self._batch = llama_cpp.LlamaBatch(n_tokens=MAX_BATCH_TOKENS, embd=0, n_seq_max=1)
        self._greedy = _greedy_sampler(llama_cpp, draft.vocab_size, limits.vocab_limit)
        # One decode at a time: the context, its batch and its last logits are shared.
        self._lock = threading.Lock()
        self._free_seq_ids = list(range(num_seq_ids - 1, -1, -1))
        self._sessions: dict[int, LlamaCppDraftSession] = {}
        self._retained: RetainedPrefixes[int, None] = RetainedPrefixes()
        self._cells = CellLedger()
        self._is_closed = False
        self.num_decoded_tokens = 0
        """Tokens fed to llama.cpp so far, all sessions together (prefills and drafted tokens)."""
        logger.info("llama.cpp draft context: %d cells shared by up to %d sessions, %d threads", self.n_ctx, max_sessions, self.threads)

    @property
    def n_ctx(self) -> int:
        """KV cells of the shared context (llama.cpp rounds the request up to a multiple of 256)."""
        return self._context.n_ctx

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_retained(self) -> int:
        """Finished sequences kept as prefixes."""
        return len(self._retained)

    @property
    def num_used_cells(self) -> int:
        """KV cells occupied, live and retained sequences together, a shared cell counted once."""
        return self._cells.num_used

    def contexts(self) -> DraftContexts:
        with self._lock:
            return DraftContexts(len(self._sessions), len(self._retained), self._retained.num_tokens)

    def start_session(self, prefix_owner: str = "") -> LlamaCppDraftSession:
        """A session for one request; it shares prefixes only with sequences of the same
        ``prefix_owner`` (``draft_prefixes.prefix_owner``: API key and cache_salt)."""
        with self._lock:
            if self._is_closed:
                raise RuntimeError("the llama.cpp drafter is closed")
            if len(self._sessions) >= self.max_sessions:
                raise OverloadedError(f"all {self.max_sessions} llama.cpp draft sessions are in use; retry shortly")
            if not self._free_seq_ids:
                self._drop_least_recent_retained()
            session = LlamaCppDraftSession(self, self._free_seq_ids.pop(), owner=prefix_owner)
            self._sessions[session.seq_id] = session
            return session

    def close(self) -> None:
        """Free the context (every session's cache); later proposals raise."""
        with self._lock:
            if not self._is_closed:
                self._is_closed = True
                self._context.close()
                self._retained, self._cells = RetainedPrefixes(), CellLedger()

    # --- what sessions call -------------------------------------------------------------------

    def _propose(self, session: LlamaCppDraftSession, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        with self._lock:
            self._check_usable(session, context, num_tokens)

            def next_token(token_ids: list[int], uniform: float | None) -> tuple[int, SparseDistribution | None]:
                self._feed(session, token_ids)
                return self._choose(sampling, uniform)

            return draft_block(self._reuse_prefix(session, context), len(context), num_tokens, sampling, next_token)

    def _is_live(self, session: LlamaCppDraftSession) -> bool:
        """Open, in an open drafter (a closed session's sequence id may serve another one now)."""
        return not self._is_closed and self._sessions.get(session.seq_id) is session

    def _num_kv_tokens(self, session: LlamaCppDraftSession) -> int:
        with self._lock:
            return self._context.memory_seq_pos_max(session.seq_id) + 1 if self._is_live(session) else 0

    def _release(self, session: LlamaCppDraftSession) -> None:
        """The session's slot is free at once; its cells stay as a retained prefix (the most
        recently used) while reuse is on, else they are freed with its sequence id."""
        with self._lock:
            if self._sessions.get(session.seq_id) is not session:
                return
            del self._sessions[session.seq_id]
            token_ids, session.cached_token_ids = session.cached_token_ids, []
            if self._is_closed or not token_ids or self.max_retained == 0:
                self._free_sequence(session.seq_id)
                return
            self._retained.add(session.seq_id, Retained(session.owner, token_ids, None))
            if len(self._retained) > self.max_retained:
                self._drop_least_recent_retained()

    # --- the shared context (called with the lock held) ----------------------------------------

    def _check_usable(self, session: LlamaCppDraftSession, context: list[int], num_tokens: int) -> None:
        if not self._is_live(session):
            raise RuntimeError("this llama.cpp draft session (or its drafter) is closed")
        if not context:
            raise InvalidRequestError("cannot draft for an empty context")
        needed = len(context) + num_tokens - 1  # the last drafted token is not fed
        if needed > self.n_ctx:
            raise InvalidRequestError(f"the draft context holds {self.n_ctx} tokens; this block needs {needed}")

    def _reuse_prefix(self, session: LlamaCppDraftSession, context: list[int]) -> list[int]:
        """Roll the session back to the longest prefix it shares with ``context``, short of the
        last context token (whose logits start the block), or replace its cache by a longer
        prefix another sequence of its owner holds; return the tokens left to feed."""
        keep = min(common_prefix_length(session.cached_token_ids, context), len(context) - 1)
        match = self._longest_shared_prefix(session, context) if self.max_retained else None
        if match is not None and match.length > keep:
            self._copy_prefix(match, session, context)
            return context[match.length :]
        if keep < len(session.cached_token_ids):
            self._remove_from(session, keep)
        return context[keep:]

    def _longest_shared_prefix(self, session: LlamaCppDraftSession, context: list[int]) -> PrefixMatch[int] | None:
        live = [
            (seq_id, other.cached_token_ids)
            for seq_id, other in self._sessions.items()
            if other is not session and other.owner == session.owner
        ]
        return longest_prefix(context, live + self._retained.candidates(session.owner))

    def _copy_prefix(self, match: PrefixMatch[int], session: LlamaCppDraftSession, context: list[int]) -> None:
        """The session's cache becomes the source's first ``match.length`` cells, shared."""
        self._remove_from(session, 0)
        self._context.memory_seq_cp(match.source, session.seq_id, 0, match.length)
        self._cells.share(match.source, session.seq_id, match.length)
        session.cached_token_ids = context[: match.length]
        session.num_cached_tokens += match.length
        if match.source in self._retained.entries:
            self._retained.touch(match.source)

    def _remove_from(self, session: LlamaCppDraftSession, position: int) -> None:
        self._context.memory_seq_rm(session.seq_id, position, -1)
        self._cells.truncate(session.seq_id, position)
        session.cached_token_ids = session.cached_token_ids[:position]

    def _free_sequence(self, seq_id: int) -> None:
        """Free a sequence no session uses any more: its cells (those no other holds) and its id."""
        if not self._is_closed:
            self._context.memory_seq_rm(seq_id, 0, -1)
        self._cells.truncate(seq_id, 0)
        self._free_seq_ids.append(seq_id)

    def _drop_least_recent_retained(self) -> None:
        dropped = self._retained.pop_least_recent()
        if dropped is not None:
            self._free_sequence(dropped[0])

    def _feed(self, session: LlamaCppDraftSession, token_ids: list[int]) -> None:
        """Decode ``token_ids`` after the session's cache, with logits for the last one only."""
        self._make_room(session, len(token_ids))
        for start in range(0, len(token_ids), MAX_BATCH_TOKENS):
            chunk = token_ids[start : start + MAX_BATCH_TOKENS]
            wants_logits = start + len(chunk) == len(token_ids)
            first_position = len(session.cached_token_ids)
            self._batch.clear()
            for offset, token_id in enumerate(chunk):
                self._batch.add(token_id, first_position + offset, [session.seq_id], wants_logits and offset == len(chunk) - 1)
            try:
                self._context.decode(self._batch)
            except BaseException:
                self._context.memory_seq_rm(session.seq_id, first_position, -1)  # a partly decoded chunk
                raise
            session.cached_token_ids = session.cached_token_ids + chunk
            self._cells.append(session.seq_id, len(chunk))
            self.num_decoded_tokens += len(chunk)

    def _make_room(self, session: LlamaCppDraftSession, num_new: int) -> None:
        """When the pool cannot hold ``num_new`` more cells: drop retained prefixes, least
        recently used first, until it can; then, if still short, the other sessions' caches."""
        while self._cells.num_used + num_new > self.n_ctx and len(self._retained):
            self._drop_least_recent_retained()
        used = self._cells.num_used
        if used + num_new <= self.n_ctx:
            return
        evicted = [other for other in self._sessions.values() if other is not session and other.cached_token_ids]
        logger.info("draft KV cache full (%d + %d > %d cells): dropping %d other sessions' caches", used, num_new, self.n_ctx, len(evicted))
        for other in evicted:
            self._remove_from(other, 0)

    def _choose(self, sampling: SamplingConfig, uniform: float | None) -> tuple[int, SparseDistribution | None]:
        if sampling.is_greedy:
            return self._greedy.sample(self._context, -1), None
        if uniform is None:
            raise ValueError("a sampled draft token needs its uniform draw")
        return sample_draft_token(self._last_logits(), sampling, uniform, self.limits.max_support)

    def _last_logits(self) -> torch.Tensor:
        """[vocab] float32 logits of the last decoded token, ids beyond ``vocab_limit`` at -inf.
        cyllama hands the row over as a Python list; numpy packs it in C, several times faster
        than torch.tensor(list) (docs/benchmarks.md, "Component measurements")."""
        logits = torch.from_numpy(np.array(self._context.get_logits_ith(-1), dtype=np.float32))
        vocab_limit = self.limits.vocab_limit
        if vocab_limit is not None and vocab_limit < logits.shape[0]:
            logits[vocab_limit:] = float("-inf")
        return logits


def _context_params(llama_cpp, n_ctx: int, threads: int, max_sessions: int):
    params = llama_cpp.LlamaContextParams()
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = MAX_BATCH_TOKENS
    params.n_threads = params.n_threads_batch = threads
    params.n_seq_max = max_sessions
    params.kv_unified = True  # one pool of n_ctx cells shared by the sessions (see the module docstring)
    return params


def _greedy_sampler(llama_cpp, vocab_size: int, vocab_limit: int | None):
    """argmax over the ids below ``vocab_limit`` (the others biased to -inf), computed in C."""
    chain_params = llama_cpp.LlamaSamplerChainParams()
    chain_params.no_perf = True
    sampler = llama_cpp.LlamaSampler(chain_params)
    if vocab_limit is not None and vocab_limit < vocab_size:
        sampler.add_logit_bias(vocab_size, [(token_id, float("-inf")) for token_id in range(vocab_limit, vocab_size)])
    sampler.add_greedy()
    return sampler


@dataclass(eq=False)
class LlamaCppDraftSession:
    """One request's sequence in the drafter's shared context."""

    drafter: LlamaCppDrafter = field(repr=False)
    seq_id: int
    owner: str = ""
    """The isolation key: prefixes are shared only between sequences of one owner."""
    cached_token_ids: list[int] = field(default_factory=list)
    """The tokens whose KV the sequence holds, at positions 0, 1, ..."""
    num_cached_tokens: int = 0
    """Context tokens taken from another sequence's cells instead of decoded (prefix reuse)."""

    def propose(self, context: list[int], num_tokens: int, sampling: SamplingConfig) -> DraftBlock:
        """``num_tokens`` drafted tokens following ``context`` (one decode per token, after
        feeding whatever part of ``context`` the cache does not hold)."""
        return self.drafter._propose(self, context, num_tokens, sampling)

    @property
    def num_kv_tokens(self) -> int:
        """Positions llama.cpp holds for this sequence (equals ``len(cached_token_ids)``)."""
        return self.drafter._num_kv_tokens(self)

    def close(self) -> None:
        """Free the sequence's cache and hand its id back (idempotent)."""
        self.drafter._release(self)
