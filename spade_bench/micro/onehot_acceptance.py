"""What verifying drafts as token ids (a one-hot q) costs in acceptance at temperature > 0, and
what drafting greedily gets back.

The pipelined-session wire (and vLLM's proposer hook under it) carries token ids only, so the
verifier checks each drafted token x with a one-hot q: accept with probability p(x), at a
rejection sample p with x removed. That is exact whatever proposed x, as long as the proposal
does not depend on p, but the acceptance differs from the verify wire's, which carries q:

    verify wire, x ~ q           sum_x min(p(x), q(x))     (the speculative-sampling rule)
    one-hot, x ~ q               sum_x q(x) p(x)           (today's pipelined edge: it samples q)
    one-hot, x = argmax q        p(argmax q)               (a greedy drafter, at any temperature)

Each is measured on the real pair along the target's own sampled text (the path the verifier
decides): per prompt, the target samples ``--max-tokens`` tokens at the temperature, then one
forward of each model over prompt + text gives p and q at every generated position, both after
the same sampling transform. Per rule it prints the mean acceptance and the expected tokens a
forward decides with d drafts (1 + sum over k <= d of the product of the acceptances of the
first k drafts from each position, averaged over positions: the run of acceptances along the
path, not an i.i.d. guess), and writes a table (``onehot_acceptance.md``), the raw numbers
(``.json``) and a plot (``.png``) to ``--output``:

    .venv/bin/python -m spade_bench.micro.onehot_acceptance --data $DATA/spec_bench/question_dev.jsonl \\
        --categories writing,coding,math_reasoning,qa --limit 3 --temperatures 0.7,1.0 --output out/

Acceptances, not timings: it may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gateway.prompts import chat_prompt_ids
from spade_bench.data import DataSelection, load_items
from spade_core.params import SamplingConfig
from spade_core.sampling import processed_probs
from spade_models.loader import LoadedModel, ModelSource, load_model

RULES = ("min(p,q)", "p.q", "p(argmax q)")
RULE_NOTES = {
    "min(p,q)": "verify wire: drafts x ~ q, q sent",
    "p.q": "token ids, drafts x ~ q (today's pipelined edge)",
    "p(argmax q)": "token ids, greedy drafts",
}


@dataclass(frozen=True)
class PathAcceptance:
    """One prompt's generated positions: each rule's acceptance at each."""

    category: str
    temperature: float
    by_rule: dict[str, list[float]]


def rule_acceptances(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> dict[str, list[float]]:
    """[positions, vocab] p and q -> each rule's acceptance per position (pure).

    Example: p = [0.6, 0.4], q = [0.5, 0.5]: min 0.9, p.q 0.5, p(argmax q) 0.6 (the first of ties)."""
    return {
        "min(p,q)": torch.minimum(target_probs, draft_probs).sum(-1).tolist(),
        "p.q": (target_probs * draft_probs).sum(-1).tolist(),
        "p(argmax q)": target_probs.gather(-1, draft_probs.argmax(-1, keepdim=True)).squeeze(-1).tolist(),
    }


def tokens_per_forward(acceptances: list[float], num_drafts: int) -> float:
    """Expected tokens one forward decides with ``num_drafts`` drafts, averaged over the positions
    it may start at: 1 + the expected run of accepted drafts (pure).

    Example: [1.0, 0.5, 0.0], 2 drafts: from 0, 1 + 1 + 0.5 = 2.5; from 1, 1 + 0.5 + 0 = 1.5;
    from 2, 1 + 0 = 1: mean 1.67."""
    totals = []
    for start in range(len(acceptances)):
        run, total = 1.0, 1.0
        for acceptance in acceptances[start : start + num_drafts]:
            run *= acceptance
            total += run
        totals.append(total)
    return statistics.fmean(totals) if totals else 1.0


@torch.inference_mode()
def sampled_text(target: LoadedModel, prompt_ids: list[int], config: SamplingConfig, max_tokens: int, seed: int) -> list[int]:
    """The target's own sample of ``max_tokens`` tokens after ``prompt_ids`` (stops at an end token)."""
    generator = torch.Generator().manual_seed(seed)
    output = target.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_tokens):
        probs = processed_probs(output.logits[0, -1], config)
        token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
        if token in target.eos_token_ids:
            break
        output = target.model(input_ids=torch.tensor([[token]]), past_key_values=output.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def position_probs(loaded: LoadedModel, prompt_ids: list[int], text: list[int], config: SamplingConfig) -> torch.Tensor:
    """[len(text), vocab] the model's distribution at each generated position, transformed."""
    logits = loaded.model(input_ids=torch.tensor([prompt_ids + text])).logits[0]
    return processed_probs(logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(text)], config)


def measure(
    target: LoadedModel, draft: LoadedModel, prompts: list[tuple[str, str]], temperatures: list[float], max_tokens: int
) -> list[PathAcceptance]:
    paths = []
    for temperature in temperatures:
        config = SamplingConfig(temperature=temperature)
        for index, (category, prompt) in enumerate(prompts):
            prompt_ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": prompt}])
            text = sampled_text(target, prompt_ids, config, max_tokens, seed=index)
            acceptances = rule_acceptances(
                position_probs(target, prompt_ids, text, config), position_probs(draft, prompt_ids, text, config)
            )
            paths.append(PathAcceptance(category, temperature, acceptances))
            print(
                f"T={temperature} {category:>16} {len(text):3d} tokens "
                + "  ".join(f"{rule} {statistics.fmean(values):.3f}" for rule, values in acceptances.items()),
                file=sys.stderr,
                flush=True,
            )
    return paths


def table(paths: list[PathAcceptance], draft_lengths: list[int]) -> list[str]:
    """Markdown rows: per temperature and rule, the mean acceptance and tokens per forward."""
    lines = [
        "| T | rule | what it is | acceptance | " + " | ".join(f"tokens/forward d={d}" for d in draft_lengths) + " |",
        "|---|---|---|---|" + "---|" * len(draft_lengths),
    ]
    for temperature in sorted({path.temperature for path in paths}):
        chosen = [path for path in paths if path.temperature == temperature]
        for rule in RULES:
            acceptance = statistics.fmean(value for path in chosen for value in path.by_rule[rule])
            per_forward = [statistics.fmean(tokens_per_forward(path.by_rule[rule], d) for path in chosen) for d in draft_lengths]
            lines.append(
                f"| {temperature} | {rule} | {RULE_NOTES[rule]} | {acceptance:.3f} | " + " | ".join(f"{v:.2f}" for v in per_forward) + " |"
            )
    return lines


def plot(paths: list[PathAcceptance], draft_lengths: list[int], destination: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({path.temperature for path in paths})
    figure, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 4), squeeze=False)
    for axis, temperature in zip(axes[0], temperatures, strict=True):
        chosen = [path for path in paths if path.temperature == temperature]
        for rule in RULES:
            values = [statistics.fmean(tokens_per_forward(path.by_rule[rule], d) for path in chosen) for d in draft_lengths]
            axis.plot(draft_lengths, values, marker="o", label=f"{rule}: {RULE_NOTES[rule]}")
        axis.set(title=f"T = {temperature}", xlabel="drafts per forward d", ylabel="expected tokens per forward")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(destination, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a Spec-Bench question file (JSONL)")
    parser.add_argument("--categories", default="writing,coding,math_reasoning,qa")
    parser.add_argument("--limit", type=int, default=3, help="prompts per category")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="registry name or directory")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="registry name or directory")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-lengths", default="1,2,4,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", help="directory for onehot_acceptance.md, .json and .png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    categories = tuple(name for name in args.categories.split(",") if name)
    items = load_items(args.data, DataSelection(categories=categories, limit=args.limit))
    prompts = [(item.category, item.turns[0]) for item in items]
    target = load_model(ModelSource(args.target), "cpu", "float32")
    draft = load_model(ModelSource(args.draft), "cpu", "float32")
    temperatures = [float(value) for value in args.temperatures.split(",")]
    draft_lengths = [int(value) for value in args.draft_lengths.split(",")]
    paths = measure(target, draft, prompts, temperatures, args.max_tokens)
    lines = [
        f"target {args.target}, draft {args.draft}, fp32; {len(prompts)} prompts ({args.categories}, {args.limit} each), "
        f"{args.max_tokens} tokens sampled by the target at each temperature",
        "",
        *table(paths, draft_lengths),
    ]
    print("\n".join(lines))
    if args.output:
        directory = Path(args.output)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "onehot_acceptance.md").write_text("\n".join(lines) + "\n")
        (directory / "onehot_acceptance.json").write_text(json.dumps([asdict(path) for path in paths]))
        plot(paths, draft_lengths, directory / "onehot_acceptance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
