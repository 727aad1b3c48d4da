"""The edge's client of the pipelined-session wire (``edge_agent.pipeline_client``) against a
scripted verifier (httpx's MockTransport): what it does when the verifier loses a session.

Specification:
- A 404 ``session_not_found`` for the decided stream opens the session again, under the same id,
  from the prompt and every token held: the rest of max_tokens, a seed of its own; the events that
  follow are numbered from the start of the request, the proposals' ``seen`` from where the new
  session starts, and every call carries the pool's routing headers.
- A session lost after it had decided all its tokens is not opened again: the stream ends as
  ``length``.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from edge_agent.pipeline_client import PipelineClient, RemoteSession
from gateway.affinity import ROUTE_HEADER, SESSION_HEADER
from spade_core.params import continued_seed
from verifier_service.pipeline_protocol import DecidedTokens, PipelineOpen, PipelineProposal, decided_digest
from verifier_service.protocol import WireSampling, context_digest

PROMPT = [5, 6, 7]


def sealed(prompt: list[int], held: list[int], event: DecidedTokens) -> str:
    """The SSE line of ``event``, sealed as a verifier holding ``prompt`` and ``held`` would."""
    digest = decided_digest(event, context_digest(prompt + held + event.token_ids))
    return "event: decided\r\ndata: " + event.model_copy(update={"digest": digest}).model_dump_json() + "\r\n\r\n"


class ScriptedVerifier:
    """Answers the wire's calls from a script: each GET of the decided stream takes the next
    answer; every request is recorded."""

    def __init__(self, streams: list[httpx.Response]) -> None:
        self.streams = streams
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "POST" and request.url.path == "/v1/pipeline/sessions":
            session_id = json.loads(request.content)["session_id"]
            return httpx.Response(201, json={"session_id": session_id, "window_tokens": 32, "max_draft_length": 8})
        if request.method == "POST":
            return httpx.Response(204)
        return self.streams.pop(0)


def sse(*lines: str) -> httpx.Response:
    return httpx.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})


def not_found() -> httpx.Response:
    """The verifier's answer for a session it does not hold (a restarted or another replica)."""
    error = {"message": "no pipelined session", "type": "not_found_error", "param": None, "code": "session_not_found"}
    return httpx.Response(404, json={"error": error})


def session(max_tokens: int) -> RemoteSession:
    opening = PipelineOpen(session_id="edge-1", prompt_tokens=PROMPT, max_tokens=max_tokens, sampling=WireSampling(temperature=0.7, seed=9))
    return RemoteSession(opening, route_key="route-1")


def test_a_lost_session_is_opened_again_from_the_tokens_held():
    verifier = ScriptedVerifier(
        [
            sse(sealed(PROMPT, [], DecidedTokens(start=0, token_ids=[10, 11]))),  # then the stream ends: read again
            not_found(),  # the replica restarted
            sse(sealed(PROMPT + [10, 11], [], DecidedTokens(start=0, token_ids=[12], finish_reason="length"))),
        ]
    )
    remote = session(max_tokens=3)

    async def run() -> list[DecidedTokens]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(verifier), base_url="http://verifier") as http:
            client = PipelineClient(http, pause_s=0.0)
            await client.open(remote)
            events = [event async for event in client.decided(remote)]
            await client.propose(remote, PipelineProposal(start=len(PROMPT) + 3, draft_tokens=[13], seen=3))
            return events

    events = asyncio.run(run())
    assert [(event.start, event.token_ids, event.finish_reason) for event in events] == [(0, [10, 11], None), (2, [12], "length")]
    opens = [json.loads(request.content) for request in verifier.requests if request.url.path == "/v1/pipeline/sessions"]
    assert [(body["session_id"], body["prompt_tokens"], body["max_tokens"]) for body in opens] == [
        ("edge-1", PROMPT, 3),
        ("edge-1", PROMPT + [10, 11], 1),
    ]
    assert [body["sampling"]["seed"] for body in opens] == [9, continued_seed(9, 2)] and continued_seed(9, 2) != 9
    proposal = json.loads(verifier.requests[-1].content)
    assert (proposal["start"], proposal["seen"]) == (len(PROMPT) + 3, 1)  # seen counted from the new session's start
    assert remote.num_resumes == 1
    assert all((r.headers[SESSION_HEADER], r.headers[ROUTE_HEADER]) == ("edge-1", "route-1") for r in verifier.requests)
    reads = [request.url.params["after"] for request in verifier.requests if request.method == "GET"]
    assert reads == ["0", "2", "0"]


def test_a_session_lost_after_its_last_token_ends_as_length_without_opening_again():
    verifier = ScriptedVerifier([sse(sealed(PROMPT, [], DecidedTokens(start=0, token_ids=[10, 11]))), not_found()])
    remote = session(max_tokens=2)

    async def run() -> list[DecidedTokens]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(verifier), base_url="http://verifier") as http:
            client = PipelineClient(http, pause_s=0.0)
            await client.open(remote)
            return [event async for event in client.decided(remote)]

    events = asyncio.run(run())
    assert [(event.start, event.token_ids, event.finish_reason) for event in events] == [(0, [10, 11], None), (2, [], "length")]
    assert sum(request.url.path == "/v1/pipeline/sessions" for request in verifier.requests) == 1
