"""``spade-bench``: cloud calls, cloud compute and wall clock of SPADE under emulated network latency.

Runs the data through target-only (the verifier's own OpenAI route, through the delay proxy),
SPADE (through the edge agent, per draft length) and draft-only, sweeping the RTT; writes
``results.json`` (every request), ``requests.jsonl`` (written as the run goes), ``summary.md``
(also printed) and ``plots/*.png`` under ``--output``.

    spade-bench --data /path/spec_bench/question_dev.jsonl --data /path/cnndm/test_dev.jsonl \\
        --limit 2 --max-tokens 128 --rtt-ms 0,10,50,100 --draft-length 4,8,auto --output bench_results
    spade-bench --quick --data ...      # tiny model pair, a few minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from edge_agent.edge_power import DEFAULT_EDGE_POWER
from gateway.cli import add_version_argument, plain_text
from spade_bench.config import DRAFT_BACKENDS, EDGE_POWERS, MODES, BenchConfig, ModelPair, NetworkSweep, Placement
from spade_bench.data import DataSelection, load_items

BENCH_EXTRA_MODULES = ("matplotlib", "rouge_score")
"""What a run needs from the bench extra (plots; ROUGE against CNN/DM references). Imported
only once the flags are parsed, so --help works on a plain install; a run without them says
which extra to install instead of failing with a traceback."""
BENCH_EXTRA_HINT = "pip install 'spade-gateway[bench]'"

CAPACITY_EPILOG = """
    spade-bench capacity --help         # the other benchmark: how many edges one verifier serves
    spade-bench chaos --help            # many edges for a long time while things break under them
"""


@dataclass(frozen=True)
class QuickPreset:
    """What ``--quick`` changes, unless given explicitly: the tiny pair, one item per category."""

    limit: int = 1
    max_tokens: int = 24
    rtts_ms: tuple[float, ...] = (0.0, 50.0)
    draft_lengths: tuple[str, ...] = ("3", "auto")
    max_article_chars: int = 1200
    startup_timeout_s: float = 300.0


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _on_off_list(text: str) -> tuple[bool, ...]:
    values = {"on": True, "off": False}
    try:
        return tuple(values[part.lower()] for part in _csv(text))
    except KeyError as error:
        raise argparse.ArgumentTypeError(f"expected on/off values, got {error.args[0]!r}") from None


def _cores(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _csv(text))


def build_parser() -> argparse.ArgumentParser:
    doc = plain_text(__doc__)
    parser = argparse.ArgumentParser(
        prog="spade-bench",
        description=doc.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n", 1)[1] + CAPACITY_EPILOG,
    )
    add_version_argument(parser)
    parser.add_argument(
        "--data", action="append", default=[], metavar="PATH", help="Spec-Bench question .jsonl or CNN/DM .jsonl (repeatable)"
    )
    parser.add_argument("--output", type=Path, default=Path("bench_results"), help="results directory (default bench_results)")
    parser.add_argument("--limit", type=int, help="at most N items per category (a CNN/DM file is one category; default all)")
    parser.add_argument("--categories", type=_csv, default=(), help="comma list of categories to keep (default all)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 128)")
    parser.add_argument("--max-article-chars", type=int, help="cut CNN/DM articles to this length (default whole)")
    parser.add_argument("--modes", type=_csv, default=MODES, help=f"comma list of {', '.join(MODES)} (default all three)")
    parser.add_argument("--draft-length", type=_csv, help="comma list of edge draft lengths and/or auto (default 4,8,auto)")
    parser.add_argument(
        "--draft-backend",
        type=_csv,
        default=BenchConfig.draft_backends,
        help=f"comma list of the edge's drafter backends among {', '.join(DRAFT_BACKENDS)} (default auto)",
    )
    parser.add_argument(
        "--overlap",
        type=_on_off_list,
        default=BenchConfig.overlaps,
        help="comma list of on/off: the edge drafts the next block while one is verified (default on)",
    )
    parser.add_argument(
        "--edge-power",
        type=_csv,
        default=BenchConfig.edge_powers,
        help=(
            f"comma list of the edge's --edge-power among {', '.join(EDGE_POWERS)}: how far it drafts ahead (default {DEFAULT_EDGE_POWER})"
        ),
    )
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests sent at once through one edge (and to target-only) (default 1)"
    )
    parser.add_argument(
        "--rtt-ms", type=lambda text: tuple(float(v) for v in _csv(text)), help="comma list of round-trip times (default 0,10,50,100)"
    )
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="+/- one-way jitter per chunk (default 0)")
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0, help="link cap per direction; 0 = none (default 100)")
    parser.add_argument("--target", help=f"target model: registry name, directory, hub id or .gguf (default {ModelPair.target})")
    parser.add_argument("--draft", help=f"draft model, same forms (default {ModelPair.draft})")
    parser.add_argument("--target-gguf-file", help="GGUF file inside a --target directory or hub repo")
    parser.add_argument("--draft-gguf-file", help="GGUF file inside a --draft directory or hub repo")
    parser.add_argument("--dtype", default="float32", help="both services' --dtype: float32, bfloat16 or float16 (default float32)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 = greedy, Spec-Bench's protocol (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed sent with every request (default 0)")
    parser.add_argument("--edge-cores", type=_cores, help="comma list of cores for the edge (default: the first core)")
    parser.add_argument("--verifier-cores", type=_cores, help="comma list of cores for the verifier (default: the second core)")
    parser.add_argument("--threads", type=int, default=1, help="threads per service, torch's and llama.cpp's (default 1)")
    parser.add_argument(
        "--verifier-args", type=shlex.split, default=(), help='extra flags for spade-verifier, one string: "--max-sessions 64"'
    )
    parser.add_argument(
        "--edge-args", type=shlex.split, default=(), help='extra flags for spade-edge, one string: "--verify-timeout-s 300"'
    )
    parser.add_argument(
        "--startup-timeout-s",
        "--startup-timeout",
        dest="startup_timeout",
        metavar="S",
        type=float,
        help=f"seconds to wait for a service's /health (default {BenchConfig.startup_timeout_s:g}; "
        f"{QuickPreset.startup_timeout_s:g} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model pair, 1 item per category, 2 RTTs")
    parser.add_argument(
        "--report-only",
        type=Path,
        metavar="RESULTS",
        help="redo tables and plots from a results.json or requests.jsonl into --output; runs nothing (--data gives the ROUGE references)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _pick(explicit, quick_value, default, is_quick: bool):
    if explicit is not None:
        return explicit
    return quick_value if is_quick else default


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    quick = QuickPreset()
    is_quick = args.quick
    selection = DataSelection(
        categories=tuple(args.categories),
        limit=_pick(args.limit, quick.limit, None, is_quick),
        max_article_chars=_pick(args.max_article_chars, quick.max_article_chars, None, is_quick),
    )
    default_placement = Placement.default(args.threads)
    placement = Placement(
        args.edge_cores or default_placement.edge_cores, args.verifier_cores or default_placement.verifier_cores, args.threads
    )
    network = NetworkSweep(_pick(args.rtt_ms, quick.rtts_ms, NetworkSweep.rtts_ms, is_quick), args.jitter_ms, args.bandwidth_mbps or None)
    return BenchConfig(
        data_paths=tuple(args.data),
        output_dir=args.output,
        selection=selection,
        models=ModelPair(**_model_fields(args)),
        modes=tuple(args.modes),
        draft_lengths=_pick(args.draft_length, quick.draft_lengths, BenchConfig.draft_lengths, is_quick),
        draft_backends=tuple(args.draft_backend),
        overlaps=tuple(args.overlap),
        edge_powers=tuple(args.edge_power),
        concurrency=args.concurrency,
        network=network,
        placement=placement,
        max_tokens=_pick(args.max_tokens, quick.max_tokens, BenchConfig.max_tokens, is_quick),
        temperature=args.temperature,
        seed=args.seed,
        verifier_args=tuple(args.verifier_args),
        edge_args=tuple(args.edge_args),
        startup_timeout_s=_pick(args.startup_timeout, quick.startup_timeout_s, BenchConfig.startup_timeout_s, is_quick),
    )


def _model_fields(args: argparse.Namespace) -> dict:
    fields = {"dtype": args.dtype, "target_gguf_file": args.target_gguf_file, "draft_gguf_file": args.draft_gguf_file}
    if args.target:
        fields["target"] = args.target
    if args.draft:
        fields["draft"] = args.draft
    return fields


def with_tiny_pair(config: BenchConfig) -> BenchConfig:
    """``--quick`` without explicit models: build the tiny pair under the output directory."""
    from spade_models.tiny import build_tiny_pair

    target, draft = build_tiny_pair(config.output_dir / "tiny-models")
    return replace(config, models=replace(config.models, target=str(target), draft=str(draft), target_gguf_file=None, draft_gguf_file=None))


def environment() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "available_cores": sorted(os.sched_getaffinity(0)),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def missing_bench_modules() -> list[str]:
    return [name for name in BENCH_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("spade_bench").setLevel(logging.INFO)  # not the HTTP clients' per-request lines
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chaos"]:  # `spade-bench chaos ...`: many edges while things break (spade_bench.chaos)
        from spade_bench.chaos.run import main as chaos_main

        return chaos_main(argv[1:])
    if argv[:1] == ["capacity"]:  # `spade-bench capacity ...`: users per verifier (spade_bench.capacity)
        from spade_bench.capacity.replay import main as capacity_main

        return capacity_main(argv[1:])
    args = build_parser().parse_args(argv)
    missing = missing_bench_modules()
    if missing:
        print(f"spade-bench: needs the bench extra (missing {', '.join(missing)}): {BENCH_EXTRA_HINT}", file=sys.stderr)
        return 2
    from spade_bench.session import report_only, run_session  # imports matplotlib

    try:
        if not args.data:
            raise ValueError("--data PATH is required (Spec-Bench or CNN/DM .jsonl; repeatable)")
        config = config_from_args(args)
        items = [item for path in config.data_paths for item in load_items(path, config.selection)]
        if args.report_only:
            print(report_only(args.report_only, args.output, items))
            return 0
        if args.quick and not (args.target or args.draft):
            config = with_tiny_pair(config)
    except ValueError as error:
        print(f"spade-bench: {error}", file=sys.stderr)
        return 2

    started = time.time()
    markdown = run_session(config, items, environment(), show_progress=not args.no_progress)
    print(markdown)
    print(f"results in {config.output_dir} ({time.time() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
