"""A fault-injecting HTTP proxy: sits on loopback between the edge and the verifier and spoils a
share of the verifier's answers the way a faulty link or a middlebox would (the link tests, and
the chaos run's "rewritten" link fault, which sets ``rate`` while the fault lasts).

On the verify wire each verify answer is, with probability ``rate``, hit by one fault drawn from
``kinds``:

    next_token    the verdict's next_token rewritten (a valid JSON verdict, a wrong token)
    num_accepted  the verdict's num_accepted moved by one (more or fewer drafts accepted)
    bit_flip      one random bit of the body flipped
    garbage       a 200 whose body is not JSON (a captive portal, an HTML error page)
    server_error  a 500 with a plain-text body
    truncate      a 200 with the body cut in half (a framed but incomplete answer)
    cut           the headers and half the body, then the connection drops
    delay         the right answer, late (within the edge's timeout)

On the pipelined-session wire (``verifier_service.pipeline_protocol``) the decided stream is
relayed as it comes, event by event, and each decided event is hit the same way: a decided token
rewritten (next_token), num_from_proposal moved by one (num_accepted), a bit of the event's line
flipped, the event replaced by an HTML line (garbage), its line cut in half (truncate), half of
it and then the connection dropped (cut), or the event held back (delay); a stream is answered
500 at its start (server_error) with probability ``rate`` / len(kinds). A proposal is hit too,
with probability ``rate``: one drafted token rewritten (``injected["proposal"]``; the verifier
verifies every proposed token, so this costs acceptance, never a wrong token).

The verifier still processes every call: a spoiled answer is one it committed, so the edge's
retry is answered from memory. Other routes (/health, DELETE, opening a session) pass
untouched. ``injected`` counts the faults by kind, so a test can show each kind was exercised.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx
from starlette.types import Receive, Scope, Send

FAULT_KINDS = ("next_token", "num_accepted", "bit_flip", "garbage", "server_error", "truncate", "cut", "delay")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}


@dataclass
class Answer:
    status: int
    body: bytes
    content_type: str = "application/json"
    complete: bool = True
    """False: send half of ``body`` and drop the connection."""


def spoil(answer: Answer, kind: str, rng: random.Random) -> Answer:
    """``answer`` hit by the fault ``kind`` (a pure function of the answer and the draws)."""
    if kind in ("next_token", "num_accepted"):
        verdict = json.loads(answer.body)
        if kind == "next_token":
            verdict["next_token"] = verdict["next_token"] ^ 1
        else:
            verdict["num_accepted"] = max(0, verdict["num_accepted"] + rng.choice((-1, 1)))
        return Answer(answer.status, json.dumps(verdict).encode())
    if kind == "bit_flip":
        body = bytearray(answer.body)
        index = rng.randrange(len(body) * 8)
        body[index // 8] ^= 1 << (index % 8)
        return Answer(answer.status, bytes(body))
    if kind == "garbage":
        return Answer(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
    if kind == "server_error":
        return Answer(500, b"Internal Server Error", "text/plain")
    if kind == "truncate":
        return Answer(answer.status, answer.body[: len(answer.body) // 2])
    if kind == "cut":
        return Answer(answer.status, answer.body, complete=False)
    return answer  # delay: the proxy waits before answering


def spoiled_event(line: str, kind: str, rng: random.Random) -> str | None:
    """A decided stream's ``data:`` line hit by the fault ``kind`` (pure, as ``spoil``); None:
    the connection drops after half of it (cut). delay leaves it."""
    payload = line.removeprefix("data:")
    if kind in ("next_token", "num_accepted"):
        event = json.loads(payload)
        if kind == "next_token" and event["token_ids"]:
            index = rng.randrange(len(event["token_ids"]))
            event["token_ids"][index] ^= 1
        else:
            event["num_from_proposal"] = max(0, event["num_from_proposal"] + rng.choice((-1, 1)))
            if kind == "next_token":  # an event without tokens (the finish): move its start instead
                event["start"] += 1
        return "data: " + json.dumps(event)
    if kind == "bit_flip":
        body = bytearray(payload.encode())
        index = rng.randrange(len(body) * 8)
        body[index // 8] ^= 1 << (index % 8)
        return "data:" + body.decode("utf-8", errors="replace").replace("\n", " ").replace("\r", " ")
    if kind == "garbage":
        return "data: <html><body>502 Bad Gateway</body></html>"
    if kind == "truncate":
        return line[: len(line) // 2]
    if kind == "cut":
        return None
    return line


def spoiled_proposal(body: bytes, rng: random.Random) -> bytes:
    """A proposal with one drafted token rewritten (the body as it was if it drafts none)."""
    proposal = json.loads(body)
    if not proposal.get("draft_tokens"):
        return body
    index = rng.randrange(len(proposal["draft_tokens"]))
    proposal["draft_tokens"][index] ^= 1
    return json.dumps(proposal).encode()


@dataclass
class FaultProxy:
    """An ASGI app relaying to ``upstream_url`` (serve it with ``spade_bench.loopback``). ``rate``
    may be changed while it serves: it applies from the next answer on."""

    upstream_url: str
    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    max_delay_s: float = 0.2
    spare_until: int = 0
    """Answers (verify answers and decided events) up to this count (``num_answers``) are never
    spoiled: a stream's first tokens go out, then the faults start."""
    injected: Counter = field(default_factory=Counter)
    num_answers: int = 0
    """Verify answers and decided events relayed."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = await _body(receive)
        if scope["method"] == "POST" and scope["path"].endswith("/proposals") and self._rng.random() < self.rate:
            body = spoiled_proposal(body, self._rng)
            self.injected["proposal"] += 1
        if scope["method"] == "GET" and scope["path"].endswith("/decided"):
            await self._relay_stream(scope, send)
            return
        try:
            answer = await self._relay(scope, body)
        except httpx.TransportError:  # the way on is cut: say so, as a proxy in a real path would
            answer = Answer(502, b"Bad Gateway: the upstream connection failed", "text/plain")
        if scope["path"] == "/v1/verify" and answer.status == 200:
            answer = await self._maybe_spoil(answer)
        await _send(answer, send)

    async def _maybe_spoil(self, answer: Answer) -> Answer:
        kind = self._drawn_kind(self.kinds)
        if kind == "delay":
            await asyncio.sleep(self._rng.uniform(0.0, self.max_delay_s))
        return answer if kind is None else spoil(answer, kind, self._rng)

    def _drawn_kind(self, kinds: tuple[str, ...]) -> str | None:
        """The fault of ``kinds`` that hits the next answer, or None (counted in ``injected``)."""
        self.num_answers += 1
        if self.num_answers <= self.spare_until or not kinds or self._rng.random() >= self.rate:
            return None
        kind = self._rng.choice(kinds)
        self.injected[kind] += 1
        return kind

    def _upstream(self, scope: Scope) -> tuple[str, dict[str, str]]:
        headers = {name.decode(): value.decode() for name, value in scope["headers"] if name.decode().lower() not in HOP_HEADERS}
        url = self.upstream_url + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        return url, headers

    async def _relay(self, scope: Scope, body: bytes) -> Answer:
        url, headers = self._upstream(scope)
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.request(scope["method"], url, content=body, headers=headers)
        return Answer(response.status_code, response.content, response.headers.get("content-type", "application/json"))

    async def _relay_stream(self, scope: Scope, send: Send) -> None:
        """A decided stream, relayed line by line as it comes, its events spoiled one by one."""
        url, headers = self._upstream(scope)
        if "server_error" in self.kinds and self._rng.random() < self.rate / len(self.kinds):
            self.injected["server_error"] += 1
            await _send(Answer(500, b"Internal Server Error", "text/plain"), send)
            return
        started = False
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None)) as client:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        await response.aread()
                        await _send(Answer(response.status_code, response.content, response.headers.get("content-type", "")), send)
                        return
                    content_type = response.headers.get("content-type", "text/event-stream").encode()
                    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
                    started = True
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            spoiled = await self._spoiled_line(line)
                            if spoiled is None:  # cut: half the line, then the connection drops
                                await send({"type": "http.response.body", "body": line[: len(line) // 2].encode(), "more_body": True})
                                return
                            line = spoiled
                        await send({"type": "http.response.body", "body": (line + "\r\n").encode(), "more_body": True})
        except (httpx.TransportError, OSError):  # the way on, or the edge, went
            if not started:
                await _send(Answer(502, b"Bad Gateway: the upstream connection failed", "text/plain"), send)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _spoiled_line(self, line: str) -> str | None:
        kind = self._drawn_kind(tuple(kind for kind in self.kinds if kind != "server_error"))
        if kind == "delay":
            await asyncio.sleep(self._rng.uniform(0.0, self.max_delay_s))
        return line if kind is None else spoiled_event(line, kind, self._rng)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(answer: Answer, send: Send) -> None:
    headers = [(b"content-type", answer.content_type.encode()), (b"content-length", str(len(answer.body)).encode())]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    if answer.complete:
        await send({"type": "http.response.body", "body": answer.body})
        return
    # Half the promised bytes, then return without finishing: the server drops the connection.
    await send({"type": "http.response.body", "body": answer.body[: len(answer.body) // 2], "more_body": True})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
