"""Aggregation maths of the benchmark on synthetic request records: exact values, no servers."""

from __future__ import annotations

import json

import pytest

from spade_bench.client import StreamResult
from spade_bench.data import BenchItem
from spade_bench.metrics import annotate_identical, annotate_rouge, find, speedup, summarize, summarize_group
from spade_bench.plots import PLOT_FILES, write_plots
from spade_bench.proxy import LinkCounters
from spade_bench.records import EdgeVariant, Phase, RequestRecord
from spade_bench.report import (
    Summaries,
    edge_cost_table,
    goals,
    load_records,
    main_table,
    markdown_report,
    time_split_table,
    write_results,
)
from spade_bench.runner import Snapshot, build_record, share_batch


def record(phase: Phase, item_id: str = "1", tokens: int = 10, wall_s: float = 1.0, **fields) -> RequestRecord:
    values = dict(
        dataset="spec_bench",
        item_id=item_id,
        category="qa",
        turn=1,
        mode=phase.mode,
        label=phase.label,
        draft_length=phase.draft_length,
        rtt_ms=phase.rtt_ms,
        text=f"answer {item_id}",
        finish_reason="length",
        prompt_tokens=5,
        completion_tokens=tokens,
        wall_s=wall_s,
        ttft_s=0.1,
    )
    return RequestRecord(**(values | fields))


TARGET_0 = Phase("target", None, 0.0)
TARGET_50 = Phase("target", None, 50.0)
SPADE_0 = Phase("spade", "4", 0.0)
SPADE_50 = Phase("spade", "4", 50.0)
DRAFT = Phase("draft")


def target_record(phase=TARGET_0, item_id="1", tokens=10, wall_s=1.0, **fields):
    costs = dict(
        verify_calls=tokens,
        drafted_tokens=0,
        accepted_tokens=0,
        target_tokens=tokens + 5,
        target_passes=tokens,
        verifier_cpu_s=tokens * 0.5,
        bytes_up=100,
        bytes_down=1000,
    )
    return record(phase, item_id, tokens, wall_s, **(costs | fields))


def spade_record(phase=SPADE_0, item_id="1", tokens=10, wall_s=1.0, **fields):
    costs = dict(
        verify_calls=2,
        drafted_tokens=8,
        accepted_tokens=8,
        target_tokens=15,
        target_passes=2,
        verifier_cpu_s=1.0,
        edge_cpu_s=2.0,
        bytes_up=400,
        bytes_down=300,
    )
    return record(phase, item_id, tokens, wall_s, **(costs | fields))


def test_phase_labels():
    assert [TARGET_0.label, SPADE_0.label, Phase("spade", "auto", 0.0).label, DRAFT.label] == ["target", "spade-k4", "spade-auto", "draft"]


def test_edge_variants_name_what_differs_from_the_edges_defaults():
    variants = [
        EdgeVariant(),
        EdgeVariant(overlap=False),
        EdgeVariant("transformers"),
        EdgeVariant("llamacpp", overlap=False),
        EdgeVariant(edge_power="saver"),
    ]
    assert [Phase("spade", "8", 0.0, variant).label for variant in variants] == [
        "spade-k8",
        "spade-k8-in-turn",
        "spade-k8-transformers",
        "spade-k8-llamacpp-in-turn",
        "spade-k8-saver",
    ]
    assert EdgeVariant("llamacpp", overlap=False).edge_args == (
        "--draft-backend",
        "llamacpp",
        "--overlap",
        "false",
        "--edge-power",
        "performance",
    )


def test_the_edges_drafts_per_token_are_split_by_what_became_of_them():
    records = [
        spade_record(tokens=10, used_draft_tokens=8, rejected_draft_tokens=2, discarded_ahead_tokens=5, draft_ms=500.0, wall_s=2.0),
        spade_record(item_id="2", tokens=30, used_draft_tokens=20, rejected_draft_tokens=6, discarded_ahead_tokens=3, draft_ms=0.0),
    ]
    summary = summarize_group(records)
    assert (summary.used_drafts_per_token, summary.rejected_drafts_per_token, summary.discarded_ahead_per_token) == (
        pytest.approx(28 / 40),
        pytest.approx(8 / 40),
        pytest.approx(8 / 40),
    )
    assert summary.edge_wait_share == pytest.approx(0.5 / 3.0)
    assert summary.aggregate_tokens_per_s == pytest.approx(40 / 3.0)  # one at a time: the requests' own walls
    table = edge_cost_table(Summaries.of(records))
    assert "| spade-k4 | 0 | 1 | 13.33 | 13.33 | 0.100 | 1.10 | 0.70 | 0.20 | 0.20 | 17 % |" in table


def test_requests_at_once_share_the_batchs_cpu_and_wall_by_tokens():
    phase = SPADE_0
    before = Snapshot(verifier_cpu_s=10.0, edge_cpu_s=5.0, link=LinkCounters(1000, 2000))
    after = Snapshot(verifier_cpu_s=14.0, edge_cpu_s=7.0, link=LinkCounters(1400, 2800))
    records = [spade_record(item_id="1", tokens=10, wall_s=4.0), spade_record(item_id="2", tokens=30, wall_s=3.0)]
    shared = share_batch(records, before, after, batch_wall_s=4.0)
    assert [(r.verifier_cpu_s, r.edge_cpu_s, r.bytes_up, r.bytes_down) for r in shared] == [(1.0, 0.5, 100, 200), (3.0, 1.5, 300, 600)]
    assert [r.concurrency for r in shared] == [2, 2]
    summary = summarize_group(shared)
    assert summary.aggregate_tokens_per_s == pytest.approx(40 / 4.0)  # the batch's wall, once
    assert summary.tokens_per_s == pytest.approx(40 / 7.0)  # each request's own wait
    assert summary.concurrency == 2 and phase.label == "spade-k4"


def test_rates_are_ratios_of_sums():
    summary = summarize_group([target_record(tokens=10, wall_s=1.0), target_record(item_id="2", tokens=90, wall_s=3.0)])
    assert summary.tokens_per_s == pytest.approx(25.0)  # 100 tokens / 4 s, not the mean of 10 and 30
    assert summary.passes_per_token == pytest.approx(1.0)
    assert summary.passes_per_sequence == pytest.approx(50.0)
    assert summary.mean_accepted_tokens == pytest.approx(1.0)  # plain decoding: one token per call
    assert summary.verifier_cpu_per_token == pytest.approx(0.5)
    assert summary.acceptance_rate is None  # nothing drafted
    assert summary.target_tokens_per_token == pytest.approx(110 / 100)
    assert summary.bytes_up_per_request == 100 and summary.bytes_down_per_request == 1000


def test_spade_counts():
    summary = summarize_group(
        [spade_record(), spade_record(item_id="2", tokens=6, verify_calls=3, target_passes=3, drafted_tokens=12, accepted_tokens=3)]
    )
    assert summary.target_passes == 5
    assert summary.passes_per_token == pytest.approx(5 / 16)
    assert summary.mean_accepted_tokens == pytest.approx(16 / 5)
    assert summary.acceptance_rate == pytest.approx(11 / 20)
    assert summary.edge_cpu_per_token == pytest.approx(4.0 / 16)


def test_a_missing_measurement_makes_the_rate_unknown_not_smaller():
    summary = summarize_group([spade_record(), spade_record(item_id="2", verifier_cpu_s=None)])
    assert summary.verifier_cpu_per_token is None
    assert summary.passes_per_token == pytest.approx(4 / 20)


def test_draft_only_has_no_target_cost():
    summary = summarize_group([record(DRAFT, edge_cpu_s=1.0)])
    assert summary.passes_per_token is None and summary.mean_accepted_tokens is None
    assert summary.edge_cpu_per_token == pytest.approx(0.1)


def test_empty_group_is_refused():
    with pytest.raises(ValueError):
        summarize_group([])


def test_groupings_and_speedup():
    records = [
        target_record(TARGET_0, wall_s=2.0),
        target_record(TARGET_50, wall_s=4.0),
        spade_record(SPADE_0, wall_s=1.0),
        spade_record(SPADE_50, wall_s=5.0),
        spade_record(SPADE_0, item_id="2", category="math", wall_s=1.0),
    ]
    by_rtt = summarize(records)
    assert [(s.label, s.rtt_ms, s.num_requests) for s in by_rtt] == [
        ("target", 0.0, 1),
        ("target", 50.0, 1),
        ("spade-k4", 0.0, 2),
        ("spade-k4", 50.0, 1),
    ]
    assert speedup(by_rtt, find(by_rtt, "spade-k4", 0.0)) == pytest.approx((20 / 2) / (10 / 2))
    assert speedup(by_rtt, find(by_rtt, "spade-k4", 50.0)) == pytest.approx((10 / 5) / (10 / 4))
    pooled = summarize(records, by_rtt=False)
    assert [(s.label, s.rtt_ms, s.num_requests) for s in pooled] == [("target", None, 2), ("spade-k4", None, 3)]
    by_category = summarize(records, by_rtt=False, by_category=True)
    assert {(s.label, s.category): s.num_requests for s in by_category} == {
        ("target", "qa"): 2,
        ("spade-k4", "qa"): 2,
        ("spade-k4", "math"): 1,
    }


def test_identical_to_target_compares_the_same_prompt():
    records = [
        target_record(TARGET_0, item_id="1", text="A"),
        target_record(TARGET_50, item_id="1", text="A"),
        spade_record(SPADE_0, item_id="1", text="A"),
        spade_record(SPADE_50, item_id="1", text="A!"),
        spade_record(SPADE_0, item_id="9", text="no target ran this prompt"),
    ]
    annotate_identical(records)
    assert [r.identical_to_target for r in records] == [True, True, True, False, None]
    assert find(summarize(records), "spade-k4", 0.0).identical_share == pytest.approx(1.0)


def test_rouge_scores_against_the_reference():
    exact = record(TARGET_0, dataset="cnndm", item_id="a", text="the cat sat on the mat")
    other = record(DRAFT, dataset="cnndm", item_id="a", text="dogs bark")
    unscored = record(TARGET_0, item_id="q")
    annotate_rouge([exact, other, unscored], {("cnndm", "a"): "The cat sat on the mat ."})
    assert (exact.rouge1, exact.rouge2, exact.rougeL) == (pytest.approx(1.0),) * 3
    assert other.rouge1 == 0.0
    assert unscored.rouge1 is None


def test_build_record_prefers_the_verifiers_counters():
    item = BenchItem("spec_bench", "7", "qa", ("q",))
    result = StreamResult(
        "out", "length", 4, 10, 2.0, 0.5, {"verify_calls": 3, "drafted_tokens": 12, "accepted_tokens": 7, "target_tokens": 16}, 5
    )
    before = Snapshot(
        {"spade_verifier_forward_passes_total": 10.0, "spade_verifier_target_tokens_total": 100.0},
        verifier_cpu_s=1.0,
        edge_cpu_s=5.0,
        link=LinkCounters(10, 20, 1),
    )
    after = Snapshot(
        {"spade_verifier_forward_passes_total": 13.0, "spade_verifier_target_tokens_total": 116.0},
        verifier_cpu_s=1.25,
        edge_cpu_s=6.0,
        link=LinkCounters(110, 70, 1),
    )
    built = build_record(item, 1, SPADE_0, result, before, after)
    assert (built.target_passes, built.target_tokens, built.verify_calls) == (3, 16, 3)
    assert (built.verifier_cpu_s, built.edge_cpu_s) == (pytest.approx(0.25), pytest.approx(1.0))
    assert (built.bytes_up, built.bytes_down) == (100, 50)
    assert built.accepted_tokens == 7 and built.label == "spade-k4"


def test_build_record_falls_back_to_the_response_when_the_counter_did_not_move():
    item = BenchItem("spec_bench", "7", "qa", ("q",))
    result = StreamResult("out", "length", 4, 10, 2.0, 0.5, {"verify_calls": 10, "target_tokens": 14}, 10)
    same = Snapshot({"spade_verifier_forward_passes_total": 3.0})
    built = build_record(item, 1, TARGET_0, result, same, same)
    assert (built.target_passes, built.target_tokens) == (10, 14)


def test_tables_goals_and_json(tmp_path):
    records = [target_record(TARGET_0, wall_s=2.0), spade_record(SPADE_0, wall_s=1.0), record(DRAFT, edge_cpu_s=1.0)]
    annotate_identical(records)
    summaries = Summaries.of(records)
    table = main_table(summaries)
    assert table.splitlines()[0].startswith("| mode | RTT ms |")
    assert "| spade-k4 | 0 | 1 | 10 | 10.00 | 2.00× |" in table
    assert "| draft | local |" in table
    lines = goals(summaries, is_greedy=True)
    assert "target passes 80.0 % fewer than target-only" in lines[0] and lines[0].endswith(": met")
    assert "verifier CPU s/token 20.0 % of target-only" in lines[1]
    assert "identical to target-only 100.0 %" in lines[2]
    assert "0 ms: 2.00×" in lines[3] and lines[3].endswith(": met")
    markdown = markdown_report(summaries, True, {"edge_cores": [0]})
    assert "| spec_bench | 133.25 | 30.16 | 10.00 | 2.00 | spade-k4 |" in markdown
    write_results(tmp_path / "results.json", records, summaries, {"config": {}})
    reloaded = load_records(tmp_path / "results.json")
    assert [r.to_dict() for r in reloaded] == [r.to_dict() for r in records]
    assert json.loads((tmp_path / "results.json").read_text())["summaries"]["pooled"][0]["label"] == "target"


def test_plots_are_written(tmp_path):
    records = [
        target_record(TARGET_0),
        target_record(TARGET_50),
        spade_record(SPADE_0),
        spade_record(SPADE_50),
        spade_record(Phase("spade", "auto", 0.0)),
        record(DRAFT, edge_cpu_s=1.0),
    ]
    paths = write_plots(Summaries.of(records), tmp_path)
    assert [path.name for path in paths] == list(PLOT_FILES)
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in paths)


def test_time_split_adds_up_to_the_wall():
    records = [
        spade_record(tokens=10, wall_s=1.0, draft_ms=500.0, verify_ms=400.0, verifier_forward_ms=300.0),
        target_record(draft_ms=0.0, verify_ms=0.0, verifier_forward_ms=900.0),
    ]
    summary = find(summarize(records), "spade-k4", 0.0)
    assert (summary.draft_s_per_token, summary.verify_s_per_token, summary.forward_s_per_token) == (
        pytest.approx(0.05),
        pytest.approx(0.04),
        pytest.approx(0.03),
    )
    (row,) = time_split_table(Summaries.of(records)).splitlines()[2:]
    assert row == "| spade-k4 | 0 | 0.100 | 0.050 | 0.040 | 0.030 | 0.010 | 0.010 | – | – |"


def test_drafting_during_verify_calls_is_listed_apart_with_the_overlap_hit_rate():
    records = [
        spade_record(
            tokens=10,
            wall_s=1.0,
            draft_ms=100.0,
            draft_ahead_ms=300.0,
            overlap_hits=3,
            overlap_misses=1,
            verify_ms=800.0,
            verifier_forward_ms=700.0,
        )
    ]
    (row,) = time_split_table(Summaries.of(records)).splitlines()[2:]
    assert row == "| spade-k4 | 0 | 0.100 | 0.010 | 0.080 | 0.070 | 0.010 | 0.010 | 0.030 | 75 % |"


def test_cpu_bound_rate_takes_drafting_during_verify_calls_off_the_edges_cpu():
    # 2 s of edge CPU, of which 1.5 s drafted while verify calls were in flight: 1 + 0.5 + 2 x 0.05.
    spade = spade_record(SPADE_50, tokens=10, verifier_cpu_s=1.0, edge_cpu_s=2.0, verify_calls=2, draft_ahead_ms=1500.0)
    assert find(summarize([spade]), "spade-k4", 50.0).cpu_bound_tokens_per_s == pytest.approx(10 / 1.6)


def test_cpu_bound_rate_adds_the_link_waits_to_the_cpu_seconds():
    target = target_record(TARGET_50, tokens=10, verifier_cpu_s=5.0)  # one stream: one RTT
    spade = spade_record(SPADE_50, tokens=10, verifier_cpu_s=1.0, edge_cpu_s=2.0, verify_calls=2)
    summaries = summarize([target, spade])
    assert find(summaries, "target", 50.0).cpu_bound_tokens_per_s == pytest.approx(10 / 5.05)
    assert find(summaries, "spade-k4", 50.0).cpu_bound_tokens_per_s == pytest.approx(10 / 3.1)
    assert summarize_group([record(DRAFT, edge_cpu_s=2.0)]).cpu_bound_tokens_per_s == pytest.approx(5.0)
    assert summarize_group([record(DRAFT)]).cpu_bound_tokens_per_s is None
