"""One forward over the real rows of several sessions: no padding, no stacked cache, no copies.

Glossary:
    session rows  the tokens one session feeds this forward (uncached context tail + drafted
                  block, or a chunk of a prompt); contiguous on the forward's one row axis
    segment       a session's [start, end) on that axis
    keys          what attention reads for a segment: that session's own cache after the
                  forward's rows were appended to it, in place

The model is called on ONE sequence, every session's rows concatenated: the linear layers see
one matrix of sum(n_i) rows (the CPU kernel's M is the sum, each weight read once for all of
them), and each row carries its own position (RoPE is per row). Worked example, session A with
3 cached tokens and 2 new, B with 1 cached and 3 new:

    rows       A3 A4 | B1 B2 B3             one matrix of 5 rows, nothing padded
    positions   3  4 |  1  2  3
    A's keys   a0 a1 a2 A3 A4               A's own cache, grown in place by 2
    B's keys   b0 B1 B2 B3                  B's own cache, grown in place by 3

``RaggedCache`` is what the model receives as its cache: each layer's ``update`` splits the new
keys/values by segment and appends each piece to its session's own cache layer (a
``GrowingLayer`` writes into spare room: no copy of what was cached); it keeps the sessions'
whole keys/values for that layer. ``ragged_attention`` (registered with transformers as
``spade_ragged``) then runs each segment's queries against its own session's keys with the
inner attention: ``gqa_attention`` (its causal mask puts a segment's rows at the end of its
keys), or ``rowwise_attention`` in batch-invariant mode, where a row's output then depends on
nothing but its own session's keys: with the batch-invariant linear kernel, every row's logits
are bitwise those of a one-token forward at its position, whatever shares the forward.

The model builds no attention mask (``NO_MASK``): causality is per segment, inside attention.

On an accelerator (``packed``) the segments' attention is one call instead of one per segment:
each layer lays the sessions' keys end to end (one concatenation) and runs one fused attention of
every row against them under a block-diagonal causal mask built once per forward. There, per
segment launches cost more than the arithmetic (an H200, Qwen2.5-1.5B's shape in fp32: 2-4 ms
per session and forward one segment at a time, against 15 ms for a whole one-row forward;
docs/runs/run-k.md); on a CPU the concatenation would copy every cache once per layer,
so the CPU keeps one call per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

from spade_models.attention import attention_for_call
from spade_models.kv_cache import cache_argument_name
from verifier_service.backends.transformers.cpu.attention import gqa_attention, rowwise_attention

RAGGED_ATTENTION = "spade_ragged"
NO_MASK = {"full_attention": None, "sliding_attention": None}
"""Passed as the model's attention_mask: a prepared mapping, so transformers builds none."""


@dataclass
class RaggedCache:
    """The forward's cache argument: routes each layer's new keys/values to the sessions' own
    caches (duck-typed as a transformers cache: the decoder layers only call ``update``)."""

    caches: Sequence[DynamicCache]
    segments: Sequence[tuple[int, int]]
    """Per session, its rows' [start, end) on the forward's row axis, in order, covering it."""
    batch_invariant: bool = False
    packed: bool = False
    """One attention call over all segments per layer (see the module docstring)."""
    layer_states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Per layer index, each session's whole (keys, values) after this forward's update."""
    packed_mask: torch.Tensor | None = None
    """The packed attention's mask, built at the first layer and shared by all."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [1, kv_heads, sum(n_i), head_dim]; session i's rows are segments[i]
        self.layer_states[layer_idx] = [
            cache.update(key_states[:, :, start:end], value_states[:, :, start:end], layer_idx)
            for cache, (start, end) in zip(self.caches, self.segments, strict=True)
        ]
        return key_states, value_states  # not read: ragged_attention takes each session's own

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Only for code that asks without positions: the forward always passes position_ids."""
        return 0


def register_ragged_attention() -> None:
    """Make ``spade_ragged`` known to transformers (idempotent); it takes no mask."""
    AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)


def ragged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, heads, sum(n_i), head_dim]
    key: torch.Tensor,  # the update's return value: unused
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # None: NO_MASK
    scaling: float,
    dropout: float = 0.0,
    *,
    ragged_cache: RaggedCache,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if kwargs.get("sliding_window"):
        raise ValueError("ragged attention takes full-attention layers only")
    states = ragged_cache.layer_states[module.layer_idx]  # type: ignore[index]
    if ragged_cache.packed and not ragged_cache.batch_invariant:
        if ragged_cache.packed_mask is None:
            ragged_cache.packed_mask = packed_causal_mask(ragged_cache.segments, [keys.shape[2] for keys, _ in states], query.device)
        return packed_attention(query, states, ragged_cache.packed_mask, scaling), None
    inner = rowwise_attention if ragged_cache.batch_invariant else gqa_attention
    outputs = []
    for (start, end), (session_keys, session_values) in zip(ragged_cache.segments, states, strict=True):
        output, _ = inner(module, query[:, :, start:end], session_keys, session_values, None, scaling)
        outputs.append(output)  # [1, n_i, heads, head_dim]
    return torch.cat(outputs, dim=1), None


def packed_attention(
    query: torch.Tensor,  # [1, heads, sum(n_i), head_dim]
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per session [1, kv_heads, L_i, head_dim]
    mask: torch.Tensor,  # [sum(n_i), sum(L_i)] bool, True where a row may look
    scaling: float,
) -> torch.Tensor:
    """Every segment's rows against its own session's keys in one fused attention call, the
    sessions' keys laid end to end; [1, sum(n_i), heads, head_dim]."""
    keys = torch.cat([session_keys for session_keys, _ in states], dim=2)
    values = torch.cat([session_values for _, session_values in states], dim=2)
    output = nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous()


def packed_causal_mask(segments: Sequence[tuple[int, int]], key_lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[sum(n_i), sum(L_i)] bool for keys laid end to end by session: a row of segment i sees
    session i's keys up to its own position (its segment's rows are the last n_i of its L_i
    keys), nothing of other sessions'. Built with a fixed number of operations, whatever the
    number of sessions. Example, A with 2 rows over 3 keys, B with 1 row over 2 keys:

        keys     a0 a1 a2 b0 b1
        A row 0   1  1  0  0  0
        A row 1   1  1  1  0  0
        B row 0   0  0  0  1  1
    """
    row_counts = torch.tensor([end - start for start, end in segments], device=device)
    key_counts = torch.tensor(list(key_lengths), device=device)
    num_rows, num_keys = segments[-1][1], sum(key_lengths)
    sessions = torch.arange(len(segments), device=device)
    row_session = torch.repeat_interleave(sessions, row_counts, output_size=num_rows)
    key_session = torch.repeat_interleave(sessions, key_counts, output_size=num_keys)
    row_starts = torch.cumsum(row_counts, 0) - row_counts
    key_ends = torch.cumsum(key_counts, 0)
    rows = torch.arange(num_rows, device=device)
    # the row's own key: its session's key end, less the rows after it in its segment
    own_key = key_ends[row_session] - row_counts[row_session] + (rows - row_starts[row_session])
    keys = torch.arange(num_keys, device=device)
    return (key_session[None, :] == row_session[:, None]) & (keys[None, :] <= own_key[:, None])


def ragged_forward(
    model: PreTrainedModel,
    ragged_cache: RaggedCache,
    new_token_ids: Sequence[list[int]],
    positions: Sequence[int],
    scored_rows: list[int],
) -> torch.Tensor:
    """One forward over every session's rows (``new_token_ids[i]`` starting at absolute position
    ``positions[i]``); returns the fp32 logits of the forward rows listed in ``scored_rows``
    (indices on the flat row axis), [len(scored_rows), vocab]. Only those rows reach the output
    layer. Each session's cache grows by its rows, in place."""
    flat_ids = [token_id for ids in new_token_ids for token_id in ids]
    flat_positions = [start + offset for ids, start in zip(new_token_ids, positions, strict=True) for offset in range(len(ids))]
    device = next(model.parameters()).device
    with attention_for_call(model, RAGGED_ATTENTION), torch.inference_mode():
        output = model(
            input_ids=torch.tensor([flat_ids], device=device),
            position_ids=torch.tensor([flat_positions], device=device),
            attention_mask=NO_MASK,
            use_cache=True,
            logits_to_keep=torch.tensor(scored_rows, dtype=torch.long, device=device),
            ragged_cache=ragged_cache,
            **{cache_argument_name(model): ragged_cache},
        )
    return output.logits[0].float()
