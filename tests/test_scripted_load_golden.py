"""The transformers backend's verdicts and forward plans on a scripted load, as recorded before a
refactor (``tests/golden/scripted_load.json``): a refactor that meant to change nothing changes
neither which calls share each forward nor what any call is answered.

The load: eight sessions (two pairs sharing a system prompt in one namespace, one 90-token prompt
prefilled in chunks, the rest short), six rounds, each session a block of 0 to 6 drafted tokens
per round (greedy ones mostly the target's own choice), greedy and seeded sampling, contexts growing by what the verifier answered, all of a
round's calls submitted together; forwards of at most 4 sessions and 24 rows, no holding (hold
waits depend on the clock; the plans here do not). Every forward's shares (session, row
allowance) and every verdict (accepted, next token, bonus, rows fed, tokens copied from a shared
prefix, sessions in its forward) are compared.

After a change that is meant to change them, regenerate the file and say why in the commit:
``SPADE_WRITE_GOLDEN=1 scripts/test tests/test_scripted_load_golden.py`` (the run writes it and
fails, so that a write is never mistaken for a pass)."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import torch

from spade_core.params import SamplingConfig
from verifier_service.backends.base import BlockToVerify
from verifier_service.backends.transformers.backend import TransformersBackend
from verifier_service.backends.transformers.plan import SchedulerLimits
from verifier_support import plain_forward_logits, random_tokens

GOLDEN = Path(__file__).parent / "golden" / "scripted_load.json"
LIMITS = SchedulerLimits(max_batch_sessions=4, max_forward_rows=24, max_block_rows=9, hold_scale=0.0, max_draft_length=8)
NUM_ROUNDS = 6


def _draft_probs(rng: random.Random, block: list[int], vocab_size: int) -> torch.Tensor:
    """Nearly flat rows that favour the drafted token a little: about half the drafts pass."""
    probs = torch.rand(len(block), vocab_size, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    probs[torch.arange(len(block)), torch.tensor(block)] += 0.5
    return probs / probs.sum(dim=-1, keepdim=True)


def _greedy_draft(model, rng: random.Random, context: list[int], vocab_size: int) -> list[int]:
    """0 to 6 tokens of the target's own greedy continuation, one of them wrong now and then, so
    greedy blocks are accepted in part."""
    drafted: list[int] = []
    for _ in range(rng.randrange(0, 7)):
        token = int(plain_forward_logits(model, context + drafted)[-1].argmax())
        drafted.append(rng.randrange(vocab_size) if rng.random() < 0.15 else token)
    return drafted


def _sessions(rng: random.Random, vocab_size: int) -> dict[str, tuple[list[int], str | None, SamplingConfig]]:
    """Each session's prompt, cache namespace and sampling."""
    system = random_tokens(rng, 40, vocab_size)
    greedy, seeded = SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8, top_k=20, top_p=0.95, seed=5)
    return {
        "shared-a": (system + random_tokens(rng, 5, vocab_size), "ns", greedy),
        "shared-b": (system + random_tokens(rng, 7, vocab_size), "ns", seeded),
        "long": (random_tokens(rng, 90, vocab_size), None, greedy),
        **{
            f"s{index}": (random_tokens(rng, rng.randrange(1, 12), vocab_size), None, seeded if index % 2 else greedy) for index in range(5)
        },
    }


async def _scripted_load(target_model, vocab_size: int) -> dict[str, list]:
    rng = random.Random(2024)
    backend = TransformersBackend(target_model)
    backend.configure(LIMITS)
    forwards: list[list] = []
    runner = backend._scheduler._runner
    run = runner.run

    def recording_run(shares):
        forwards.append([[share.block.session_id, share.max_rows] for share in shares])
        return run(shares)

    runner.run = recording_run
    sessions = _sessions(rng, vocab_size)
    contexts = {session_id: list(prompt) for session_id, (prompt, _, _) in sessions.items()}
    verdicts: list[list] = []
    try:
        for _ in range(NUM_ROUNDS):
            blocks = []
            for session_id, (_, namespace, sampling) in sessions.items():
                if sampling.temperature > 0:
                    drafted = random_tokens(rng, rng.randrange(0, 7), vocab_size)
                else:
                    drafted = _greedy_draft(target_model.model, rng, contexts[session_id], vocab_size)
                probs = _draft_probs(rng, drafted, vocab_size) if sampling.temperature > 0 and drafted else None
                blocks.append(BlockToVerify(session_id, contexts[session_id], drafted, probs, sampling, cache_namespace=namespace))
            answers = await asyncio.gather(*(backend.verify_block(block) for block in blocks))
            for block, answer in zip(blocks, answers, strict=True):
                verdicts.append(
                    [
                        block.session_id,
                        answer.num_accepted,
                        answer.next_token_id,
                        answer.is_bonus,
                        answer.num_target_tokens,
                        answer.num_cached_tokens,
                        answer.num_batched,
                    ]
                )
                contexts[block.session_id] = block.context_token_ids + block.draft_token_ids[: answer.num_accepted] + [answer.next_token_id]
    finally:
        await backend.aclose()
    return {"forwards": forwards, "verdicts": verdicts}


def test_verdicts_and_forward_plans_are_those_recorded_before_the_refactor(target_model, vocab_size):
    observed = asyncio.run(_scripted_load(target_model, vocab_size))
    if os.environ.get("SPADE_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(observed, indent=None, separators=(",", ":")) + "\n")
        raise AssertionError(f"wrote {GOLDEN}: commit it (and say why it changed), then run without SPADE_WRITE_GOLDEN")
    recorded = json.loads(GOLDEN.read_text())
    assert len(observed["forwards"]) > NUM_ROUNDS  # chunked prefills and full forwards: more forwards than rounds
    assert any(verdict[5] > 0 for verdict in observed["verdicts"])  # a shared prefix was copied
    assert sum(verdict[1] > 0 for verdict in observed["verdicts"]) >= 10  # blocks accepted in part or whole
    assert observed["forwards"] == recorded["forwards"]
    assert observed["verdicts"] == recorded["verdicts"]
