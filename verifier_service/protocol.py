"""The edge <-> verifier wire: the one definition both sides import.

A verify call asks: given the committed context and a block of drafted tokens, which does the
target accept, and what comes next?

The block may be empty: the edge's first call of a generation carries the prompt alone, so it
leaves before the edge has drafted anything (the edge prefills its draft model meanwhile). With
no drafted token nothing is accepted and ``next_token`` is the target's own next token, drawn
from its distribution at the last context position with that position's seeded draws, exactly
as the verifier's target-only routes draw it (a bonus token, ``num_accepted`` 0).

Session protocol. The verifier keeps, per ``session_id``, the committed context it has seen and
the target's KV cache over it. After answering a call it appends the accepted drafted tokens and
the next token to that context itself, so the following call normally carries no context at
all, only ``prefix_length`` (= the committed length) with its ``prefix_digest`` and the new
block. When the edge holds committed tokens the verifier has not seen, it sends them in
``new_tokens``. On an unknown session or a mismatching length/digest the verifier answers 409
(code ``session_resync_required``) and the edge repeats the call with ``prefix_length = 0`` and
the whole context in ``new_tokens``; the verifier then reuses whatever cached prefix matches.

Retries. The verifier remembers its last answer per session, keyed by the request's
fingerprint, so a call repeated after a lost response gets the same answer back instead of
advancing the session twice.

Integrity. Every verdict carries ``verdict_digest`` (``verdict_digest()``): a digest over the
call's request fingerprint, the whole verdict (every field but the digest itself and
``replayed``) and the ``context_digest`` of the verifier's committed context after the call.
The edge recomputes it from the request it sent, the verdict it read and its OWN context +
accepted + next (+ continued) before emitting a token: a verdict garbled on the way, meant for
another call or for another context fails the check and is treated as lost (retried: the
verifier replays it from memory; then resynced from the edge's context). It is a checksum, not
a MAC: it catches faults, truncation and rewriting middleboxes, not an attacker on the path
(only TLS does).

Example, context c0..c9 committed, the verifier already holds all ten:
    {"session_id": "s", "prefix_length": 10, "prefix_digest": digest(c0..c9), "new_tokens": [],
     "draft_tokens": [d0, d1, d2], "draft_probs": null, "sampling": {"temperature": 0, ...}}
    -> {"num_accepted": 2, "next_token": t, "context_length": 13, ...}
    the committed context is now c0..c9 d0 d1 t (length 13).

Example, the first call of a generation with prompt c0..c9 (nothing drafted yet):
    {"session_id": "s", "prefix_length": 0, "prefix_digest": digest(), "new_tokens": [c0, ..., c9],
     "draft_tokens": [], "sampling": {...}}
    -> {"num_accepted": 0, "next_token": t, "next_token_kind": "bonus", "context_length": 11, ...}

Advice. Every answer carries ``advised_draft_length``: the longest block the verifier wants next
from this session, chosen from its load (``backends.transformers.advice``): its
``--max-draft-length`` while the target has idle time, shorter blocks when its forwards follow
each other and extra rows would slow every session down, 0 (a call without a block, a
target-only step) where even one drafted row costs more than it brings. The edge drafts no
further. A block longer than the session's last advice is cut to it before it is verified:
verifying a prefix of a block is exact (the verdict is the one a block of that length gets), so
an edge that ignores the advice is still served exactly, but cannot lengthen everyone's forwards.

Continuation. A call may allow ``max_continued_tokens`` (K > 0): where the verifier's advice
after the call is 0 (its forwards are past the point where a drafted row pays, so the edge's next
call would carry no block), it goes on decoding the session by itself, one target-only step per
forward of its own scheduler, and answers the tokens in ``continued_tokens``: each the target's
own next token, drawn with that position's seeded draws, exactly what empty-block calls would
have got one by one. It stops after K tokens, at an end-of-sequence token, at the context limit,
or as soon as its advice for the session is above 0 again (drafting pays again). Past the knee
a session then costs the verifier one row per token and one call per K tokens, as a target-only
user does, instead of a call per token. The committed context after the call is context +
accepted + next + continued. Example, the verifier saturated:
    {"session_id": "s", "prefix_length": 13, ..., "draft_tokens": [], "max_continued_tokens": 4}
    -> {"num_accepted": 0, "next_token": t, "continued_tokens": [u, v, w, x], "context_length": 18,
        "advised_draft_length": 0, ...}

Logprobs. Only a call with ``num_top_logprobs`` (N >= 0) gets them: ``logprobs`` per emitted
token (accepted drafts, next, continued) and, in ``top_logprobs``, its N most likely
alternatives, all the target's (``spade_core.sampling.reported_logprobs``). Without it (the default) nothing is computed,
``logprobs`` is [] and ``top_logprobs`` null. ``VerifierHealth.logprobs_support`` says which
calls may ask.

Versions. ``WIRE_VERSION`` numbers this wire; the verifier's ``/health`` carries it and an edge
works only with a verifier of its own version (it refuses to start against another, and while
running answers 503 ``verifier_incompatible``). A change an edge of the current version would
misread (a field renamed, removed or newly required, a meaning changed) takes the next version.
Versions: 1, the first release; 2, the advice may be 0; 3, continuation (``max_continued_tokens``,
``continued_tokens``, and the request fingerprint covers every field).

Prefix caching. Calls that start a session's cache (``prefix_length`` 0) may start it from a
prefix another session of the same namespace (``cache_salt`` and, by default, API key:
``verifier_service.prefix_sharing``) has cached; ``num_cached_tokens`` says how many context
tokens that saved. The verdict is the same either way (bitwise where the verifier is batch
invariant).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.engine import LogprobsSupport
from gateway.model import ModelDescription
from gateway.protocol import MAX_CACHE_SALT_LENGTH, MAX_TOP_LOGPROBS, Seed, Temperature, TopK, TopP, UnicodeChecked
from spade_core.params import MAX_CONTINUED_TOKENS, SamplingConfig

WIRE_VERSION = 3
"""The version of this wire (first release: 1; 2: the advice may be 0; 3: continuation). See the module's "Versions"."""

SESSION_RESYNC_CODE = "session_resync_required"


def context_digest(token_ids: list[int]) -> str:
    """Digest of a committed token sequence (both sides compute it the same way)."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(",".join(map(str, token_ids)).encode())  # "5,6,7": the ids in decimal, comma-separated
    return hasher.hexdigest()


class WireSampling(BaseModel):
    """The request's sampling transform, as applied to the target's logits."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Temperature = 1.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    seed: Seed = Field(0, description="Seeds the acceptance draws with the token position.")

    def to_config(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    @classmethod
    def from_config(cls, config: SamplingConfig) -> WireSampling:
        return cls(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, seed=config.seed)


class SparseDistribution(BaseModel):
    """The distribution one drafted token was sampled from: its support and their probabilities."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids: list[int] = Field(min_length=1, json_schema_extra={"uniqueItems": True})
    probs: list[float] = Field(min_length=1, description="One per token id (same length as token_ids).")

    @model_validator(mode="after")
    def _same_length(self) -> SparseDistribution:
        if len(self.token_ids) != len(self.probs):
            raise ValueError("token_ids and probs must have the same length")
        if len(set(self.token_ids)) != len(self.token_ids):
            raise ValueError("token_ids must not repeat")
        return self


class VerifyRequest(UnicodeChecked):
    # A call must carry some context: prefix_length > 0, or the context in new_tokens (prefix 0
    # with nothing new has no position to continue from: 400). Declared so in the schema.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {"properties": {"prefix_length": {"minimum": 1}}},
                {"properties": {"new_tokens": {"minItems": 1}}, "required": ["new_tokens"]},
            ]
        },
    )

    session_id: str = Field(min_length=1, max_length=128)
    prefix_length: int = Field(ge=0, description="Committed tokens the edge assumes the verifier holds.")
    prefix_digest: str = Field(description="context_digest of those prefix_length tokens.")
    new_tokens: list[int] = Field(default_factory=list, description="Committed tokens past prefix_length.")
    draft_tokens: list[int] = Field(description="The drafted block; empty: the target's next token alone (the prompt-only first call).")
    draft_probs: list[SparseDistribution] | None = Field(
        None, description="Per drafted token, the distribution it was sampled from; null = greedy draft (null or [] for an empty block)."
    )
    sampling: WireSampling = Field(default_factory=lambda: WireSampling())
    num_top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="null (default): no logprobs. N: each emitted token's logprob and its N most likely alternatives.",
    )
    cache_salt: str | None = Field(
        default=None,
        max_length=MAX_CACHE_SALT_LENGTH,
        description="Only calls with the same salt (within the verifier's --prefix-sharing scope) share cached prompt "
        "prefixes: the OpenAI request's cache_salt, with the edge's caller folded in.",
    )

    max_continued_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_CONTINUED_TOKENS,
        description="Up to this many tokens the verifier may decode on by itself after next_token, where its advice "
        "is 0 (see continued_tokens); 0: never.",
    )

    def fingerprint(self) -> str:
        """Digest of the call's fields, all of them."""
        return hashlib.blake2b(self.model_dump_json().encode(), digest_size=16).hexdigest()


class VerifyTimings(BaseModel):
    queue_ms: float = Field(description="Waiting for the target (other sessions' forwards).")
    forward_ms: float = Field(description="The target's forward pass and the acceptance math.")
    total_ms: float = Field(description="From receiving the call to answering it.")
    model_ms: float | None = Field(
        None,
        description="The target's forward alone (the model call over num_target_tokens tokens), without the "
        "acceptance math; null where the backend does not measure it.",
    )


class TopLogprobs(BaseModel):
    """One emitted token's most likely alternatives, most likely first."""

    token_ids: list[int]
    logprobs: list[float]

    @model_validator(mode="after")
    def _same_length(self) -> TopLogprobs:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")
        return self


class VerifyResponse(BaseModel):
    session_id: str
    num_accepted: int = Field(description="Leading drafted tokens the target accepted.")
    next_token: int = Field(description="The correction (after a rejection) or the bonus token.")
    next_token_kind: Literal["correction", "bonus"]
    logprobs: list[float] = Field(
        default_factory=list,
        description="With num_top_logprobs: the target's log-probability of each emitted token (accepted drafts, "
        "then next, then continued; spade_core.sampling.reported_logprobs). Otherwise empty.",
    )
    top_logprobs: list[TopLogprobs] | None = Field(
        default=None, description="With num_top_logprobs: per emitted token, its most likely alternatives. Otherwise null."
    )
    continued_tokens: list[int] = Field(
        default_factory=list,
        description="Tokens the target decoded on by itself after next_token (at most the call's max_continued_tokens, "
        "only where the advice was 0): its own next tokens with their positions' seeded draws, what calls without a "
        "block would have got one by one.",
    )
    context_length: int = Field(description="Committed length after this call (context + accepted + next + continued).")
    num_target_tokens: int = Field(description="Tokens in the target's forward pass for this call.")
    advised_draft_length: int = Field(
        ge=0,
        description="The longest block the verifier wants next from this session, from its load (its --max-draft-length "
        "while it has idle time; 0 where its forwards are past the point where a drafted row pays: the next call then "
        "carries no block). The edge drafts no further; a longer block is cut to it before it is verified (exact: "
        "a prefix of a block is verified as if only the prefix had been drafted).",
    )
    timings: VerifyTimings
    replayed: bool = Field(default=False, description="True when this answers a retried call from memory.")
    num_cached_tokens: int = Field(
        default=0,
        description="Context tokens the verifier did not prefill because a shared cached prefix covered them (a call "
        "that started the session's cache: a new session or a resync); outside the verdict digest.",
    )
    verdict_digest: str = Field(
        default="",
        description="verdict_digest(request fingerprint, this verdict, context_digest of the committed context after the "
        "call): the edge checks it before emitting a token.",
    )


UNDIGESTED_FIELDS = frozenset({"verdict_digest", "replayed", "num_cached_tokens"})
"""The verdict's fields outside its digest: the digest itself, ``replayed``, the one field a
replay changes, and ``num_cached_tokens`` (accounting only: which session's prefill it copied
is not the edge's concern). ``timings`` are inside: the draft-length
policy and the request's stats read them, and a replay returns the stored ones unchanged."""


def verdict_digest(request_fingerprint: str, verdict: VerifyResponse, context_digest_after: str) -> str:
    """The digest that binds a verdict to its call and to the committed context after it.

    Both sides compute it over the same canonical bytes: pydantic's JSON of the verdict's
    fields (all but ``UNDIGESTED_FIELDS``, so a field added later is covered without edits;
    floats round-trip exactly through JSON), framed by the fingerprint and the context digest."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(request_fingerprint.encode())
    hasher.update(b"|")
    hasher.update(verdict.model_dump_json(exclude=set(UNDIGESTED_FIELDS)).encode())
    hasher.update(b"|")
    hasher.update(context_digest_after.encode())
    return hasher.hexdigest()


class SessionDeleted(BaseModel):
    session_id: str
    deleted: bool


def health_fields(model: ModelDescription) -> dict[str, Any]:
    """The ``VerifierHealth`` fields that describe the served model, under their wire names."""
    return {
        "model": model.model_id,
        "vocab_size": model.vocab_size,
        "tokenizer_fingerprint": model.tokenizer_fingerprint,
        "max_context_length": model.max_context_length,
        "eos_token_ids": sorted(model.eos_token_ids),
        "logprobs_support": model.logprobs_support,
    }


def described_model(health: VerifierHealth) -> ModelDescription:
    """The served model as the verifier's ``/health`` describes it (``health_fields`` read back)."""
    return ModelDescription(
        model_id=health.model,
        vocab_size=health.vocab_size,
        max_context_length=health.max_context_length,
        eos_token_ids=frozenset(health.eos_token_ids),
        tokenizer_fingerprint=health.tokenizer_fingerprint,
        logprobs_support=health.logprobs_support,
    )


class HealthStatus(BaseModel):
    """All /health tells a caller without a valid key where keys are configured."""

    status: Literal["ok", "loading"]


class VerifierHealth(BaseModel):
    """The verifier's state, limits and served model (``health_fields`` / ``described_model``)."""

    status: Literal["ok", "loading"]
    wire_version: int = Field(description="The edge <-> verifier wire's version (WIRE_VERSION); an edge of another refuses this verifier.")
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context_length: int
    max_draft_length: int = Field(description="The verifier's --max-draft-length: most drafted tokens one verify call may carry.")
    max_draft_support: int
    eos_token_ids: list[int]
    backend: str
    preferred_wire: Literal["verify", "pipelined"] = Field(
        "verify",
        description="The wire an edge on --verifier-wire auto speaks to this verifier: 'pipelined' where it serves "
        "pipelined sessions (--pipelined-sessions) on a backend that does better with them (vLLM), else 'verify'.",
    )
    logprobs_support: LogprobsSupport = Field(
        description=f"Which verify calls may ask for logprobs, one of {get_args(LogprobsSupport)}: all, greedy "
        "ones only (vLLM backend, sample_match route), none.",
    )
