"""``spade-bench --quick`` end to end on the tiny pair: real services as pinned subprocesses, the
delay proxy, the openai client. Checks the output files and the invariants of their numbers;
never a timing (this machine's speed is not under test here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

XDIST_HEAVY = True
"""The quick benchmark run takes about a minute: queued first (conftest.py)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("verifier_service.cli") is None or importlib.util.find_spec("edge_agent.cli") is None,
        reason="needs the spade-verifier and spade-edge services",
    ),
]

SPEC_ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a short note about the edge.", "Now make it shorter."]},
    {"question_id": 2, "category": "translation", "turns": ["Translate to French: the cloud verifies the block."]},
    {"question_id": 3, "category": "translation", "turns": ["Not selected: --quick keeps one item per category."]},
]
CNNDM_ROWS = [
    {
        "id": "a1",
        "article": "The edge drafts a block of tokens and the cloud verifies the whole block in one pass. "
        "Speculative decoding keeps the output distribution of the target model exactly.",
        "highlights": "The edge drafts tokens . The cloud verifies them in one pass .",
    },
]
LABELS = {"target", "spade-k3", "spade-auto", "draft"}
PHASES = 2 + 2 * 2 + 1  # target at 2 RTTs, 2 draft lengths at 2 RTTs, draft-only once
TURNS = 2 + 1 + 1  # writing (2 turns), translation, cnndm


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-quick")
    spec = _write_jsonl(root / "spec.jsonl", SPEC_ROWS)
    cnndm = _write_jsonl(root / "cnndm.jsonl", CNNDM_ROWS)
    output = root / "out"
    command = [
        sys.executable,
        "-m",
        "spade_bench.cli",
        "--quick",
        "--data",
        str(spec),
        "--data",
        str(cnndm),
        "--output",
        str(output),
        "--no-progress",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((output / "results.json").read_text())
    return output, completed.stdout, results


def test_writes_every_output_file(quick_run):
    output, stdout, _ = quick_run
    for name in ("results.json", "requests.jsonl", "summary.md"):
        assert (output / name).is_file(), name
    for name in ("tokens_per_s_vs_rtt.png", "passes_vs_draft_length.png", "accepted_per_category.png", "verifier_cpu_per_token.png"):
        assert (output / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "| mode | RTT ms |" in stdout
    assert (output / "summary.md").read_text() in stdout


def test_one_record_per_phase_and_turn(quick_run):
    output, _, results = quick_run
    requests = results["requests"]
    assert len(requests) == PHASES * TURNS
    assert len((output / "requests.jsonl").read_text().splitlines()) == len(requests)
    assert {record["label"] for record in requests} == LABELS
    assert {record["rtt_ms"] for record in requests} == {0.0, 50.0, None}
    assert sorted(record["turn"] for record in requests if record["item_id"] == "1") == [1] * PHASES + [2] * PHASES


def test_request_invariants(quick_run):
    for record in quick_run[2]["requests"]:
        assert 1 <= record["completion_tokens"] <= 24
        assert record["wall_s"] > 0
        assert record["ttft_s"] is None or 0 < record["ttft_s"] <= record["wall_s"]
        if record["mode"] == "draft":
            assert (record["bytes_up"], record["bytes_down"]) == (0, 0)  # the edge alone: no link
            assert record["verifier_cpu_s"] is None and record["edge_cpu_s"] >= 0
            continue
        assert record["bytes_up"] > 0 and record["bytes_down"] > 0
        assert record["verifier_cpu_s"] >= 0
        if record["mode"] == "target":
            assert record["drafted_tokens"] == record["accepted_tokens"] == 0
            assert record["target_passes"] >= record["completion_tokens"]
        else:
            assert 0 <= record["accepted_tokens"] <= record["drafted_tokens"]
            assert 1 <= record["target_passes"] == record["verify_calls"]
            assert record["target_passes"] <= record["completion_tokens"] + 1
            assert record["edge_cpu_s"] >= 0


def test_greedy_spade_outputs_equal_target_only(quick_run):
    spade = [record for record in quick_run[2]["requests"] if record["mode"] == "spade"]
    assert spade and all(record["identical_to_target"] is True for record in spade)


def test_rouge_only_on_cnndm(quick_run):
    for record in quick_run[2]["requests"]:
        scores = [record["rouge1"], record["rouge2"], record["rougeL"]]
        if record["dataset"] == "cnndm":
            assert all(0.0 <= score <= 1.0 for score in scores)
        else:
            assert scores == [None, None, None]


def test_summaries_agree_with_the_records(quick_run):
    results = quick_run[2]
    pooled = {summary["label"]: summary for summary in results["summaries"]["pooled"]}
    assert set(pooled) == LABELS
    for label, summary in pooled.items():
        records = [record for record in results["requests"] if record["label"] == label]
        assert summary["num_requests"] == len(records)
        assert summary["completion_tokens"] == sum(record["completion_tokens"] for record in records)
    assert pooled["target"]["mean_accepted_tokens"] == pytest.approx(
        pooled["target"]["completion_tokens"] / pooled["target"]["verify_calls"]
    )
    assert pooled["spade-k3"]["passes_per_token"] < pooled["target"]["passes_per_token"]


def test_records_the_placement(quick_run):
    placement = quick_run[2]["run"]["placement"]
    observed = placement["observed_affinity"]
    assert observed["verifier-target"] == placement["verifier_cores"]
    assert observed["edge-spade-k3"] == observed["verifier-draft"] == placement["edge_cores"]
    assert placement["threads_per_service"] == 1
