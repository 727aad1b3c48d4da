"""The README stays true: every flag of both services is documented, and the set-up commands
it names exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edge_agent.settings import EdgeSettings
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("settings_class", [VerifierSettings, EdgeSettings])
def test_every_flag_and_env_var_is_documented(settings_class):
    prefix = settings_class.model_config["env_prefix"]
    for name in settings_class.model_fields:
        assert f"`--{name.replace('_', '-')}`" in README, name
        assert f"`{prefix}{name.upper()}`" in README, name


@pytest.mark.parametrize("command", ["scripts/demo", "scripts/test", "scripts/setup", "scripts/lint", ".ci/run"])
def test_setup_commands_exist_and_are_executable(command):
    path = ROOT / command
    assert path.is_file()
    assert os.access(path, os.X_OK)
    assert command in README or command == "scripts/setup"
