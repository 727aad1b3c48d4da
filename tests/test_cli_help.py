"""Every console script answers --help on a plain install (no extras), and a command that needs
an extra names it instead of ending in a traceback.

"Plain install" is emulated in a subprocess: a sitecustomize hides the bench extra's modules
from every import finder, so ``import matplotlib`` fails exactly as it does where the package
is not installed. The scripts run as installed (the console-script entry points of this venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
HIDDEN_MODULES = ("matplotlib", "rouge_score", "psutil", "vllm")
"""The import names of the bench and vllm extras."""

HIDE_MODULES = f"""
import sys

HIDDEN = {HIDDEN_MODULES!r}


class HideModules:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [HideModules(finder) if hasattr(finder, "find_spec") else finder for finder in sys.meta_path]
"""


@pytest.fixture(scope="module")
def plain_install_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("plain-install")
    (site / "sitecustomize.py").write_text(HIDE_MODULES)
    return os.environ | {"PYTHONPATH": str(site)}


def run_script(script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).parent / script
    return subprocess.run([str(executable), *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_emulation_hides_the_extras(plain_install_env):
    probe = "import importlib.util; print([importlib.util.find_spec(n) is None for n in ('matplotlib', 'rouge_score', 'torch')])"
    result = subprocess.run([sys.executable, "-c", probe], env=plain_install_env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[True, True, False]", result.stderr


def test_the_hidden_modules_are_the_extras_imports():
    assert {"matplotlib", "rouge-score", "psutil"} <= {spec.split(">")[0].split("=")[0] for spec in EXTRAS["bench"]}
    assert [spec.split("=")[0].split(">")[0] for spec in EXTRAS["vllm"]] == ["vllm"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_works_without_the_extras(script, plain_install_env):
    result = run_script(script, ["--help"], plain_install_env)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"usage: {script}")


def test_a_bench_run_without_the_extra_names_it(plain_install_env, tmp_path):
    data = tmp_path / "question.jsonl"
    data.write_text('{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n')
    result = run_script("spade-bench", ["--quick", "--data", str(data), "--output", str(tmp_path / "out")], plain_install_env)
    assert result.returncode == 2
    assert result.stderr == "spade-bench: needs the bench extra (missing matplotlib, rouge_score): pip install 'spade-gateway[bench]'\n"
    assert not (tmp_path / "out").exists()


VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
HEAVY_MODULES = ("torch", "transformers", "uvicorn", "fastapi", "cyllama", "numpy")
"""What --help and --version must not import: each costs seconds on a small machine."""

IMPORTS_AFTER_HELP = f"""
import sys
from importlib.metadata import entry_points

script, flag = sys.argv[1], sys.argv[2]
(entry,) = [e for e in entry_points(group="console_scripts") if e.name == script]
try:
    entry.load()([flag])
except SystemExit:
    pass
print("LOADED", sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_version_prints_the_package_version(script):
    result = run_script(script, ["--version"], dict(os.environ))
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{script} {VERSION}\n", "")


@pytest.mark.parametrize("flag", ["--help", "--version"])
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_and_version_import_nothing_heavy(script, flag):
    """The time of --help is the time of its imports: a deterministic stand-in for "well under a
    second" (torch alone takes seconds to import on the machines this runs on)."""
    result = subprocess.run([sys.executable, "-c", IMPORTS_AFTER_HELP, script, flag], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr


@pytest.mark.parametrize(
    ("script", "flag", "values"),
    [
        ("spade-edge", "--draft-backend", ("auto", "llamacpp", "transformers")),
        ("spade-edge", "--fallback", ("error", "draft")),
        ("spade-edge", "--log-level", ("critical", "error", "warning", "info", "debug")),
        ("spade-verifier", "--backend", ("transformers", "vllm")),
        ("spade-verifier", "--vllm-exact-route", ("sample_match", "full_logprobs")),
        ("spade-verifier", "--log-level", ("critical", "error", "warning", "info", "debug")),
    ],
)
def test_help_lists_the_allowed_values(script, flag, values):
    assert f"One of: {', '.join(values)}." in help_entry(run_script(script, ["--help"], dict(os.environ)).stdout, flag)


def help_entry(help_text: str, flag: str) -> str:
    """The options section's entry of ``flag``, its lines joined."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_is_plain_text(script):
    assert "``" not in run_script(script, ["--help"], dict(os.environ)).stdout


def test_every_boolean_setting_has_a_no_flag():
    """The help texts say --no-fast-kernels and --no-metrics-require-key: those flags exist."""
    import argparse

    from gateway.cli import add_settings_arguments, settings_from_arguments
    from verifier_service.settings import VerifierSettings

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, VerifierSettings)
    settings = settings_from_arguments(parser, parser.parse_args(["--no-fast-kernels", "--no-metrics-require-key"]), VerifierSettings)
    assert (settings.fast_kernels, settings.metrics_require_key) == (False, False)
    settings = settings_from_arguments(parser, parser.parse_args(["--batch-invariant", "--log-level", "DEBUG"]), VerifierSettings)
    assert (settings.batch_invariant, settings.log_level) == (True, "debug")
    assert settings.batch_invariance() == "required"  # asked for: an error where it cannot be met


@pytest.mark.parametrize(
    "arguments,invariance",
    [
        ([], "preferred"),  # the default: where the CPU kernel runs
        (["--no-batch-invariant"], "off"),
        (["--no-fast-kernels"], "off"),  # stock transformers, as asked
        (["--backend", "vllm"], "off"),  # no error: the default only applies where it can
        (["--batch-invariant", "--backend", "vllm"], "required"),  # create_backend refuses it
    ],
)
def test_the_verifier_is_batch_invariant_by_default_where_it_can_be(arguments, invariance):
    import argparse

    from gateway.cli import add_settings_arguments, settings_from_arguments
    from verifier_service.settings import VerifierSettings

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, VerifierSettings)
    assert settings_from_arguments(parser, parser.parse_args(arguments), VerifierSettings).batch_invariance() == invariance


def test_bench_takes_the_services_flag_spelling_and_keeps_the_old_one():
    from spade_bench.cli import build_parser, config_from_args

    for flag in ("--startup-timeout-s", "--startup-timeout"):
        args = build_parser().parse_args(["--data", "x.jsonl", flag, "42"])
        assert config_from_args(args).startup_timeout_s == 42.0


def test_demo_help_prints_usage_and_starts_nothing():
    result = subprocess.run([str(ROOT / "scripts" / "demo"), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith("The main job, from a fresh clone")
    assert "scripts/demo --no-baseline" in result.stdout


def test_the_demo_drafts_as_a_default_edge_does_and_its_line_says_so(monkeypatch):
    """A user who sets nothing gets the best measured draft length (docs/benchmarks.md): the edge's
    default, the demo's, and the line the demo prints about the edge."""
    import importlib.util
    import re

    from edge_agent.settings import EdgeSettings

    edge_default = EdgeSettings.model_fields["draft_length"].default
    demo_default = re.search(r"DRAFT_LENGTH=\$\{SPADE_DEMO_DRAFT_LENGTH:-(\w+)\}", (ROOT / "scripts" / "demo").read_text())
    assert demo_default is not None and demo_default.group(1) == edge_default == "auto"
    spec = importlib.util.spec_from_file_location("demo_request", ROOT / "scripts" / "demo_request.py")
    assert spec is not None and spec.loader is not None
    demo_request = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo_request", demo_request)  # its dataclasses look their module up
    spec.loader.exec_module(demo_request)
    health = {"draft_model": "qwen", "draft_backend": "llamacpp", "draft_length": edge_default, "overlap": True}
    assert demo_request.edge_description(health) == (
        "edge: draft qwen on llamacpp, draft length auto (chosen before each block), overlapped with verification"
    )
    without_keys = {key: value for key, value in health.items() if key != "draft_model"}  # what a keyless edge shows
    assert demo_request.edge_description(without_keys).startswith("edge: a local draft on llamacpp, draft length auto")


def test_the_demo_s_two_runs_never_share_a_prefix_cache(monkeypatch):
    """The target-alone run warms the verifier's prefix cache; SPADE's run must not find its
    prompt there (it once showed a 0.33 s first token against 2.56 s for that reason)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_request", ROOT / "scripts" / "demo_request.py")
    assert spec is not None and spec.loader is not None
    demo_request = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo_request", demo_request)
    spec.loader.exec_module(demo_request)
    salts = []

    def handler(request: httpx.Request) -> httpx.Response:
        salts.append(json.loads(request.content)["cache_salt"])
        events = 'data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    original = demo_request.OpenAI
    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(demo_request, "OpenAI", lambda **kwargs: original(**kwargs, http_client=httpx.Client(transport=transport)))
    for _ in range(2):
        demo_request.stream_chat("http://verifier/v1", "m", "the same prompt", 8, 0.0, echo=False)
    assert len(salts) == 2 and salts[0] != salts[1] and all(salts)


# Every flag the services take (docs/configuration.md): none lost when their settings came to
# share a base class, or when they were split into user-facing and advanced groups.
SERVICE_FLAGS = {
    "spade-verifier": (
        "model gguf-file served-model-name backend host port device dtype threads max-context-length max-draft-length "
        "max-draft-support fast-kernels cpu-kernel-isa batch-invariant max-batch-sessions batch-wait-ms max-kv-cache-bytes max-sessions "
        "max-session-tokens session-ttl-s vllm-block-size vllm-kv-cache-gib vllm-exact-route log-level"
    ),
    "spade-edge": (
        "draft-model gguf-file verifier-url host port device dtype threads draft-length overlap draft-backend "
        "max-draft-sessions verifier-api-key verifier-api-key-file trusted-hosts max-draft-length max-draft-support "
        "verify-timeout-s verify-retries fallback circuit-open-s startup-timeout-s log-level"
    ),
}
SHARED_FLAGS = (
    "api-key api-key-file allow-no-auth metrics-require-key max-request-bytes max-concurrent-requests max-tokens-cap "
    "default-max-tokens max-prompt-tokens shutdown-grace-s ssl-certfile ssl-keyfile"
)


def settings_parser(script: str):
    import argparse

    from edge_agent.settings import EdgeSettings
    from gateway.cli import add_settings_arguments
    from verifier_service.settings import VerifierSettings

    settings_class = VerifierSettings if script == "spade-verifier" else EdgeSettings
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, settings_class)
    return parser, settings_class


@pytest.mark.parametrize("script", sorted(SERVICE_FLAGS))
def test_every_documented_flag_is_accepted(script):
    parser, _ = settings_parser(script)
    missing = [flag for flag in (SERVICE_FLAGS[script] + " " + SHARED_FLAGS).split() if f"--{flag}" not in parser._option_string_actions]
    assert missing == []


def test_the_verifiers_draft_length_limit_has_one_spelling(capsys):
    """Unreleased, the project keeps no old spelling (docs/design.md, "The verify wire and its version"): the name the
    limit had before, --max-draft-tokens, is an unknown flag."""
    from gateway.cli import settings_from_arguments

    parser, settings_class = settings_parser("spade-verifier")
    assert settings_from_arguments(parser, parser.parse_args(["--max-draft-length", "3"]), settings_class).max_draft_length == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-draft-tokens", "3"])
    assert "unrecognized arguments: --max-draft-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("arguments", [["--batch-hold-rule", "fraction"], ["--batch-hold-fraction=0.25"], ["--batch-hold-rule"]])
def test_a_removed_flag_exits_naming_what_replaced_it(arguments, capsys):
    from gateway.cli import service_parser
    from verifier_service.settings import VerifierSettings

    parser = service_parser("spade-verifier", "", VerifierSettings)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--port", "9000", *arguments])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"{arguments[0].split('=')[0]} was removed: " in error and "--batch-hold-scale" in error
    assert "--batch-hold-rule" not in parser.format_help()  # hidden from --help


def test_a_removed_setting_in_the_environment_exits_naming_what_replaced_it(monkeypatch, capsys):
    from gateway.cli import service_parser, settings_from_arguments
    from verifier_service.settings import VerifierSettings

    parser = service_parser("spade-verifier", "", VerifierSettings)
    monkeypatch.setenv("SPADE_VERIFIER_BATCH_HOLD_FRACTION", "0.5")
    with pytest.raises(SystemExit):
        settings_from_arguments(parser, parser.parse_args([]), VerifierSettings)
    assert "SPADE_VERIFIER_BATCH_HOLD_FRACTION was removed: " in capsys.readouterr().err
    monkeypatch.delenv("SPADE_VERIFIER_BATCH_HOLD_FRACTION")
    assert settings_from_arguments(parser, parser.parse_args([]), VerifierSettings).batch_hold_scale == 1.0


def test_every_removed_setting_is_in_the_change_log():
    from edge_agent.settings import EdgeSettings
    from gateway.cli import flag_name, removed_settings
    from verifier_service.settings import VerifierSettings

    change_log = (ROOT / "CHANGELOG.md").read_text()
    for settings_class in (VerifierSettings, EdgeSettings):
        for name in removed_settings(settings_class):
            assert name not in settings_class.model_fields
            assert f"`{flag_name(name)}`" in change_log, name


@pytest.mark.parametrize("field", ["host", "port", "device", "dtype", "threads", "gguf_file"])
@pytest.mark.parametrize("prefix", ["SPADE_VERIFIER_", "SPADE_EDGE_"])
def test_the_shared_settings_keep_each_services_env_var(monkeypatch, field, prefix):
    from edge_agent.settings import EdgeSettings
    from verifier_service.settings import VerifierSettings

    value = {"host": "0.0.0.0", "port": "9123", "device": "cuda:1", "dtype": "bfloat16", "threads": "3", "gguf_file": "m.gguf"}[field]
    monkeypatch.setenv(prefix + field.upper(), value)
    settings = (VerifierSettings if prefix == "SPADE_VERIFIER_" else EdgeSettings)()
    assert str(getattr(settings, field)) == value


def test_each_service_keeps_its_own_port():
    from edge_agent.settings import EdgeSettings
    from verifier_service.settings import VerifierSettings

    assert (VerifierSettings().port, EdgeSettings().port) == (8001, 8000)


@pytest.mark.parametrize(
    "arguments,route",
    [
        ([], "verify-steps"),  # transformers: its only route
        (["--target-route", "verify-steps"], "verify-steps"),
        (["--backend", "vllm"], "native"),  # vLLM's own decode loop by default
        (["--backend", "vllm", "--target-route", "verify-steps"], "verify-steps"),
    ],
)
def test_the_target_only_route_is_native_by_default_on_vllm(arguments, route):
    import argparse

    from gateway.cli import add_settings_arguments, settings_from_arguments
    from verifier_service.settings import VerifierSettings

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, VerifierSettings)
    assert settings_from_arguments(parser, parser.parse_args(arguments), VerifierSettings).target_only_route() == route


def test_the_native_route_without_vllm_is_refused_with_the_reason(capsys):
    import argparse

    from gateway.cli import add_settings_arguments, settings_from_arguments
    from verifier_service.settings import VerifierSettings

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, VerifierSettings)
    with pytest.raises(SystemExit) as exited:
        settings_from_arguments(parser, parser.parse_args(["--target-route", "native"]), VerifierSettings)
    assert exited.value.code == 2
    assert "--target-route: Value error, native is vLLM's own decode loop: it needs --backend vllm" in capsys.readouterr().err
