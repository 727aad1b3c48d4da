"""Which attention implementation a transformers model runs: the one place that reads or writes
transformers' private ``config._attn_implementation`` (transformers offers
``set_attn_implementation`` to change it, and nothing public to read it or to swap it for a call)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers import PreTrainedModel


def attention_implementation(model: PreTrainedModel) -> str:
    """The name of the attention the model's layers call (``eager``, ``sdpa``, a registered one)."""
    return model.config._attn_implementation


def set_attention_implementation(model: PreTrainedModel, implementation: str) -> None:
    """Switch the model to ``implementation`` (registered with ``AttentionInterface``) for good,
    through transformers' own setter, which checks it; nothing happens when it already runs it."""
    if attention_implementation(model) != implementation:
        model.set_attn_implementation(implementation)


@contextmanager
def attention_for_call(model: PreTrainedModel, implementation: str) -> Iterator[None]:
    """Run the model's forwards inside the block with ``implementation``, then restore what it ran
    before, an exception included. Every attention layer reads the name from the config on each
    call, so the swap costs nothing; unlike the setter it does not re-check the implementation
    per call (the caller registered it once)."""
    previous = attention_implementation(model)
    model.config._attn_implementation = implementation
    try:
        yield
    finally:
        model.config._attn_implementation = previous
