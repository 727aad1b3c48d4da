"""How a request's generation ends when its client or the service goes away.

- A client that disconnects cancels its generation, streamed (sse-starlette watches the
  connection) or not (``run_while_wanted`` watches it here): the engine's ``finally`` frees the
  draft cache and the verifier session.
- SIGTERM (uvicorn's shutdown) starts a ``Drain``: uvicorn stops accepting, in-flight requests
  get ``grace_s`` to finish, then every stream still running ends with an error event and
  ``data: [DONE]`` (``until_expired``) and every non-streamed request answers 503, so no client
  mistakes a cut stream for a complete answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import ServiceUnavailableError

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
"""Status of a response nobody will read (the client left first), after nginx's."""
SHUTDOWN_MARGIN_S = 5.0
"""uvicorn and sse-starlette wait this much longer than the grace period, so the streams end
themselves (error event, [DONE]) before anything cancels them."""


class Drain:
    """The service's shutdown state: ``draining`` once SIGTERM arrived, ``expired`` once the
    grace period after it has passed."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = asyncio.Event()
        self.expired = asyncio.Event()

    def begin(self) -> None:
        if self.draining.is_set():
            return
        self.draining.set()
        asyncio.get_running_loop().call_later(self.grace_s, self.expired.set)


def shutting_down_error() -> ServiceUnavailableError:
    return ServiceUnavailableError("the service is shutting down; retry on another instance", code="shutting_down")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app's Drain when shutdown starts (it then stops accepting
    and waits ``timeout_graceful_shutdown`` for the requests in flight)."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets=None) -> None:
        if self._drain is not None:
            self._drain.begin()
        await super().shutdown(sockets=sockets)


async def until_expired(items: AsyncGenerator[T, None], drain: Drain | None) -> AsyncGenerator[T, None]:
    """``items`` as they come, until the drain's grace period expires: then the pending step is
    cancelled (closing ``items``) and the shutting-down error is raised."""
    if drain is None:
        async for item in items:
            yield item
        return
    expired = asyncio.ensure_future(drain.expired.wait())
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                await _cancelled(step)
                raise shutting_down_error()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # Cancelled from outside (the client left) while a step runs ``items``: stop that step
        # first, which ends ``items`` at its await point (its own finally blocks free what it
        # holds); closing a generator another task is still running raises RuntimeError instead.
        if step is not None and not step.done():
            await _cancelled(step)
        await _cancelled(expired)
        await items.aclose()


async def run_while_wanted(work: Awaitable[T], request: Request, drain: Drain | None) -> T | Response:
    """Await ``work`` unless the client disconnects first (its generation is cancelled and a
    response nobody reads is returned) or the drain expires (cancelled, 503)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    watchers = {gone} | ({asyncio.ensure_future(drain.expired.wait())} if drain is not None else set())
    try:
        await asyncio.wait({task} | watchers, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        await _cancelled(task)
        if gone.done():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise shutting_down_error()
    finally:
        for watcher in watchers:
            await _cancelled(watcher)
        if not task.done():
            await _cancelled(task)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already, so the next message the
    server delivers is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancelled(task: asyncio.Future) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
