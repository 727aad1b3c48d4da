"""The edge <-> verifier link under faults: a proxy on loopback spoils verify answers (rewritten
next_token / num_accepted, flipped bits, garbage, 5xx, truncation, dropped connections, delays)
and the edge must never emit a wrong token. Every request is exact, or ends in a clear 502
(503 where the verifier stayed unreachable) or an in-band error event + [DONE]; never a 500,
never a traceback in the logs."""

from __future__ import annotations

import logging

import pytest

from edge_support import edge_app, verifier_app
from link_fault_support import PROXY_CUT_MESSAGE, FaultRun, is_clear_error, run_through_faults
from servers import serve
from spade_bench.fault_proxy import FAULT_KINDS

pytestmark = pytest.mark.slow  # ~210 requests through three servers: about a minute on a shared CPU

MAX_TOKENS = 12
FAULT_RATES = (0.05, 0.1, 0.2)
REQUESTS_PER_RATE = 72


def _run(pair) -> FaultRun:
    with serve(verifier_app(pair)) as verifier_url:
        return run_through_faults(
            verifier_url,
            lambda proxy_url: edge_app(pair, proxy_url, "3", circuit_open_s=0.2),
            FAULT_RATES,
            REQUESTS_PER_RATE,
            MAX_TOKENS,
            all_bad_kinds=("next_token", "garbage", "server_error"),
            seed=22,
        )


@pytest.fixture(scope="module")
def run(tiny_pair) -> FaultRun:
    return _run(tiny_pair)


def test_at_least_200_requests_went_through_every_kind_of_fault(run):
    assert (len(run.outcomes) >= 200, set(run.injected) == set(FAULT_KINDS)) == (True, True)


def test_no_wrong_token_is_ever_emitted(run):
    assert run.wrong() == []


def test_every_request_is_exact_or_ends_in_a_clear_error(run):
    assert run.unclear() == []


def test_most_requests_come_out_exact_despite_the_faults(run):
    # Each spoiled answer is retried, then resynced: only a run of ~6 spoiled answers in a row fails.
    assert len(run.exact()) >= 0.95 * len(run.outcomes)


def test_when_every_answer_is_spoiled_the_client_gets_502_or_an_error_event_then_done(run):
    assert [(o.streamed, is_clear_error(o), o.error["code"]) for o in run.all_bad] == [
        (streamed, True, "verifier_bad_response") for streamed in (False, True, False, True)
    ]


def test_a_502_logs_one_line_per_request_and_nothing_logs_a_traceback(run):
    tracebacks = [r for r in run.records if r.exc_info or "Traceback" in r.getMessage()]
    errors = [r for r in run.records if r.levelno >= logging.ERROR and r.getMessage() != PROXY_CUT_MESSAGE]
    bad_gateway_lines = [r for r in run.records if r.levelno == logging.WARNING and "502 no valid answer" in r.getMessage()]
    assert (tracebacks, errors, len(bad_gateway_lines) >= len(run.all_bad)) == ([], [], True)


def test_no_request_got_a_500(run):
    assert run.server_errors() == []
