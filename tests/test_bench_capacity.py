"""The capacity benchmark on the tiny pair: a real edge recorded through the recording proxy,
replayed by emulated edges at concurrency N against a batching verifier (every verdict as
capacity_sessions, so the output is reproduced token for token), target-only users over the same
prompts, and the report's arithmetic on fixed numbers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from itertools import count

import pytest

from capacity_support import MAX_TOKENS
from spade_bench.capacity.levels import run_level
from spade_bench.capacity.report import (
    REPLAY,
    SPADE,
    TARGET,
    VERIFIER_CPU,
    LevelRow,
    UserResult,
    level_row,
    markdown_table,
    max_users_at,
)
from spade_bench.services import process_tree_cpu_seconds


def test_a_recorded_session_holds_every_verify_call_of_its_request(capacity_sessions):
    assert [session.item_id for session in capacity_sessions] == ["1", "2"]
    for session in capacity_sessions:
        assert session.is_clean
        assert session.completion_tokens == MAX_TOKENS
        assert session.num_emitted >= session.completion_tokens  # the last block may overshoot
        assert session.calls[0].request["prefix_length"] == 0  # the first call carries the prompt
        assert all(call.think_s >= 0.0 for call in session.calls)


@pytest.mark.parametrize("num_users", [1, 3])
def test_replayed_sessions_reproduce_their_recorded_verdicts(capacity_verifier_url, capacity_sessions, num_users):
    users, delta = asyncio.run(run_level(capacity_verifier_url, REPLAY, capacity_sessions, num_users))
    assert [user.num_mismatches for user in users] == [0] * num_users
    assert [user.num_calls for user in users] == [len(capacity_sessions[k % 2].calls) for k in range(num_users)]
    assert [user.tokens for user in users] == [MAX_TOKENS] * num_users
    assert delta["spade_verifier_queue_seconds_count"] == sum(user.num_calls for user in users)


def test_a_level_reports_the_verifier_cpu_it_is_given(capacity_verifier_url, capacity_sessions):
    readings = count(start=10.0, step=2.5)  # before the level, then after it
    users, delta = asyncio.run(run_level(capacity_verifier_url, REPLAY, capacity_sessions, 1, cpu_seconds=lambda: next(readings)))
    assert delta[VERIFIER_CPU] == 2.5
    assert level_row(SPADE, users, delta).cpu_s_per_token == 2.5 / MAX_TOKENS


BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nprint(1, flush=True)\ntime.sleep(60)"
"""A child's program: 0.6 s of CPU, then a line, then idle."""
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {BURN!r}], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""
"""A parent's program: starts the child, waits for its line, prints its pid, idles."""


def test_the_verifier_cpu_includes_its_child_processes():
    """vLLM's engine runs in child processes: a parent that only waits while its child burns
    0.6 s of CPU is charged that 0.6 s, though its own accounting shows far less."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert process_tree_cpu_seconds(parent.pid) - process_tree_cpu_seconds(child_pid) < 0.4
        assert process_tree_cpu_seconds(parent.pid) >= 0.55
    finally:
        parent.kill()
        parent.wait()
        if child_pid is not None:
            os.kill(child_pid, signal.SIGKILL)


def test_target_only_users_generate_the_same_number_of_tokens(capacity_verifier_url, capacity_sessions):
    users, delta = asyncio.run(run_level(capacity_verifier_url, TARGET, capacity_sessions, 2))
    assert [user.tokens for user in users] == [MAX_TOKENS, MAX_TOKENS]
    assert all(user.ttft_s is not None for user in users)
    assert delta["spade_verifier_forward_passes_total"] == 2 * MAX_TOKENS


def _user(mode: str, tokens: int, started: float, finished: float, ttft: float) -> UserResult:
    return UserResult(mode, tokens, started, finished, ttft)


def test_a_level_row_is_computed_from_its_users_and_the_metrics_delta():
    users = [_user(SPADE, 10, 0.0, 5.0, 1.0), _user(SPADE, 20, 1.0, 5.0, 2.0), _user(SPADE, 10, 0.0, 10.0, 3.0)]
    delta = {
        "process_cpu_seconds_total": 3.0,  # the verifier's own process; its tree's CPU wins
        VERIFIER_CPU: 8.0,
        "spade_verifier_queue_seconds_sum": 0.5,
        "spade_verifier_queue_seconds_count": 10.0,
        "spade_verifier_batch_sessions_sum": 25.0,
        "spade_verifier_batch_sessions_count": 10.0,
    }
    row = level_row(SPADE, users, delta)
    assert (row.tokens, row.makespan_s, row.aggregate_tok_s) == (40, 10.0, 4.0)
    assert (row.user_tok_s_p50, row.user_tok_s_p99) == (2.0, pytest.approx(1.02))
    assert (row.ttft_p50_s, row.ttft_p99_s) == (2.0, pytest.approx(2.98))
    assert (row.cpu_s_per_token, row.queue_ms_mean, row.mean_batch) == (0.2, 50.0, 2.5)


def _row(mode: str, num_users: int, aggregate: float, slowest: float) -> LevelRow:
    return LevelRow(mode, num_users, 0, 1.0, aggregate, slowest, slowest, None, None, None, None, None, 0)


def test_capacity_is_the_largest_n_whose_slowest_users_meet_the_target():
    rows = [
        _row(TARGET, 1, 2.0, 2.0),
        _row(TARGET, 2, 2.2, 1.1),
        _row(TARGET, 4, 2.4, 0.6),
        _row(SPADE, 1, 1.5, 1.5),
        _row(SPADE, 2, 3.0, 1.5),
        _row(SPADE, 4, 5.0, 1.2),
    ]
    assert (max_users_at(rows, TARGET, 1.0), max_users_at(rows, SPADE, 1.0), max_users_at(rows, SPADE, 2.0)) == (2, 4, None)
    table = markdown_table(rows, 1.0)
    assert "| 4 | spade | 5.00 | 2.08× |" in table
    assert "spade: 4, target: 2" in table
