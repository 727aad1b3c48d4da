"""The GPU check's run: the verifiers started, each part measured in turn, the report rewritten
after each (``gpu_check.md``, ``gpu_check.json`` under --output)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from spade_bench.gpu_check.config import CheckConfig, parse_args
from spade_bench.gpu_check.model import (
    build_model,
    build_tokenizer,
    forward_costs,
    forward_table,
    ragged_costs,
    ragged_table,
    synthetic_sessions,
)

# --- the run ------------------------------------------------------------------------------------


def verifier_spec(config: CheckConfig, model_dir: Path, extra: tuple[str, ...] = (), suffix: str = ""):
    from spade_bench.services import ServiceSpec, console_command

    command = console_command("spade-verifier", "verifier_service.cli") + (
        "--model", str(model_dir), "--backend", config.backend, "--device", config.device, "--dtype", config.dtype,
        "--max-batch-sessions", str(config.batch_sessions), "--max-draft-length", "64",
        "--max-context-length", str(config.prompt_tokens + config.prefill_tokens + config.max_tokens + 64),
    ) + extra  # fmt: skip
    if config.verifier_cores:
        return ServiceSpec(
            "verifier-gpu-check" + suffix, command, config.verifier_cores, len(config.verifier_cores), config.output_dir / "logs"
        )
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return ServiceSpec("verifier-gpu-check" + suffix, command, cores, min(4, len(cores)), config.output_dir / "logs")


def require_vllm() -> None:
    """Exit (status 2) saying so where vLLM does not import: ``--backend vllm`` needs it in this
    Python (the lent GPU machines have torch and transformers, not vLLM)."""
    try:
        import vllm
    except ImportError as error:
        print(f"gpu_check --backend vllm: vLLM does not import in {sys.executable} ({error}); nothing was run", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"gpu_check: vLLM {vllm.__version__} imports", flush=True)


def pin_check_beside_verifiers(config: CheckConfig) -> tuple[int, ...]:
    """Move this process (the emulated edges) off the verifiers' cores; the cores it keeps."""
    if not config.verifier_cores:
        return tuple(sorted(os.sched_getaffinity(0)))
    others = sorted(set(os.sched_getaffinity(0)) - set(config.verifier_cores))
    if not others:
        raise SystemExit(f"--verifier-cores {','.join(map(str, config.verifier_cores))} leaves no core for the emulated edges")
    os.sched_setaffinity(0, others)
    import torch

    torch.set_num_threads(len(others))  # no more threads than cores: OpenMP's waiting threads would spin on the one core
    return tuple(others)


def run_check(config: CheckConfig) -> dict:
    from spade_bench.capacity.emulated_edge import EdgePolicy
    from spade_bench.capacity.levels import LevelSetup, measure_levels, run_level
    from spade_bench.capacity.pipelined_edge import PipelinePolicy
    from spade_bench.capacity.prefill_interference import InterferenceSetup, interference_table, measure_interference
    from spade_bench.capacity.report import CONTINUE, PIPE, TARGET, markdown_table
    from spade_bench.services import Service, start_service
    from verifier_service.tuning import TUNING

    if config.backend == "vllm":
        require_vllm()
    config.output_dir.mkdir(parents=True, exist_ok=True)
    step = _stepper(time.perf_counter())
    results = CheckResults(config, {"config": {k: str(v) for k, v in vars(config).items()}})
    check_cores = pin_check_beside_verifiers(config)
    results.add({"host": host_description(config, check_cores)}, host_section(config, check_cores))
    model_dir = build_model(config, config.output_dir / "model" if config.tiny else Path("/tmp/spade-gpu-check-model"))
    step("model built and saved")
    if "forward" in config.parts:
        costs = {dtype: forward_costs(config, model_dir, dtype) for dtype in dict.fromkeys((config.dtype, *config.forward_dtypes))}
        results.add(
            {"forward_ms": costs[config.dtype], "forward_ms_by_dtype": costs},
            f"Forward of r rows over a cached context of {config.context_length} tokens (medians):\n\n" + forward_table(costs),
        )
        step("forward costs measured")
    if "ragged" in config.parts:
        ragged = ragged_costs(config, model_dir)
        results.add(
            {"ragged_ms": [dict(zip(("mode", "rows", "sessions", "ms"), (*key, ms), strict=True)) for key, ms in sorted(ragged.items())]},
            f"The verifier's ragged forward ({config.dtype}): R rows over S sessions, each after {config.context_length} cached "
            "tokens, attention one call per session (fast) or one for all (packed, the default off a CPU), medians:\n\n"
            + ragged_table(ragged),
        )
        step("ragged forward costs measured")
    if not {"capacity", "prefill"} & set(config.parts):
        print(results.markdown())
        return results.report
    with contextlib.ExitStack() as services:
        pipelined = ("--pipelined-sessions", "true") if PIPE in config.modes else ()
        verifier = services.enter_context(start_service(verifier_spec(config, model_dir, pipelined), 900))
        variants: tuple[tuple[str, Service], ...] = ()
        if config.step_ahead_tokens > 0:  # the continuous-sessions spike (Run T) beside the shipped verifier
            ahead = verifier_spec(config, model_dir, ("--step-ahead-tokens", str(config.step_ahead_tokens)), "-ahead")
            variants = (("ahead", services.enter_context(start_service(ahead, 900))),)
        step("verifier started")
        sessions = asyncio.run(synthetic_sessions(config, verifier.url, build_tokenizer(config.shape["vocab_size"])))
        step("target outputs generated")
        # Levels a busy window apart: the next starts unsaturated (a shorter pause than the CPU
        # benchmark's, for the GPU's short lease).
        pipeline = PipelinePolicy(config.pipe_lead_tokens, config.pipe_proposal_every)
        setup = LevelSetup(config.rtt_ms / 1e3, EdgePolicy("auto", 16), pipeline=pipeline, pause_s=TUNING.busy_window_s)
        if "capacity" in config.parts:
            asyncio.run(run_level(verifier.url, TARGET, sessions[:1], 1, setup))  # warms the target-only route up, unrecorded
            ahead_setup = replace(setup, policy=replace(setup.policy, lead_tokens=config.ahead_lead_tokens))
            rows = measure_levels(
                verifier,
                sessions,
                config.users,
                config.modes,
                setup,
                variants=variants,
                variant_modes=(CONTINUE,),
                variant_setups={"ahead": ahead_setup},
            )
            results.add(
                {"rows": [row.to_dict() for row in rows]},
                f"Capacity: {config.num_sessions} synthetic sessions of {config.prompt_tokens}-word prompts, {config.max_tokens} tokens, "
                f"draft acceptance {config.acceptance}, drafting {config.draft_ms:g} ms/token, RTT {config.rtt_ms:g} ms, "
                f"--max-batch-sessions {config.batch_sessions}, edges' draft length auto{lead_note(config)}{pipe_note(config)}:\n\n"
                + markdown_table(rows, 1.0),
            )
            step("capacity levels run")
        if "prefill" in config.parts:
            prefill = InterferenceSetup(config.prefill_tokens, 4, rtt_s=setup.rtt_s, policy=EdgePolicy(8))
            interference = asyncio.run(measure_interference(verifier.url, sessions, prefill))
            results.add({"prefill_interference": interference.to_dict()}, interference_table(interference))
            step("prefill interference measured")
    print(results.markdown())
    return results.report


@dataclass
class CheckResults:
    """What the check has measured so far, rewritten to --output after every step (a step that
    fails leaves the earlier ones' results)."""

    config: CheckConfig
    report: dict
    sections: list[str] = field(default_factory=list)

    def add(self, report: dict, section: str) -> None:
        self.report |= report
        self.sections.append(section)
        (self.config.output_dir / "gpu_check.md").write_text(self.markdown() + "\n")
        (self.config.output_dir / "gpu_check.json").write_text(json.dumps(self.report, indent=2, default=str))

    def markdown(self) -> str:
        title = f"# GPU check ({_device_name(self.config.device)}, {self.config.dtype}, {_shape_name(self.config)} shape, random weights)"
        return "\n\n".join([title, *self.sections])


def _stepper(started: float):
    def step(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    return step


def lead_note(config: CheckConfig) -> str:
    if not config.ahead_lead_tokens or not config.step_ahead_tokens:
        return ""
    return f" (the stepping verifier's edges drafting {config.ahead_lead_tokens} more than they choose)"


def pipe_note(config: CheckConfig) -> str:
    from spade_bench.capacity.report import PIPE

    if PIPE not in config.modes:
        return ""
    return f"; spade+pipe edges drafting up to {config.pipe_lead_tokens} ahead, proposing every {config.pipe_proposal_every}"


def _shape_name(config: CheckConfig) -> str:
    return {"qwen2.5-1.5b": "Qwen2.5-1.5B"}.get(config.shape_name, config.shape_name)


def host_description(config: CheckConfig, check_cores: tuple[int, ...]) -> dict:
    """The machine the numbers come from: device, CPU model and its vector ISA, core placement."""
    from spade_bench.micro.cpu_physics import cpu_description
    from verifier_service.backends.transformers.cpu.kernels import cpu_isa

    model, clock_mhz = cpu_description()
    clock = f", {clock_mhz:.0f} MHz" if clock_mhz else ""
    return {
        "device": _device_name(config.device),
        "cpu": f"{model}{clock}, vector ISA {cpu_isa() or 'neither AVX2 nor AVX-512'}",
        "verifier_cores": list(config.verifier_cores) or "all",
        "check_cores": list(check_cores),
    }


def host_section(config: CheckConfig, check_cores: tuple[int, ...]) -> str:
    host = host_description(config, check_cores)
    return (
        f"Host: {host['device']}; CPU {host['cpu']}; verifiers on cores {host['verifier_cores']}, "
        f"the emulated edges on {host['check_cores']}; shape {_shape_name(config)}, {config.dtype}; "
        + ("the verifier on vLLM (its session route for spade+pipe)." if config.backend == "vllm" else "this project's engine, not vLLM's.")
    )


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device


def main(argv: list[str] | None = None) -> int:
    run_check(parse_args(argv))
    return 0
