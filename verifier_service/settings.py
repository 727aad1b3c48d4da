"""Verifier configuration: every field is a CLI flag and an env var SPADE_VERIFIER_<FIELD>."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from verifier_service.service import VerifyLimits
from verifier_service.sessions import SessionLimits


class VerifierSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPADE_VERIFIER_", protected_namespaces=())

    model: str = Field("qwen2.5-coder-1.5b-instruct", description="Target model: HF id, local directory, .gguf path or spade-models name.")
    gguf_file: str | None = Field(None, description="GGUF file inside --model (a directory or hub repo) to load.")
    served_model_name: str | None = Field(None, description="Model id clients pass; defaults to the model's name.")
    backend: Literal["transformers", "vllm"] = Field("transformers", description="Engine running the target.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8001, ge=0, le=65535, description="Port to listen on.")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or mps.")
    dtype: str = Field("float32", description="float32, bfloat16 or float16 (float32 for bit-exact greedy).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice).")
    max_context_length: int | None = Field(None, ge=2, description="Override the model's context length.")
    max_draft_tokens: int = Field(64, ge=1, description="Longest drafted block per verify call.")
    max_draft_support: int = Field(256, ge=1, description="Most tokens in one drafted position's distribution.")
    max_sessions: int = Field(256, ge=1, description="Edge sessions kept (least recently used evicted).")
    max_session_tokens: int = Field(2_000_000, ge=1, description="Committed tokens kept over all sessions.")
    session_ttl_s: float = Field(600.0, gt=0, description="Idle seconds before a session is dropped.")
    vllm_block_size: int = Field(32, ge=1, description="--backend vllm: KV block size (CPU attention needs a multiple of 32).")
    vllm_kv_cache_gib: float = Field(1.0, gt=0, description="--backend vllm: KV cache size in GiB (must hold the model's context length).")
    vllm_exact_route: Literal["sample_match", "full_logprobs"] = Field("sample_match", description="--backend vllm, temperature > 0: vLLM samples each position and drafts are matched (sample_match), or full-vocabulary logprobs feed the acceptance rule (full_logprobs, heavy).")
    log_level: str = Field("info", description="Logging level.")

    def session_limits(self) -> SessionLimits:
        return SessionLimits(self.max_sessions, self.max_session_tokens, self.session_ttl_s)

    def verify_limits(self) -> VerifyLimits:
        return VerifyLimits(self.max_draft_tokens, self.max_draft_support)
