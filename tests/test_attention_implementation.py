"""The one helper through which the code reads and swaps transformers' attention implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spade_models.attention import attention_for_call, attention_implementation, set_attention_implementation


@pytest.fixture
def model():
    config = Qwen2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, vocab_size=64
    )
    return Qwen2ForCausalLM(config).eval()


def test_a_call_runs_the_swapped_attention_and_the_model_gets_its_own_back_even_after_an_error(model):
    set_attention_implementation(model, "eager")
    calls = []
    inputs = {"input_ids": torch.tensor([[1, 2, 3]])}
    with attention_for_call(model, "sdpa"):
        assert attention_implementation(model) == "sdpa"
        model(**inputs)
        calls.append(attention_implementation(model))
    assert attention_implementation(model) == "eager" and calls == ["sdpa"]
    with pytest.raises(RuntimeError), attention_for_call(model, "sdpa"):
        raise RuntimeError("a forward failed")
    assert attention_implementation(model) == "eager"


def test_setting_the_attention_it_already_runs_changes_nothing_and_another_goes_through_transformers(model):
    set_attention_implementation(model, "eager")
    set_attention_implementation(model, "eager")
    assert attention_implementation(model) == "eager"
    set_attention_implementation(model, "sdpa")
    assert attention_implementation(model) == "sdpa"
    with pytest.raises(ValueError):
        set_attention_implementation(model, "no-such-attention")  # transformers' setter checks the name
