"""The verify-call micro-benchmark drafts with the edge's own drafter: its blocks are the ones
an edge would send (same tokens, same truncated distributions, as the backend takes them)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from edge_agent.drafter import DraftLimits, ModelDrafter
from edge_agent.settings import EdgeSettings
from spade_bench.micro.backend_bench import BenchConfig, RandomTokens, draft_block, run_rounds
from spade_core.params import SamplingConfig
from verifier_service.backends.base import BlockToVerify, BlockVerdict
from verifier_service.backends.transformers.backend import TransformersBackend

SAMPLED = SamplingConfig(temperature=1.0, seed=3)


class RecordingBackend(TransformersBackend):
    """The transformers backend, remembering every block it was asked to verify."""

    blocks: list[BlockToVerify]

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        self.blocks.append(block)
        return await super().verify_block(block)


def test_a_sampled_block_is_the_edge_drafters_with_its_distributions_spread_over_the_vocabulary(draft_model):
    vocab_size = 384
    context = draft_model.tokenizer.encode("The edge drafts a block")
    edge = ModelDrafter(draft_model, DraftLimits(EdgeSettings.model_fields["max_draft_support"].default, vocab_size))
    expected = edge.start_session().propose(context, 3, SAMPLED)
    rng = RandomTokens(random.Random(0), vocab_size)
    tokens, probs = draft_block(edge.start_session(), context, SAMPLED, 3, vocab_size, rng)
    assert tokens == expected.token_ids
    assert probs is not None and tuple(probs.shape) == (3, vocab_size)
    for row, sparse in zip(probs, expected.probs or [], strict=True):
        assert torch.nonzero(row).flatten().tolist() == sorted(sparse.token_ids)
        assert float(row.sum()) == pytest.approx(1.0, abs=1e-6)


def test_a_run_verifies_drafted_blocks_and_commits_as_an_edge_would(target_model, draft_model):
    backend = RecordingBackend(target_model)
    backend.blocks = []
    config = BenchConfig(context_length=16, num_drafted=3, rounds=2, concurrencies=(2,), temperatures=(1.0,))
    try:
        stats = asyncio.run(run_rounds(backend, draft_model, config, 1.0, 2, "bench"))
    finally:
        asyncio.run(backend.aclose())
    assert (stats.num_calls, len(backend.blocks)) == (4, 6)  # round 0 warms up, untimed
    assert stats.num_committed == stats.num_accepted + stats.num_calls
    assert all(block.num_drafted == 3 and block.draft_probs is not None for block in backend.blocks)
