"""Hypothesis properties of the sampling transform and the wire models: for any logits and any
valid sampling parameters the transform is a distribution (finite, non-negative, sums to 1)
inside the top-k / top-p support; any valid request survives a JSON round trip unchanged, and
no lone surrogate or bool-for-int gets through."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from spade_core.params import GREEDY_BELOW_TEMPERATURE, MAX_SEED, MAX_TEMPERATURE, SamplingConfig
from spade_core.sampling import processed_probs
from verifier_service.protocol import VerifyRequest, WireSampling

VOCAB = 24
logit_rows = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=VOCAB, max_size=VOCAB)
temperatures = st.one_of(st.just(0.0), st.floats(min_value=5e-324, max_value=2.0))
top_ps = st.floats(min_value=5e-324, max_value=1.0)
top_ks = st.integers(-1, VOCAB + 3)


@settings(max_examples=300, deadline=None)
@given(logits=logit_rows, temperature=temperatures, top_p=top_ps, top_k=top_ks)
def test_the_transform_is_always_a_distribution_inside_its_support(logits, temperature, top_p, top_k):
    probs = processed_probs(torch.tensor([logits]), SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))[0]
    num_kept = int((probs > 0).sum())
    assert bool(torch.isfinite(probs).all() and (probs >= 0).all())
    assert abs(float(probs.double().sum()) - 1.0) < 1e-5
    # top-k keeps at most k tokens beyond ties at the k-th value
    if top_k > 0:
        kth = torch.tensor(logits).topk(min(top_k, VOCAB)).values[-1]
        assert num_kept <= int((torch.tensor(logits) >= kth).sum())
    # a most likely token (one of them, on ties) always keeps mass
    row = torch.tensor(logits)
    assert float(probs[row == row.max()].sum()) > 0


@settings(max_examples=200, deadline=None)
@given(logits=logit_rows, temperature=st.floats(min_value=5e-324, max_value=GREEDY_BELOW_TEMPERATURE, exclude_max=True))
def test_a_temperature_below_the_threshold_is_exactly_greedy(logits, temperature):
    row = torch.tensor([logits])
    assert torch.equal(processed_probs(row, SamplingConfig(temperature=temperature)), processed_probs(row, SamplingConfig(temperature=0.0)))


@settings(max_examples=200, deadline=None)
@given(logits=logit_rows, top_p=st.floats(min_value=5e-324, max_value=1e-30))
@example(logits=[0.0] * 23 + [1.401298464324817e-45], top_p=1e-31)
def test_a_tiny_top_p_keeps_only_the_top_token(logits, top_p):
    probs = processed_probs(torch.tensor([logits]), SamplingConfig(temperature=1.0, top_p=top_p))[0]
    # Logits that differ by less than float32 resolves after the softmax (1.4e-45 and 0, say)
    # are equally likely tokens; any of them is the "top token".
    full = processed_probs(torch.tensor([logits]), SamplingConfig(temperature=1.0))[0]
    assert set(torch.nonzero(probs).flatten().tolist()) <= set(torch.nonzero(full == full.max()).flatten().tolist())


text = st.text(st.characters(codec="utf-8"), max_size=40)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    min_size=1,
    max_size=4,
)
chat_requests = st.fixed_dictionaries(
    {"model": text, "messages": messages},
    optional={
        "max_tokens": st.integers(1, 10**6),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(1e-300, 1.0),
        "top_k": st.integers(-1, 10**6),
        "seed": st.integers(0, MAX_SEED),
        "stop": st.lists(text.filter(bool), max_size=8),
        "stream": st.booleans(),
        "user": text,
    },
)


@settings(max_examples=200, deadline=None)
@given(body=chat_requests)
def test_any_valid_chat_request_survives_a_json_round_trip(body):
    request = ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert ChatCompletionRequest.model_validate_json(request.model_dump_json()) == request


@settings(max_examples=100, deadline=None)
@given(prefix=text, suffix=text, surrogate=st.integers(0xD800, 0xDFFF))
def test_no_lone_surrogate_gets_through(prefix, suffix, surrogate):
    # FastAPI parses bodies with json.loads, which turns "\\ud800" into a lone surrogate.
    body = json.loads(json.dumps({"model": "m", "prompt": prefix + chr(surrogate) + suffix}))
    with pytest.raises(ValidationError, match="valid Unicode"):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("field", ["max_tokens", "seed", "top_k", "n"])
def test_a_bool_is_not_an_integer(field):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", field: True})


OUT_OF_BOUNDS = [
    ("temperature", 2.0000001),
    ("temperature", float("inf")),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("seed", MAX_SEED + 1),
    ("seed", -1),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_BOUNDS)
def test_the_openai_schema_and_the_wire_refuse_the_same_sampling_values(field, value):
    """One set of bounds (spade_core.params): a value the OpenAI route refuses never reaches the
    wire, and one the wire would refuse never passes the OpenAI route (a 500 instead of a 400)."""
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", field: value})
    with pytest.raises(ValidationError):
        WireSampling.model_validate({field: value})
    with pytest.raises(ValueError):
        SamplingConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 2.0), ("temperature", 0.0), ("top_p", 1e-300), ("top_k", -1), ("seed", MAX_SEED), ("seed", 0)]
)
def test_the_bounds_themselves_pass_everywhere(field, value):
    CompletionRequest.model_validate({"model": "m", "prompt": "hi", field: value})
    WireSampling.model_validate({field: value}).to_config()
    SamplingConfig(**{field: value})


@settings(max_examples=100, deadline=None)
@given(
    new_tokens=st.lists(st.integers(0, 10**6), max_size=20),
    draft=st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
    temperature=st.floats(0, MAX_TEMPERATURE),
    seed=st.integers(0, MAX_SEED),
)
def test_a_verify_request_round_trips_with_the_same_fingerprint(new_tokens, draft, temperature, seed):
    body = {
        "session_id": "s",
        "prefix_length": 0,
        "prefix_digest": "",
        "new_tokens": new_tokens,
        "draft_tokens": draft,
        "sampling": {"temperature": temperature, "seed": seed},
    }
    request = VerifyRequest.model_validate_json(json.dumps(body))
    assert VerifyRequest.model_validate_json(request.model_dump_json()).fingerprint() == request.fingerprint()
