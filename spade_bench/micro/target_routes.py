"""The vLLM backend's two target-only routes side by side, one user, one engine, one run:
``native`` (one vLLM request per generation, vLLM's own decode loop) and ``verify-steps`` (one
verify call with an empty block per token). For each prompt, each route in turn (alternating
which goes first, so drift on a shared box hits both alike) generates greedily; reported: each
route's tokens/s per generation (median and range over the runs), its forwards' tokens, and
whether the two routes' greedy tokens are equal, prompt by prompt (where they part, the first
differing position).

    .venv-vllm/bin/python -m spade_bench.micro.target_routes --model qwen2.5-coder-0.5b-instruct \
        --max-tokens 64 --rounds 2 --max-context-length 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from gateway.engine import GenerationRequest
from gateway.prompts import chat_prompt_ids
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig

ROUTES = ("native", "verify-steps")
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in three sentences what a hash map is.",
    "Write a short email asking a colleague to review a pull request.",
    "List five prime numbers and say why each is prime.",
)


@dataclass(frozen=True)
class RouteRun:
    route: str
    prompt_index: int
    num_tokens: int
    seconds: float
    num_target_tokens: int
    token_ids: list[int]

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


async def run_route(engine, prompt_ids: list[int], max_tokens: int, eos_token_ids: frozenset[int], index: int, route: str) -> RouteRun:
    request = GenerationRequest(f"bench-{uuid.uuid4().hex}", prompt_ids, max_tokens, SamplingConfig(temperature=0.0), eos_token_ids)
    stats, token_ids = SpadeStats(), []
    started = time.perf_counter()
    async for batch in engine.generate(request, stats):
        token_ids += batch.token_ids
    return RouteRun(route, index, len(token_ids), time.perf_counter() - started, stats.target_tokens, token_ids)


def first_difference(left: list[int], right: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(left, right, strict=False)):
        if a != b:
            return position
    return None if len(left) == len(right) else min(len(left), len(right))


def summary(runs: list[RouteRun], num_prompts: int) -> dict:
    by_route = {route: [run for run in runs if run.route == route] for route in ROUTES}
    speeds = {route: [run.tokens_per_s for run in route_runs] for route, route_runs in by_route.items()}
    equal = []
    for index in range(num_prompts):
        native, steps = (next(run for run in by_route[route] if run.prompt_index == index) for route in ROUTES)
        difference = first_difference(native.token_ids, steps.token_ids)
        equal.append({"prompt": index, "tokens": native.num_tokens, "first_difference": difference})
    median = {route: statistics.median(values) for route, values in speeds.items()}
    return {
        "tokens_per_s": {route: {"median": median[route], "min": min(values), "max": max(values)} for route, values in speeds.items()},
        "native_over_verify_steps": median["native"] / median["verify-steps"],
        "target_tokens_per_generation": {
            route: statistics.median(run.num_target_tokens for run in route_runs) for route, route_runs in by_route.items()
        },
        "greedy_equal": equal,
    }


async def measure(args: argparse.Namespace) -> dict:
    from spade_models.loader import ModelSource
    from verifier_service.backends.vllm.backend import VllmEngineOptions, create_vllm_backend
    from verifier_service.metrics import VerifierMetrics
    from verifier_service.target_engine import create_target_engine

    options = VllmEngineOptions(max_model_len=args.max_context_length, kv_cache_gib=args.kv_cache_gib)
    backend = await create_vllm_backend(ModelSource(args.model), options)
    try:
        metrics = VerifierMetrics()
        engines = {route: create_target_engine(backend, route, metrics) for route in ROUTES}
        prompts = [chat_prompt_ids(backend.tokenizer, [{"role": "user", "content": text}]) for text in PROMPTS[: args.prompts]]
        await run_route(engines["native"], prompts[0], 4, backend.model.eos_token_ids, -1, "native")  # warm-up, unrecorded
        runs = []
        for round_index in range(args.rounds):
            for index, prompt_ids in enumerate(prompts):
                order = ROUTES if (round_index + index) % 2 == 0 else ROUTES[::-1]
                for route in order:
                    runs.append(await run_route(engines[route], prompt_ids, args.max_tokens, backend.model.eos_token_ids, index, route))
        return {"model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds, **summary(runs, len(prompts))} | {
            "runs": [asdict(run) | {"token_ids": None} for run in runs]
        }
    finally:
        await backend.aclose()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spade_bench.micro.target_routes", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="target model (HF id, directory or spade-models name)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="generations of each prompt by each route (default 2)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} built-in prompts")
    parser.add_argument("--max-context-length", type=int, default=2048, help="vLLM's max_model_len (default 2048)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache (default 1.0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(measure(args))
    print(json.dumps({key: value for key, value in result.items() if key != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
