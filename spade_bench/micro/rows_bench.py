"""The verifier's forward cost per row count, through the transformers backend's own ragged
forward (``backends.transformers.ragged``): t(R) for R rows shared by S sessions, each with its
own cached context, in the fast and batch-invariant modes side by side. This is the curve the
scheduler's advice fits, and where its knee lies says how many rows a forward takes for about
the price of one.

    python -m spade_bench.micro.rows_bench                                     # tiny target, built here
    taskset -c 1 python -m spade_bench.micro.rows_bench --model qwen2.5-coder-1.5b-instruct \
        --isa AVX512,AVX2 --rows 1,2,4,8,16,32,64,128 --sessions 1,4,8 --repeats 3 --output bench_results/rows

Every measurement feeds R random rows, split as evenly as they go over S sessions (each after its
own cached context of --context-length tokens), scores each session's last row, and crops the
caches back. Modes, row counts and session counts are interleaved within each repetition; the
table prints medians of CPU time. On CPU each mode runs once per kernel ISA asked for (``--isa``:
an AVX-512 CPU also runs the AVX2 build), labelled ``fast (AVX2)``, and the report opens with
the core's physics per ISA (``spade_bench.micro.cpu_physics``). Runs on CPU, or CUDA with --device cuda (the modes are then
the stock model under the ragged forward, one attention call per segment or ``packed``: the
kernels are CPU-only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spade_bench.micro.cpu_physics import measure_core, parse_isas
from spade_bench.micro.forward_bench import physics_lines, split_variant, tiny_source, variant_name
from spade_models.loader import ModelSource, load_model
from spade_models.pull import resolve_cache_dir
from verifier_service.backends.transformers.cpu.kernels import CpuKernelPatch, apply_cpu_kernels, load_kernel_library
from verifier_service.backends.transformers.growing_cache import growing_cache
from verifier_service.backends.transformers.ragged import RaggedCache, ragged_forward, register_ragged_attention

MODES = ("fast", "batch_invariant")
PACKED = "packed"
"""A third mode: fast, with every session's attention in one call (the default off a CPU)."""


def split_rows(num_rows: int, num_sessions: int) -> list[int]:
    """R rows over S sessions as evenly as they go (no session left empty): 10 over 4 -> 3 3 2 2."""
    sessions = min(num_rows, num_sessions)
    return [num_rows // sessions + (1 if index < num_rows % sessions else 0) for index in range(sessions)]


class RowsBench:
    """One model, S cached contexts, and one timed ragged forward per (mode, rows, sessions)."""

    def __init__(self, model, context_length: int, max_sessions: int, seed: int = 0) -> None:
        register_ragged_attention()
        self.model = model
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = context_length
        self.caches = [self._prefilled() for _ in range(max_sessions)]

    def _random(self, count: int) -> list[int]:
        return torch.randint(3, self.vocab_size, (count,), generator=self.generator).tolist()

    def _prefilled(self):
        cache = growing_cache(self.model.config)
        ragged_forward(self.model, RaggedCache([cache], [(0, self.context_length)]), [self._random(self.context_length)], [0], [])
        return cache

    def time_forward(self, num_rows: int, num_sessions: int, batch_invariant: bool, packed: bool = False) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of one ragged forward of ``num_rows`` rows over ``num_sessions``."""
        shares = split_rows(num_rows, num_sessions)
        caches = self.caches[: len(shares)]
        bounds = [0]
        for rows in shares:
            bounds.append(bounds[-1] + rows)
        segments = list(zip(bounds, bounds[1:], strict=False))
        new_ids = [self._random(rows) for rows in shares]
        scored = [end - 1 for _, end in segments]
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        ragged_cache = RaggedCache(caches, segments, batch_invariant, packed)
        ragged_forward(self.model, ragged_cache, new_ids, [self.context_length] * len(shares), scored)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.process_time() - cpu_started, time.perf_counter() - wall_started)
        for cache, rows in zip(caches, shares, strict=True):
            cache.crop(-rows)
        return elapsed


def run(bench: RowsBench, libraries: dict, modes: list[str], rows: list[int], sessions: list[int], repeats: int) -> dict:
    """(mode, rows, sessions) -> [(cpu_s, wall_s)] per repetition (repetition 0 warms up). A CPU
    mode names its kernel's ISA (``fast (AVX2)``, a key of ``libraries``)."""
    timings: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    patch: CpuKernelPatch | None = None
    for repeat in range(repeats + 1):
        for variant in modes:
            if patch is not None:
                patch.remove()
                patch = None
            mode, isa = split_variant(variant)
            if bench.device.type == "cpu":
                patch = apply_cpu_kernels(bench.model, libraries.get(isa), batch_invariant=mode == "batch_invariant")
            for num_rows in rows:
                for num_sessions in sessions:
                    elapsed = bench.time_forward(num_rows, num_sessions, mode == "batch_invariant", mode == PACKED)
                    if repeat:
                        timings.setdefault((variant, num_rows, num_sessions), []).append(elapsed)
        print(f"repetition {repeat}/{repeats} done, load {os.getloadavg()[0]:.2f}", flush=True)
    if patch is not None:
        patch.remove()
    return timings


def median_ms(samples: list[tuple[float, float]], clock: int) -> float:
    return statistics.median(sample[clock] for sample in samples) * 1e3


def table(timings: dict, modes: list[str], rows: list[int], sessions: list[int], clock: int) -> str:
    """ms per forward by row count (lines) and mode x sessions (columns), and each mode's
    t(R)/t(1) with the first session count."""
    columns = [(mode, count) for mode in modes for count in sessions]
    header = (
        "| rows | "
        + " | ".join(f"{mode}, {count} sess." for mode, count in columns)
        + " | "
        + " | ".join(f"t(R)/t(1), {mode}" for mode in modes)
        + " |"
    )
    lines = [header, "|" + " --- |" * (len(columns) + len(modes) + 1)]
    for num_rows in rows:
        cells = [f"{median_ms(timings[(mode, num_rows, count)], clock):.0f}" for mode, count in columns]
        ratios = [
            median_ms(timings[(mode, num_rows, sessions[0])], clock) / median_ms(timings[(mode, rows[0], sessions[0])], clock)
            for mode in modes
        ]
        lines.append(f"| {num_rows} | " + " | ".join(cells) + " | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")
    return "\n".join(lines)


def invariance_cost(timings: dict, rows: list[int], sessions: list[int], isa: str | None = None) -> str:
    """batch_invariant / fast per (rows, sessions): what bitwise invariance costs per forward."""
    invariant, fast = variant_name("batch_invariant", isa), variant_name("fast", isa)
    ratios = [
        median_ms(timings[(invariant, r, s)], 0) / median_ms(timings[(fast, r, s)], 0)
        for r in rows
        for s in sessions
        if (invariant, r, s) in timings and (fast, r, s) in timings
    ]
    if not ratios:
        return ""
    label = f" ({isa})" if isa else ""
    return f"batch-invariant / fast{label}, CPU time per forward: median {statistics.median(ratios):.3f}, max {max(ratios):.3f}"


def plot(timings: dict, modes: list[str], rows: list[int], sessions: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        for count in sessions:
            axes.plot(rows, [median_ms(timings[(mode, r, count)], 0) for r in rows], marker="o", label=f"{mode}, {count} sessions")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("rows per forward (R)")
    axes.set_ylabel("CPU ms per forward")
    axes.set_title("Verifier forward cost per row count (ragged forward)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target: registry name, directory or .gguf; default: a tiny target built in a temp dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--isa", help="CPU kernel ISAs, a comma list such as AVX512,AVX2 (default: the best this CPU runs)")
    parser.add_argument("--context-length", type=int, default=200)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--sessions", default="1,4,8")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join((*MODES, PACKED))}; off a CPU: fast and {PACKED}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="directory for rows_bench.md and rows_bench.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(value) for value in args.rows.split(",")]
    sessions = [int(value) for value in args.sessions.split(",")]
    on_cpu = args.device == "cpu"
    isas: list[str | None] = list(parse_isas(args.isa)) if on_cpu else []
    with tempfile.TemporaryDirectory(prefix="spade-rows-bench-") as workdir:
        source = ModelSource(args.model) if args.model else tiny_source(Path(workdir))
        loaded = load_model(source, args.device, "float32")
        libraries = {isa: load_kernel_library(resolve_cache_dir(None), isa) for isa in isas} or {None: None}
        physics = {isa: measure_core(isa) for isa in isas if isa}
        modes = [variant_name(mode, isa) for mode in args.modes.split(",") for isa in libraries] if on_cpu else ["fast", PACKED]
        bench = RowsBench(loaded.model, args.context_length, max(sessions))
        timings = run(bench, libraries, modes, rows, sessions, args.repeats)
    report = "\n\n".join(
        part
        for part in [
            f"{loaded.model_id}, fp32, {args.device}, {torch.get_num_threads()} torch thread(s), context {args.context_length} per "
            f"session, {args.repeats} repetitions (medians), load average at the end {os.getloadavg()[0]:.2f}",
            "\n".join(physics_lines(physics)),
            "CPU ms per forward\n" + table(timings, modes, rows, sessions, 0),
            "wall ms per forward\n" + table(timings, modes, rows, sessions, 1),
            "\n".join(filter(None, (invariance_cost(timings, rows, sessions, isa) for isa in libraries))),
        ]
        if part
    )
    print("\n" + report)
    if args.output:
        output = Path(args.output)
        output.mkdir(parents=True, exist_ok=True)
        (output / "rows_bench.md").write_text(report + "\n")
        plot(timings, modes, rows, sessions, output / "rows_bench.png")


if __name__ == "__main__":
    main()
