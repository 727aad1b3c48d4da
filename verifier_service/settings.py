"""Verifier configuration: every field is a CLI flag and an env var SPADE_VERIFIER_<FIELD>."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from gateway.settings import ServiceSettings
from spade_core.params import MAX_CONTINUED_TOKENS

if TYPE_CHECKING:  # both pull in torch; a CLI's --help imports this module and must not
    from verifier_service.backends.transformers.cpu.kernels import BatchInvariance
    from verifier_service.backends.transformers.plan import SchedulerLimits
    from verifier_service.pipeline import PipelineLimits
    from verifier_service.service import VerifyLimits
    from verifier_service.sessions import SessionLimits


class VerifierSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPADE_VERIFIER_", protected_namespaces=())

    REMOVED_SETTINGS: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "batch_hold_rule": "forwards hold for sessions due soon by the cost rule alone; --batch-hold-scale scales it (0: never hold).",
            "batch_hold_fraction": "the fraction rule went; forwards hold by the cost rule, scaled by --batch-hold-scale (0: never hold).",
        }
    )
    """Settings that went, each with what replaced it (CHANGELOG.md): their flags and env vars exit
    with that message."""

    model: str = Field("qwen2.5-coder-1.5b-instruct", description="Target model: HF id, local directory, .gguf path or spade-models name.")
    served_model_name: str | None = Field(
        None, description="Model id clients pass; defaults to the model's name.", json_schema_extra={"default_note": "the model's name"}
    )
    backend: Literal["transformers", "vllm"] = Field("transformers", description="Engine running the target.")
    port: int = Field(8001, ge=0, le=65535, description="Port to listen on.")
    max_context_length: int | None = Field(
        None,
        ge=2,
        description="Override the model's context length (the vLLM backend serves one token less: room for the token it returns).",
        json_schema_extra={"default_note": "the model's own"},
    )
    max_draft_length: int = Field(
        64, ge=1, description="Longest draft length (drafted tokens) one verify call may carry.", json_schema_extra={"advanced": True}
    )
    max_draft_support: int = Field(
        256, ge=1, description="Most tokens in one drafted position's distribution.", json_schema_extra={"advanced": True}
    )
    max_continued_tokens: int = Field(
        64,
        ge=0,
        le=MAX_CONTINUED_TOKENS,
        description=(
            "Most tokens one verify call may have the verifier decode on by itself while its advice is 0 (past the point"
            " where a drafted row pays: one call per that many tokens instead of one per token); 0: never."
        ),
        json_schema_extra={"advanced": True},
    )
    step_ahead_tokens: int = Field(
        0,
        ge=0,
        le=MAX_CONTINUED_TOKENS,
        description=(
            "Experimental: between an edge's verify calls, decode its session on by itself, one target-only step per"
            " forward, up to this many tokens ahead (within what each call lets the verifier continue); the next call's"
            " drafts are checked against them, and a contradicted block is answered at once from them. Greedy output is"
            " unchanged; at temperature > 0 the output is the target's distribution but not the lock-step's text for a"
            " seed. 0: lock-step (the default)."
        ),
        json_schema_extra={"advanced": True},
    )
    pipelined_sessions: bool = Field(
        False,
        description=(
            "Experimental: serve the pipelined-session wire (/v1/pipeline/sessions: the verifier decodes each session in"
            " every forward and reads the edge's proposals as they arrive) beside the verify wire. On --backend vllm each"
            " session is one long-lived vLLM request whose speculative tokens are its edge's proposals (the engine starts"
            " with vLLM's custom-class proposer)."
        ),
        json_schema_extra={"advanced": True},
    )
    pipeline_window_tokens: int = Field(
        32,
        ge=1,
        le=1024,
        description="--pipelined-sessions: tokens a session decodes past what its edge has acknowledged, at most.",
        json_schema_extra={"advanced": True},
    )
    max_sessions: int = Field(256, ge=1, description="Edge sessions kept (least recently used evicted).")
    max_session_tokens: int = Field(
        2_000_000, ge=1, description="Committed tokens kept over all sessions.", json_schema_extra={"advanced": True}
    )
    session_ttl_s: float = Field(600.0, gt=0, description="Idle seconds before a session is dropped.", json_schema_extra={"advanced": True})
    max_kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description=(
            "--backend transformers: bytes all sessions' KV caches (and retained prefix caches) may hold; retained prefix"
            " caches go first, then idle sessions are evicted, then calls get 429 kv_cache_full;"
            " default: 4 GiB or one full context, whichever is larger."
        ),
        json_schema_extra={"default_note": "4 GiB or one full context, whichever is larger"},
    )
    max_batch_sessions: int = Field(
        8,
        ge=1,
        description=(
            "--backend transformers: most sessions whose verify calls (or target-only steps) share one forward; 1 = one call at a time."
        ),
        json_schema_extra={"advanced": True},
    )
    max_forward_rows: int = Field(
        128,
        ge=1,
        description=(
            "--backend transformers: most rows (tokens fed) in one forward; a longer prompt is prefilled in chunks that share"
            " forwards with other sessions' blocks, so no block waits behind a whole prompt."
        ),
        json_schema_extra={"advanced": True},
    )
    batch_wait_ms: float = Field(
        2.0,
        ge=0,
        description="--backend transformers: shortest wait for more sessions before a forward runs while the target is idle.",
        json_schema_extra={"advanced": True},
    )
    batch_hold_scale: float = Field(
        1.0,
        ge=0,
        description=(
            "--backend transformers: a forward waits for sessions whose next call is due soon (learnt per session) while"
            " the wait costs less than the forward's fixed part it saves, so many edges' calls share forwards; this"
            " multiplies the wait that allows; 0 = never hold."
        ),
        json_schema_extra={"advanced": True},
    )
    batch_hold_late_deviations: float = Field(
        2.0,
        ge=0,
        description=(
            "--backend transformers: a forward holding for a session waits this many mean deviations of its gaps past"
            " its expected call (at most a one-row forward's time) before giving up on it; 0 = only until the expected time."
        ),
        json_schema_extra={"advanced": True},
    )
    audit_log: str | None = Field(
        None,
        description=(
            "Append every verify call's verdict with its inputs (context, drafted tokens and their distributions, sampling, "
            "seed) to this JSON-lines file, for an offline re-check of the acceptance rule (python -m spade_bench.chaos.audit). "
            "For tests and chaos runs: each line holds the call's whole context."
        ),
        json_schema_extra={"advanced": True},
    )
    fast_kernels: bool = Field(
        True,
        description=(
            "--backend transformers, CPU, float32: linear layers through the verifier's own kernel (reads "
            "each weight once for the whole block) and attention without per-head KV copies, for the verify "
            "and target-only routes alike; --no-fast-kernels runs stock transformers. Needs a C compiler and AVX2 or AVX-512 "
            "(built once into the model cache); without them the linears are stock, logged."
        ),
        json_schema_extra={"advanced": True},
    )
    cpu_kernel_isa: Literal["auto", "AVX512", "AVX2"] = Field(
        "auto",
        description=(
            "--fast-kernels: the vector ISA the kernel is built for; auto = the best this CPU runs. AVX2 on an AVX-512 CPU"
            " measures what an AVX2-only machine would do, or avoids AVX-512 where it lowers the core's clock; an ISA"
            " the CPU lacks is an error at start."
        ),
        json_schema_extra={"advanced": True, "default_note": "depends on the machine: the best this CPU runs"},
    )
    batch_invariant: bool = Field(
        True,
        description=(
            "--backend transformers, CPU, float32: each row's logits independent of what shares the forward (the "
            "same kernel, attention row by row), so greedy SPADE output equals target-only by construction; as fast as "
            "the fast mode where measured. By default on where the compiled CPU kernel runs (else the fast mode); "
            "asked for explicitly where it cannot be met (GPU, bfloat16, vLLM), an error; --no-batch-invariant runs the fast mode."
        ),
        json_schema_extra={"advanced": True, "default_note": "on where the compiled CPU kernel runs, else off"},
    )
    prefix_sharing: Literal["per-key", "global", "off"] = Field(
        "per-key",
        description=(
            "Which requests may start from a prompt prefix another request cached (KV reuse across sessions; a hit shows"
            " in the time to first token): per-key = only requests of one API key (all callers without keys) and one"
            " cache_salt; global = any requests with the same cache_salt; off = none."
        ),
        json_schema_extra={"advanced": True},
    )
    vllm_block_size: int = Field(
        32, ge=1, description="--backend vllm: KV block size (CPU attention needs a multiple of 32).", json_schema_extra={"advanced": True}
    )
    vllm_kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description="--backend vllm: KV cache size in GiB (must hold the model's context length).",
        json_schema_extra={"advanced": True},
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--backend vllm: GPUs each of the target's layers is split across (vLLM's tensor parallelism; the GPUs of one"
            " node, or per node with --pipeline-parallel-size)."
        ),
        json_schema_extra={"advanced": True},
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--backend vllm: stages the target's layers are split into (vLLM's pipeline parallelism; across nodes: the"
            " number of nodes, each with --tensor-parallel-size GPUs)."
        ),
        json_schema_extra={"advanced": True},
    )
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None,
        description=(
            "--backend vllm: how vLLM runs its workers: mp, processes on this node; ray, a Ray cluster started beforehand"
            " (vLLM's way across nodes). Default: vLLM's choice (mp where this node has the GPUs)."
        ),
        json_schema_extra={"advanced": True, "default_note": "vLLM's choice"},
    )
    vllm_exact_route: Literal["sample_match", "full_logprobs"] = Field(
        "sample_match",
        description=(
            "--backend vllm, temperature > 0: vLLM samples each position and drafts are matched "
            "(sample_match), or full-vocabulary logprobs feed the acceptance rule (full_logprobs, heavy)."
        ),
        json_schema_extra={"advanced": True},
    )

    target_route: Literal["native", "verify-steps"] | None = Field(
        None,
        description=(
            "How the OpenAI routes decode target-only: native, one vLLM request per generation streamed from vLLM's own"
            " decode loop (--backend vllm only; vLLM's speed; logprobs at temperature 0 only); verify-steps, one verify call"
            " with an empty block per token, the very code that verifies drafts (greedy SPADE equals it by construction)."
            " Default: native on --backend vllm, verify-steps on transformers (its only route)."
        ),
        json_schema_extra={"advanced": True, "default_note": "native on --backend vllm, else verify-steps"},
    )

    @field_validator("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
    @classmethod
    def _parallelism_needs_vllm(cls, value: int | str | None, info: ValidationInfo) -> int | str | None:
        if value not in (1, None) and info.data.get("backend") != "vllm":
            flag = "--" + str(info.field_name).replace("_", "-")
            raise ValueError(f"{flag} is vLLM's: it needs --backend vllm (--backend transformers runs the target on one device)")
        return value

    @field_validator("target_route")
    @classmethod
    def _native_needs_vllm(cls, route: str | None, info: ValidationInfo) -> str | None:
        if route == "native" and info.data.get("backend") != "vllm":
            raise ValueError("native is vLLM's own decode loop: it needs --backend vllm (transformers serves verify-steps only)")
        return route

    def target_only_route(self) -> Literal["native", "verify-steps"]:
        """The route the OpenAI endpoints decode by: as set, else native on vLLM, verify-steps elsewhere."""
        if self.target_route is not None:
            return self.target_route
        return "native" if self.backend == "vllm" else "verify-steps"

    def session_limits(self) -> SessionLimits:
        from verifier_service.sessions import SessionLimits

        return SessionLimits(self.max_sessions, self.max_session_tokens, self.session_ttl_s)

    def batch_invariance(self) -> BatchInvariance:
        """``required`` when --batch-invariant was given, ``preferred`` by default (the transformers
        backend with its CPU kernels), ``off`` otherwise."""
        if "batch_invariant" in self.model_fields_set:
            return "required" if self.batch_invariant else "off"
        return "preferred" if self.batch_invariant and self.backend == "transformers" and self.fast_kernels else "off"

    def scheduler_limits(self) -> SchedulerLimits:
        from verifier_service.backends.transformers.plan import SchedulerLimits

        return SchedulerLimits(
            max_batch_sessions=self.max_batch_sessions,
            max_forward_rows=self.max_forward_rows,
            max_block_rows=self.max_draft_length + 1,
            batch_wait_s=self.batch_wait_ms / 1000.0,
            hold_scale=self.batch_hold_scale,
            hold_late_deviations=self.batch_hold_late_deviations,
            max_draft_length=self.max_draft_length,
        )

    def verify_limits(self) -> VerifyLimits:
        from verifier_service.service import VerifyLimits

        return VerifyLimits(self.max_draft_length, self.max_draft_support, self.max_continued_tokens, self.step_ahead_tokens)

    def pipeline_limits(self) -> PipelineLimits:
        from verifier_service.pipeline import PipelineLimits

        return PipelineLimits(self.pipeline_window_tokens, self.max_draft_length, self.max_sessions, self.session_ttl_s)
