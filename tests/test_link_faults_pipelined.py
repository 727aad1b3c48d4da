"""The pipelined-session wire under link faults: the fault proxy relays each decided stream event
by event and spoils a share of them (a decided token or num_from_proposal rewritten, a flipped
bit, garbage, a line cut in half, the connection dropped mid-event, an event held back, a 500 for
the whole stream) and of the proposals (a drafted token rewritten). The edge must never emit a
wrong token: every request is exact or ends in a clear 502/503 (an error event then [DONE] once
streaming); never a 500, never a traceback; and no session is left open on the verifier.

The same run against the vLLM backend's session route is in the vLLM suite
(``tests/vllm/test_vllm_pipeline.py``)."""

from __future__ import annotations

import logging

import httpx
import pytest

from edge_support import edge_app, metric_value, verifier_app
from link_fault_support import PROXY_CUT_MESSAGE, FaultRun, is_clear_error, run_through_faults
from servers import serve, wait_until
from spade_bench.fault_proxy import FAULT_KINDS
from test_pipeline import pipeline_tokens

MAX_TOKENS = 12
FAULT_RATES = (0.05, 0.1, 0.2)
REQUESTS_PER_RATE = 24
ALL_BAD_KINDS = ("next_token", "garbage", "truncate")
"""The kinds every decided event is hit by at the end (a 500 for a whole stream would be a 503)."""


@pytest.fixture(scope="module")
def run(tiny_pair) -> tuple[FaultRun, dict[str, float]]:
    # A window of 4 tokens: the verifier waits for the edge's acknowledgements, so proposals
    # (spoilt ones too) are read; with the default the tiny target outruns the drafter.
    with serve(verifier_app(tiny_pair, pipelined_sessions=True, pipeline_window_tokens=4)) as verifier_url:
        fault_run = run_through_faults(
            verifier_url,
            lambda proxy_url: edge_app(tiny_pair, proxy_url, verifier_wire="pipelined"),
            FAULT_RATES,
            REQUESTS_PER_RATE,
            MAX_TOKENS,
            all_bad_kinds=ALL_BAD_KINDS,
            seed=39,
        )
        left_open = wait_until(lambda: metric_value(verifier_url, "spade_verifier_pipeline_sessions") == 0, timeout_s=20)
        with httpx.Client(base_url=verifier_url, timeout=10) as client:
            after = {"left_open": float(not left_open), "proposal_tokens": pipeline_tokens(client, "proposal")}
    return fault_run, after


def test_every_kind_of_fault_hit_the_decided_streams_and_the_proposals(run):
    fault_run, _ = run
    assert len(fault_run.outcomes) == len(FAULT_RATES) * REQUESTS_PER_RATE
    assert set(fault_run.injected) == set(FAULT_KINDS) | {"proposal"}


def test_no_wrong_token_is_ever_emitted(run):
    fault_run, _ = run
    assert fault_run.wrong() == []


def test_every_request_is_exact_or_ends_in_a_clear_error(run):
    fault_run, _ = run
    assert fault_run.unclear() == []


def test_most_requests_come_out_exact_and_the_edge_still_took_drafts(run):
    # A spoilt event is dropped and the stream read again: only ~9 failures in a row end a request.
    fault_run, after = run
    assert len(fault_run.exact()) >= 0.95 * len(fault_run.outcomes)
    assert after["proposal_tokens"] > 0


def test_when_every_event_is_spoiled_the_client_gets_502_or_an_error_event_then_done(run):
    fault_run, _ = run
    assert [(o.streamed, is_clear_error(o), o.error["code"]) for o in fault_run.all_bad] == [
        (streamed, True, "verifier_bad_response") for streamed in (False, True, False, True)
    ]


def test_no_request_got_a_500_and_nothing_logs_a_traceback(run):
    fault_run, _ = run
    tracebacks = [r for r in fault_run.records if r.exc_info or "Traceback" in r.getMessage()]
    errors = [r for r in fault_run.records if r.levelno >= logging.ERROR and r.getMessage() != PROXY_CUT_MESSAGE]
    assert (fault_run.server_errors(), tracebacks, errors) == ([], [], [])


def test_no_session_is_left_open_on_the_verifier(run):
    _, after = run
    assert after["left_open"] == 0
