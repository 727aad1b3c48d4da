"""The references rendered from the code stay true: docs/configuration.md and docs/metrics.md are
what ``scripts/reference_docs.py`` renders now, they cover every setting, metric and ``spade``
stats field, and ``--help`` groups the flags as the reference does (user-facing, then advanced).
No model is loaded: the registries are built directly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from gateway.cli import ADVANCED_TITLE, FIELD_MARKERS, field_markers, flag_name, is_advanced, service_parser
from gateway.protocol import SpadeStats
from gateway.reference_docs import configuration_page, metrics_page, stale_references, write_references
from verifier_service.metrics import VerifierMetrics
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"spade-verifier": VerifierSettings, "spade-edge": EdgeSettings}
METRICS = {"spade-verifier": VerifierMetrics, "spade-edge": EdgeMetrics}


def load_script():
    spec = importlib.util.spec_from_file_location("reference_docs_script", ROOT / "scripts" / "reference_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.mark.parametrize("name", ["configuration.md", "metrics.md"])
def test_the_generated_reference_is_up_to_date(script, name):
    path = ROOT / "docs" / name
    assert path.read_text() == script.references()[path], f"docs/{name} is out of date with the code: run `{script.COMMAND}`"


def test_check_names_the_stale_file_and_the_command(script, tmp_path):
    """--check's verdict and message, on a copy of the references with one file edited by hand."""
    rendered = script.references(tmp_path)
    assert sorted(write_references(rendered)) == sorted(rendered)  # missing files are stale
    assert stale_references(rendered) == []
    edited = tmp_path / "docs" / "metrics.md"
    edited.write_text(edited.read_text().replace("Verify calls answered", "Verify calls"))
    assert stale_references(rendered) == [edited]
    assert script.stale_message([edited], tmp_path) == (
        "out of date with the code: docs/metrics.md; regenerate with `.venv/bin/python scripts/reference_docs.py`"
    )
    assert write_references(rendered) == [edited]
    assert stale_references(rendered) == []


def test_the_command_checks_the_tree_without_importing_torch():
    code = (
        "import runpy, sys\nsys.argv = ['reference_docs', '--check']\n"
        "try:\n    runpy.run_path('scripts/reference_docs.py', run_name='__main__')\n"
        "except SystemExit as exit:\n    print('EXIT', exit.code)\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[:2] == ["EXIT 0", "HEAVY []"], result.stderr


@pytest.mark.parametrize("prog", sorted(SETTINGS))
def test_every_setting_is_documented_with_its_env_var(prog):
    settings_class = SETTINGS[prog]
    page = configuration_page([(prog, settings_class)], "cmd")
    prefix = settings_class.model_config["env_prefix"]
    for name, field in settings_class.model_fields.items():
        assert field.description, f"{name}: a setting without a description"
        assert f"| `{flag_name(name)}` | `{prefix}{name.upper()}` |" in page, name


@pytest.mark.parametrize("prog", sorted(SETTINGS))
def test_the_markers_are_known_and_advanced_flags_come_second(prog):
    """A misspelt marker ("advance") would silently list a tuning flag among the user-facing ones."""
    settings_class = SETTINGS[prog]
    for name, field in settings_class.model_fields.items():
        assert set(field_markers(field)) <= FIELD_MARKERS, name
    page = configuration_page([(prog, settings_class)], "cmd")
    advanced_at = page.index("### Advanced options")
    for name, field in settings_class.model_fields.items():
        row_at = page.index(f"| `{flag_name(name)}` |")
        assert (row_at > advanced_at) == is_advanced(field), name


@pytest.mark.parametrize(
    ("prog", "user_facing"),
    [
        (
            "spade-verifier",
            "model served-model-name backend max-context-length max-sessions max-kv-cache-bytes host port device dtype threads "
            "api-key api-key-file max-concurrent-requests log-level",
        ),
        (
            "spade-edge",
            "draft-model verifier-url draft-length edge-power fallback verifier-api-key verifier-api-key-file host port device dtype "
            "threads api-key api-key-file max-concurrent-requests log-level",
        ),
    ],
)
def test_help_lists_the_user_facing_flags_before_the_advanced_group(prog, user_facing):
    lines = service_parser(prog, "", SETTINGS[prog]).format_help().splitlines()
    advanced_at = lines.index(f"{ADVANCED_TITLE}:")
    flags = [(at, line.split()[0]) for at, line in enumerate(lines) if line.startswith("  --")]
    listed_before = [flag for at, flag in flags if at < advanced_at]
    assert listed_before == ["--version"] + [f"--{flag}" for flag in user_facing.split()]
    assert len(flags) - len(listed_before) > len(listed_before)  # most flags are tuning


@pytest.mark.parametrize("prog", sorted(METRICS))
def test_every_metric_is_documented_as_exposed(prog):
    metrics = METRICS[prog]()
    page = metrics_page([(prog, metrics)], SpadeStats, "cmd")
    for wrapper in vars(metrics).values():
        if isinstance(wrapper, MetricWrapperBase):
            assert f"`{wrapper._name}" in page, wrapper._name
    # Every series the fresh registry exposes, under the exact name prometheus-client gives it.
    exposed = {line.split()[2] for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith("# TYPE")}
    samples = {line.split("{")[0].split()[0] for line in generate_latest(metrics.registry).decode().splitlines() if line[:1] != "#"}
    assert exposed and samples
    for name in samples:
        assert name.endswith("_created") or f"`{name}`" in page, name


def test_a_labelled_metric_lists_its_labels():
    page = metrics_page([("spade-verifier", VerifierMetrics())], SpadeStats, "cmd")
    row = next(line for line in page.splitlines() if "`spade_verifier_forward_seconds_by_block_bucket`" in line)
    assert "| histogram | `num_drafted` |" in row


def test_every_spade_stats_field_is_documented():
    page = metrics_page([], SpadeStats, "cmd")
    for name, field in SpadeStats.model_fields.items():
        assert field.description, f"spade.{name}: a field without a docstring"
        assert f"| `{name}` |" in page, name
    assert "| `advised_draft_length` | `int \\| None` |" in page  # a pipe inside a table cell is escaped
