"""The README stays true: it names every user-facing flag of both services and links the
generated references (every flag and env var: docs/configuration.md, kept true by
tests/test_reference_docs.py), and the set-up commands it names exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_agent.settings import EdgeSettings
from gateway.cli import flag_name, is_advanced
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("settings_class", [VerifierSettings, EdgeSettings])
def test_every_user_facing_flag_is_named(settings_class):
    for name, field in settings_class.model_fields.items():
        assert is_advanced(field) or f"`{flag_name(name)}`" in README, name


def test_the_references_are_linked():
    assert "[docs/configuration.md](docs/configuration.md)" in README
    assert "[docs/metrics.md](docs/metrics.md)" in README


@pytest.mark.parametrize("command", ["scripts/demo", "scripts/test", "scripts/setup", "scripts/lint", ".ci/run"])
def test_setup_commands_exist_and_are_executable(command):
    path = ROOT / command
    assert path.is_file()
    assert os.access(path, os.X_OK)
    assert command in README or command == "scripts/setup"
