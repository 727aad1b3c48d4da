"""Requests through an edge whose link to the verifier goes through the fault proxy
(``spade_bench.fault_proxy``), and what counts as a clear outcome: the link tests of both wires
(``test_link_faults``, ``test_link_faults_pipelined``, and the vLLM suite's) share them."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from edge_support import DONE, sse_payloads
from servers import serve
from spade_bench.fault_proxy import FaultProxy

MODEL = "target"
PROMPTS = ["The edge drafts", "def add(a, b):", "Once upon a time", "1, 2, 3,", "SELECT * FROM", "Dear team,"]
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


@dataclass
class FaultRun:
    reference: dict[str, str]
    outcomes: list[Outcome]
    injected: Counter
    num_answers: int
    records: list[logging.LogRecord]
    all_bad: list[Outcome] = field(default_factory=list)
    """Requests while every answer was spoiled (rate 1)."""

    def wrong(self) -> list[Outcome]:
        """Requests whose text is not a prefix of the target's own (a wrong token emitted)."""
        return [o for o in self.outcomes + self.all_bad if not self.reference[o.prompt].startswith(o.text)]

    def exact(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and o.error is None and o.text == self.reference[o.prompt]]

    def unclear(self) -> list[Outcome]:
        """Requests neither exact nor ended in a clear error."""
        exact = self.exact()
        return [o for o in self.outcomes if o not in exact and not is_clear_error(o)]

    def server_errors(self) -> list[Outcome]:
        return [o for o in self.outcomes + self.all_bad if o.status == 500 or (o.error or {}).get("type") == "server_error"]


def completion_body(prompt: str, max_tokens: int, streamed: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": streamed}


def completion(edge_url: str, prompt: str, max_tokens: int, streamed: bool) -> Outcome:
    if not streamed:
        response = httpx.post(edge_url + "/v1/completions", json=completion_body(prompt, max_tokens, False), timeout=120)
        body = response.json()
        text = body["choices"][0]["text"] if response.status_code == 200 else ""
        return Outcome(prompt, False, response.status_code, text, body.get("error"))
    with httpx.stream("POST", edge_url + "/v1/completions", json=completion_body(prompt, max_tokens, True), timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return Outcome(prompt, True, response.status_code, "", response.json().get("error"))
        payloads = sse_payloads(response.iter_lines())
    chunks = [json.loads(payload) for payload in payloads if payload != DONE]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))
    error = next((chunk["error"] for chunk in chunks if "error" in chunk), None)
    return Outcome(prompt, True, 200, text, error, payloads)


def completions(edge_url: str, count: int, max_tokens: int, prompts: list[str] = PROMPTS) -> list[Outcome]:
    """``count`` requests, 4 at a time, cycling through ``prompts``, every other one streamed."""
    cases = [(prompts[index % len(prompts)], index % 2 == 1) for index in range(count)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda case: completion(edge_url, case[0], max_tokens, case[1]), cases))


def target_only(verifier_url: str, prompt: str, max_tokens: int) -> str:
    response = httpx.post(verifier_url + "/v1/completions", json=completion_body(prompt, max_tokens, False), timeout=120)
    return response.json()["choices"][0]["text"]


def is_clear_error(outcome: Outcome) -> bool:
    if outcome.error is None:
        return False
    code = outcome.error.get("code")
    if outcome.streamed and outcome.status == 200:
        return outcome.payloads[-1] == DONE and code in CLEAN_ERROR_CODES.values()
    return CLEAN_ERROR_CODES.get(outcome.status) == code


def run_through_faults(
    verifier_url: str,
    edge_for: Callable[[str], object],
    rates: tuple[float, ...],
    requests_per_rate: int,
    max_tokens: int,
    all_bad_kinds: tuple[str, ...],
    seed: int = 0,
) -> FaultRun:
    """Requests through an edge (``edge_for(proxy_url)``: its app) whose link to the verifier goes
    through the fault proxy at each of ``rates``, then 4 while every answer is hit by one of
    ``all_bad_kinds``; the reference is the verifier's own target-only text. Every log record of
    the run is kept (``FaultRun.records``)."""
    recorder = Recorder()
    for name in ("", "uvicorn"):
        logging.getLogger(name).addHandler(recorder)
    proxy = FaultProxy(verifier_url, seed=seed)
    try:
        with serve(proxy) as proxy_url, serve(edge_for(proxy_url)) as edge_url:
            reference = {prompt: target_only(verifier_url, prompt, max_tokens) for prompt in PROMPTS}
            outcomes = []
            for rate in rates:
                proxy.rate = rate
                outcomes += completions(edge_url, requests_per_rate, max_tokens)
            proxy.rate, proxy.kinds = 1.0, all_bad_kinds
            all_bad = completions(edge_url, 4, max_tokens)
    finally:
        for name in ("", "uvicorn"):
            logging.getLogger(name).removeHandler(recorder)
    return FaultRun(reference, outcomes, proxy.injected, proxy.num_answers, recorder.records, all_bad)
