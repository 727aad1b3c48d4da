"""Each service's tuning constants live in one frozen, documented ``Tuning`` (``edge_agent.tuning``,
``verifier_service.tuning``), with one acceptance prior per side: the estimates that start from a
prior start from that one, and no policy module keeps a numeric constant of its own."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect

import pytest

from edge_agent import tuning as edge_tuning
from edge_agent.draft_length import AdaptiveDraftLength
from edge_agent.edge_power import DraftAheadPolicy
from edge_agent.estimates import EdgeEstimates
from verifier_service import tuning as verifier_tuning
from verifier_service.backends.transformers.advice import AcceptanceRate

POLICY_MODULES = (
    "edge_agent.draft_length",
    "edge_agent.estimates",
    "edge_agent.edge_power",
    "edge_agent.draft_ahead",
    "edge_agent.health",
    "verifier_service.backends.transformers.advice",
    "verifier_service.backends.transformers.hold",
    "verifier_service.backends.transformers.scheduler",
    "verifier_service.backends.transformers.plan",
    "verifier_service.backends.transformers.pace",
)


def test_one_acceptance_prior_per_side():
    edge_prior = edge_tuning.TUNING.acceptance_prior
    estimates = EdgeEstimates()
    assert estimates.acceptance_prior == edge_prior
    # Both of a request's policies read the one estimate, started from that prior.
    estimate = estimates.for_request()
    assert estimate.acceptance_rate == pytest.approx(edge_prior)
    assert AdaptiveDraftLength().for_request(estimate).estimate is DraftAheadPolicy().for_request(estimate).estimate
    assert AcceptanceRate().alpha == pytest.approx(verifier_tuning.TUNING.acceptance_prior)


@pytest.mark.parametrize("module", [edge_tuning, verifier_tuning], ids=["edge", "verifier"])
def test_the_tuning_is_frozen_and_every_field_documented(module):
    tuning_class = next(value for name, value in vars(module).items() if name.endswith("Tuning") and dataclasses.is_dataclass(value))
    with pytest.raises(dataclasses.FrozenInstanceError):
        module.TUNING.acceptance_prior = 0.5
    tree = ast.parse(inspect.getsource(tuning_class))
    body = tree.body[0].body
    documented = {
        statement.target.id
        for statement, following in zip(body, body[1:], strict=False)
        if isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
    }
    # A field may share the docstring of the one after it only when that one names it.
    fields = [field.name for field in dataclasses.fields(tuning_class)]
    undocumented = [name for name in fields if name not in documented and f"``{name}``" not in inspect.getsource(tuning_class)]
    assert undocumented == []


@pytest.mark.parametrize("module", [edge_tuning, verifier_tuning], ids=["edge", "verifier"])
def test_a_tuning_out_of_range_is_refused(module):
    tuning_class = type(module.TUNING)
    with pytest.raises(ValueError):
        tuning_class(acceptance_prior=1.5)


def numeric_constants(source: str) -> list[str]:
    """Module-level names assigned a number (or an arithmetic of numbers) in ``source``."""
    names = []
    for statement in ast.parse(source).body:
        targets = (
            statement.targets if isinstance(statement, ast.Assign) else [statement.target] if isinstance(statement, ast.AnnAssign) else []
        )
        value = getattr(statement, "value", None)
        if value is None or not all(
            isinstance(node, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop) for node in ast.walk(value)
        ):
            continue
        if any(
            isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool)
            for node in ast.walk(value)
        ):
            names += [target.id for target in targets if isinstance(target, ast.Name)]
    return names


def test_the_constant_finder_finds_constants():
    assert numeric_constants("A = 0.7\nB: float = 2 * 3\nC = 'x'\nD = (1, 2)\nE = True\n") == ["A", "B"]


@pytest.mark.parametrize("module_name", POLICY_MODULES)
def test_no_policy_module_keeps_a_numeric_constant_of_its_own(module_name):
    source = inspect.getsource(importlib.import_module(module_name))
    assert numeric_constants(source) == [], f"{module_name}: move them to its service's Tuning"
