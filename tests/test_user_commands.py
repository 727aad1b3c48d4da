"""Every command a user is shown or runs uses user-facing flags only: the ``spade-verifier`` and
``spade-edge`` command lines in the README and docs/setup.md, in the compose files' ``command:``
entries and in the scripts a user runs (``scripts/``). A flag there that is advanced (tuning a user
seldom sets, listed after the user-facing ones in ``--help``), removed or unknown fails the test,
so the first commands a newcomer copies never lean on a knob the docs call advanced.

Environment variables in the compose files are a deployment's configuration, not commands: the GPU
profile sets vLLM's parallelism and KV budget there, which are advanced flags by design."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from edge_agent.settings import EdgeSettings
from gateway.cli import flag_name, is_advanced
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"spade-verifier": VerifierSettings, "spade-edge": EdgeSettings}
ALWAYS_ALLOWED = frozenset({"--help", "--version"})
SHELL_ENDS = re.compile(r"^(>|>>|2>|&|&&|\||\|\||;|\)|`)")
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "setup.md"]
SCRIPTS = sorted(path for path in (ROOT / "scripts").iterdir() if path.is_file())
COMPOSE_FILES = sorted(ROOT.glob("docker-compose*.yml"))


def user_facing_flags(settings_class) -> set[str]:
    flags = set(ALWAYS_ALLOWED)
    for name, field in settings_class.model_fields.items():
        if not is_advanced(field):
            flags.add(flag_name(name))
            if field.annotation is bool:
                flags.add("--no-" + flag_name(name)[2:])
    return flags


def shell_commands(text: str) -> list[tuple[str, list[str]]]:
    """(service, its flags) for every ``spade-verifier`` / ``spade-edge`` command line in shell or
    Markdown text, backslash continuations joined; a command ends at a redirection, ``&``, a pipe
    or ``;``."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for match in re.finditer(r"(?<![\w/-])(?:\.venv/bin/)?(spade-verifier|spade-edge)\b([^\n]*)", joined):
        flags = []
        for token in match.group(2).split():
            if SHELL_ENDS.match(token):
                break
            if token.startswith("--"):
                flags.append(token.split("=", 1)[0].strip("`\"'"))
        commands.append((match.group(1), flags))
    return commands


def compose_commands(path: Path) -> list[tuple[str, list[str]]]:
    services = yaml.safe_load(path.read_text()).get("services", {})
    commands = []
    for service in services.values():
        command = service.get("command")
        if isinstance(command, list) and command and command[0] in SERVICES:
            commands.append((command[0], [item.split("=", 1)[0] for item in command[1:] if str(item).startswith("--")]))
    return commands


def test_the_command_finder_finds_commands_and_their_flags():
    text = "x\n.venv/bin/spade-edge --draft-model m --overlap=false \\\n  --port 1 >log 2>&1 &\nsee `spade-verifier --help`"
    assert shell_commands(text) == [("spade-edge", ["--draft-model", "--overlap", "--port"]), ("spade-verifier", ["--help"])]


def _where_commands():
    for path in DOCUMENTS + SCRIPTS:
        yield path, shell_commands(path.read_text(errors="replace"))
    for path in COMPOSE_FILES:
        yield path, compose_commands(path)


def test_the_user_facing_commands_are_found():
    found = {path.name: commands for path, commands in _where_commands() if commands}
    assert "demo" in found and any(name.startswith("docker-compose") for name in found)


@pytest.mark.parametrize("path", DOCUMENTS + SCRIPTS + COMPOSE_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_command_uses_user_facing_flags_only(path):
    commands = compose_commands(path) if path in COMPOSE_FILES else shell_commands(path.read_text(errors="replace"))
    for service, flags in commands:
        allowed = user_facing_flags(SERVICES[service])
        assert [flag for flag in flags if flag not in allowed] == [], f"{path.name}: {service} {' '.join(flags)}"
