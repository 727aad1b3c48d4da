"""What a GPU check measures: the random model's shape, the levels, the emulated edges, and the
command line that sets them (``scripts/gpu_check --help``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
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
framework's per-layer dispatch (on a 2.4 GHz Zen 3 core: 16 ms for one row, 1.2x that for 8
rows, 1.7x for 32; Run X), the regime of a GPU whose host launches the kernels (Runs K and M:
15-30 ms, flat to 128 rows). It lets a machine
without a GPU see what the schedule does where a forward costs a fraction of the round trip and
rows are nearly free; it says nothing of a GPU's own costs."""
TINY_VLLM_SHAPE = TINY_SHAPE | {"hidden_size": 128, "intermediate_size": 256}
"""The tiny shape with heads of 32 (vLLM's CPU attention takes no smaller)."""
SHAPES = {"qwen2.5-1.5b": QWEN_SHAPE, "tiny": TINY_SHAPE, "tiny-vllm": TINY_VLLM_SHAPE, "host-bound": HOST_BOUND_SHAPE}
BACKENDS = ("transformers", "vllm")
VLLM_PARTS = ("capacity",)
"""What runs on ``--backend vllm``: the forward and ragged parts time this project's own forward,
and the prefill scenario its chunked prefill; vLLM schedules its own."""
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
    modes: tuple[str, ...] = ("target", "spade+advice", "spade+continue", "spade+pipe")
    """The capacity modes run on the shipped verifier (``spade_bench.capacity.report``); with
    ``spade+pipe`` it serves the pipelined-session wire (``--pipelined-sessions``)."""
    pipe_lead_tokens: int = 8
    """The ``spade+pipe`` edges draft this far ahead of the decided tokens they have seen."""
    pipe_proposal_every: int = 1
    """The ``spade+pipe`` edges propose after this many new drafts."""
    shape_name: str = "qwen2.5-1.5b"
    """A key of ``SHAPES``; ``--tiny`` makes it ``tiny``."""
    parts: tuple[str, ...] = PARTS
    """Which of ``PARTS`` run."""
    verifier_cores: tuple[int, ...] = ()
    """The verifiers' cores (one torch thread each), the check itself moving to the others; empty:
    every core for both (a GPU machine's 16 cores)."""
    backend: str = "transformers"
    """The verifier's ``--backend``: ``vllm`` serves ``spade+pipe`` on its session route (one vLLM
    request per edge session) and target-only on vLLM's native decoding."""

    @property
    def shape(self) -> dict:
        return SHAPES[self.shape_name]


def parse_args(argv: list[str] | None) -> CheckConfig:
    from spade_bench import gpu_check

    doc = gpu_check.__doc__ or ""
    parser = argparse.ArgumentParser(prog="scripts/gpu_check", description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1])
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
    parser.add_argument(
        "--modes",
        default="target,spade+advice,spade+continue,spade+pipe",
        help="comma list of capacity modes on the shipped verifier (default target,spade+advice,spade+continue,spade+pipe)",
    )
    parser.add_argument(
        "--pipe-lead-tokens", type=int, default=8, help="spade+pipe edges draft this far ahead of what they saw (default 8)"
    )
    parser.add_argument("--pipe-proposal-every", type=int, default=1, help="spade+pipe edges propose after this many drafts (default 1)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of what runs (default {','.join(PARTS)})")
    parser.add_argument("--users", default="1,2,4,8,16,32", help="comma list of N (default 1,2,4,8,16,32)")
    parser.add_argument("--acceptance", type=float, default=0.7, help="chance a proposal is the target's token (default 0.7)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per user (default 128)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="transformers",
        help="the verifier's backend (default transformers); vllm: checks that vLLM imports first, runs the capacity part only, "
        "without spade+continue and the stepping verifier",
    )
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
                "modes": parse_modes(args.modes),
                "pipe_lead_tokens": args.pipe_lead_tokens,
                "pipe_proposal_every": args.pipe_proposal_every,
            }
        )
    )
    if args.backend == "vllm":
        config = on_vllm(config)
    if args.tiny:
        tiny = {
            "shape_name": "tiny-vllm" if args.backend == "vllm" else "tiny",
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


def on_vllm(config: CheckConfig) -> CheckConfig:
    """``config`` for a verifier on vLLM: the capacity part, the modes vLLM's backend serves (no
    ``spade+continue``), no stepping verifier.

    Example: parts forward,capacity and modes target,spade+continue,spade+pipe -> capacity and
    target,spade+pipe."""
    from spade_bench.capacity.report import CONTINUE

    parts = tuple(part for part in config.parts if part in VLLM_PARTS)
    if not parts:
        raise SystemExit(f"--backend vllm runs --parts {','.join(VLLM_PARTS)} only")
    modes = tuple(mode for mode in config.modes if mode != CONTINUE)
    return CheckConfig(**(vars(config) | {"backend": "vllm", "parts": parts, "modes": modes, "step_ahead_tokens": 0}))


def parse_parts(value: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise SystemExit(f"--parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    return parts


def parse_modes(value: str) -> tuple[str, ...]:
    from spade_bench.capacity.report import ADVICE, CONTINUE, PIPE, SPADE, TARGET

    known = (TARGET, SPADE, ADVICE, CONTINUE, PIPE)
    modes = tuple(mode.strip() for mode in value.split(",") if mode.strip())
    unknown = sorted(set(modes) - set(known))
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'nothing'} is not one of {', '.join(known)}")
    return modes
