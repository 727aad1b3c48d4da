"""The pipelined-session wire (experimental, the verifier's ``--pipelined-sessions``): the one
definition both sides import.

On today's wire (``verifier_service.protocol``) an edge has one verify call at a time, so a
session is in the verifier's forwards only while one of its blocks is. On this wire the verifier
decodes the session itself, in every forward (``verifier_service.pipeline``), and the edge's
drafts are *proposals* it reads when they help:

    POST   /v1/pipeline/sessions                     PipelineOpen -> 201 PipelineOpened
    POST   /v1/pipeline/sessions/{id}/proposals      PipelineProposal -> 204, at any time, any number
    GET    /v1/pipeline/sessions/{id}/decided?after=N    an SSE stream of DecidedTokens events
    DELETE /v1/pipeline/sessions/{id}                -> PipelineClosed

A proposal is drafted token ids from an absolute position (the prompt's first token is 0): the
verifier checks the part it has already decided against what it decided, drops a contradicted
proposal, and verifies the rest in its next forward (``spade_core.proposals.aligned_proposal``).
Only the latest proposal counts (by its ``sequence``: POSTs on several connections may overtake
each other); each also says how many generated tokens the edge holds
(``seen``), the acknowledgement that bounds how far the verifier decodes past its edge.

Example, prompt p0..p9 (10 tokens), the verifier has decided t0 t1 t2 (positions 10-12):
    {"start": 12, "draft_tokens": [t2, d1, d2], "seen": 2}
    -> its next forward verifies [d1, d2] after t2; with d1 accepted and d2 rejected, the event
       {"start": 3, "token_ids": [d1, c], "num_from_proposal": 1, "finish_reason": null}
       (c the correction) comes down the stream.

Token ids only, as vLLM's proposer hook takes them: the verifier treats each drafted token as
certain (one-hot q), which is exact at any temperature (accept x with probability p(x); at a
rejection, sample from p with x removed) at the acceptance sum p.q instead of sum min(p, q).
The same wire is served by the transformers backend (``verifier_service.pipeline``: a verify block
per forward) and by vLLM (``verifier_service.backends.vllm.sessions``: one vLLM request per
session, the proposals its speculative tokens).

Integrity: each decided event is sealed with ``decided_digest`` (its fields and the digest of the
committed context after it); an edge checks it (``checked_event``) and, at a failure, drops the
event and reads the stream again from the tokens it holds (``after``).

Resume: an edge whose verifier answers 404 ``session_not_found`` for a session (a restarted or
another replica) opens it again from the prompt and the tokens it holds
(``edge_agent.pipeline_client``); every call carries ``X-Spade-Session`` for the pool.

Not yet on this wire (it is experimental, measured against today's): stop strings at the
verifier, logprobs. Its wire version is separate from today's and is not announced in /health.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from verifier_service.protocol import MAX_CACHE_SALT_LENGTH, WireSampling, context_digest

PIPELINE_WIRE_VERSION = "pipeline-1"
"""Experimental: any change may break edges; a stable version replaces it. pipeline-1: decided
events carry ``digest``. An edge that opens a session on a verifier of another version closes it
and serves on the verify wire (``edge_agent.pipelined_engine``)."""

FinishReason = Literal["stop", "length", "error", "closed"]
"""stop: an end-of-sequence token; length: max_tokens or the context's room; error: a forward
failed (the tokens before stand); closed: the session was closed or evicted."""


class PipelineOpen(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    session_id: str = Field(min_length=1, max_length=128)
    prompt_tokens: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1, description="Generated tokens after which the session finishes (finish_reason length).")
    sampling: WireSampling = Field(default_factory=lambda: WireSampling())
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_LENGTH)


class PipelineOpened(BaseModel):
    session_id: str
    wire_version: str = PIPELINE_WIRE_VERSION
    window_tokens: int = Field(description="Tokens the verifier decodes past the edge's last acknowledgement (seen) at most.")
    max_draft_length: int = Field(description="Proposed tokens one forward verifies at most.")


class PipelineProposal(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    start: int = Field(ge=0, description="Absolute position of the first drafted token (the prompt's first token is 0).")
    draft_tokens: list[int] = Field(default_factory=list, description="Drafted token ids from start; [] only acknowledges.")
    seen: int = Field(ge=0, description="Generated tokens the edge holds (its acknowledgement).")
    sequence: int = Field(
        0, ge=0, description="The edge numbers its proposals: one that arrives after a higher-numbered one is ignored (acknowledged only)."
    )


class DecidedTokens(BaseModel):
    """One forward's tokens for the session (an SSE ``decided`` event), or the session's end."""

    start: int = Field(description="Index of the first of token_ids among the generated tokens.")
    token_ids: list[int]
    num_from_proposal: int = Field(0, description="Of token_ids, the leading ones that were proposed drafts the target accepted.")
    finish_reason: FinishReason | None = None
    digest: str = Field(
        "",
        description=(
            "decided_digest: binds the event to the session's committed context after it (prompt and every generated"
            " token through this event). An edge that computes another from what it holds drops the event and resumes."
        ),
    )


def decided_digest(event: DecidedTokens, context_digest_after: str) -> str:
    """The digest of a decided event: over pydantic's JSON of its fields but ``digest``, then
    ``context_digest_after`` (``protocol.context_digest`` of the prompt and every generated token
    through this event). The verifier seals each event it sends with it; the edge recomputes it
    from the prompt and the tokens it holds, so a token, a position or a finish changed on the way
    (or an event that does not continue what the edge holds) fails the check and is never
    emitted. Proposals carry none: the verifier verifies every proposed token, so a spoilt
    proposal costs acceptance, never a wrong token.

    Example: prompt [5, 6], event start 0, token_ids [7]: the JSON of (0, [7], 0, null), "|",
    context_digest([5, 6, 7])."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(event.model_dump_json(exclude={"digest"}).encode())
    hasher.update(b"|")
    hasher.update(context_digest_after.encode())
    return hasher.hexdigest()


def checked_event(event: DecidedTokens, prompt: list[int], held: list[int]) -> bool:
    """Whether ``event`` continues what an edge holds (``held``: the generated tokens it has) and
    carries the digest the verifier would have sealed it with."""
    if event.start != len(held):
        return False
    return event.digest == decided_digest(event, context_digest(prompt + held + event.token_ids))


class PipelineClosed(BaseModel):
    session_id: str
    num_generated: int
