"""The demo's request: one chat prompt through the target model alone (the verifier's own OpenAI
route, the cloud-only baseline) and through SPADE (the edge drafting, the verifier checking),
both streamed with the OpenAI client, then side by side: tokens/s, time to first token and the
target's forward passes. Without a baseline URL (or with --no-baseline) only SPADE runs."""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import dataclass, field

import httpx
from openai import OpenAI, OpenAIError

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


@dataclass(frozen=True)
class StreamResult:
    """One streamed answer as the client saw it."""

    text: str
    num_tokens: int
    elapsed_s: float
    first_token_s: float | None
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def num_target_passes(self) -> int | None:
        """The target's forward passes: one per verify call (target-only: one per token)."""
        return self.stats.get("verify_calls")


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int, temperature: float, echo: bool) -> StreamResult:
    """Stream one chat answer; print its text as it arrives when ``echo``. Each call has a cache
    salt of its own, so neither run finds its prompt in a prefix cache the other one warmed (the
    target-alone run and SPADE reach the same verifier)."""
    client = OpenAI(base_url=base_url, api_key="unused")
    started = time.perf_counter()
    first_token_at = None
    pieces: list[str] = []
    num_tokens, stats = None, {}
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": uuid.uuid4().hex},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first_token_at = first_token_at or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
            if echo:
                print(pieces[-1], end="", flush=True)
        if chunk.usage is not None:
            num_tokens, stats = chunk.usage.completion_tokens, (chunk.model_extra or {}).get("spade") or {}
    elapsed_s = time.perf_counter() - started
    first_token_s = None if first_token_at is None else first_token_at - started
    text = "".join(pieces)
    return StreamResult(text, num_tokens if num_tokens is not None else len(pieces), elapsed_s, first_token_s, stats)


def describe_edge(base_url: str) -> str:
    """One line on how the edge drafts, from its /health (fields it lacks are left out)."""
    try:
        health = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return "edge: /health did not answer"
    return edge_description(health)


def edge_description(health: dict) -> str:
    """The line ``describe_edge`` prints for the edge's /health body (an edge without API keys
    keeps its draft model's name or path to itself)."""
    draft = f"draft {health['draft_model']}" if health.get("draft_model") else "a local draft"
    parts = [f"{draft} on {health['draft_backend']}" if health.get("draft_backend") else draft]
    if health.get("draft_length") == "auto":
        parts.append("draft length auto (chosen before each block)")
    elif health.get("draft_length") is not None:
        parts.append(f"draft length {health['draft_length']}")
    if health.get("overlap") is not None:
        parts.append("overlapped with verification" if health["overlap"] else "drafting and verifying in turn")
    return "edge: " + ", ".join(parts)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def comparison_rows(baseline: StreamResult, spade: StreamResult) -> list[tuple[str, str, str]]:
    """(measure, target alone, SPADE) rows; the last one is SPADE's speed over the baseline's."""
    speedup = spade.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s > 0 else float("nan")
    return [
        ("tokens", str(baseline.num_tokens), str(spade.num_tokens)),
        ("wall time", _seconds(baseline.elapsed_s), _seconds(spade.elapsed_s)),
        ("time to first token", _seconds(baseline.first_token_s), _seconds(spade.first_token_s)),
        ("tokens/s", f"{baseline.tokens_per_s:.2f}", f"{spade.tokens_per_s:.2f}"),
        ("target forward passes", str(baseline.num_target_passes or "-"), str(spade.num_target_passes or "-")),
        ("speed vs target alone", "1.00×", f"{speedup:.2f}×"),
    ]


def format_table(rows: list[tuple[str, str, str]]) -> str:
    header = ("", "target alone", "SPADE (edge + verifier)")
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(3)]
    return "\n".join(f"  {a:<{widths[0]}}   {b:>{widths[1]}}   {c:>{widths[2]}}" for a, b, c in [header, *rows])


def spade_details(result: StreamResult) -> list[str]:
    stats, calls = result.stats, max(result.stats.get("verify_calls", 0), 1)
    return [
        f"SPADE: {result.num_tokens / calls:.2f} tokens per verify call, "
        f"accepted/drafted {stats.get('accepted_tokens')}/{stats.get('drafted_tokens')}",
        f"SPADE: waiting for drafts {stats.get('draft_ms', 0) / 1e3:.1f} s, verify round trips "
        f"{stats.get('verify_ms', 0) / 1e3:.1f} s (target forward {stats.get('verifier_forward_ms', 0) / 1e3:.1f} s)",
    ]


def verdict(baseline: StreamResult, spade: StreamResult, temperature: float) -> str:
    same = "same text as the target alone" if baseline.text == spade.text else "text differs from the target alone"
    if temperature > 0:
        same += " (sampled: expected to differ)"
    if spade.tokens_per_s >= baseline.tokens_per_s:
        return same + "."
    return (
        same + ". SPADE was slower than the target alone on this prompt: speculation pays when the"
        " draft agrees with the target often (code more than prose) and the target's pass dominates."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the edge's OpenAI API (default: %(default)s)")
    parser.add_argument(
        "--baseline-url", default=None, help="the verifier's OpenAI API, for the target-only baseline (e.g. http://127.0.0.1:8001/v1)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="run SPADE only")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target's model id (default: %(default)s)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (default: a palindrome function)")
    parser.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    return parser


def run_baseline(arguments: argparse.Namespace) -> StreamResult | None:
    print(f"target alone ({arguments.baseline_url}): the same prompt, {arguments.max_tokens} tokens at most ...", flush=True)
    try:
        result = stream_chat(
            arguments.baseline_url,
            arguments.model,
            arguments.prompt,
            arguments.max_tokens,
            arguments.temperature,
            echo=False,
        )
    except OpenAIError as error:
        print(f"target alone: failed ({error}); showing SPADE only")
        return None
    print(f"target alone: {result.num_tokens} tokens in {result.elapsed_s:.1f} s\n")
    return result


def main() -> None:
    arguments = build_parser().parse_args()
    print(f"> {arguments.prompt}\n")
    baseline = None if arguments.no_baseline or not arguments.baseline_url else run_baseline(arguments)
    print(describe_edge(arguments.base_url))
    print("SPADE (edge drafts, verifier checks):\n", flush=True)
    spade = stream_chat(arguments.base_url, arguments.model, arguments.prompt, arguments.max_tokens, arguments.temperature, echo=True)
    print("\n")
    if baseline is None:
        print(
            f"SPADE: {spade.num_tokens} tokens in {spade.elapsed_s:.1f} s ({spade.tokens_per_s:.2f} tokens/s), "
            f"first token after {_seconds(spade.first_token_s)}, {spade.num_target_passes} target forward passes"
        )
    else:
        print(format_table(comparison_rows(baseline, spade)))
        print()
        print(verdict(baseline, spade, arguments.temperature))
    for line in spade_details(spade):
        print(line)


if __name__ == "__main__":
    main()
