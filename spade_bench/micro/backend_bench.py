"""Verify-call micro-benchmark: the vLLM backend against the transformers backend, same model.

Each configuration runs ``--rounds`` lock-step rounds over N concurrent sessions (N = 1 and 8 by
default). In a round every session first drafts a block (outside the timing: the edge's own
transformers drafter, ``edge_agent.drafter.ModelDrafter``, or random tokens when there is no
draft), then all N verify calls go out at once; each call's latency and the round's wall time
are recorded, and each session commits its accepted tokens plus the next token, as the edge
would.

Run it in the vLLM environment (``.ci/vllm_env.sh``) so both backends are importable:

    .venv-vllm/bin/python -m spade_bench.micro.backend_bench                       # tiny pair, built here
    .venv-vllm/bin/python -m spade_bench.micro.backend_bench --model qwen2.5-coder-1.5b-instruct
        --draft none --context-length 256 --rounds 2 --routes sample_match   # (one line)

Prints a Markdown table: per backend (and vLLM exact route), temperature and concurrency, the
verify latency (mean, p50, p90), verify calls/s, committed tokens/s, drafted tokens accepted per
call, target tokens computed per call, and resident memory of the serving processes (summed
over vLLM's three processes). Other processes on a shared machine stretch both backends'
OpenMP threads many times over: compare rows of one run, and read the load average printed with
the table. Results: docs/benchmarks.md, "Component measurements".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edge_agent.drafter import DraftLimits, ModelDrafter, ModelDraftSession
from edge_agent.settings import EdgeSettings
from spade_core.params import SamplingConfig
from spade_models.loader import LoadedModel, ModelSource, load_model
from verifier_service.backends.base import BlockToVerify, VerifierBackend
from verifier_service.verify_input import dense_draft_probs


@dataclass(frozen=True)
class BenchConfig:
    context_length: int = 512
    num_drafted: int = 8
    rounds: int = 16
    concurrencies: tuple[int, ...] = (1, 8)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0


@dataclass
class RunStats:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    num_calls: int = 0
    num_committed: int = 0
    num_accepted: int = 0
    num_target_tokens: int = 0


@dataclass
class Session:
    session_id: str
    context: list[int]


def process_tree_rss_gib() -> float:
    """Resident memory of this process and its children (vLLM's engine core and worker)."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    process = psutil.Process(os.getpid())
    processes = [process, *process.children(recursive=True)]
    return sum(p.memory_info().rss for p in processes if p.is_running()) / 2**30


def draft_block(
    session: ModelDraftSession | None, context: list[int], sampling: SamplingConfig, num_drafted: int, vocab_size: int, rng: RandomTokens
) -> tuple[list[int], torch.Tensor | None]:
    """What the edge sends, drafted by the edge's own drafter (its KV cache kept across rounds,
    its distributions truncated as the edge's are), as the backend takes it; random tokens
    without a draft model."""
    if session is None:
        return rng.tokens(num_drafted), None
    block = session.propose(context, num_drafted, sampling)
    return block.token_ids, None if block.probs is None else dense_draft_probs(block.probs, vocab_size)


@dataclass
class RandomTokens:
    """Random token ids from the tokenizer's table, as real text would use (Qwen2.5's logits have
    151,936 rows, its tokenizer 151,665 tokens)."""

    rng: random.Random
    num_real_tokens: int

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(3, self.num_real_tokens) for _ in range(count)]


async def run_rounds(
    backend: VerifierBackend, draft: LoadedModel | None, config: BenchConfig, temperature: float, concurrency: int, label: str
) -> RunStats:
    vocab_size = backend.model.vocab_size
    if not isinstance(backend.tokenizer, Sized):
        raise ValueError(f"{label}: the backend's tokenizer does not tell its number of tokens")
    rng = RandomTokens(random.Random(config.seed), min(vocab_size, len(backend.tokenizer)))
    max_support = EdgeSettings.model_fields["max_draft_support"].default  # what an edge sends by default
    drafter = None if draft is None else ModelDrafter(draft, DraftLimits(max_support, vocab_size))
    sessions = [Session(f"{label}-{index}", rng.tokens(config.context_length)) for index in range(concurrency)]
    drafts = [None if drafter is None else drafter.start_session() for _ in sessions]
    stats = RunStats()
    for round_index in range(config.rounds + 1):  # round 0 warms each session up, untimed
        blocks = []
        for index, (session, draft_session) in enumerate(zip(sessions, drafts, strict=True)):
            sampling = SamplingConfig(temperature=temperature, seed=config.seed + index)
            tokens, probs = draft_block(draft_session, session.context, sampling, config.num_drafted, vocab_size, rng)
            blocks.append(BlockToVerify(session.session_id, list(session.context), tokens, probs, sampling))
        started = time.perf_counter()
        results = await asyncio.gather(*[timed_verify(backend, block) for block in blocks])
        wall_s = time.perf_counter() - started
        for session, block, (verdict, latency_s) in zip(sessions, blocks, results, strict=True):
            session.context += block.draft_token_ids[: verdict.num_accepted] + [verdict.next_token_id]
            if round_index:
                record(stats, verdict, latency_s)
        stats.wall_s += wall_s if round_index else 0.0
    for session, draft_session in zip(sessions, drafts, strict=True):
        backend.release_session(session.session_id)
        if draft_session is not None:
            draft_session.close()
    return stats


async def timed_verify(backend: VerifierBackend, block: BlockToVerify):
    started = time.perf_counter()
    verdict = await backend.verify_block(block)
    return verdict, time.perf_counter() - started


def record(stats: RunStats, verdict, latency_s: float) -> None:
    stats.latencies_s.append(latency_s)
    stats.num_calls += 1
    stats.num_accepted += verdict.num_accepted
    stats.num_committed += verdict.num_accepted + 1
    stats.num_target_tokens += verdict.num_target_tokens


def table_row(name: str, temperature: float, concurrency: int, stats: RunStats, rss_gib: float) -> str:
    latencies_ms = sorted(latency * 1000 for latency in stats.latencies_s)
    p90 = latencies_ms[min(len(latencies_ms) - 1, int(0.9 * len(latencies_ms)))]
    cells = [
        name,
        f"{temperature:g}",
        str(concurrency),
        f"{statistics.mean(latencies_ms):.1f}",
        f"{statistics.median(latencies_ms):.1f}",
        f"{p90:.1f}",
        f"{stats.num_calls / stats.wall_s:.1f}",
        f"{stats.num_committed / stats.wall_s:.1f}",
        f"{stats.num_accepted / stats.num_calls:.2f}",
        f"{stats.num_target_tokens / stats.num_calls:.1f}",
        f"{rss_gib:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| backend | temp | sessions | mean ms | p50 ms | p90 ms | calls/s | tokens/s | accepted/call | target tokens/call | RSS GiB |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


async def bench_backend(
    name: str, backends: Sequence[tuple[str, VerifierBackend]], draft: LoadedModel | None, config: BenchConfig
) -> list[str]:
    rows = []
    for temperature in config.temperatures:
        for route_name, backend in backends:
            if temperature == 0 and route_name != backends[0][0]:
                continue  # greedy ignores the exact route: measure it once
            label = name if temperature == 0 else route_name
            for concurrency in config.concurrencies:
                stats = await run_rounds(backend, draft, config, temperature, concurrency, f"{label}-{temperature}")
                rows.append(table_row(label, temperature, concurrency, stats, process_tree_rss_gib()))
                print(rows[-1], flush=True)
    return rows


async def transformers_rows(source: ModelSource, draft: LoadedModel | None, config: BenchConfig, args) -> list[str]:
    from verifier_service.backends.transformers.backend import TransformersBackend

    started = time.perf_counter()
    backend = TransformersBackend(
        load_model(source, "cpu", args.dtype),
        args.max_model_len,
        fast_kernels=args.cpu_kernels != "stock",
        batch_invariant=args.cpu_kernels == "batch_invariant",
    )
    print(f"transformers backend loaded in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        return await bench_backend("transformers", [("transformers", backend)], draft, config)
    finally:
        await backend.aclose()


async def vllm_rows(source: ModelSource, draft: LoadedModel | None, config: BenchConfig, args) -> list[str]:
    from verifier_service.backends.vllm.backend import EXACT_ROUTES, VllmEngineOptions, create_vllm_backend

    options = VllmEngineOptions(
        dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size, kv_cache_gib=args.kv_cache_gib
    )
    backend = await create_vllm_backend(source, options)
    startup = backend.startup
    timings = f"start {startup.engine_s:.1f} s, warm-up {startup.warmup_s:.1f} s" if startup else "started"
    print(f"vLLM engine {timings}, RSS after start {process_tree_rss_gib():.2f} GiB", flush=True)
    try:
        names = args.routes.split(",")
        if not set(names) <= set(EXACT_ROUTES):
            raise ValueError(f"--routes takes {EXACT_ROUTES}, got {args.routes!r}")
        routes = [(f"vllm {route}", backend.with_route(route)) for route in names]
        return await bench_backend("vllm", routes, draft, config)
    finally:
        await backend.aclose()


def tiny_sources(directory: Path) -> tuple[ModelSource, ModelSource]:
    from spade_models.tiny import TinyPairSpec, build_tiny_pair

    # vLLM CPU attention supports head dimensions 32, 64, ...: the tiny pair with head_dim 32.
    spec = TinyPairSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=11)
    target, draft = build_tiny_pair(directory, spec)
    return ModelSource(str(target)), ModelSource(str(draft))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target: registry name, directory or .gguf; default: the tiny pair, built in a temp dir")
    parser.add_argument("--gguf-file", help="GGUF file inside --model")
    parser.add_argument("--draft", help="draft model for realistic blocks ('none': random tokens)")
    parser.add_argument("--backends", default="transformers,vllm")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--cpu-kernels",
        choices=("fast", "batch_invariant", "stock"),
        default="fast",
        help="transformers backend on CPU: the verifier's kernels (its default), batch-invariant, or stock transformers",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--context-length", type=int, default=BenchConfig.context_length)
    parser.add_argument("--num-drafted", type=int, default=BenchConfig.num_drafted)
    parser.add_argument("--rounds", type=int, default=BenchConfig.rounds)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated session counts")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    parser.add_argument(
        "--routes",
        default="sample_match,full_logprobs",
        help="vLLM exact routes for temperature > 0 (full_logprobs is prompt x vocab per call)",
    )
    return parser.parse_args(argv)


async def run(args: argparse.Namespace, workdir: Path) -> list[str]:
    if args.model:
        source, draft_source = ModelSource(args.model, args.gguf_file), None
    else:
        source, draft_source = tiny_sources(workdir)
    if args.draft:
        draft_source = None if args.draft == "none" else ModelSource(args.draft)
    draft = load_model(draft_source, "cpu", "float32") if draft_source else None
    config = BenchConfig(
        context_length=args.context_length,
        num_drafted=args.num_drafted,
        rounds=args.rounds,
        concurrencies=tuple(int(value) for value in args.concurrency.split(",")),
        temperatures=tuple(float(value) for value in args.temperatures.split(",")),
    )
    rows = []
    for name in args.backends.split(","):
        if name not in ("transformers", "vllm"):
            raise ValueError(f"unknown backend {name!r} (transformers or vllm)")
        make_rows = transformers_rows if name == "transformers" else vllm_rows
        rows += await make_rows(source, draft, config, args)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spade-backend-bench-") as workdir:
        rows = asyncio.run(run(args, Path(workdir)))
    print(
        f"\nverify calls: context {args.context_length} tokens, {args.num_drafted} drafted per call, "
        f"{args.rounds} rounds, dtype {args.dtype}, {torch.get_num_threads()} torch threads, "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print(TABLE_HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
