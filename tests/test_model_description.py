"""The one description of the served model (``gateway.model``): the context-limit rule at its
boundary, the trip through the verifier's /health to the edge and back, and the end tokens both
backends collect by one rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gateway.errors import InvalidRequestError
from gateway.model import ModelDescription
from spade_models.loader import eos_token_ids
from verifier_service.protocol import WIRE_VERSION, VerifierHealth, described_model, health_fields

MODEL = ModelDescription("target", 384, 32, frozenset({9, 2}), "f1ngerprint", "greedy")


@pytest.mark.parametrize(
    ("num_held", "num_added", "fits"),
    [
        (30, 2, True),  # a 30-token prompt may ask for 2 tokens ...
        (30, 3, False),  # ... not 3
        (29, 3, True),  # a verify call on 29 committed tokens may carry 3 drafted (32 fed) ...
        (29, 4, False),  # ... not 4
        (32, 0, True),  # a full context, nothing added
        (33, 0, False),  # past it already
    ],
)
def test_the_context_limit_rule_at_its_boundary(num_held, num_added, fits):
    assert MODEL.room(num_held) == 32 - num_held
    if fits:
        MODEL.check_fits(num_held, num_added, param="max_tokens")
        return
    with pytest.raises(InvalidRequestError) as refused:
        MODEL.check_fits(num_held, num_added, param="max_tokens")
    assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
    assert f"needs {num_held + num_added}" in refused.value.message


HEALTH_LIMITS = {"status": "ok", "wire_version": WIRE_VERSION, "max_draft_length": 8, "max_draft_support": 16, "backend": "vllm"}


def test_the_description_round_trips_through_the_health_json():
    health = VerifierHealth(**health_fields(MODEL), **HEALTH_LIMITS)
    assert described_model(VerifierHealth.model_validate_json(health.model_dump_json())) == MODEL


def test_the_health_json_carries_the_description_under_its_wire_names():
    body = VerifierHealth(**health_fields(MODEL), **HEALTH_LIMITS).model_dump()
    assert {key: body[key] for key in ("model", "vocab_size", "max_context_length", "eos_token_ids", "tokenizer_fingerprint")} == {
        "model": "target",
        "vocab_size": 384,
        "max_context_length": 32,
        "eos_token_ids": [2, 9],
        "tokenizer_fingerprint": "f1ngerprint",
    }


def test_a_health_without_logprobs_support_is_refused_not_defaulted():
    body = health_fields(MODEL) | HEALTH_LIMITS
    del body["logprobs_support"]
    with pytest.raises(ValidationError, match="logprobs_support"):
        VerifierHealth.model_validate(body)


def test_end_tokens_are_the_union_of_both_configs_and_the_tokenizer():
    generation_config = SimpleNamespace(eos_token_id=[7, 8])
    vllm_generation_config = {"eos_token_id": 8}  # vLLM reads the generation config as a dict
    model_config = SimpleNamespace(eos_token_id=5)
    tokenizer = SimpleNamespace(eos_token_id=9)
    assert eos_token_ids(tokenizer, generation_config, model_config) == frozenset({5, 7, 8, 9})
    assert eos_token_ids(tokenizer, vllm_generation_config, SimpleNamespace()) == frozenset({8, 9})
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), {}, SimpleNamespace(eos_token_id=None)) == frozenset()
