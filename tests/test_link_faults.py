"""The edge <-> verifier link under faults: a proxy on loopback spoils verify answers (rewritten
next_token / num_accepted, flipped bits, garbage, 5xx, truncation, dropped connections, delays)
and the edge must never emit a wrong token. Every request is exact, or ends in a clear 502
(503 where the verifier stayed unreachable) or an in-band error event + [DONE]; never a 500,
never a traceback in the logs."""

from __future__ import annotations

import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from edge_support import DONE, edge_app, sse_payloads, verifier_app
from servers import serve
from spade_bench.fault_proxy import FAULT_KINDS, FaultProxy

pytestmark = pytest.mark.slow  # ~210 requests through three servers: about a minute on a shared CPU

MODEL = "target"
PROMPTS = ["The edge drafts", "def add(a, b):", "Once upon a time", "1, 2, 3,", "SELECT * FROM", "Dear team,"]
MAX_TOKENS = 12
FAULT_RATES = (0.05, 0.1, 0.2)
REQUESTS_PER_RATE = 72
CLEAN_ERROR_CODES = {502: "verifier_bad_response", 503: "verifier_unavailable"}
PROXY_CUT_MESSAGE = "ASGI callable returned without completing response."
"""What uvicorn logs for the proxy's own ``cut`` fault (the proxy's line, not the services')."""


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Outcome:
    prompt: str
    streamed: bool
    status: int
    text: str
    """Everything the client received as generated text (before any error)."""
    error: dict | None = None
    payloads: list[str] = field(default_factory=list)


def _body(prompt: str, streamed: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": streamed}


def _request(edge_url: str, prompt: str, streamed: bool) -> Outcome:
    if not streamed:
        response = httpx.post(edge_url + "/v1/completions", json=_body(prompt, False), timeout=120)
        body = response.json()
        text = body["choices"][0]["text"] if response.status_code == 200 else ""
        return Outcome(prompt, False, response.status_code, text, body.get("error"))
    with httpx.stream("POST", edge_url + "/v1/completions", json=_body(prompt, True), timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return Outcome(prompt, True, response.status_code, "", response.json().get("error"))
        payloads = sse_payloads(response.iter_lines())
    chunks = [json.loads(payload) for payload in payloads if payload != DONE]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))
    error = next((chunk["error"] for chunk in chunks if "error" in chunk), None)
    return Outcome(prompt, True, 200, text, error, payloads)


@dataclass
class FaultRun:
    reference: dict[str, str]
    outcomes: list[Outcome]
    injected: Counter
    num_verify_answers: int
    records: list[logging.LogRecord]
    all_bad: list[Outcome]
    """Requests while every answer was spoiled (rate 1)."""


def _run(pair) -> FaultRun:
    recorder = Recorder()
    for name in ("", "uvicorn"):
        logging.getLogger(name).addHandler(recorder)
    try:
        with serve(verifier_app(pair)) as verifier_url:
            proxy = FaultProxy(verifier_url, seed=22)
            with serve(proxy) as proxy_url, serve(edge_app(pair, proxy_url, "3", circuit_open_s=0.2)) as edge_url:
                reference = {prompt: _target_only(verifier_url, prompt) for prompt in PROMPTS}
                outcomes = []
                for rate in FAULT_RATES:
                    proxy.rate = rate
                    outcomes += _requests(edge_url, REQUESTS_PER_RATE)
                proxy.rate, proxy.kinds = 1.0, ("next_token", "garbage", "server_error")
                all_bad = _requests(edge_url, 4)
    finally:
        for name in ("", "uvicorn"):
            logging.getLogger(name).removeHandler(recorder)
    return FaultRun(reference, outcomes, proxy.injected, proxy.num_verify_answers, recorder.records, all_bad)


def _requests(edge_url: str, count: int) -> list[Outcome]:
    cases = [(PROMPTS[index % len(PROMPTS)], index % 2 == 1) for index in range(count)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda case: _request(edge_url, *case), cases))


def _target_only(verifier_url: str, prompt: str) -> str:
    response = httpx.post(verifier_url + "/v1/completions", json=_body(prompt, False), timeout=120)
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def run(tiny_pair) -> FaultRun:
    return _run(tiny_pair)


def test_at_least_200_requests_went_through_every_kind_of_fault(run):
    assert (len(run.outcomes) >= 200, set(run.injected) == set(FAULT_KINDS)) == (True, True)


def test_no_wrong_token_is_ever_emitted(run):
    wrong = [o for o in run.outcomes + run.all_bad if not run.reference[o.prompt].startswith(o.text)]
    assert wrong == []


def test_every_request_is_exact_or_ends_in_a_clear_error(run):
    unclear = [
        o
        for o in run.outcomes
        if not (o.status == 200 and o.error is None and o.text == run.reference[o.prompt]) and not _is_clear_error(o)
    ]
    assert unclear == []


def test_most_requests_come_out_exact_despite_the_faults(run):
    # Each spoiled answer is retried, then resynced: only a run of ~6 spoiled answers in a row fails.
    exact = [o for o in run.outcomes if o.status == 200 and o.error is None and o.text == run.reference[o.prompt]]
    assert len(exact) >= 0.95 * len(run.outcomes)


def test_when_every_answer_is_spoiled_the_client_gets_502_or_an_error_event_then_done(run):
    assert [(o.streamed, _is_clear_error(o), o.error["code"]) for o in run.all_bad] == [
        (streamed, True, "verifier_bad_response") for streamed in (False, True, False, True)
    ]


def test_a_502_logs_one_line_per_request_and_nothing_logs_a_traceback(run):
    tracebacks = [r for r in run.records if r.exc_info or "Traceback" in r.getMessage()]
    errors = [r for r in run.records if r.levelno >= logging.ERROR and r.getMessage() != PROXY_CUT_MESSAGE]
    bad_gateway_lines = [r for r in run.records if r.levelno == logging.WARNING and "502 no valid answer" in r.getMessage()]
    assert (tracebacks, errors, len(bad_gateway_lines) >= len(run.all_bad)) == ([], [], True)


def test_no_request_got_a_500(run):
    assert [o for o in run.outcomes + run.all_bad if o.status == 500 or (o.error or {}).get("type") == "server_error"] == []


def _is_clear_error(outcome: Outcome) -> bool:
    if outcome.error is None:
        return False
    code = outcome.error.get("code")
    if outcome.streamed and outcome.status == 200:
        return outcome.payloads[-1] == DONE and code in CLEAN_ERROR_CODES.values()
    return CLEAN_ERROR_CODES.get(outcome.status) == code
