"""``spade_bench.micro.prefix_bench`` on the tiny target: the scenarios run cache on and off side by
side; with the cache, a second turn and every user after the first (one after another or all at
once) prefill only what the cache did not cover, and without it everything."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

from spade_bench.micro.prefix_bench import run, summary
from spade_models.loader import ModelSource, load_model
from verifier_service.backends.transformers.backend import TransformersBackend


def test_the_cache_covers_second_turns_and_the_shared_system_prompt(tiny_pair, tmp_path):
    rows = [
        {"question_id": n, "category": "writing", "turns": [f"Write note {n} about apples and pears.", "Now shorter."]} for n in range(8)
    ]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    backend = TransformersBackend(load_model(ModelSource(str(tiny_pair.target_dir))))
    args = Namespace(data=str(data), items=2, answer_tokens=4, num_users=3, system_tokens=60, together=True)
    records = asyncio.run(run(backend, args))
    turn_2 = {r.cache: r for r in records if r.scenario == "multi-turn: turn 2" and r.request == "0"}
    assert turn_2["off"].cached_tokens == 0 and turn_2["off"].prefilled_tokens == turn_2["off"].prompt_tokens
    assert turn_2["on"].cached_tokens >= 16
    assert turn_2["on"].prefilled_tokens == turn_2["on"].prompt_tokens - turn_2["on"].cached_tokens
    users = [r for r in records if r.scenario == "system prompt" and r.cache == "on"]
    assert users[0].cached_tokens == 0 and all(r.cached_tokens >= 48 for r in users[1:])
    assert all(r.cached_tokens == 0 for r in records if r.cache == "off")
    together = [r for r in records if r.scenario == "all at once"]
    on, off = [r for r in together if r.cache == "on"], [r for r in together if r.cache == "off"]
    assert len(on) == len(off) == 3 and all(r.cached_tokens == 0 and r.prefilled_tokens == r.prompt_tokens for r in off)
    # Arriving together, the shared prompt is prefilled once: users 2 and 3 copy user 1's.
    assert on[0].cached_tokens == 0 and all(r.cached_tokens >= 48 for r in on[1:])
    assert len(summary(records)) == 2 + 4 + 2 + 3  # header, rule, a row per scenario; blank, title, a line per user
