"""``spade-models``: fetch, list and pre-convert the named models; write a tiny test pair.

    spade-models list                        # the registry, and what is cached
    spade-models pull qwen2.5-coder-1.5b-instruct   # prints the GGUF path (progress on stderr)
    spade-models convert qwen2.5-coder-1.5b-instruct --dtype float32
    spade-models tiny /tmp/tiny-pair         # a random ~0.3 M parameter draft/target pair

Results go to stdout (one path per line), so ``$(spade-models pull NAME)`` works in scripts;
progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from spade_models.pull import PullError, default_cache_dir, gguf_path, pull, resolve_cache_dir
from spade_models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, REGISTRY

logger = logging.getLogger("spade_models")


def build_parser() -> argparse.ArgumentParser:
    from gateway.cli import add_version_argument, plain_text

    parser = argparse.ArgumentParser(prog="spade-models", description=plain_text(__doc__.split("\n\n")[0]))
    add_version_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    commands = parser.add_subparsers(dest="command", required=True)

    pull_parser = commands.add_parser("pull", help="fetch a model's GGUF file into the cache; print its path")
    pull_parser.add_argument("names", nargs="+", metavar="NAME", help="registry names (see `list`)")
    _add_cache_dir(pull_parser)
    pull_parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    list_parser = commands.add_parser("list", help="the named models and whether they are cached")
    _add_cache_dir(list_parser)

    convert_parser = commands.add_parser("convert", help="pull and dequantize once, so later loads are fast")
    convert_parser.add_argument("names", nargs="+", metavar="NAME", help="registry names or .gguf paths")
    convert_parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    _add_cache_dir(convert_parser)

    tiny_parser = commands.add_parser("tiny", help="write a tiny random draft/target pair into DIR")
    tiny_parser.add_argument("directory", metavar="DIR")
    tiny_parser.add_argument("--vocab", choices=("bpe", "letters"), default="bpe")
    tiny_parser.add_argument("--seed", type=int, default=0)
    return parser


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None, help=f"model cache (default: $SPADE_CACHE_DIR or {default_cache_dir()})")


def run_pull(args: argparse.Namespace) -> int:
    for name in args.names:
        print(pull(name, args.cache_dir, progress=not args.no_progress), flush=True)
    return 0


def run_list(args: argparse.Namespace) -> int:
    cache_dir = resolve_cache_dir(args.cache_dir)
    defaults = {DEFAULT_DRAFT: " (default draft)", DEFAULT_TARGET: " (default target)"}
    print(f"{'NAME':<30} {'ROLE':<7} {'SIZE':>9}  {'CACHED':<6}  DESCRIPTION")
    for model in REGISTRY.values():
        cached = "yes" if gguf_path(model, cache_dir).is_file() else "no"
        size = f"{model.size / 2**20:.0f} MiB"
        print(f"{model.name:<30} {model.role:<7} {size:>9}  {cached:<6}  {model.description}{defaults.get(model.name, '')}")
    print(f"cache: {cache_dir}", file=sys.stderr)
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from spade_models.loader import ModelSource, convert  # imports torch: only when needed

    for name in args.names:
        print(convert(ModelSource(name, cache_dir=args.cache_dir), dtype=args.dtype), flush=True)
    return 0


def run_tiny(args: argparse.Namespace) -> int:
    from spade_models.tiny import TinyPairSpec, build_tiny_pair

    target, draft = build_tiny_pair(Path(args.directory), TinyPairSpec(vocab=args.vocab, seed=args.seed))
    print(target)
    print(draft)
    return 0


COMMANDS = {"pull": run_pull, "list": run_list, "convert": run_convert, "tiny": run_tiny}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command](args)
    except (PullError, ValueError) as error:
        print(f"spade-models: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
