"""Edge agent configuration: every field is a CLI flag and an env var SPADE_EDGE_<FIELD>."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from edge_agent.draft_length import DraftLengthPolicy, draft_length_policy, parse_draft_length
from edge_agent.edge_power import DEFAULT_EDGE_POWER, DraftAheadPolicy, EdgePower
from gateway.settings import ServiceSettings
from spade_core.params import MAX_CONTINUED_TOKENS

if TYPE_CHECKING:  # the client pulls in torch via the drafter (edge_agent.drafter); --help must not
    from edge_agent.verifier_client import ClientSettings


class EdgeSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPADE_EDGE_", protected_namespaces=())

    draft_model: str = Field(
        "qwen2.5-coder-0.5b-instruct",
        description="Draft model: HF id, local directory, .gguf path or spade-models name.",
    )
    verifier_url: str = Field("http://127.0.0.1:8001", description="Base URL of the verifier service.")
    draft_backend: Literal["auto", "llamacpp", "transformers"] = Field(
        "auto",
        description=(
            "Runtime of the draft model: 'llamacpp' reads a GGUF draft as it is (CPU, cyllama); "
            "'transformers' loads any checkpoint (a GGUF one dequantized); 'auto' picks llamacpp for a GGUF "
            "draft on the CPU when cyllama is installed."
        ),
        json_schema_extra={
            "advanced": True,
            "default_note": "depends on the machine: llamacpp for a GGUF draft on the CPU with cyllama installed, else transformers",
        },
    )
    max_draft_sessions: int = Field(
        96,
        ge=1,
        le=256,
        description=(
            "llama.cpp draft backend: requests drafting at once (sequences of its one shared KV cache, each "
            "adding little); more are answered 429. Keep it above --max-concurrent-requests (a session closes a "
            "moment after its request ends)."
        ),
        json_schema_extra={"advanced": True},
    )
    draft_length: int | Literal["auto"] = Field(
        "auto",
        description=(
            "The draft length: tokens drafted per verify call, a positive integer, or 'auto' (the default, the "
            "fastest setting measured: docs/benchmarks.md) to choose it before each block from acceptance and round trip."
        ),
    )
    verifier_wire: Literal["auto", "verify", "pipelined"] = Field(
        "auto",
        description=(
            "'pipelined' speaks the pipelined-session wire (experimental: the verifier decodes each request in every"
            " forward and the edge's drafts are proposals; the verifier needs --pipelined-sessions; a seed no longer"
            " fixes a sampled text; requests asking for logprobs, and every request to a verifier without the wire, go"
            " on the verify wire). 'auto' takes the wire the verifier's /health prefers at start-up (pipelined on a vLLM"
            " verifier serving pipelined sessions, where it measured faster; else verify)."
        ),
        json_schema_extra={"advanced": True},
    )
    overlap: bool = Field(
        True,
        description=(
            "Draft the next block while the verifier checks this one; the pre-drafted tokens are used only "
            "when the verdict runs through the draft's guess of the next token."
        ),
        json_schema_extra={"advanced": True},
    )
    edge_power: EdgePower = Field(
        DEFAULT_EDGE_POWER,
        description=(
            "How far the edge drafts ahead while a verify call is in flight (with --overlap), CPU against wait: "
            "'performance' drafts ahead under every call; 'balanced' only where a CPU-second of it is expected to "
            "save at least half a second of the wait (from the measured acceptance and guess rate, the draft's speed "
            "and the round trip); 'saver' never, past the prompt's prefill. The output is the same in every mode."
        ),
    )
    prefill_first: bool = Field(
        True,
        description=(
            "The first verify call of a request carries the prompt alone (no drafted block) and leaves at once: "
            "the target prefills the prompt and answers its first token while the edge prefills the draft "
            "(with --overlap, and drafts ahead of that token). With --overlap false the draft waits for that "
            "first token."
        ),
        json_schema_extra={"advanced": True},
    )
    max_draft_length: int = Field(
        16,
        ge=1,
        description="Longest draft length --draft-length auto chooses (the verifier's --max-draft-length caps any).",
        json_schema_extra={"advanced": True},
    )
    max_draft_support: int = Field(
        32,
        ge=1,
        description="Tokens kept in each drafted distribution sent to the verifier (temperature > 0).",
        json_schema_extra={"advanced": True},
    )
    max_continued_tokens: int = Field(
        8,
        ge=0,
        le=MAX_CONTINUED_TOKENS,
        description=(
            "Most tokens one verify call lets a saturated verifier decode on by itself (where it advises blocks of 0,"
            " so drafting does not pay): it answers them at once, one call per that many tokens instead of one per"
            " token; they then reach the caller together. The call that brings a request's first token allows none (that"
            " token goes out at once). 0: one call per token."
        ),
        json_schema_extra={"advanced": True},
    )
    verify_timeout_s: float = Field(60.0, gt=0, description="Timeout of one verify call.", json_schema_extra={"advanced": True})
    verify_retries: int = Field(
        2, ge=0, description="Retries of a lost verify call or a 429/502/503/504 answer.", json_schema_extra={"advanced": True}
    )
    fallback: Literal["error", "draft"] = Field(
        "error",
        description=(
            "When the verifier is unreachable: 'error' answers 503 (or an in-band stream error); 'draft' "
            "keeps serving the draft model's own tokens, unverified, counted in spade.fallback_tokens."
        ),
    )
    circuit_open_s: float = Field(
        5.0,
        gt=0,
        description=(
            "After the verifier is found unreachable, fail (or fall back) at once for a while before trying it again: "
            "0.5 s, doubling while it stays unreachable, up to this; an answer resets it."
        ),
        json_schema_extra={"advanced": True},
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long to wait at start-up for the verifier's /health to report ok.",
        json_schema_extra={"advanced": True},
    )
    verifier_api_key: str | None = Field(None, description="API key the edge sends to the verifier (Authorization: Bearer).")
    verifier_api_key_file: str | None = Field(None, description="File holding the verifier API key (its first line).")
    trusted_hosts: str | None = Field(
        None,
        description=(
            "Host headers the edge answers, comma-separated ('*' = any); default: the loopback names when "
            "listening on loopback (DNS rebinding), any otherwise."
        ),
        json_schema_extra={"advanced": True, "default_note": "the loopback names when listening on loopback, else any"},
    )

    @field_validator("draft_length", mode="before")
    @classmethod
    def _parse_draft_length(cls, value: object) -> int | str:
        return parse_draft_length(value)

    def draft_length_policy(self) -> DraftLengthPolicy:
        """The policy choosing each block's draft length (not yet capped by the verifier)."""
        # The speed model counts a block's drafting as hidden by drafting ahead only where the
        # edge drafts ahead under every call: balanced does so only on the few blocks likely to
        # hit, and modelling every block as overlapped there chose blocks of about 2 tokens
        # (measured: target passes per token 0.51 against saver's 0.32; docs/runs/2026-12-04-edge-power.md).
        return draft_length_policy(self.draft_length, self.max_draft_length, self.overlap and self.edge_power == "performance")

    def draft_ahead_policy(self) -> DraftAheadPolicy:
        """How far to draft ahead under a verify call (``--edge-power``)."""
        return DraftAheadPolicy(self.edge_power)

    def client_settings(self) -> ClientSettings:
        from edge_agent.verifier_client import ClientSettings

        return ClientSettings(
            timeout_s=self.verify_timeout_s,
            retries=self.verify_retries,
            circuit_open_s=self.circuit_open_s,
            api_key=self.verifier_key(),
        )

    def verifier_key(self) -> str | None:
        """--verifier-api-key, else the first line of --verifier-api-key-file."""
        if self.verifier_api_key:
            return self.verifier_api_key.strip()
        if self.verifier_api_key_file:
            lines = [line.strip() for line in Path(self.verifier_api_key_file).read_text().splitlines()]
            return next((line for line in lines if line), None)
        return None
