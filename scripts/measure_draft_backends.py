"""Per-token draft time of the edge's two draft backends on this machine (not a test).

Qwen2.5-Coder-0.5B-Instruct: llama.cpp on its Q4_K_M GGUF (LlamaCppDrafter) against transformers
fp32 (ModelDrafter), greedy blocks of 8 continuing the context (each block feeds the previous
block's last token, as an all-accepted verdict would), a few repetitions; then what reading the
logits row costs (sampled drafting needs it, greedy does not), and the price of sharing the
llama.cpp context (a decode next to another session's 3000 tokens).

    .venv/bin/python scripts/measure_draft_backends.py [--threads 1] [--blocks 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from edge_agent.drafter import ModelDrafter
from edge_agent.llamacpp_drafter import LlamaCppDrafter, load_llamacpp_draft
from spade_core.params import SamplingConfig
from spade_models.loader import ModelSource, load_model

DRAFT = "qwen2.5-coder-0.5b-instruct"
BLOCK = 8
GREEDY = SamplingConfig(temperature=0)
PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."


def ms_per_token(drafter, prompt_ids: list[int], num_blocks: int, sampling: SamplingConfig = GREEDY) -> list[float]:
    session = drafter.start_session()
    context = list(prompt_ids)
    context += session.propose(context, BLOCK, sampling).token_ids  # prefill + warm-up
    timings = []
    for _ in range(num_blocks):
        started = time.perf_counter()
        block = session.propose(context, BLOCK, sampling)
        timings.append((time.perf_counter() - started) / BLOCK * 1e3)
        context += block.token_ids
    session.close()
    return timings


def summary(timings: list[float]) -> str:
    return (
        f"median {statistics.median(timings):.1f} ms/token "
        f"(min {min(timings):.1f}, max {max(timings):.1f}, {len(timings)} blocks of {BLOCK})"
    )


def time_call(function, repeats: int = 20) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats * 1e3


def measure_llamacpp(prompt_ids: list[int], threads: int, num_blocks: int) -> None:
    draft = load_llamacpp_draft(ModelSource(DRAFT))
    drafter = LlamaCppDrafter(draft, 32768, threads=threads, max_sessions=4)
    print(f"llama.cpp Q4_K_M, {threads} thread(s), greedy: {summary(ms_per_token(drafter, prompt_ids, num_blocks))}")
    sampled = SamplingConfig(temperature=0.8, top_p=0.95, seed=1)
    print(f"llama.cpp Q4_K_M, {threads} thread(s), sampled T=0.8: {summary(ms_per_token(drafter, prompt_ids, num_blocks, sampled))}")
    session = drafter.start_session()
    session.propose(prompt_ids, 1, GREEDY)
    context = drafter._context
    print(f"  logits row as a Python list (get_logits_ith): {time_call(lambda: context.get_logits_ith(-1)):.2f} ms")
    print(f"  logits row as a torch tensor (list + numpy, what sampling uses): {time_call(drafter._last_logits):.2f} ms")
    print(f"  greedy argmax in C (llama.cpp sampler, what greedy uses): {time_call(lambda: drafter._greedy.sample(context, -1)):.2f} ms")
    session.close()
    neighbour = drafter.start_session()
    alone, beside = [], []
    for _ in range(3):  # alternate, so load changes hit both alike
        alone += ms_per_token(drafter, prompt_ids, 2)
        neighbour.propose((prompt_ids * 200)[:3000], 1, GREEDY)
        beside += ms_per_token(drafter, prompt_ids, 2)
        neighbour.close()
        neighbour = drafter.start_session()
    print(
        f"shared context: alone {statistics.median(alone):.1f} ms/token, "
        f"beside a 3000-token session {statistics.median(beside):.1f} ms/token"
    )
    drafter.close()


def measure_transformers(prompt_ids: list[int], threads: int, num_blocks: int) -> None:
    torch.set_num_threads(threads)
    loaded = load_model(ModelSource(DRAFT), "cpu", "float32")
    print(f"transformers fp32, {threads} thread(s), greedy: {summary(ms_per_token(ModelDrafter(loaded), prompt_ids, num_blocks))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--skip-transformers", action="store_true")
    arguments = parser.parse_args()
    print(f"load before: {os.getloadavg()} on {os.cpu_count()} cores")
    draft = load_llamacpp_draft(ModelSource(DRAFT))
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = draft.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    print(f"prompt: {len(prompt_ids)} tokens")
    measure_llamacpp(prompt_ids, arguments.threads, arguments.blocks)
    if not arguments.skip_transformers:
        measure_transformers(prompt_ids, arguments.threads, arguments.blocks)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
