"""What one core can do, measured beside a forward, so a reader sees how far each point is from
the physics: the core's stream bandwidth (what a one-row forward, which reads every weight once,
is bound by) and its in-register FMA rate for an ISA (what a many-row prefill is bound by), with
the CPU's model and clock. The benches (``forward_bench``, ``rows_bench``) print these per ISA
beside the GB/s and GFLOP/s each of their forwards achieved.

    python -m spade_bench.micro.cpu_physics --isa AVX512,AVX2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spade_models.pull import resolve_cache_dir
from verifier_service.backends.transformers.cpu.kernels import build_library, runnable_isas

PHYSICS_SOURCE = Path(__file__).with_name("cpu_physics.c")
READ_BYTES = 1 << 30
"""The stream measurement's buffer: far past any cache (the 1.5B target's weights are ~6 GB)."""
FMA_SECONDS = 0.2


@dataclass(frozen=True)
class CorePhysics:
    isa: str
    cpu_model: str
    clock_mhz: float | None
    """/proc/cpuinfo's current clock of the first CPU this process may run on (a VM may report its
    nominal clock)."""
    stream_gbps: float
    fma_gflops: float

    def describe(self) -> str:
        clock = f"{self.clock_mhz:.0f} MHz" if self.clock_mhz else "clock unknown"
        return (
            f"{self.cpu_model}, {clock}; one core: stream read {self.stream_gbps:.1f} GB/s, "
            f"{self.isa} in-register FMA {self.fma_gflops:.0f} GFLOP/s"
        )


def cpuinfo_fields(text: str, processor: int) -> dict[str, str]:
    """The ``key: value`` lines of one processor's block of /proc/cpuinfo (the first block when
    ``processor`` has none)."""
    blocks = [dict(line.split(":", 1) for line in block.splitlines() if ":" in line) for block in text.strip().split("\n\n")]
    blocks = [{key.strip(): value.strip() for key, value in block.items()} for block in blocks]
    return next((block for block in blocks if block.get("processor") == str(processor)), blocks[0] if blocks else {})


def cpu_description() -> tuple[str, float | None]:
    """(model name, current MHz) of the first CPU this process may run on."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", None
    fields = cpuinfo_fields(text, min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0)
    clock = fields.get("cpu MHz")
    return fields.get("model name", "unknown CPU"), float(clock) if clock else None


def load_physics(isa: str, cache_dir: Path | None = None) -> ctypes.CDLL | None:
    built = build_library(PHYSICS_SOURCE, resolve_cache_dir(cache_dir), isa)
    if built is None:
        return None
    library = built[0]
    library.physics_fma.argtypes, library.physics_fma.restype = [ctypes.c_long, ctypes.c_float], ctypes.c_float
    library.physics_read.argtypes, library.physics_read.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_float
    library.physics_lanes.restype = library.physics_chains.restype = ctypes.c_int
    return library


def fma_gflops(library: ctypes.CDLL, repeats: int = 3) -> float:
    flops_per_iteration = library.physics_chains() * library.physics_lanes() * 2
    iterations = 1_000_000
    started = time.perf_counter()
    library.physics_fma(iterations, 0.5)
    iterations = max(iterations, int(iterations * FMA_SECONDS / max(time.perf_counter() - started, 1e-6)))
    best = min(_timed(library.physics_fma, iterations, 0.5) for _ in range(repeats))
    return iterations * flops_per_iteration / best / 1e9


def stream_gbps(library: ctypes.CDLL, num_bytes: int = READ_BYTES, repeats: int = 3) -> float:
    data = torch.ones(num_bytes // 4, dtype=torch.float32)  # written: every page is there
    best = min(_timed(library.physics_read, data.data_ptr(), data.numel()) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def measure_core(isa: str, cache_dir: Path | None = None, read_bytes: int = READ_BYTES) -> CorePhysics | None:
    """The core's physics for ``isa`` (one of ``runnable_isas()``); None where nothing can be built."""
    library = load_physics(isa, cache_dir)
    if library is None:
        return None
    model, clock = cpu_description()
    return CorePhysics(isa, model, clock, stream_gbps(library, read_bytes), fma_gflops(library))


def efficiency(seconds: float, weight_bytes: int, flops: float) -> str:
    """What a forward achieved: the weights it read per second and its FLOPs per second."""
    return f"{weight_bytes / seconds / 1e9:.1f} GB/s, {flops / seconds / 1e9:.1f} GFLOP/s"


def parse_isas(value: str | None) -> list[str]:
    """``--isa``: a comma list of ISAs this CPU runs (default: its best one)."""
    available = runnable_isas()
    if not value:
        return available[:1]
    isas = [item.strip().upper().replace("-", "") for item in value.split(",") if item.strip()]
    unknown = [isa for isa in isas if isa not in available]
    if unknown:
        raise SystemExit(f"--isa {','.join(unknown)}: this CPU runs {', '.join(available) or 'no kernel ISA'}")
    return isas


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", help="comma list, e.g. AVX512,AVX2 (default: the best this CPU runs)")
    args = parser.parse_args(argv)
    for isa in parse_isas(args.isa):
        physics = measure_core(isa)
        print(physics.describe() if physics else f"{isa}: could not build the probe (see the log)")


if __name__ == "__main__":
    main()
