"""scripts/gpu_check, the prepared check for a lent GPU machine, run end to end here on the CPU
with a tiny model: it builds the model and its tokenizer, times forwards per row count, starts
the verifier, generates synthetic sessions and runs the capacity levels and the prefill
scenario, writing its results where it is told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spade_bench.gpu_check import build_tokenizer, synthetic_proposals

ROOT = Path(__file__).resolve().parents[1]


def test_the_tokenizer_has_one_id_per_model_row_and_encodes_the_prompt_words():
    tokenizer = build_tokenizer(40)
    assert len(tokenizer) == 40
    assert tokenizer.encode("w7 w39 w6", add_special_tokens=False) == [7, 39, 6]
    assert tokenizer.decode([7, 39]) == "w7 w39"


def test_synthetic_proposals_agree_with_the_target_at_the_chosen_rate():
    import random

    target = list(range(1000))
    proposals = synthetic_proposals(target, 0.7, 5000, random.Random(0))
    agreeing = sum(p == t for p, t in zip(proposals, target, strict=True))
    assert 650 < agreeing < 750
    assert all(0 <= p < 5000 for p in proposals)


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_a_cpu_with_a_tiny_model(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    command = [
        str(ROOT / "scripts" / "gpu_check"),
        "--device",
        "cpu",
        "--tiny",
        "--users",
        "1,2",
        "--max-tokens",
        "12",
        "--output",
        str(tmp_path),
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert sorted(int(rows) for rows in report["forward_ms"]) == [1, 2, 4, 8]
    ragged = {(cost["mode"], cost["rows"], cost["sessions"]) for cost in report["ragged_ms"]}
    assert ragged == {(m, r, s) for m in ("fast", "packed") for r in (1, 2, 4, 8) for s in (1, 4)}
    assert all(cost["ms"] > 0 for cost in report["ragged_ms"])
    rows = {(row["mode"], row["num_users"]): row for row in report["rows"]}
    # @ahead: a verifier stepping ahead beside; spade+pipe: edges on the pipelined-session wire
    modes = ("target", "spade+advice", "spade+continue", "spade+continue@ahead", "spade+pipe")
    assert set(rows) == {(mode, n) for mode in modes for n in (1, 2)}
    assert all(rows["spade+pipe", n]["proposal_share"] is not None for n in (1, 2))
    assert all(row["num_mismatches"] == 0 for row in report["rows"])
    assert all(row["tokens"] == 12 * row["num_users"] for row in report["rows"])
    assert report["prefill_interference"]["num_mismatches"] == 0
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| rows | float32 ms | × one row |" in markdown
    assert "| rows | fast, 1 sess. ms | fast, 4 sess. ms | packed, 1 sess. ms |" in markdown


def test_the_capacity_modes_and_the_pipelined_edges_reach_the_check_config():
    from spade_bench.gpu_check import parse_args

    config = parse_args(["--modes", "target,spade+pipe", "--pipe-lead-tokens", "4", "--pipe-proposal-every", "2"])
    assert (config.modes, config.pipe_lead_tokens, config.pipe_proposal_every) == (("target", "spade+pipe"), 4, 2)
    assert parse_args([]).modes == ("target", "spade+advice", "spade+continue", "spade+pipe")
    with pytest.raises(SystemExit, match="spade\\+fast"):
        parse_args(["--modes", "target,spade+fast"])


def test_the_host_bound_shape_and_the_verifier_cores_reach_the_check_config():
    from spade_bench.gpu_check import HOST_BOUND_SHAPE, parse_args, verifier_spec

    config = parse_args(
        [
            "--device",
            "cpu",
            "--shape",
            "host-bound",
            "--verifier-cores",
            "0",
            "--sessions",
            "4",
            "--draft-ms",
            "2",
            "--parts",
            "capacity",
            "--output",
            "/tmp/x",
        ]
    )
    assert config.shape == HOST_BOUND_SHAPE and config.num_sessions == 4 and config.verifier_cores == (0,)
    assert config.draft_ms == 2.0 and config.parts == ("capacity",)
    with pytest.raises(SystemExit, match="forwards"):
        parse_args(["--parts", "forwards", "--output", "/tmp/x"])
    spec = verifier_spec(config, Path("/tmp/model"))
    assert spec.cores == (0,) and spec.threads == 1
    assert parse_args(["--tiny", "--output", "/tmp/x"]).shape["hidden_size"] == 64
    assert parse_args(["--output", "/tmp/x"]).shape["hidden_size"] == 1536


def test_on_vllm_the_check_runs_the_capacity_part_without_continuation_and_the_stepping_verifier(tmp_path):
    from spade_bench.gpu_check import parse_args

    config = parse_args(["--backend", "vllm", "--tiny", "--output", str(tmp_path)])
    assert (config.backend, config.parts, config.step_ahead_tokens) == ("vllm", ("capacity",), 0)
    assert config.modes == ("target", "spade+advice", "spade+pipe")
    assert config.shape["hidden_size"] // config.shape["num_attention_heads"] == 32  # vLLM's CPU attention's smallest head
    with pytest.raises(SystemExit):
        parse_args(["--backend", "vllm", "--parts", "forward,ragged"])


def test_on_vllm_without_vllm_the_check_says_so_and_runs_nothing(tmp_path):
    """Where vLLM does not import (this suite's environment, the lent GPU machines), the check
    stops first with status 2 and says why."""
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.fail("this suite's environment has vLLM: the check below needs one without it")
    completed = subprocess.run(
        [sys.executable, "-m", "spade_bench.gpu_check", "--backend", "vllm", "--device", "cpu", "--tiny", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "vLLM does not import" in completed.stderr and not any(tmp_path.iterdir())
