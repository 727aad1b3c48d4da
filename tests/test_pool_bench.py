"""``spade_bench.pool.bench`` end to end on the tiny pair: two verifier replicas behind the
shipped nginx config, one edge, both scenarios under both routings. Routed by prefix, a chat's
second turn and the later users of a system prompt reach the replica that cached their prefix;
routed by session they reach it only by chance, so never more often."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from deploy_support import nginx_binary
from spade_bench.pool.bench import main

SCENARIOS = ["multi-turn: turn 1", "multi-turn: turn 2", "system prompt: user 1", "system prompt: users 2+"]


def spec_bench_rows() -> list[dict]:
    """Three two-turn rows (conversations), notes for the system prompts, and short questions."""
    conversations = [
        {"question_id": n, "category": "writing", "turns": [f"Conversation {n}: write a note about apples and pears.", "Now shorter."]}
        for n in range(3)
    ]
    notes = [
        {"question_id": 10 + n, "category": "qa", "turns": [f"Note {n}: the edge drafts tokens and the cloud verifies them. " * 3]}
        for n in range(6)
    ]
    questions = [{"question_id": 20 + n, "category": "qa", "turns": [f"Why {n}?"]} for n in range(6)]
    return conversations + notes + questions


@pytest.fixture(scope="module")
def bench(tiny_pair, tmp_path_factory) -> tuple[dict, str]:
    nginx_binary()  # skips where nginx is missing
    directory = tmp_path_factory.mktemp("pool-bench")
    data, output = directory / "questions.jsonl", directory / "pool.json"
    data.write_text("".join(json.dumps(row) + "\n" for row in spec_bench_rows()))
    argv = ["--data", str(data), "--draft", str(tiny_pair.draft_dir), "--target", str(tiny_pair.target_dir), "--output", str(output)]
    argv += ["--conversations", "3", "--system-prompts", "2", "--users", "3", "--system-chars", "300", "--max-tokens", "8"]
    argv += ["--log-dir", str(directory / "logs")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return json.loads(output.read_text()), printed.getvalue()


def by_routing(results: dict, routing: str) -> dict[str, dict]:
    return {row["scenario"]: row for row in results["results"] if row["routing"] == routing}


def test_both_routings_run_every_phase_and_every_request_reaches_a_replica(bench):
    results, _ = bench
    for routing in ("prefix", "session"):
        rows = by_routing(results, routing)
        assert list(rows) == SCENARIOS
        assert [rows[s]["num_requests"] for s in SCENARIOS] == [3, 3, 2, 4]
        assert all(sum(row["requests_per_replica"].values()) == row["num_requests"] for row in rows.values())
        assert rows["system prompt: user 1"]["hit_tokens"] == 0  # each system prompt opens with its own notes


def test_routing_by_prefix_finds_the_cached_prefix_at_least_as_often_as_by_session(bench):
    results, _ = bench
    prefix, session = by_routing(results, "prefix"), by_routing(results, "session")
    for scenario in ("multi-turn: turn 2", "system prompt: users 2+"):
        assert prefix[scenario]["hit_rate"] > 0
        assert prefix[scenario]["hit_rate"] >= session[scenario]["hit_rate"]
        assert prefix[scenario]["prompt_tokens"] == session[scenario]["prompt_tokens"]  # greedy: the same prompts


def test_the_table_prints_one_row_per_routing_and_phase(bench):
    _, printed = bench
    lines = printed.strip().splitlines()
    assert lines[0].startswith("| routing | scenario | requests | prompt tokens | hit tokens | hit rate |")
    assert len(lines) == 2 + 8
    assert lines[3].startswith("| prefix | multi-turn: turn 2 | 3 |")
