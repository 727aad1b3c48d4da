"""A fault-injecting HTTP proxy: sits on loopback between the edge and the verifier and spoils a
share of the verify answers the way a faulty link or a middlebox would (the link tests, and the
chaos run's "rewritten" link fault, which sets ``rate`` while the fault lasts).

Each verify answer is, with probability ``rate``, hit by one fault drawn from ``kinds``:

    next_token    the verdict's next_token rewritten (a valid JSON verdict, a wrong token)
    num_accepted  the verdict's num_accepted moved by one (more or fewer drafts accepted)
    bit_flip      one random bit of the body flipped
    garbage       a 200 whose body is not JSON (a captive portal, an HTML error page)
    server_error  a 500 with a plain-text body
    truncate      a 200 with the body cut in half (a framed but incomplete answer)
    cut           the headers and half the body, then the connection drops
    delay         the right answer, late (within the edge's timeout)

The verifier still processes every call: a spoiled answer is one it committed, so the edge's
retry is answered from memory. Other routes (/health, DELETE) pass untouched. ``injected``
counts the faults by kind, so a test can show each kind was exercised.
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


@dataclass
class FaultProxy:
    """An ASGI app relaying to ``upstream_url`` (serve it with ``spade_bench.loopback``). ``rate``
    may be changed while it serves: it applies from the next verify answer on."""

    upstream_url: str
    rate: float = 0.0
    kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 0
    max_delay_s: float = 0.2
    spare_until: int = 0
    """Verify answers up to this count (``num_verify_answers``) are never spoiled: a stream's
    first tokens go out, then the faults start."""
    injected: Counter = field(default_factory=Counter)
    num_verify_answers: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        try:
            answer = await self._relay(scope, await _body(receive))
        except httpx.TransportError:  # the way on is cut: say so, as a proxy in a real path would
            answer = Answer(502, b"Bad Gateway: the upstream connection failed", "text/plain")
        if scope["path"] == "/v1/verify" and answer.status == 200:
            answer = await self._maybe_spoil(answer)
        await _send(answer, send)

    async def _maybe_spoil(self, answer: Answer) -> Answer:
        self.num_verify_answers += 1
        if self.num_verify_answers <= self.spare_until or self._rng.random() >= self.rate:
            return answer
        kind = self._rng.choice(self.kinds)
        self.injected[kind] += 1
        if kind == "delay":
            await asyncio.sleep(self._rng.uniform(0.0, self.max_delay_s))
        return spoil(answer, kind, self._rng)

    async def _relay(self, scope: Scope, body: bytes) -> Answer:
        headers = {name.decode(): value.decode() for name, value in scope["headers"] if name.decode().lower() not in HOP_HEADERS}
        url = self.upstream_url + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.request(scope["method"], url, content=body, headers=headers)
        return Answer(response.status_code, response.content, response.headers.get("content-type", "application/json"))


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
