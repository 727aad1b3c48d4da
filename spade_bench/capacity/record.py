"""Recording real edge sessions for the capacity benchmark (``spade_bench.capacity``).

A recording proxy sits between one real ``spade-edge`` and the verifier: it relays every call
unchanged and keeps each ``/v1/verify`` request with the time it arrived and the time its answer
left. For each prompt the benchmark sends one chat request to the edge; that request's verify
calls (one session) become a ``RecordedSession``:

    think_s  of call 0: request sent to the edge -> call 0 arrives (edge prefill + first draft)
             of call i: answer i-1 left -> call i arrives (the edge's exposed drafting time)

Replaying a session later (``levels.replay_user``) waits each think_s plus the link's RTT,
then POSTs the recorded request: the verifier does all its real work, only the edge is replayed.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from spade_bench.capacity.sessions import RecordedCall, RecordedSession

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


@dataclass(frozen=True)
class _Observed:
    body: dict
    arrived_at: float
    answered_at: float
    status: int
    answer: dict | None


class VerifyRecorder:
    """The observed verify calls, grouped by session, in arrival order."""

    def __init__(self) -> None:
        self._calls: dict[str, list[_Observed]] = {}
        self._lock = threading.Lock()

    def add(self, observed: _Observed) -> None:
        with self._lock:
            self._calls.setdefault(observed.body.get("session_id", ""), []).append(observed)

    def sessions_since(self, started_at: float) -> list[str]:
        with self._lock:
            return [sid for sid, calls in self._calls.items() if calls[0].arrived_at >= started_at]

    def session(
        self, session_id: str, started_at: float, item_id: str, messages: list[dict], max_tokens: int, completion_tokens: int, text: str
    ) -> RecordedSession:
        with self._lock:
            observed = list(self._calls.get(session_id, []))
        calls, previous_end = [], started_at
        for call in observed:
            answer = call.answer or {}
            calls.append(
                RecordedCall(
                    call.body,
                    call.arrived_at - previous_end,
                    call.status,
                    answer.get("num_accepted"),
                    answer.get("next_token"),
                    call.answered_at - call.arrived_at,
                    list(answer.get("continued_tokens", [])),
                )
            )
            previous_end = call.answered_at
        return RecordedSession(item_id, messages, max_tokens, completion_tokens, text, calls)


def recording_app(upstream_url: str, recorder: VerifyRecorder) -> FastAPI:
    """Relays everything to ``upstream_url``; records /v1/verify calls."""
    app = FastAPI(title="spade-bench recording proxy")
    client = httpx.AsyncClient(base_url=upstream_url, timeout=None)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        arrived_at = time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = await client.request(request.method, "/" + path, content=body, headers=headers, params=request.query_params)
        if path == "v1/verify" and request.method == "POST":
            answer = upstream.json() if upstream.status_code == 200 else None
            recorder.add(_Observed(json.loads(body), arrived_at, time.perf_counter(), upstream.status_code, answer))
        return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    return app


class ThreadServer:
    """A uvicorn server for ``app`` on a free loopback port, in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not (self._server.started and self._server.servers):
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("recording proxy did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
