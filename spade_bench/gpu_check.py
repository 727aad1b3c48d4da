"""The prepared check for a lent GPU machine (no network, a 64 MiB upload, torch + transformers):
the target's forward cost per row count and a short capacity run, transformers backend on CUDA.

Timings do not depend on the weights, so the model is built there: Qwen2.5-1.5B's shape (hidden
1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary 151,936) with random
weights, the output layer scaled so that greedy choices are clear of near-ties (as
``spade_models.tiny`` does), and a word-level tokenizer of one word per id (made with the
``tokenizers`` library; any generated id decodes).

    forward    one sequence over a cached context, r rows fed at once (r = 1 .. 512): the
               linear layers' M is r, as in a batch of sessions whose rows sum to r; wall time
               to a synchronised result, medians; in float32 and bfloat16. Where the time
               starts to grow is the knee.
    ragged     the verifier's own forward (``rows_bench``): R rows shared by S sessions, each
               after its own cached context; what S sessions cost beyond R rows is the
               per-session work (attention and its launches), one attention call per
               session (fast) and one for all (packed).
    capacity   synthetic sessions: random prompts, the target's own greedy output (the
               verifier's, one empty-block call per token), and draft proposals that equal the
               target's token with probability --acceptance (else another token); then N
               emulated edges (``emulated_edge``, advice, and advice with continuation) and N target-only users
               against one verifier, and the prefill-interference scenario
               (``capacity.levels``, ``capacity.prefill_interference``).

Everything is written under --output (markdown + JSON). On the GPU machine:

    scripts/gpu_check --output $OUT                      # about 5 minutes on an H200
    scripts/gpu_check --device cpu --tiny --output /tmp/g   # the same steps, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

QWEN_SHAPE = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
HOST_BOUND_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 28,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 4096,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
"""Qwen2.5-1.5B's depth at a width with next to no arithmetic: on a CPU its forward is the
framework's per-layer dispatch (~15-20 ms, nearly flat from 1 to 64 rows), the regime of a GPU
whose host launches the kernels (Runs K and M: 15-30 ms, flat to 128 rows). It lets a machine
without a GPU see what the schedule does where a forward costs a fraction of the round trip and
rows are nearly free; it says nothing of a GPU's own costs."""
SHAPES = {"qwen2.5-1.5b": QWEN_SHAPE, "tiny": TINY_SHAPE, "host-bound": HOST_BOUND_SHAPE}
PARTS = ("forward", "ragged", "capacity", "prefill")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
LOGIT_SCALE = 20.0
"""The output layer's weights times this: peaked distributions, greedy choices far from ties."""


@dataclass(frozen=True)
class CheckConfig:
    output_dir: Path
    device: str = "cuda"
    dtype: str = "float32"
    tiny: bool = False
    users: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    forward_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    ragged_rows: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256)
    ragged_sessions: tuple[int, ...] = (1, 8, 32)
    context_length: int = 1000
    num_sessions: int = 8
    prompt_tokens: int = 200
    max_tokens: int = 128
    acceptance: float = 0.7
    draft_ms: float = 10.0
    """The emulated edges' drafting time per token."""
    rtt_ms: float = 20.0
    prefill_tokens: int = 2000
    batch_sessions: int = 32
    step_ahead_tokens: int = 8
    """A second verifier with ``--step-ahead-tokens`` this many (its ``spade+continue`` rows
    ``@ahead``, beside the shipped one's per N); 0: none."""
    ahead_lead_tokens: int = 0
    """The stepping verifier's edges draft this many more than their draft-length policy and the
    advice choose (``EdgePolicy.lead_tokens``)."""
    shape_name: str = "qwen2.5-1.5b"
    """A key of ``SHAPES``; ``--tiny`` makes it ``tiny``."""
    parts: tuple[str, ...] = PARTS
    """Which of ``PARTS`` run."""
    verifier_cores: tuple[int, ...] = ()
    """The verifiers' cores (one torch thread each), the check itself moving to the others; empty:
    every core for both (a GPU machine's 16 cores)."""

    @property
    def shape(self) -> dict:
        return SHAPES[self.shape_name]


# --- the model ----------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly ``vocab_size`` ids: the specials, then ``w<id>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from spade_models.tiny import CHAT_TEMPLATE

    words = SPECIAL_TOKENS + [f"w{index}" for index in range(len(SPECIAL_TOKENS), vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="w6"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(config: CheckConfig, directory: Path) -> Path:
    """A random model of the chosen shape, saved with its tokenizer; built on the device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(config.shape["vocab_size"])
    model_config = Qwen2Config(**config.shape, tie_word_embeddings=False, eos_token_id=2, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(config.device):
        model = Qwen2ForCausalLM(model_config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    if config.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return directory


# --- forward cost per row count -----------------------------------------------------------------


def forward_costs(config: CheckConfig, model_dir: Path, dtype: str, repeats: int = 5) -> dict[int, float]:
    """Median ms of one forward of r rows over a cached context of ``context_length`` tokens."""
    import torch

    from spade_models.loader import ModelSource, load_model

    model = load_model(ModelSource(str(model_dir)), config.device, dtype).model  # the verifier's own loader
    try:
        return {rows: statistics.median(seconds) * 1e3 for rows, seconds in _row_timings(config, model, repeats).items()}
    finally:
        del model
        if config.device.startswith("cuda"):
            torch.cuda.empty_cache()


def ragged_costs(config: CheckConfig, model_dir: Path, repeats: int = 5) -> dict[tuple[str, int, int], float]:
    """Median wall ms of the verifier's ragged forward: (mode, rows, sessions) -> ms, each
    session after its own cached context of ``context_length`` tokens (``rows_bench``; modes
    fast, one attention call per session, and packed, one for all)."""
    import torch

    from spade_bench.micro.rows_bench import PACKED, RowsBench, median_ms, run
    from spade_models.loader import ModelSource, load_model

    model = load_model(ModelSource(str(model_dir)), config.device, config.dtype).model
    try:
        bench = RowsBench(model, config.context_length, max(config.ragged_sessions))
        timings = run(bench, {}, ["fast", PACKED], list(config.ragged_rows), list(config.ragged_sessions), repeats)
        return {key: median_ms(samples, 1) for key, samples in timings.items()}
    finally:
        del model
        if config.device.startswith("cuda"):
            torch.cuda.empty_cache()


def _row_timings(config: CheckConfig, model, repeats: int) -> dict[int, list[float]]:
    import torch
    from transformers import DynamicCache

    from spade_models.kv_cache import cache_argument_name

    vocab, timings = config.shape["vocab_size"], {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        cached = {cache_argument_name(model): cache, "use_cache": True}
        model(input_ids=torch.randint(0, vocab, (1, config.context_length), device=config.device), logits_to_keep=1, **cached)
        for rows in config.rows:
            seconds = []
            for _ in range(repeats + 1):  # the first is a warm-up
                block = torch.randint(0, vocab, (1, rows), device=config.device)
                # logits for every row, as the verifier keeps them
                seconds.append(_timed(lambda block=block, rows=rows: model(input_ids=block, logits_to_keep=rows, **cached), config.device))
                cache.crop(-rows)
            timings[rows] = seconds[1:]
    return timings


def _timed(call, device: str) -> float:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def forward_table(costs_by_dtype: dict[str, dict[int, float]]) -> str:
    """Per row count and dtype: ms per forward, and its multiple of one row's."""
    dtypes = list(costs_by_dtype)
    lines = ["| rows | " + " | ".join(f"{dtype} ms | × one row" for dtype in dtypes) + " |", "|---|" + "---|---|" * len(dtypes)]
    for rows in sorted(costs_by_dtype[dtypes[0]]):
        cells = []
        for dtype in dtypes:
            costs = costs_by_dtype[dtype]
            cells.append(f"{costs[rows]:.2f} | {costs[rows] / costs[min(costs)]:.2f}×")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ragged_table(costs: dict[tuple[str, int, int], float]) -> str:
    """ms per ragged forward: row counts down, mode x session count across."""
    modes = list(dict.fromkeys(mode for mode, _, _ in costs))
    rows_list = sorted({rows for _, rows, _ in costs})
    columns = [(mode, count) for mode in modes for count in sorted({sessions for _, _, sessions in costs})]
    lines = ["| rows | " + " | ".join(f"{mode}, {count} sess. ms" for mode, count in columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {rows} | " + " | ".join(f"{costs[(mode, rows, count)]:.2f}" for mode, count in columns) + " |" for rows in rows_list]
    return "\n".join(lines)


# --- synthetic sessions -------------------------------------------------------------------------


def synthetic_prompts(config: CheckConfig, tokenizer, rng: random.Random) -> list[tuple[list[dict], list[int]]]:
    """(messages, prompt token ids) per session: random words, through the chat template."""
    vocab = config.shape["vocab_size"]
    prompts = []
    for _ in range(config.num_sessions):
        words = " ".join(f"w{rng.randrange(len(SPECIAL_TOKENS), vocab)}" for _ in range(config.prompt_tokens))
        messages = [{"role": "user", "content": words}]
        prompts.append(
            (messages, list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)))
        )
    return prompts


async def target_output(client, prompt: list[int], num_tokens: int) -> list[int]:
    """The verifier's own greedy output after ``prompt``: one empty-block call per token."""
    from verifier_service.protocol import VerifyRequest, WireSampling, context_digest

    session_id, committed = f"gpu-check-{random.getrandbits(48):x}", list(prompt)
    for _ in range(num_tokens):
        known = 0 if len(committed) == len(prompt) else len(committed)
        request = VerifyRequest(
            session_id=session_id,
            prefix_length=known,
            prefix_digest=context_digest(committed[:known]),
            new_tokens=committed[known:],
            draft_tokens=[],
            sampling=WireSampling(temperature=0.0),
        )
        response = await client.post(
            "/v1/verify", content=request.model_dump_json(exclude_none=True), headers={"content-type": "application/json"}
        )
        response.raise_for_status()
        committed.append(response.json()["next_token"])
    await client.delete(f"/v1/sessions/{session_id}")
    return committed[len(prompt) :]


def synthetic_proposals(target: list[int], acceptance: float, vocab: int, rng: random.Random) -> list[int]:
    """The target's token with probability ``acceptance``, else another one."""
    return [token if rng.random() < acceptance else (token + rng.randrange(1, vocab)) % vocab for token in target]


async def synthetic_sessions(config: CheckConfig, verifier_url: str, tokenizer) -> list:
    import httpx

    from spade_bench.capacity.sessions import DraftTrace, RecordedSession

    rng = random.Random(0)
    prompts = synthetic_prompts(config, tokenizer, rng)
    async with httpx.AsyncClient(base_url=verifier_url, timeout=600) as client:
        outputs = await asyncio.gather(*(target_output(client, prompt, config.max_tokens) for _, prompt in prompts))
    sessions = []
    for (messages, prompt), output in zip(prompts, outputs, strict=True):
        proposals = synthetic_proposals(output, config.acceptance, config.shape["vocab_size"], rng)
        trace = DraftTrace(prompt, output, proposals, config.draft_ms / 1e3, 5 * config.draft_ms / 1e3)
        sessions.append(RecordedSession("synthetic", messages, config.max_tokens, len(output), "", [], trace))
    return sessions


# --- the run ------------------------------------------------------------------------------------


def verifier_spec(config: CheckConfig, model_dir: Path, extra: tuple[str, ...] = (), suffix: str = ""):
    from spade_bench.services import ServiceSpec, console_command

    command = console_command("spade-verifier", "verifier_service.cli") + (
        "--model", str(model_dir), "--device", config.device, "--dtype", config.dtype,
        "--max-batch-sessions", str(config.batch_sessions), "--max-draft-length", "64",
        "--max-context-length", str(config.prompt_tokens + config.prefill_tokens + config.max_tokens + 64),
    ) + extra  # fmt: skip
    if config.verifier_cores:
        return ServiceSpec(
            "verifier-gpu-check" + suffix, command, config.verifier_cores, len(config.verifier_cores), config.output_dir / "logs"
        )
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return ServiceSpec("verifier-gpu-check" + suffix, command, cores, min(4, len(cores)), config.output_dir / "logs")


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
    from spade_bench.capacity.prefill_interference import InterferenceSetup, interference_table, measure_interference
    from spade_bench.capacity.report import ADVICE, CONTINUE, TARGET, markdown_table
    from spade_bench.services import Service, start_service
    from verifier_service.backends.transformers.advice import BUSY_WINDOW_S

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
        verifier = services.enter_context(start_service(verifier_spec(config, model_dir), 900))
        variants: tuple[tuple[str, Service], ...] = ()
        if config.step_ahead_tokens > 0:  # the continuous-sessions spike (Run T) beside the shipped verifier
            ahead = verifier_spec(config, model_dir, ("--step-ahead-tokens", str(config.step_ahead_tokens)), "-ahead")
            variants = (("ahead", services.enter_context(start_service(ahead, 900))),)
        step("verifier started")
        sessions = asyncio.run(synthetic_sessions(config, verifier.url, build_tokenizer(config.shape["vocab_size"])))
        step("target outputs generated")
        # Levels a busy window apart: the next starts unsaturated (a shorter pause than the CPU
        # benchmark's, for the GPU's short lease).
        setup = LevelSetup(config.rtt_ms / 1e3, EdgePolicy("auto", 16), pause_s=BUSY_WINDOW_S)
        if "capacity" in config.parts:
            asyncio.run(run_level(verifier.url, TARGET, sessions[:1], 1, setup))  # warms the target-only route up, unrecorded
            # Edges ignoring the advice (Run K's "spade" rows) are left out for continuation's: the GPU's time is short.
            ahead_setup = replace(setup, policy=replace(setup.policy, lead_tokens=config.ahead_lead_tokens))
            rows = measure_levels(
                verifier,
                sessions,
                config.users,
                (TARGET, ADVICE, CONTINUE),
                setup,
                variants=variants,
                variant_modes=(CONTINUE,),
                variant_setups={"ahead": ahead_setup},
            )
            results.add(
                {"rows": [row.to_dict() for row in rows]},
                f"Capacity: {config.num_sessions} synthetic sessions of {config.prompt_tokens}-word prompts, {config.max_tokens} tokens, "
                f"draft acceptance {config.acceptance}, drafting {config.draft_ms:g} ms/token, RTT {config.rtt_ms:g} ms, "
                f"--max-batch-sessions {config.batch_sessions}, edges' draft length auto{lead_note(config)}:\n\n"
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


def _shape_name(config: CheckConfig) -> str:
    return {"qwen2.5-1.5b": "Qwen2.5-1.5B"}.get(config.shape_name, config.shape_name)


def host_description(config: CheckConfig, check_cores: tuple[int, ...]) -> dict:
    """The machine the numbers come from: device, CPU model and its vector ISA, core placement."""
    from spade_bench.micro.cpu_physics import cpu_description
    from verifier_service.backends.cpu_kernels import cpu_isa

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
        f"the emulated edges on {host['check_cores']}; shape {_shape_name(config)}, {config.dtype}."
    )


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device


def parse_args(argv: list[str] | None) -> CheckConfig:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", "gpu_check_results")), help="results ($OUT by default)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a small run (for a CPU, and the tests)")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen2.5-1.5b",
        help="the random model's shape (default qwen2.5-1.5b; host-bound: a GPU-like flat forward on a CPU)",
    )
    parser.add_argument(
        "--verifier-cores", default="", help="comma list: the verifiers' cores, the check on the others (default: all for both)"
    )
    parser.add_argument("--sessions", type=int, default=8, help="synthetic sessions (default 8)")
    parser.add_argument("--draft-ms", type=float, default=10.0, help="the emulated edges' drafting time per token (default 10)")
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="the emulated edges' round trip (default 20)")
    parser.add_argument(
        "--ahead-lead-tokens", type=int, default=0, help="the stepping verifier's edges draft this many more than they choose (default 0)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of what runs (default {','.join(PARTS)})")
    parser.add_argument("--users", default="1,2,4,8,16,32", help="comma list of N (default 1,2,4,8,16,32)")
    parser.add_argument("--acceptance", type=float, default=0.7, help="chance a proposal is the target's token (default 0.7)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per user (default 128)")
    parser.add_argument(
        "--step-ahead-tokens",
        type=int,
        default=8,
        help="a second verifier stepping this many tokens ahead, its rows beside the shipped one's (default 8; 0: none)",
    )
    args = parser.parse_args(argv)
    config = CheckConfig(args.output, args.device, args.dtype, args.tiny, tuple(int(n) for n in args.users.split(",")))
    config = CheckConfig(
        **(
            vars(config)
            | {
                "acceptance": args.acceptance,
                "max_tokens": args.max_tokens,
                "step_ahead_tokens": args.step_ahead_tokens,
                "shape_name": args.shape,
                "verifier_cores": tuple(int(core) for core in args.verifier_cores.split(",") if core),
                "num_sessions": args.sessions,
                "draft_ms": args.draft_ms,
                "rtt_ms": args.rtt_ms,
                "ahead_lead_tokens": args.ahead_lead_tokens,
                "parts": parse_parts(args.parts),
            }
        )
    )
    if args.tiny:
        tiny = {
            "shape_name": "tiny",
            "rows": (1, 2, 4, 8),
            "forward_dtypes": ("float32",),
            "ragged_rows": (1, 2, 4, 8),
            "ragged_sessions": (1, 4),
            "context_length": 64,
            "num_sessions": 2,
            "prompt_tokens": 20,
            "prefill_tokens": 200,
            "batch_sessions": 4,
        }
        config = CheckConfig(**(vars(config) | tiny))
    return config


def parse_parts(value: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise SystemExit(f"--parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> int:
    run_check(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
