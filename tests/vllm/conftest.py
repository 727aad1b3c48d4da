"""Fixtures for the vLLM backend suite: a tiny pair vLLM's CPU attention accepts, one engine per
test session, and the same target loaded by transformers as the fp32 reference.

Run with ``.venv-vllm/bin/python -m pytest -m vllm tests/vllm`` (``.ci/vllm_suite.sh`` builds
that environment). Nothing here imports vLLM at collection time, so the default suite, which
deselects the ``vllm`` mark, collects these files without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from spade_models.loader import LoadedModel, ModelSource, load_model
from spade_models.tiny import TinyPairSpec, build_tiny_pair

# vLLM CPU attention supports head dimensions 32, 64, ... (not the default tiny pair's 16).
VLLM_TINY_SPEC = TinyPairSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=11)
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class VllmPair:
    target_dir: Path
    draft_dir: Path


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory) -> VllmPair:
    return VllmPair(*build_tiny_pair(tmp_path_factory.mktemp("tiny-vllm"), VLLM_TINY_SPEC))


@pytest.fixture(scope="session")
def hf_target(vllm_pair) -> LoadedModel:
    return load_model(ModelSource(str(vllm_pair.target_dir)))


@pytest.fixture(scope="session")
def hf_draft(vllm_pair) -> LoadedModel:
    return load_model(ModelSource(str(vllm_pair.draft_dir)))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_backend(vllm_pair):
    """One engine for the session (about 20-30 s to start on 2 cores), sample_match route."""
    from verifier_service.backends.vllm.backend import VllmEngineOptions, create_vllm_backend

    backend = await create_vllm_backend(
        ModelSource(str(vllm_pair.target_dir)), VllmEngineOptions(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.5)
    )
    yield backend
    await backend.aclose()


@pytest.fixture(scope="session")
def target_logits(hf_target):
    """Token ids -> fp32 logits [len, vocab] of the transformers target (the reference)."""

    def forward(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf_target.model(input_ids=torch.tensor([token_ids])).logits[0].float()

    return forward


@dataclass(frozen=True)
class ServedVerifier:
    """A verifier app built as ``spade-verifier --backend vllm`` builds it, served on loopback."""

    url: str
    app: Any


def served_verifier(vllm_pair: VllmPair, **settings: Any) -> Iterator[ServedVerifier]:
    from servers import serve
    from verifier_support import verifier_app

    app = verifier_app(vllm_pair, backend="vllm", **settings)
    with serve(app, timeout_s=240) as url:
        yield ServedVerifier(url, app)


@pytest.fixture(scope="session")
def native_verifier(vllm_pair) -> Iterator[ServedVerifier]:
    """The default: target-only requests on vLLM's own decode loop (--target-route native)."""
    yield from served_verifier(vllm_pair)


@pytest.fixture(scope="session")
def steps_verifier(vllm_pair) -> Iterator[ServedVerifier]:
    """Target-only requests as one verify call with an empty block per token (--target-route verify-steps)."""
    yield from served_verifier(vllm_pair, target_route="verify-steps")


@pytest.fixture(scope="session")
def pipelined_verifier(vllm_pair) -> Iterator[ServedVerifier]:
    """Pipelined sessions on vLLM (--pipelined-sessions: the engine runs with the session proposer),
    a window of 6 tokens."""
    yield from served_verifier(vllm_pair, pipelined_sessions=True, pipeline_window_tokens=6)
