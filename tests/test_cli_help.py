"""Every console script answers --help on a plain install (no extras), and a command that needs
an extra names it instead of ending in a traceback.

"Plain install" is emulated in a subprocess: a sitecustomize hides the bench extra's modules
from every import finder, so ``import matplotlib`` fails exactly as it does where the package
is not installed. The scripts run as installed (the console-script entry points of this venv).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

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
    assert [spec.split(">")[0] for spec in EXTRAS["vllm"]] == ["vllm"]


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
