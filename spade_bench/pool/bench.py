"""The verifier's prefix hit rate behind a pool of two replicas, routed by prefix or by session
(issue 23 item 6).

Two verifier replicas sit behind nginx running the shipped docker/nginx/verifier-pool.conf, one
edge in front; requests go through the edge's /v1/chat/completions (greedy). Two scenarios:

- **multi-turn**: two-turn Spec-Bench (MT-bench) conversations; turn 1 is answered, then turn 2
  is asked with turn 1 and its answer before it.
- **system prompt**: ``--system-prompts`` long system prompts (reference notes built from other
  rows' text, about ``--system-chars`` characters), each used by ``--users`` users with a short
  question of their own (the shortest single-turn rows).

Each runs twice, on fresh replicas: with the shipped routing (nginx hashes the edge's prefix key,
X-Spade-Route: a chat's first message) and by session alone (the same config with the route map
sending everything to the session key). Each phase (turn 1, turn 2; user 1, users 2+) reads every
replica's ``spade_verifier_prompt_tokens_total`` and ``spade_verifier_prefix_hit_tokens_total``
before and after; the hit rate is hit tokens / prompt tokens. The split of requests over the
replicas comes from nginx's access log.

    python -m spade_bench.pool --data ../shared/data/spec_bench/question_dev.jsonl \\
        --conversations 6 --system-prompts 2 --users 4 --output pool.json

Without ``--draft``/``--target`` it builds the tiny random pair (spade_models.tiny): a hit rate
is a property of routing and token counts, not of model quality.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from spade_bench.data import BenchItem, load_items
from spade_bench.nginx_pool import find_nginx
from spade_bench.pool.stack import Pool, PoolSpec, running_pool

PROMPT_TOKENS = "spade_verifier_prompt_tokens_total"
HIT_TOKENS = "spade_verifier_prefix_hit_tokens_total"
QUESTION_CHARS = 200
SYSTEM_INSTRUCTION = "Answer the user's question in one or two sentences; use these notes where they help."


@dataclass(frozen=True)
class Workload:
    conversations: list[tuple[str, str]]
    """(turn 1, turn 2) per conversation."""
    system_prompts: list[str]
    questions: list[list[str]]
    """Per system prompt, one question per user."""


@dataclass(frozen=True)
class PhaseResult:
    routing: str
    """"prefix" (the shipped config) or "session"."""
    scenario: str
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    requests_per_replica: dict[str, int]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def build_workload(items: list[BenchItem], num_conversations: int, num_system_prompts: int, num_users: int, system_chars: int) -> Workload:
    """Conversations from the first two-turn rows; questions from the shortest single-turn rows;
    system prompts from the other single-turn rows, in file order, each about ``system_chars``
    long and naming its team in its first characters (so no two share a first block of the prefix
    cache, even with the tiny pair's near character-level tokenizer, and even where their notes
    open alike: Spec-Bench's translation rows all start "Translate German to English:")."""
    if num_users < 2:
        raise ValueError("the system-prompt scenario needs at least 2 users: users 2+ are the ones a cache can serve")
    two_turn = [item for item in items if item.num_turns >= 2][:num_conversations]
    single = [item for item in items if item.num_turns == 1]
    num_questions = num_system_prompts * num_users
    shortest = sorted(single, key=lambda item: len(item.turns[0]))[:num_questions]
    notes = [item.turns[0] for item in single if item not in shortest]
    if len(two_turn) < num_conversations or len(shortest) < num_questions or len(notes) < num_system_prompts:
        raise ValueError(f"the data has {len(two_turn)} two-turn and {len(single)} single-turn rows: too few for this workload")
    system_prompts = []
    for index in range(num_system_prompts):
        text = f"Team {index + 1}'s assistant. Reference notes:\n"
        for note in notes[index::num_system_prompts]:
            if len(text) >= system_chars:
                break
            text += f"- {note[: system_chars - len(text)]}\n"
        system_prompts.append(text + SYSTEM_INSTRUCTION)
    questions = [item.turns[0][:QUESTION_CHARS] for item in shortest]
    per_prompt = [questions[index::num_system_prompts] for index in range(num_system_prompts)]
    return Workload([(item.turns[0], item.turns[1]) for item in two_turn], system_prompts, per_prompt)


def chat(client: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> str:
    """One greedy chat completion through the edge; its answer's text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


@contextlib.contextmanager
def measured(pool: Pool, routing: str, scenario: str, num_requests: int, results: list[PhaseResult]) -> Iterator[None]:
    """Every replica's prompt and hit tokens before and after the block: one phase's result."""
    before, mark = pool.replica_metrics(), pool.num_logged()
    yield
    after = pool.replica_metrics()
    prompt_tokens = sum(after[name][PROMPT_TOKENS] - before[name][PROMPT_TOKENS] for name in after)
    hit_tokens = sum(after[name][HIT_TOKENS] - before[name][HIT_TOKENS] for name in after)
    results.append(PhaseResult(routing, scenario, num_requests, int(prompt_tokens), int(hit_tokens), pool.sessions_per_replica(mark)))


def run_scenarios(pool: Pool, routing: str, workload: Workload, max_tokens: int) -> list[PhaseResult]:
    """Both scenarios through the pool's edge, phase by phase."""
    results: list[PhaseResult] = []
    with httpx.Client(base_url=pool.edge_url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def phase(scenario: str, requests: list[list[dict]]) -> list[str]:
            with measured(pool, routing, scenario, len(requests), results):
                return [chat(client, model, messages, max_tokens) for messages in requests]

        first_turns = [[{"role": "user", "content": turn_1}] for turn_1, _ in workload.conversations]
        answers = phase("multi-turn: turn 1", first_turns)
        phase("multi-turn: turn 2", second_turns(first_turns, answers, [turn_2 for _, turn_2 in workload.conversations]))
        rounds = user_rounds(workload)
        phase("system prompt: user 1", rounds[0])
        phase("system prompt: users 2+", [messages for round_ in rounds[1:] for messages in round_])
    return results


def second_turns(first_turns: list[list[dict]], answers: list[str], questions: list[str]) -> list[list[dict]]:
    """Turn 1's messages, its answer, and the second user turn."""
    return [
        messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        for messages, answer, question in zip(first_turns, answers, questions, strict=True)
    ]


def user_rounds(workload: Workload) -> list[list[list[dict]]]:
    """Round u holds user u's request under every system prompt: rounds[0] are the first users
    (each pays for its system prompt), the later rounds may find it cached."""
    num_users = len(workload.questions[0])
    return [
        [
            [{"role": "system", "content": system}, {"role": "user", "content": questions[user]}]
            for system, questions in zip(workload.system_prompts, workload.questions, strict=True)
        ]
        for user in range(num_users)
    ]


def table(results: list[PhaseResult]) -> list[str]:
    """One markdown row per (routing, phase)."""
    replicas = list(results[0].requests_per_replica) if results else []
    lines = [
        f"| routing | scenario | requests | prompt tokens | hit tokens | hit rate | requests per replica ({' / '.join(replicas)}) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        split = " / ".join(str(r.requests_per_replica[name]) for name in replicas)
        lines.append(f"| {r.routing} | {r.scenario} | {r.num_requests} | {r.prompt_tokens} | {r.hit_tokens} | {r.hit_rate:.0%} | {split} |")
    return lines


@contextlib.contextmanager
def model_pair(draft: str | None, target: str | None) -> Iterator[tuple[str, str]]:
    """The models given, else the tiny random pair built in a temporary directory."""
    if draft and target:
        yield draft, target
        return
    if draft or target:
        raise ValueError("give both --draft and --target, or neither (the tiny pair)")
    from spade_models.tiny import build_tiny_pair

    with tempfile.TemporaryDirectory(prefix="spade-pool-tiny-") as directory:
        target_dir, draft_dir = build_tiny_pair(directory)
        yield str(draft_dir), str(target_dir)


def run(args: argparse.Namespace) -> list[PhaseResult]:
    """Both routings, each on fresh replicas, nginx and edge."""
    nginx = find_nginx()
    if nginx is None:
        raise RuntimeError("nginx is not installed (apt-get install nginx): the pool cannot run")
    workload = build_workload(load_items(args.data), args.conversations, args.system_prompts, args.users, args.system_chars)
    results: list[PhaseResult] = []
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spade-pool-")))
        draft, target = stack.enter_context(model_pair(args.draft, args.target))
        for route_by_prefix in (True, False):
            spec = PoolSpec(
                draft, target, log_dir, route_by_prefix, args.dtype, args.draft_length, startup_timeout_s=args.startup_timeout_s
            )
            with running_pool(spec, nginx) as pool:
                results += run_scenarios(pool, spec.routing, workload, args.max_tokens)
    return results


def write_json(path: str, args: argparse.Namespace, results: list[PhaseResult]) -> None:
    setup = {key: value for key, value in vars(args).items() if key not in ("output", "log_dir")}
    setup |= {"draft": args.draft or "tiny pair (spade_models.tiny)", "target": args.target or "tiny pair (spade_models.tiny)"}
    rows = [asdict(result) | {"hit_rate": result.hit_rate} for result in results]
    Path(path).write_text(json.dumps({"setup": setup, "results": rows}, indent=2) + "\n")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spade_bench.pool", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", required=True, help="Spec-Bench question file (two-turn rows: conversations; the others: notes, questions)."
    )
    parser.add_argument("--draft", help="Draft model (spade-models name, directory or HF id); default: the tiny pair.")
    parser.add_argument("--target", help="Target model; default: the tiny pair.")
    parser.add_argument("--conversations", type=_positive, default=6, help="Two-turn conversations (K).")
    parser.add_argument("--system-prompts", type=_positive, default=2, help="Shared system prompts (M).")
    parser.add_argument("--users", type=_positive, default=4, help="Users of each system prompt (U).")
    parser.add_argument("--system-chars", type=_positive, default=1500, help="About how long each system prompt is, in characters.")
    parser.add_argument("--max-tokens", type=_positive, default=16, help="Greedy tokens per answer.")
    parser.add_argument("--draft-length", default="3", help="The edge's --draft-length.")
    parser.add_argument("--dtype", default="float32", help="Both models' dtype.")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="How long a service may take to start.")
    parser.add_argument("--log-dir", help="Service logs and nginx's files (default: a temporary directory).")
    parser.add_argument("--output", help="Write the setup and every phase's result here (JSON).")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop everything started, as on Ctrl-C
    try:
        results = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.output:
        write_json(args.output, args, results)
    print("\n".join(table(results)), flush=True)


if __name__ == "__main__":
    main()
