"""The GPU check's model and sessions: a random model of the chosen shape with a word-level
tokenizer, its forward's cost per row count (one sequence, and the verifier's ragged forward),
and synthetic sessions (the target's own greedy output, proposals agreeing at a set rate)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from spade_bench.gpu_check.config import LOGIT_SCALE, SPECIAL_TOKENS, CheckConfig

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
