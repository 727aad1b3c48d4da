"""The target's forward time against the draft length: t(d) for d drafted tokens (d + 1 rows
fed on top of a cached context), stock transformers vs the verifier's CPU kernels (fast, fast
without packed weights, batch-invariant), for each kernel ISA asked for (``--isa AVX512,AVX2``:
an AVX-512 CPU also runs the AVX2 build), side by side in one process on one loaded model.

    python -m spade_bench.micro.forward_bench                                  # tiny target, built here
    taskset -c 1 python -m spade_bench.micro.forward_bench --model qwen2.5-coder-1.5b-instruct \
        --isa AVX512,AVX2 --context-lengths 1000 --repeats 3 --output bench_results/forward

Beside the times it prints the physics (``spade_bench.micro.cpu_physics``): the CPU's model and clock,
one core's stream bandwidth and in-register FMA rate per ISA, and what each forward achieved (its
linear layers' weight bytes and FLOPs over its time), for the curve t(R), R = 1 to 16 rows, and
a ``--prefill-rows`` prefill (512 by default, keeping one row's logits as a prefill does).

For each context length the context is prefilled once (with the fast kernels; the cache
contents do not change the timing) and every measurement feeds d + 1 random tokens after it,
times the model call alone (logits for the d + 1 rows, as the verifier keeps), then crops the
cache back. Stock runs on transformers' DynamicCache, the kernels on the verifier's in-place
``growing_cache``, as in the verifier. Modes and draft lengths are interleaved within each
repetition, so a neighbour's load spreads over all of them; the tables print medians of CPU
time (and of wall time). Also checked, on the same model:
the batch-invariant mode's rows are bitwise equal to one-token steps, and the kernels' logits
stay within fp32 rounding of the stock model's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from spade_bench.micro.cpu_physics import CorePhysics, measure_core, parse_isas
from spade_models.kv_cache import cache_argument_name
from spade_models.loader import ModelSource, load_model
from spade_models.pull import resolve_cache_dir
from verifier_service.backends.transformers.cpu.kernels import CpuKernelPatch, KernelLibrary, apply_cpu_kernels, load_kernel_library
from verifier_service.backends.transformers.growing_cache import growing_cache

MODES = ("stock", "fast_dot", "fast", "batch_invariant")
"""fast_dot: the fast mode with every weight left row-major (the kernel's dot-product form, as
before weights were packed); fast and batch_invariant pack the weights as the verifier does."""
DRAFTED = tuple(range(16))
"""d = 0 is one target-only step (one row); d drafted tokens feed d + 1 rows: R = 1 to 16."""
PREFILL_ROWS = 512


CLOCKS = ("cpu", "wall")
"""cpu: this process's CPU time (what the verifier's process_cpu_seconds_total counts; a busy
neighbour on the same core stretches wall time, not CPU time); wall: elapsed time."""


@dataclass
class Timings:
    seconds: dict[tuple[str, int, str, int], list[float]] = field(default_factory=dict)
    """(clock, context length, mode, drafted) -> one forward's seconds per repetition."""

    def add(self, context_length: int, mode: str, drafted: int, cpu_s: float, wall_s: float) -> None:
        for clock, value in zip(CLOCKS, (cpu_s, wall_s), strict=True):
            self.seconds.setdefault((clock, context_length, mode, drafted), []).append(value)

    def median_ms(self, clock: str, context_length: int, mode: str, drafted: int) -> float:
        return statistics.median(self.seconds[(clock, context_length, mode, drafted)]) * 1e3


def variant_name(mode: str, isa: str | None) -> str:
    """A mode on one kernel ISA: ``fast (AVX2)``; stock runs no kernel."""
    return mode if mode == "stock" or isa is None else f"{mode} ({isa})"


def split_variant(variant: str) -> tuple[str, str | None]:
    """``fast (AVX2 old)`` -> (``fast``, ``AVX2 old``): the mode and its kernel's label."""
    mode, _, isa = variant.partition(" (")
    return mode, isa.rstrip(")") or None


def variant_isa(variant: str) -> str:
    """The ISA a variant's kernel runs (``AVX2`` for ``fast (AVX2 old)``); "" for stock."""
    return (split_variant(variant)[1] or "").split(" ")[0]


class ForwardBench:
    """One model, its cache over a random context, and the variants (mode, ISA) to switch between."""

    def __init__(self, model, libraries: dict[str | None, KernelLibrary | None], seed: int = 0) -> None:
        self.model = model
        self.libraries = libraries
        self.cache_argument = cache_argument_name(model)
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.patch: CpuKernelPatch | None = None

    def use(self, variant: str) -> None:
        if self.patch is not None:
            self.patch.remove()
            self.patch = None
        mode, isa = split_variant(variant)
        if mode != "stock":
            library = self.libraries.get(isa, next(iter(self.libraries.values()), None))
            self.patch = apply_cpu_kernels(self.model, library, batch_invariant=mode == "batch_invariant", pack_weights=mode != "fast_dot")

    def random_tokens(self, count: int) -> torch.Tensor:
        return torch.randint(3, self.vocab_size, (1, count), generator=self.generator)

    def forward(self, cache: DynamicCache, token_ids: torch.Tensor, keep: int) -> torch.Tensor:
        with torch.inference_mode():
            output = self.model(input_ids=token_ids, use_cache=True, logits_to_keep=keep, **{self.cache_argument: cache})
        return output.logits[0]

    def prefill(self, context_length: int) -> dict[str, DynamicCache]:
        """Per mode, the cache the verifier would use over one random context: transformers'
        DynamicCache for stock, the in-place ``growing_cache`` with the kernels."""
        grown = growing_cache(self.model.config)
        self.use(variant_name("fast", next(iter(self.libraries), None)))
        self.forward(grown, self.random_tokens(context_length), 1)
        stock = DynamicCache(config=self.model.config)
        for index, layer in enumerate(grown.layers):
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                raise ValueError(f"layer {index} is not a filled key/value layer: the bench copies those only")
            stock.update(layer.keys.clone(), layer.values.clone(), index)
        return {"stock": stock, "kernels": grown}

    def cache_for(self, caches: dict[str, DynamicCache], variant: str) -> DynamicCache:
        return caches["stock" if variant == "stock" else "kernels"]

    def time_block(self, cache: DynamicCache, drafted: int, keep: int | None = None) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of one forward of d + 1 rows after the cached context,
        keeping the logits of every row (a verify) or of the last ``keep`` (a prefill)."""
        token_ids = self.random_tokens(drafted + 1)
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        self.forward(cache, token_ids, drafted + 1 if keep is None else keep)
        elapsed = (time.process_time() - cpu_started, time.perf_counter() - wall_started)
        cache.crop(-(drafted + 1))
        return elapsed


def run_timings(bench: ForwardBench, context_lengths: list[int], modes: list[str], drafted: list[int], repeats: int) -> Timings:
    timings = Timings()
    for context_length in context_lengths:
        caches = bench.prefill(context_length)
        for repeat in range(repeats + 1):  # repetition 0 warms up, untimed
            for mode in modes:
                bench.use(mode)
                for num_drafted in drafted:
                    cpu_s, wall_s = bench.time_block(bench.cache_for(caches, mode), num_drafted)
                    if repeat:
                        timings.add(context_length, mode, num_drafted, cpu_s, wall_s)
            print(f"context {context_length}: repetition {repeat}/{repeats} done, load {os.getloadavg()[0]:.2f}", flush=True)
    bench.use("stock")
    return timings


def run_prefills(bench: ForwardBench, context_length: int, modes: list[str], num_rows: int, repeats: int) -> dict[str, float]:
    """Per variant, the median CPU seconds of a ``num_rows``-row forward after the context that
    keeps one row's logits (a prefill chunk); variants interleaved within each repetition."""
    caches = bench.prefill(context_length)
    seconds: dict[str, list[float]] = {}
    for repeat in range(repeats):
        for mode in modes:
            bench.use(mode)
            seconds.setdefault(mode, []).append(bench.time_block(bench.cache_for(caches, mode), num_rows - 1, keep=1)[0])
        print(f"prefill of {num_rows} rows: repetition {repeat + 1}/{repeats} done", flush=True)
    bench.use("stock")
    return {mode: statistics.median(values) for mode, values in seconds.items()}


@dataclass(frozen=True)
class LinearSizes:
    """The target's linear layers: what a forward reads (weight bytes) and computes (2 FLOPs per
    weight and row; attention's own FLOPs are left out, small at these context lengths)."""

    body_parameters: int
    head_parameters: int

    @classmethod
    def of(cls, model) -> LinearSizes:
        head = model.get_output_embeddings()
        head_id = id(head.weight) if head is not None else None
        body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) != head_id)
        return cls(body, 0 if head is None else head.weight.numel())

    @property
    def weight_bytes(self) -> int:
        return 4 * (self.body_parameters + self.head_parameters)

    def flops(self, num_rows: int, logit_rows: int) -> float:
        return 2.0 * (self.body_parameters * num_rows + self.head_parameters * logit_rows)


def physics_lines(physics: dict[str, CorePhysics | None]) -> list[str]:
    return [f"{isa}: {core.describe()}" if core else f"{isa}: the physics probe could not be built" for isa, core in physics.items()]


def efficiency_table(
    timings: Timings, context_length: int, modes: list[str], drafted: list[int], sizes: LinearSizes, physics: dict[str, CorePhysics | None]
) -> str:
    """Per kernel variant and row count: CPU ms, t(R)/t(1), and the weight GB/s and GFLOP/s the
    forward achieved, as shares of the core's stream bandwidth and FMA rate for its ISA."""
    lines = [
        "| variant | rows R | CPU ms | t(R)/t(1) | GB/s (of stream) | GFLOP/s (of FMA peak) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in modes:
        core = physics.get(variant_isa(mode))
        one_row = timings.median_ms("cpu", context_length, mode, drafted[0])
        for num_drafted in drafted:
            milliseconds = timings.median_ms("cpu", context_length, mode, num_drafted)
            lines.append(
                f"| {mode} | {num_drafted + 1} | {milliseconds:.0f} | {milliseconds / one_row:.2f} | "
                + efficiency_cells(milliseconds / 1e3, sizes, num_drafted + 1, num_drafted + 1, core)
                + " |"
            )
    return "\n".join(lines)


def efficiency_cells(seconds: float, sizes: LinearSizes, num_rows: int, logit_rows: int, core: CorePhysics | None) -> str:
    gbps, gflops = sizes.weight_bytes / seconds / 1e9, sizes.flops(num_rows, logit_rows) / seconds / 1e9
    if core is None:
        return f"{gbps:.1f} | {gflops:.1f}"
    return f"{gbps:.1f} ({gbps / core.stream_gbps:.0%}) | {gflops:.1f} ({gflops / core.fma_gflops:.0%})"


def prefill_table(seconds: dict[str, float], num_rows: int, sizes: LinearSizes, physics: dict[str, CorePhysics | None]) -> str:
    lines = [
        f"| variant | {num_rows}-row prefill, CPU s | ms per row | GB/s (of stream) | GFLOP/s (of FMA peak) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, value in seconds.items():
        core = physics.get(variant_isa(mode))
        lines.append(f"| {mode} | {value:.2f} | {value / num_rows * 1e3:.1f} | " + efficiency_cells(value, sizes, num_rows, 1, core) + " |")
    return "\n".join(lines)


NUMERICS_CONTEXT = 128
"""The numerics check's context, at most: it prefills it anew for every variant and block size
(with the real 1.5B, ``--compare-source`` and a 1000-token context, that was over half an hour
after the timings); row invariance and the distance from stock do not depend on its length."""


def check_numerics(bench: ForwardBench, context_length: int, row_counts: list[int]) -> list[str]:
    """Per ISA: bitwise row invariance of the batch-invariant mode, and the kernels' distance from stock."""
    prefix = bench.random_tokens(context_length)
    block = bench.random_tokens(max(row_counts))
    lines = []
    logits = {}
    variants = ["stock"] + [variant_name(mode, isa) for isa in bench.libraries for mode in ("fast", "batch_invariant")]
    for variant in variants:
        bench.use(variant)
        rows = {}
        for length in row_counts:
            cache = DynamicCache(config=bench.model.config) if variant == "stock" else growing_cache(bench.model.config)
            bench.forward(cache, prefix, 1)
            rows[length] = bench.forward(cache, block[:, :length], length)
        logits[variant] = rows
        if variant != "stock":
            equal = [length for length in row_counts[1:] if torch.equal(rows[length][0], rows[1][0])]
            lines.append(f"{variant}: row 0 of an M-row block bitwise equal to the one-row forward for M in {equal} (of {row_counts[1:]})")
    bench.use("stock")
    longest = max(row_counts)
    for variant in variants[1:]:
        difference = (logits[variant][longest] - logits["stock"][longest]).abs().max().item()
        same_top1 = bool((logits[variant][longest].argmax(-1) == logits["stock"][longest].argmax(-1)).all())
        lines.append(f"{variant} vs stock, {longest}-row block: max |logit difference| {difference:.2e}, same argmax {same_top1}")
    return lines


def breakdown(bench: ForwardBench, cache: DynamicCache, mode: str, drafted: int, repeats: int = 3) -> str:
    """Where one forward's CPU time goes: each linear layer kind (q_proj, gate_proj, lm_head, ...,
    summed over layers), attention (its modules less their linears), and the rest (norms,
    rotary, residuals, embedding, Python). The median repetition by total time."""
    bench.use(mode)
    spent: dict[str, float] = {}
    hooks = []
    for name, module in bench.model.named_modules():
        kind = (
            name.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear)
            else ("attention" if type(module).__name__.endswith("Attention") else None)
        )
        if kind is not None:
            hooks += [
                module.register_forward_pre_hook(lambda module, args: setattr(module, "_bench_started", time.thread_time())),
                module.register_forward_hook(partial(_charge, spent, kind)),
            ]
    runs = []
    try:
        for _ in range(repeats):
            spent.clear()
            started = time.thread_time()
            bench.time_block(cache, drafted)
            runs.append((time.thread_time() - started, dict(spent)))
    finally:
        for hook in hooks:
            hook.remove()
    total, parts = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    linear_total = sum(value for kind, value in parts.items() if kind != "attention")
    parts["attention"] = parts.get("attention", 0.0) - sum(parts.get(kind, 0.0) for kind in ATTENTION_LINEARS)
    parts["rest"] = total - linear_total - parts["attention"]
    cells = ", ".join(f"{kind} {value * 1e3:.0f}" for kind, value in sorted(parts.items(), key=lambda item: -item[1]))
    return f"{mode}, d={drafted} ({drafted + 1} rows): {total * 1e3:.0f} ms CPU = {cells}"


ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _charge(spent: dict[str, float], kind: str, module, args, output) -> None:
    spent[kind] = spent.get(kind, 0.0) + time.thread_time() - module._bench_started


def breakdown_lines(bench: ForwardBench, context_length: int, modes: list[str], drafted_list: str) -> list[str]:
    if not drafted_list:
        return []
    caches = bench.prefill(context_length)
    return [breakdown(bench, bench.cache_for(caches, mode), mode, int(drafted)) for mode in modes for drafted in drafted_list.split(",")]


def table(timings: Timings, clock: str, context_lengths: list[int], modes: list[str], drafted: list[int]) -> str:
    header = (
        f"| {clock} | context | mode | "
        + " | ".join(f"d={d} ({d + 1} rows)" for d in drafted)
        + " | "
        + " | ".join(f"t({d})/t(0)" for d in drafted[1:])
        + " |"
    )
    lines = [header, "|" + " --- |" * (3 + 2 * len(drafted) - 1)]
    for context_length in context_lengths:
        for mode in modes:
            milliseconds = [timings.median_ms(clock, context_length, mode, d) for d in drafted]
            ratios = [value / milliseconds[0] for value in milliseconds[1:]]
            lines.append(
                f"| {clock} | {context_length} | {mode} | "
                + " | ".join(f"{value:.3g} ms" for value in milliseconds)
                + " | "
                + " | ".join(f"{ratio:.2f}" for ratio in ratios)
                + " |"
            )
    return "\n".join(lines)


def speedup_table(timings: Timings, context_lengths: list[int], modes: list[str], drafted: list[int]) -> str:
    """Stock's CPU time over each mode's, per draft length."""
    lines = ["| context | mode | " + " | ".join(f"stock/mode d={d}" for d in drafted) + " |", "|" + " --- |" * (2 + len(drafted))]
    for context_length in context_lengths:
        for mode in modes:
            if mode == "stock":
                continue
            cells = [
                timings.median_ms("cpu", context_length, "stock", d) / timings.median_ms("cpu", context_length, mode, d) for d in drafted
            ]
            lines.append(f"| {context_length} | {mode} | " + " | ".join(f"{cell:.2f}x" for cell in cells) + " |")
    return "\n".join(lines)


def plot(timings: Timings, context_lengths: list[int], modes: list[str], drafted: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'spade-gateway[bench]'): no plot")
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for context_length in context_lengths:
        for mode in modes:
            axis.plot(
                drafted,
                [timings.median_ms("cpu", context_length, mode, d) for d in drafted],
                marker="o",
                label=f"{mode}, context {context_length}",
            )
    axis.set_xlabel("drafted tokens d (d + 1 rows fed)")
    axis.set_ylabel("forward CPU ms (median)")
    axis.set_title("Target forward time against draft length")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target: registry name, directory or .gguf; default: a tiny target built in a temp dir")
    parser.add_argument("--gguf-file", help="GGUF file inside --model")
    parser.add_argument("--isa", help="kernel ISAs, a comma list such as AVX512,AVX2 (default: the best this CPU runs)")
    parser.add_argument(
        "--compare-source",
        help="another kernels.c (say, an earlier commit's: git show REV:verifier_service/backends/transformers/cpu/kernels.c"
        " > old.c; before December 2026, verifier_service/backends/cpu_kernels.c) "
        "built for the same ISAs and timed beside this one, labelled by its file name",
    )
    parser.add_argument("--context-lengths", default="200,1000")
    parser.add_argument("--drafted", default="0-15", help="draft lengths d (0 = one-row step): a comma list, or a range such as 0-15")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-rows", type=int, default=PREFILL_ROWS, help="rows of the timed prefill forward (0 to skip)")
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check-blocks", default="1,2,9,16", help="rows M of the numerics check's blocks ('' to skip)")
    parser.add_argument("--breakdown", default="0,8", help="draft lengths d to break down by layer kind ('' to skip)")
    parser.add_argument("--output", help="directory for forward_bench.md and forward_bench.png")
    return parser.parse_args(argv)


def parse_counts(value: str) -> list[int]:
    """``0,1,4`` or ``0-15`` (inclusive), or both mixed: ``0-3,8``."""
    counts: list[int] = []
    for item in value.split(","):
        low, _, high = item.partition("-")
        counts += list(range(int(low), int(high) + 1)) if high else [int(low)]
    return counts


def kernel_libraries(isas: list[str], compare_source: Path | None) -> dict[str | None, KernelLibrary | None]:
    """Label -> kernel: ``AVX2`` for this version, ``AVX2 old`` for --compare-source old.c."""
    libraries: dict[str | None, KernelLibrary | None] = {isa: load_kernel_library(resolve_cache_dir(None), isa) for isa in isas}
    if compare_source is not None:
        libraries |= {f"{isa} {compare_source.stem}": load_kernel_library(resolve_cache_dir(None), isa, compare_source) for isa in isas}
    return libraries or {None: None}


def expand_variants(modes: list[str], isas: list[str | None]) -> list[str]:
    """Each kernel mode once per ISA (interleaved: the ISAs side by side), stock once."""
    return [variant_name(mode, isa) for mode in modes for isa in (isas if mode != "stock" else [None])]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    context_lengths = [int(value) for value in args.context_lengths.split(",")]
    drafted = parse_counts(args.drafted)
    isas = parse_isas(args.isa)
    with tempfile.TemporaryDirectory(prefix="spade-forward-bench-") as workdir:
        source = ModelSource(args.model, args.gguf_file) if args.model else tiny_source(Path(workdir))
        loaded = load_model(source, "cpu", "float32")
        started = time.perf_counter()
        libraries = kernel_libraries(isas, Path(args.compare_source) if args.compare_source else None)
        print(f"kernels: {list(libraries.values())} (build or load {time.perf_counter() - started:.1f} s)", flush=True)
        physics = {isa: measure_core(isa) for isa in isas}
        modes = expand_variants(args.modes.split(","), list(libraries))
        bench = ForwardBench(loaded.model, libraries)
        timings = run_timings(bench, context_lengths, modes, drafted, args.repeats)
        kernel_modes = [mode for mode in modes if mode != "stock"]
        prefills = (
            run_prefills(bench, min(context_lengths), kernel_modes, args.prefill_rows, args.prefill_repeats) if args.prefill_rows else {}
        )
        breakdowns = breakdown_lines(bench, max(context_lengths), modes, args.breakdown)
        block_sizes = [int(v) for v in args.check_blocks.split(",")] if args.check_blocks else []
        checks = check_numerics(bench, min(*context_lengths, NUMERICS_CONTEXT), block_sizes) if block_sizes else []
    sizes = LinearSizes.of(loaded.model)
    report = "\n\n".join(
        part
        for part in [
            f"{loaded.model_id}, fp32, {torch.get_num_threads()} torch thread(s), affinity {sorted(os.sched_getaffinity(0))}, "
            f"{args.repeats} repetitions (medians), load average at the end {os.getloadavg()[0]:.2f}",
            "\n".join(physics_lines(physics)),
            table(timings, "cpu", context_lengths, modes, drafted),
            table(timings, "wall", context_lengths, modes, drafted),
            speedup_table(timings, context_lengths, modes, drafted) if "stock" in modes else "",
            f"What each forward achieved, context {max(context_lengths)}: the linear layers' weights "
            f"({sizes.weight_bytes / 1e9:.2f} GB) over its CPU time, and their FLOPs\n"
            + efficiency_table(timings, max(context_lengths), kernel_modes, drafted, sizes, physics),
            prefill_table(prefills, args.prefill_rows, sizes, physics) if prefills else "",
            "CPU ms per forward by layer kind, context " + str(max(context_lengths)) + ":\n" + "\n".join(breakdowns),
            "\n".join(checks),
        ]
        if part
    )
    print("\n" + report)
    if args.output:
        output = Path(args.output)
        output.mkdir(parents=True, exist_ok=True)
        (output / "forward_bench.md").write_text(report + "\n")
        plot(timings, context_lengths, modes, drafted, output / "forward_bench.png")


def tiny_source(directory: Path) -> ModelSource:
    from spade_models.tiny import build_tiny_pair

    target, _ = build_tiny_pair(directory)
    return ModelSource(str(target))


if __name__ == "__main__":
    main()
