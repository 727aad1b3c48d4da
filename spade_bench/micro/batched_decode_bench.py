"""Does one llama.cpp decode over several sequences cost less than decoding them in turn? The
question of issue 24 item 2, asked of the edge's own drafting step: K requests each drafting one
token after its own cached context.

    taskset -c 0 python -m spade_bench.micro.batched_decode_bench                        # SmolLM2-135M
    taskset -c 0 python -m spade_bench.micro.batched_decode_bench --model qwen2.5-coder-0.5b-instruct \
        --sequences 2,3 --context-length 300 --steps 16 --repeats 7

One context as the drafter builds it (unified KV cache, one thread, K sequences), each sequence
prefilled with its own random context of --context-length tokens. A measurement drafts --steps
tokens for every sequence, either *in turn* (one decode of one token per sequence per step, as
the drafter does today) or *batched* (one decode of K tokens, one per sequence, per step), then
rolls the sequences back. The two variants alternate within each repetition (which goes first
alternates too), so a neighbour's load on a shared core hits both alike; each repetition gives a
ratio, in-turn CPU seconds over batched CPU seconds for the same tokens. The decision rule of
the issue: batched drafting is worth building if that ratio is >= 1.3 at K = 3.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from edge_agent.llamacpp_drafter import load_llamacpp_draft
from spade_models.loader import ModelSource

VARIANTS = ("in_turn", "batched")


@dataclass
class BatchedDecodeBench:
    """One llama.cpp context holding ``max_sequences`` prefilled sequences."""

    llama_cpp: Any
    context: Any
    vocab_size: int
    context_length: int

    @classmethod
    def build(cls, model: Any, vocab_size: int, context_length: int, max_sequences: int, seed: int = 0) -> BatchedDecodeBench:
        import cyllama.llama.llama_cpp as llama_cpp

        params = llama_cpp.LlamaContextParams()
        params.n_ctx = max_sequences * (context_length + 256)
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = 1
        params.n_seq_max = max_sequences
        params.kv_unified = True
        bench = cls(llama_cpp, llama_cpp.LlamaContext(model, params), vocab_size, context_length)
        generator = random.Random(seed)
        for seq_id in range(max_sequences):
            prompt = [generator.randrange(100, vocab_size) for _ in range(context_length)]
            bench._decode([(token_id, position, seq_id) for position, token_id in enumerate(prompt)])
        return bench

    def _decode(self, entries: list[tuple[int, int, int]]) -> None:
        """One llama.cpp decode of (token, position, sequence) entries, logits for each
        sequence's last entry (a drafter reads one row per sequence)."""
        batch = self.llama_cpp.LlamaBatch(n_tokens=max(len(entries), 1), embd=0, n_seq_max=1)
        last_of_sequence = {seq_id: index for index, (_, _, seq_id) in enumerate(entries)}
        for index, (token_id, position, seq_id) in enumerate(entries):
            batch.add(token_id, position, [seq_id], last_of_sequence[seq_id] == index)
        self.context.decode(batch)

    def draft_steps(self, num_sequences: int, num_steps: int, variant: str) -> float:
        """CPU seconds to draft ``num_steps`` tokens for each of the first ``num_sequences``
        sequences (the token fed back is a fixed id: the cost does not depend on which)."""
        started = time.thread_time()
        for step in range(num_steps):
            entries = [(1000 + seq_id, self.context_length + step, seq_id) for seq_id in range(num_sequences)]
            if variant == "batched":
                self._decode(entries)
            else:
                for entry in entries:
                    self._decode([entry])
        seconds = time.thread_time() - started
        for seq_id in range(num_sequences):
            self.context.memory_seq_rm(seq_id, self.context_length, -1)
        return seconds


def measure(bench: BatchedDecodeBench, sequence_counts: list[int], num_steps: int, repeats: int) -> dict[int, list[float]]:
    """Per K, the in-turn / batched CPU-time ratio of each repetition (variants interleaved)."""
    ratios: dict[int, list[float]] = {count: [] for count in sequence_counts}
    for repeat in range(repeats):
        for count in sequence_counts:
            order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
            seconds = {variant: bench.draft_steps(count, num_steps, variant) for variant in order}
            ratios[count].append(seconds["in_turn"] / seconds["batched"])
            tokens = count * num_steps
            print(
                f"repeat {repeat} K={count}: in turn {seconds['in_turn'] / tokens * 1e3:.2f} ms/token, "
                f"batched {seconds['batched'] / tokens * 1e3:.2f} ms/token, ratio {ratios[count][-1]:.2f}",
                flush=True,
            )
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF registry name or .gguf path")
    parser.add_argument("--sequences", default="1,2,3", help="comma-separated sequence counts K")
    parser.add_argument("--context-length", type=int, default=300, help="tokens cached per sequence before drafting")
    parser.add_argument("--steps", type=int, default=16, help="tokens drafted per sequence per measurement")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sequence_counts = [int(part) for part in args.sequences.split(",")]
    draft = load_llamacpp_draft(ModelSource(args.model))
    bench = BatchedDecodeBench.build(draft.model, draft.vocab_size, args.context_length, max(sequence_counts))
    ratios = measure(bench, sequence_counts, args.steps, args.repeats)
    print(f"\n{args.model}, context {args.context_length}, {args.steps} steps, {args.repeats} repeats, one thread")
    print("K  in-turn/batched CPU time: median (min-max)")
    for count, values in ratios.items():
        print(f"{count}  {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
