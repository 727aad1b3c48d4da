"""The verifier's prefix cache, cache on against cache off in one run (issue 23).

Two scenarios, each request timed to its first token on the transformers backend in-process
(target-only decoding: the first token is one step with an empty block, so its time is the
prefill of whatever the verifier did not have cached):

- **multi-turn**: Spec-Bench's MT-bench items; turn 1 is answered (greedy, ``answer_tokens``),
  then turn 2 is asked after the chat template's rendering of turn 1 and its answer.
- **system prompt**: ``num_users`` users, one after another, each a long shared system prompt
  (first turns of other Spec-Bench items as reference notes, about ``system_tokens`` tokens)
  plus a short question of their own.
- **all at once**: the same users (under a system prompt nobody sent before) arriving at the
  same moment: with the cache on, the first prefills the shared prompt and the others copy it
  (``scheduler.waiting_for_shared_prefix``), so the prefilled tokens are one prompt plus each
  other user's own question, and each first token comes after the shared prefill plus that
  user's question; off, each prefills everything, in shared forwards.

"Off" is the same backend with a salt per request (nothing shared), "on" one namespace for
all; the two run interleaved, request by request, so load on a shared core hits both alike.
Reported per request: prompt tokens, tokens prefilled by the verifier (its ``num_target_tokens``
on the first step), tokens the cache covered, and time to the first token.

    python -m spade_bench.micro.prefix_bench --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/spec_bench/question_dev.jsonl --items 3 --num-users 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from spade_bench.data import BenchItem, DataSelection, load_items
from spade_core.params import SamplingConfig
from verifier_service.backends.base import BlockToVerify
from verifier_service.backends.transformers.backend import TransformersBackend

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GREEDY = SamplingConfig(temperature=0.0)
SHARED = "prefix-bench"


@dataclass(frozen=True)
class FirstToken:
    scenario: str
    cache: str
    """"on" or "off"."""
    request: str
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    ttft_s: float


async def first_token(
    backend: TransformersBackend, prompt: list[int], namespace: str, answer_tokens: int = 0
) -> tuple[FirstToken, list[int]]:
    """Time to the first token of a target-only request, and its greedy answer (``answer_tokens``
    more steps when asked); the session is released (its cache retained) at the end."""
    session_id = uuid.uuid4().hex
    started = time.perf_counter()
    first = await backend.verify_block(BlockToVerify(session_id, prompt, [], None, GREEDY, cache_namespace=namespace))
    ttft_s = time.perf_counter() - started
    answer = [first.next_token_id]
    for _ in range(answer_tokens - 1):
        verdict = await backend.verify_block(BlockToVerify(session_id, prompt + answer, [], None, GREEDY, cache_namespace=namespace))
        answer.append(verdict.next_token_id)
    backend.release_session(session_id)
    record = FirstToken("", "", "", len(prompt), first.num_target_tokens, first.num_cached_tokens, ttft_s)
    return record, answer


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


async def multi_turn(backend: TransformersBackend, items: list[BenchItem], answer_tokens: int) -> list[FirstToken]:
    """Per item, cache on then off: turn 1 answered, turn 2 timed (turn 1's time kept too)."""
    tokenizer = backend.tokenizer
    records = []
    for item in items:
        for cache in ("on", "off"):
            first_messages = [{"role": "user", "content": item.turns[0]}]
            turn_1, answer = await first_token(backend, chat_ids(tokenizer, first_messages), namespace_of(cache), answer_tokens)
            answer_text = tokenizer.decode(answer, skip_special_tokens=True)
            second = first_messages + [{"role": "assistant", "content": answer_text}, {"role": "user", "content": item.turns[1]}]
            turn_2, _ = await first_token(backend, chat_ids(tokenizer, second), namespace_of(cache))
            records.append(_named(turn_1, "multi-turn: turn 1", cache, item.item_id))
            records.append(_named(turn_2, "multi-turn: turn 2", cache, item.item_id))
    return records


async def all_at_once(backend: TransformersBackend, notes: list[BenchItem], questions: list[str], system_tokens: int) -> list[FirstToken]:
    """Every user at the same moment, on (one fresh namespace: nothing of it cached yet) then off."""
    tokenizer = backend.tokenizer
    system = "Team notes, revision 2.\n" + shared_system_prompt(tokenizer, notes, system_tokens)
    prompts = [
        chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}]) for question in questions
    ]
    records = []
    for cache in ("on", "off"):
        namespace = uuid.uuid4().hex
        answers = await asyncio.gather(
            *[first_token(backend, prompt, namespace if cache == "on" else uuid.uuid4().hex) for prompt in prompts]
        )
        records += [_named(record, "all at once", cache, f"user {index + 1}") for index, (record, _) in enumerate(answers)]
    return records


async def system_prompt(backend: TransformersBackend, notes: list[BenchItem], questions: list[str], system_tokens: int) -> list[FirstToken]:
    """Each user (in turn) with the shared system prompt and a question of their own, on then off."""
    tokenizer = backend.tokenizer
    system = shared_system_prompt(tokenizer, notes, system_tokens)
    records = []
    for index, question in enumerate(questions):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for cache in ("on", "off"):
            record, _ = await first_token(backend, chat_ids(tokenizer, messages), namespace_of(cache))
            records.append(_named(record, "system prompt", cache, f"user {index + 1}"))
    return records


def shared_system_prompt(tokenizer, notes: list[BenchItem], system_tokens: int) -> str:
    """An assistant's instructions and reference notes (first turns of Spec-Bench items) of
    about ``system_tokens`` tokens."""
    text = "You are a careful assistant for a writing team. Answer briefly. Reference notes:\n"
    for item in notes:
        if len(tokenizer.encode(text)) >= system_tokens:
            break
        text += f"- {item.turns[0]}\n"
    return text


def namespace_of(cache: str) -> str:
    """One namespace for every request with the cache on; a fresh one per request with it off."""
    return SHARED if cache == "on" else uuid.uuid4().hex


def _named(record: FirstToken, scenario: str, cache: str, request: str) -> FirstToken:
    return FirstToken(scenario, cache, request, record.prompt_tokens, record.prefilled_tokens, record.cached_tokens, record.ttft_s)


def summary(records: list[FirstToken]) -> list[str]:
    """Per scenario: prefilled share of the prompt and median TTFT, on and off, and their ratio."""
    lines = [
        "| scenario | requests | prefilled / prompt, on | off | TTFT on (median) | off | on / off |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scenario in dict.fromkeys(record.scenario for record in records):
        on = [r for r in records if r.scenario == scenario and r.cache == "on"]
        off = [r for r in records if r.scenario == scenario and r.cache == "off"]
        if scenario == "system prompt":  # the first user pays the prefix once: the others are the point
            on, off = on[1:], off[1:]
        ttft_on, ttft_off = statistics.median(r.ttft_s for r in on), statistics.median(r.ttft_s for r in off)
        lines.append(
            f"| {scenario}{' (users 2+)' if scenario == 'system prompt' else ''} | {len(on)} | "
            f"{_share(on):.0%} | {_share(off):.0%} | {ttft_on:.2f} s | {ttft_off:.2f} s | {ttft_on / ttft_off:.2f} |"
        )
    together = [r for r in records if r.scenario == "all at once"]
    if together:
        lines.append("")
        lines.append("All at once, per user: prefilled tokens and time to the first token, on | off")
        ons, offs = [r for r in together if r.cache == "on"], [r for r in together if r.cache == "off"]
        for user_on, user_off in zip(ons, offs, strict=True):
            on_text = f"{user_on.prefilled_tokens} of {user_on.prompt_tokens}, {user_on.ttft_s:.2f} s"
            lines.append(f"  {user_on.request}: {on_text} | {user_off.prefilled_tokens}, {user_off.ttft_s:.2f} s")
    return lines


def _share(records: list[FirstToken]) -> float:
    return sum(r.prefilled_tokens for r in records) / sum(r.prompt_tokens for r in records)


async def run(backend: TransformersBackend, args: argparse.Namespace) -> list[FirstToken]:
    items = load_items(args.data, DataSelection(categories=MT_BENCH_CATEGORIES))
    two_turn = [item for item in items if item.num_turns >= 2][: args.items]
    records = await multi_turn(backend, two_turn, args.answer_tokens)
    questions = [item.turns[0][:200] for item in items[-args.num_users :]]
    notes = items[len(two_turn) : len(items) - args.num_users]
    records += await system_prompt(backend, notes, questions, args.system_tokens)
    if args.together:
        records += await all_at_once(backend, notes, questions, args.system_tokens)
    await backend.aclose()
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Target model (spade-models name, directory or HF id).")
    parser.add_argument("--data", required=True, help="Spec-Bench question file (MT-bench categories are used).")
    parser.add_argument("--items", type=int, default=3, help="Two-turn items of the multi-turn scenario.")
    parser.add_argument("--answer-tokens", type=int, default=32, help="Greedy tokens answering turn 1.")
    parser.add_argument("--num-users", type=int, default=4, help="Users of the shared system prompt.")
    parser.add_argument("--system-tokens", type=int, default=1000, help="About how long the shared system prompt is.")
    parser.add_argument("--no-together", dest="together", action="store_false", help="Skip the all-at-once scenario.")
    parser.add_argument("--output", help="Write every request's record here (JSON lines).")
    args = parser.parse_args(argv)
    import torch

    from spade_models.loader import ModelSource, load_model

    torch.set_num_threads(1)
    backend = TransformersBackend(load_model(ModelSource(args.model)), fast_kernels=True, batch_invariant="preferred")
    records = asyncio.run(run(backend, args))
    for record in records:
        print(json.dumps(asdict(record)), flush=True)
    if args.output:
        with open(args.output, "w") as out:
            out.writelines(json.dumps(asdict(record)) + "\n" for record in records)
    print("\n".join(summary(records)))


if __name__ == "__main__":
    main()
