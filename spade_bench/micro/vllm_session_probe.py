"""vLLM's proposer hook fed from outside its engine: does it take proposals that arrive while its
requests run, and what does speculation cost a step when nothing is proposed?

The first questions of the vLLM session route (long-lived requests in vLLM's running batch, the
edges' proposals as their speculative tokens: ``verifier_service.backends.vllm.proposals``). Each
mode starts its own ``AsyncLLM`` on the same target and runs the same N greedy requests at once,
each under a request id of its own:

    plain      no speculation: vLLM decodes one token a request a step (the reference text)
    empty      speculation through ``SessionProposer`` with nothing on the board: every step asks
               for proposals and gets none (the cost of the hook itself)
    proposed   the same, while another process (standing in for the edges) posts proposals to the
               board: each edge learns where its request stands from the tokens streamed back (as a
               real edge hears the decided tokens), drafts from there at ``--draft-tokens-per-s``
               the plain run's text, each token wrong with probability 1 - ``--acceptance`` (and
               nothing past a wrong one), and posts what it has every ``--post-interval-ms``; by
               the time a step reads a proposal the request may have passed part of it, which the
               proposer checks against the request's own tokens

It prints, per mode and N: wall seconds, output tokens/s, the ratio to ``plain``, whether every
text is identical to ``plain``'s, and vLLM's own speculation counters (proposals, proposed and
accepted tokens). Run it in the vLLM environment (``.ci/vllm_env.sh``):

    .venv-vllm/bin/python -m spade_bench.micro.vllm_session_probe --model DIR --users 1,4 --max-tokens 64

``--model`` defaults to a tiny target built on the spot (head size 32, as vLLM's CPU attention
needs); timings on it measure the engine's overheads, not a model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verifier_service.backends.vllm.proposals import PROPOSER_CLASS

MODES = ("plain", "empty", "proposed")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    users: int
    wall_s: float
    output_tokens: int
    texts: list[list[int]]
    drafts: int | None
    draft_tokens: int | None
    accepted_tokens: int | None


def prompts_for(users: int, seed: int, vocab_size: int) -> list[list[int]]:
    """Random token-id prompts of 12-40 tokens, one a user."""
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab_size, 30_000)) for _ in range(rng.randrange(12, 40))] for _ in range(users)]


def vocab_size_of(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def kept_positions(num_tokens: int, acceptance: float, seed: int) -> list[bool]:
    """Per position, whether a stand-in edge's draft there is the target's token: probability
    ``acceptance``, fixed per position by the seed (as a real draft's guess is fixed by its context)."""
    return [random.Random(seed * 1_000_003 + index).random() < acceptance for index in range(num_tokens)]


def edge_draft(truth: list[int], kept: list[bool], position: int, length: int) -> list[int]:
    """What a stand-in edge drafts from ``position``: the target's text where ``kept``, another
    token where not; it stops after its first wrong token (what follows it is drafted on a context
    the target will not have)."""
    drafted: list[int] = []
    for index in range(position, min(position + length, len(truth))):
        if kept[index]:
            drafted.append(truth[index])
        else:
            drafted.append(truth[index] ^ 1)  # another id, in range for an even vocabulary
            break
    return drafted


def post_proposals(board_name: str, truths: dict[str, list[int]], progress, options: dict, ready_event, stop_event) -> None:
    """The edges' stand-in, in a process of its own, until told to stop: every
    ``post_interval_ms`` each edge posts what it has drafted since it last learned where its
    request stands (``progress``, kept by the client as tokens stream back: the decided tokens a
    real edge hears), at ``draft_tokens_per_s``."""
    from verifier_service.backends.vllm.proposals import ProposalBoard

    board = ProposalBoard.attach(board_name)
    kept = {
        key: kept_positions(len(truth), options["acceptance"], options["seed"] + index) for index, (key, truth) in enumerate(truths.items())
    }
    learned = {key: (-1, 0.0) for key in truths}
    posted: dict[str, tuple[int, int]] = {}
    ready_event.set()
    try:
        while not stop_event.is_set():
            now = time.monotonic()
            for index, (key, truth) in enumerate(truths.items()):
                position = progress[index]
                if position != learned[key][0]:
                    learned[key] = (position, now)
                length = min(board.max_tokens, int((now - learned[key][1]) * options["draft_tokens_per_s"]))
                drafted = edge_draft(truth, kept[key], position, length)
                if drafted and posted.get(key) != (position, len(drafted)):  # nothing new: the board keeps the last
                    board.post(key, position, drafted)
                    posted[key] = (position, len(drafted))
            time.sleep(options["post_interval_ms"] / 1000)
    finally:
        board.close()


@dataclass
class StandInEdges:
    """The process that posts proposals (``post_proposals``), and what it shares with the client."""

    process: Any
    progress: Any
    """Where each request stands (prompt + output tokens so far), kept by ``generate``."""
    stop_event: Any

    @classmethod
    async def start(cls, board_path: str, keys: list[str], prompts: list[list[int]], truths: list[list[int]], args: argparse.Namespace):
        context = multiprocessing.get_context("spawn")
        stop_event, ready_event = context.Event(), context.Event()
        options = {
            "seed": args.seed,
            "draft_tokens_per_s": args.draft_tokens_per_s,
            "acceptance": args.acceptance,
            "post_interval_ms": args.post_interval_ms,
        }
        truth_of = {key: prompt + truth for key, prompt, truth in zip(keys, prompts, truths, strict=True)}
        progress = context.Array("i", [len(prompt) for prompt in prompts], lock=False)
        process = context.Process(
            target=post_proposals, args=(board_path, truth_of, progress, options, ready_event, stop_event), daemon=True
        )
        process.start()
        edges = cls(process, progress, stop_event)
        if not await asyncio.to_thread(ready_event.wait, 120):
            edges.stop()
            raise RuntimeError("the stand-in edges' process did not start")
        return edges

    def stop(self) -> None:
        self.stop_event.set()
        self.process.join(timeout=10)


async def run_mode(
    model: str, mode: str, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace, truths: list[list[int]] | None = None
) -> ModeResult:
    """One engine, the N requests at once (``proposed`` needs the plain run's texts, ``truths``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from verifier_service.backends.vllm.proposals import BOARD_ENV, ProposalBoard
    from vllm import SamplingParams

    engine_args: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "max_model_len": args.max_model_len,
        "enforce_eager": True,
        # A KV cache of a set size: else vLLM's CPU backend wants 92 % of the machine's memory free.
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
    }
    board = ProposalBoard.create(num_slots=max(len(prompts), 1), max_tokens=max_tokens + 64) if mode != "plain" else None
    if board is not None:
        os.environ[BOARD_ENV] = board.name
        engine_args["speculative_config"] = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": args.k}
    keys = [f"s{index}{uuid.uuid4().hex[:8]}" for index in range(len(prompts))]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    edges: StandInEdges | None = None
    try:
        await warm_up(engine, SamplingParams)
        if mode == "proposed":
            assert board is not None and truths is not None, "'proposed' posts the plain run's texts"
            edges = await StandInEdges.start(board.name, keys, prompts, truths, args)
        progress = edges.progress if edges is not None else None
        before = spec_counters()
        started = time.perf_counter()
        texts = await asyncio.gather(
            *(
                generate(engine, SamplingParams, key, prompt, max_tokens, progress, index)
                for index, (key, prompt) in enumerate(zip(keys, prompts, strict=True))
            )
        )
        wall = time.perf_counter() - started
        after = spec_counters()
    finally:
        if edges is not None:
            edges.stop()
        engine.shutdown()
        if board is not None:
            board.close()
    drafts, draft_tokens, accepted = (_difference(after[name], before[name]) for name in ("drafts", "draft_tokens", "accepted"))
    return ModeResult(mode, len(prompts), wall, sum(len(text) for text in texts), list(texts), drafts, draft_tokens, accepted)


def _difference(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


async def warm_up(engine, sampling_params_class) -> None:
    params = sampling_params_class(temperature=0.0, max_tokens=4, detokenize=False)
    async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id=f"warm-{uuid.uuid4().hex[:8]}"):
        pass


async def generate(engine, sampling_params_class, key: str, prompt: list[int], max_tokens: int, progress, index: int) -> list[int]:
    """One request's output token ids; as they stream, ``progress[index]`` says where it stands."""
    params = sampling_params_class(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    token_ids: list[int] = []
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=key):
        token_ids = list(output.outputs[0].token_ids)
        if progress is not None:
            progress[index] = len(prompt) + len(token_ids)
    return token_ids


def spec_counters() -> dict[str, int | None]:
    """vLLM's speculation counters in this process's Prometheus registry (None without them)."""
    try:
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

        values = {metric.name: metric.value for metric in get_metrics_snapshot() if isinstance(metric, Counter)}
    except Exception:
        values = {}
    names = {
        "drafts": "vllm:spec_decode_num_drafts",
        "draft_tokens": "vllm:spec_decode_num_draft_tokens",
        "accepted": "vllm:spec_decode_num_accepted_tokens",
    }
    if not values:
        return dict.fromkeys(names)
    return {short: int(values.get(name, 0)) for short, name in names.items()}


def table(results: list[ModeResult]) -> str:
    lines = [
        "| N | mode | wall s | output tok/s | x plain | text = plain's | proposals | proposed tokens | accepted | accepted / proposed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    plain = {result.users: result for result in results if result.mode == "plain"}
    for result in results:
        reference = plain.get(result.users)
        rate = result.output_tokens / result.wall_s
        ratio = f"{rate / (reference.output_tokens / reference.wall_s):.2f}" if reference else "-"
        same = "-" if reference is None or result is reference else ("yes" if result.texts == reference.texts else "NO")
        share = f"{result.accepted_tokens / result.draft_tokens:.2f}" if result.draft_tokens and result.accepted_tokens is not None else "-"
        cells = [_cell(result.drafts), _cell(result.draft_tokens), _cell(result.accepted_tokens)]
        lines.append(
            f"| {result.users} | {result.mode} | {result.wall_s:.2f} | {rate:.1f} | {ratio} | {same} | {' | '.join(cells)} | {share} |"
        )
    return "\n".join(lines)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spade_bench.micro.vllm_session_probe", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default=None, help="target directory (default: a tiny target built in a temp dir)")
    parser.add_argument("--users", default="1,4", help="concurrent requests N, a comma list")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--acceptance", type=float, default=0.8, help="the stand-in edges' per-token chance of the target's token")
    parser.add_argument(
        "--draft-tokens-per-s",
        type=float,
        default=2000.0,
        help="the stand-in edges' drafting speed (the tiny target decodes hundreds a second)",
    )
    parser.add_argument("--post-interval-ms", type=float, default=5.0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="each engine's KV cache (it must hold --max-model-len tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the table and the raw results (JSON) here")
    return parser


async def main_async(args: argparse.Namespace) -> str:
    model = args.model
    if model is None:
        from spade_models.tiny import TinyPairSpec, build_tiny_pair

        _, target = build_tiny_pair(
            tempfile.mkdtemp(prefix="spade-probe-"), TinyPairSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=11)
        )
        model = str(target)
    modes = [mode for mode in args.modes.split(",") if mode]
    if "proposed" in modes and "plain" not in modes:
        raise SystemExit("--modes: 'proposed' posts the plain run's text, so it needs 'plain' too")
    results: list[ModeResult] = []
    for users in [int(value) for value in args.users.split(",")]:
        prompts = prompts_for(users, args.seed + users, vocab_size_of(model))
        truths = None
        for mode in [mode for mode in MODES if mode in modes]:
            result = await run_mode(model, mode, prompts, args.max_tokens, args, truths)
            truths = result.texts if mode == "plain" else truths
            results.append(result)
            print(f"vllm_session_probe: N = {users}, {mode}: {result.wall_s:.2f} s", file=sys.stderr, flush=True)
    report = table(results)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "vllm_session_probe.md").write_text(report + "\n")
        raw = [{key: value for key, value in vars(result).items() if key != "texts"} for result in results]
        (args.output / "vllm_session_probe.json").write_text(
            json.dumps({"args": vars(args) | {"output": str(args.output)}, "results": raw}, indent=1)
        )
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(asyncio.run(main_async(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
