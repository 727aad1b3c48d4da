"""Batched verification for the transformers backend: verify calls of different sessions that
arrive together run as ONE forward of the target.

Glossary:
    pending     a verify call (or a target-only step) waiting for the target
    batch       up to ``max_batch_sessions`` pending calls, at most one per session, FIFO
    cached      tokens a session's KV cache already covers (L_i); its rows are not recomputed
    new         the tokens a call feeds (n_i): uncached context tail + drafted block

``BatchGatherer`` runs on the event loop: calls queue in arrival order; when the target is free
the oldest call opens a batch, waits at most ``batch_wait_s`` for company, and the batch goes to
the backend's single worker thread. While a batch runs, new calls queue, so under load batches
fill without waiting. A session never has two calls in one batch (the second waits for the
next). Calls of very different lengths do not share a batch (``padding_fits``: every row of the
padded batch is computed, so a prompt's prefill padded onto others' blocks would cost the
prompt's length once per session); a call left out waits for the next batch, which the oldest
waiting call always opens, so no session starves. A call whose caller went away is dropped when
the batch is taken (no forward for nobody); the waiting calls of a session that is released
(ended, or evicted by the registry while a call was on its way) are still answered but keep no
KV cache (``forget_session``): run after the release, they would store one nobody frees.

``batched_forward`` stacks the sessions' caches and new tokens into one padded batch. Worked
example, session A with 3 cached tokens and 2 new, B with 1 cached and 3 new (pad = ·):

    keys      A: a0 a1 a2 | A3 A4 ·      B: ·  ·  b0 | B1 B2 B3
              cache, left-padded to 3      new tokens, right-padded to 3
    positions A: 3 4 5                     B: 1 2 3

Left padding lines every cache up against the new columns (RoPE is already inside the cached
keys, so their place in the batch does not matter); right padding keeps each real row ahead of
its pads, so causality hides the pads from real rows, and every row, pads included, still has a
real key to attend to (no all-masked row, no NaN). The attention mask zeroes the pad columns.
Afterwards each session gets back its own slice of the batch's cache (pads dropped).

fp32 results are not bitwise equal to a one-session forward (the GEMM's blocking changes with
the row count), only close; verdicts agree unless two top logits are nearly tied.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from spade_models.kv_cache import TokenCache
from verifier_service.backends.base import BlockToVerify, BlockVerdict

PAD_TOKEN_ID = 0
"""Any valid id: pad rows are computed but never read."""
UNPADDABLE_ATTENTION = frozenset({"spade_rowwise"})
"""Attention implementations that take no mask (the batch-invariant mode): batches of these
models run one session at a time."""


@dataclass
class PendingCall:
    block: BlockToVerify
    queued_at: float
    future: asyncio.Future = field(repr=False)
    keep_cache: bool = True
    """False once the session was released while this call waited: it is still answered (the
    block carries its whole context), but its KV cache is not kept."""


MAX_PAD_ROWS = 16
"""A call joins a batch only while the batch's pad rows (computed for nothing) stay within
max(MAX_PAD_ROWS, half its real rows): a 300-token prompt is not padded onto seven 9-row
blocks (2,100 wasted rows), nor a block onto a prompt."""


def take_batch(
    queue: list[PendingCall], max_batch_sessions: int, rows_of: Callable[[BlockToVerify], int] | None = None
) -> list[PendingCall]:
    """Remove and return the oldest calls, at most one per session, keeping the others' order.
    With ``rows_of`` (the rows a call will feed), a later call whose rows would pad the batch
    beyond ``padding_fits`` waits for the next batch, which the oldest waiting call always opens:
    a call is passed over at most once per batch it does not fit, and never starves."""
    batch: list[PendingCall] = []
    rows: list[int] = []
    sessions: set[str] = set()
    for call in list(queue):
        if len(batch) == max_batch_sessions:
            break
        if call.block.session_id in sessions:
            continue
        call_rows = rows_of(call.block) if rows_of else 1
        if batch and not padding_fits(rows + [call_rows]):
            continue
        sessions.add(call.block.session_id)
        batch.append(call)
        rows.append(call_rows)
        queue.remove(call)
    return batch


def padding_fits(rows: list[int]) -> bool:
    """Whether one padded forward over calls of these row counts wastes at most
    max(MAX_PAD_ROWS, half the real rows) on padding."""
    real = sum(rows)
    return len(rows) * max(rows) - real <= max(MAX_PAD_ROWS, real // 2)


class BatchGatherer:
    """Gathers pending calls into batches and runs them one at a time on ``executor``."""

    def __init__(
        self,
        run_batch: Callable[[list[PendingCall]], list[BlockVerdict]],
        executor: Executor,
        max_batch_sessions: int,
        batch_wait_s: float,
        rows_of: Callable[[BlockToVerify], int] | None = None,
    ) -> None:
        if max_batch_sessions < 1 or batch_wait_s < 0:
            raise ValueError("max_batch_sessions must be >= 1 and batch_wait_s >= 0")
        self._run_batch = run_batch
        self._rows_of = rows_of
        self._executor = executor
        self.max_batch_sessions = max_batch_sessions
        self.batch_wait_s = batch_wait_s
        self._queue: list[PendingCall] = []
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None

    async def submit(self, block: BlockToVerify, queued_at: float) -> BlockVerdict:
        future = asyncio.get_running_loop().create_future()
        self._queue.append(PendingCall(block, queued_at, future))
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for call in self._queue:
            if not call.future.done():
                call.future.cancel()
        self._queue.clear()

    def forget_session(self, session_id: str) -> None:
        """The session was released: its waiting calls will still be answered but keep no KV
        cache (run after the release, they would store one nobody frees). A call already in a
        running batch finishes first, on the worker thread that then frees the session's cache."""
        for call in self._queue:
            if call.block.session_id == session_id:
                call.keep_cache = False

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            await self._gather()
            self._queue[:] = [call for call in self._queue if not call.future.done()]  # callers that left cost nothing
            batch = take_batch(self._queue, self.max_batch_sessions, self._rows_of)
            if not batch:
                continue
            try:
                verdicts = await loop.run_in_executor(self._executor, self._run_batch, batch)
            except Exception as error:  # every caller of the batch gets the error
                for call in batch:
                    _settle(call.future, error=error)
                continue
            for call, verdict in zip(batch, verdicts, strict=True):
                _settle(call.future, verdict=verdict)

    async def _gather(self) -> None:
        """Wait (bounded) for more sessions while the batch is not full."""
        deadline = time.perf_counter() + self.batch_wait_s
        while len({call.block.session_id for call in self._queue}) < self.max_batch_sessions:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return


def _settle(future: asyncio.Future, verdict: BlockVerdict | None = None, error: Exception | None = None) -> None:
    if future.done():  # the caller went away (cancelled); the work is simply dropped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(verdict)


def batched_forward(
    model: PreTrainedModel,
    entries: Sequence[TokenCache],
    new_token_ids: Sequence[list[int]],
    cache_argument: str,
    device: torch.device,
    num_scored: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """One forward over every session's new tokens; each entry's cache is replaced by its slice
    of the batch's cache (covering its old tokens + new ones). Returns per session the fp32
    logits of its last ``num_scored[i]`` new rows (all of them by default), [k_i, vocab].

    Only the rows some session scores go through the output layer: a session prefilling a
    500-token prompt beside blocks of 9 would otherwise cost 500 x vocabulary logits per session
    of the batch (the padded batch has one length), most of a forward's time and gigabytes."""
    cached = [entry.cache.get_seq_length() for entry in entries]
    num_new = [len(ids) for ids in new_token_ids]
    scored = [range(n - k, n) for n, k in zip(num_new, num_scored or num_new, strict=True)]
    kept_positions = sorted({position for rows in scored for position in rows})
    column = {position: index for index, position in enumerate(kept_positions)}
    max_cached, max_new = max(cached), max(num_new)
    input_ids = torch.full((len(entries), max_new), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(entries), max_cached + max_new), dtype=torch.long)
    position_ids = torch.zeros((len(entries), max_new), dtype=torch.long)
    for row, (ids, length) in enumerate(zip(new_token_ids, cached, strict=True)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, max_cached - length : max_cached + len(ids)] = 1
        position_ids[row] = torch.arange(length, length + max_new)
    batch_cache = stacked_cache(model, entries, max_cached)
    with torch.inference_mode():
        output = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=True,
            logits_to_keep=torch.tensor(kept_positions, device=device),
            **{cache_argument: batch_cache},
        )
    for row, entry in enumerate(entries):
        entry.cache = session_slice(model, batch_cache, row, max_cached - cached[row], max_cached + num_new[row])
    return [output.logits[row, [column[position] for position in rows]].float() for row, rows in enumerate(scored)]


def stacked_cache(model: PreTrainedModel, entries: Sequence[TokenCache], max_cached: int) -> DynamicCache:
    """The sessions' caches as one batch, each left-padded with zeros to ``max_cached``."""
    batch_cache = DynamicCache(config=model.config)
    if max_cached == 0:
        return batch_cache
    for layer_index in range(model.config.num_hidden_layers):
        states = [layer_states(entry.cache.layers[layer_index]) for entry in entries]
        template = next(held[0] for held in states if held is not None)
        keys = [_left_padded(None if held is None else held[0], template, max_cached) for held in states]
        values = [_left_padded(None if held is None else held[1], template, max_cached) for held in states]
        batch_cache.update(torch.cat(keys), torch.cat(values), layer_index)
    return batch_cache


def layer_states(layer: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's (keys, values), [1, heads, seq, dim] each; None while it holds nothing.
    Read by attribute: transformers types its layers as a union, but the models batched here
    have full-attention layers only (DynamicLayer)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if keys is None or values is None or keys.shape[-2] == 0:
        return None
    return keys, values


def _left_padded(states: torch.Tensor | None, template: torch.Tensor, length: int) -> torch.Tensor:
    """[1, heads, length, dim]: ``states`` preceded by zeros (all zeros for an empty cache)."""
    padded = template.new_zeros((1, template.shape[1], length, template.shape[3]))
    if states is not None:
        padded[:, :, length - states.shape[2] :] = states
    return padded


def session_slice(model: PreTrainedModel, batch_cache: DynamicCache, row: int, start: int, end: int) -> DynamicCache:
    """Row ``row``'s columns [start, end) of every layer, as a cache of its own."""
    cache = DynamicCache(config=model.config)
    for layer_index, layer in enumerate(batch_cache.layers):
        states = layer_states(layer)
        if states is None:
            raise ValueError(f"layer {layer_index} of the batch's cache is empty after its forward")
        keys, values = states
        cache.update(keys[row : row + 1, :, start:end].clone(), values[row : row + 1, :, start:end].clone(), layer_index)
    return cache


def accepts_padding(model: PreTrainedModel) -> bool:
    return getattr(model.config, "_attn_implementation", None) not in UNPADDABLE_ATTENTION


def verify_batch(backend, batch: list[PendingCall]) -> list[BlockVerdict]:
    """The backend's verify for several sessions at once (runs on its worker thread). A batch
    of one takes the backend's own one-session path, unchanged."""
    if len(batch) == 1 or not accepts_padding(backend._model):
        return [backend._verify(call.block, call.queued_at, call.keep_cache) for call in batch]
    started = time.perf_counter()
    entries = [backend._caches.pop(call.block.session_id, None) or TokenCache.empty(backend._model) for call in batch]
    new_token_ids = [
        entry.reuse_for(call.block.context_token_ids) + call.block.draft_token_ids for entry, call in zip(entries, batch, strict=True)
    ]
    # The scored rows are the block's: the last context token's, then each drafted token's.
    num_scored = [call.block.num_drafted + 1 for call in batch]
    logits = batched_forward(backend._model, entries, new_token_ids, backend._cache_argument, backend._device, num_scored)
    verdicts = []
    for entry, call, ids, scored in zip(entries, batch, new_token_ids, logits, strict=True):
        verdicts.append(
            backend._conclude(entry, call.block, len(ids), scored, call.queued_at, started, len(batch), keep_cache=call.keep_cache)
        )
    return verdicts
