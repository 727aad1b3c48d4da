"""What shares the next forward, and how many rows each share may feed: pure functions of the
queue, which the scheduler (``scheduler``) calls before every forward.

Glossary:
    pending     a verify call (or a target-only step) waiting for the target
    need        the rows a call still has to feed: its uncached context + its drafted block
    small call  a call whose need fits one block (at most ``max_block_rows``): a steady-state
                verify call, a target-only step, a short prompt
    big call    a long prompt (or a resync) whose need is larger: it is prefilled in chunks
    forward     one model call over every share's rows (``runner``), at most
                ``max_forward_rows`` rows and ``max_batch_sessions`` sessions

Each forward takes, in arrival order, every small call that fits (a session never has two calls
in one forward), then gives what is left of the row budget to the oldest big calls as chunks;
while a big call waits, ``TUNING.min_chunk_rows`` of the budget and one of the forward's sessions
are kept for it, so a long prompt always progresses (sessions the verifier continues come back
the moment they are answered and would fill every place) and no block ever waits behind a whole
prompt. After a forward that fed a big chunk, the next one gives prompts only
``TUNING.min_chunk_rows`` when blocks wait: a block waits at most one chunk's forward
(``max_forward_rows`` rows), and the prompt gets a big chunk every other forward.

Shared prefixes arriving together: a call that would start its session's cache (a new
session's prompt) while an earlier queued call of its namespace is still prefilling a longer
common prefix waits until that prefix is cached (``waiting_for_shared_prefix``), then copies it:
eight users of one system prompt arriving at once prefill it once, not eight times, and each
reaches its first token after the shared prefill plus its own suffix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from spade_models.kv_cache import common_prefix_length
from verifier_service.backends.base import BlockToVerify
from verifier_service.backends.transformers.prefix_store import BLOCK_TOKENS
from verifier_service.backends.transformers.runner import ShareResult
from verifier_service.tuning import TUNING


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_sessions: int = 8
    """Most sessions sharing one forward."""
    max_forward_rows: int = 128
    """Most rows in one forward: the prefill chunk size (a prompt's chunk shares it with blocks)."""
    max_block_rows: int = 65
    """The largest need treated as one block (the verifier's longest draft + 1)."""
    batch_wait_s: float = 0.0
    """While the target is idle, how long the oldest call waits for company at least."""
    hold_scale: float = 1.0
    """A forward holds for sessions due soon while the wait costs less than the forward's fixed
    part it saves (``hold.latest_worth_holding``); the wait that allows is multiplied by this
    (0: never hold)."""
    hold_late_deviations: float = 2.0
    """A session held for may come this many of its gaps' mean deviations after its expected
    time (at most a one-row forward's time) and still be waited for; 0: only until then."""
    max_draft_length: int = 64
    """The verifier's longest draft: the advice never exceeds it."""

    def __post_init__(self) -> None:
        if self.max_batch_sessions < 1 or self.max_forward_rows < 1 or self.max_block_rows < 1:
            raise ValueError("scheduler limits must be positive")
        if self.batch_wait_s < 0 or self.hold_scale < 0 or self.hold_late_deviations < 0:
            raise ValueError("batch_wait_s, hold_scale and hold_late_deviations must be >= 0")


@dataclass
class PendingCall:
    block: BlockToVerify
    queued_at: float
    future: asyncio.Future = field(repr=False)
    keep_cache: bool = True
    """False once the session was released while this call waited: answered, no cache kept."""
    rows_fed: int = 0
    """Rows its earlier prefill chunks fed."""
    num_cached_tokens: int = 0
    """Context tokens copied from a shared prefix instead of fed (``runner``'s prefix cache)."""


def plan_forward(
    queue: list[PendingCall], need_of: Callable[[PendingCall], int], limits: SchedulerLimits, after_chunk: bool = False
) -> list[tuple[PendingCall, int]]:
    """The next forward's shares, (call, row allowance), in queue order of their selection:
    small calls first (arrival order, whole, while they fit), then chunks for the big ones.

    ``after_chunk``: the forward before fed a big chunk of a prompt. Then, if blocks wait, the
    prompt gets only ``TUNING.min_chunk_rows`` now: a block that arrived during that chunk's forward is
    answered by the next one, which is short, so it waits one chunk's forward at most (forwards
    alternate between a big chunk and the blocks, and the prompt still gets every other one)."""
    needs = [need_of(call) for call in queue]
    waiting_big = any(need > limits.max_block_rows for need in needs)
    budget = limits.max_forward_rows - (TUNING.min_chunk_rows if waiting_big else 0)
    small_places = limits.max_batch_sessions - (1 if waiting_big and limits.max_batch_sessions > 1 else 0)
    shares: list[tuple[PendingCall, int]] = []
    sessions: set[str] = set()
    for call, need in zip(queue, needs, strict=True):
        is_first = not shares
        if len(shares) == small_places or need > limits.max_block_rows or call.block.session_id in sessions:
            continue
        if need <= budget or is_first:
            shares.append((call, need))
            sessions.add(call.block.session_id)
            budget -= need
    budget += TUNING.min_chunk_rows if waiting_big else 0
    if after_chunk and shares:
        budget = min(budget, TUNING.min_chunk_rows)
    for call, need in zip(queue, needs, strict=True):
        if budget <= 0 or len(shares) == limits.max_batch_sessions:
            break
        if need > limits.max_block_rows and call.block.session_id not in sessions:
            shares.append((call, min(need, budget)))
            sessions.add(call.block.session_id)
            budget -= min(need, budget)
    return shares


def waiting_for_shared_prefix(
    queue: list[PendingCall], cached_length: Callable[[BlockToVerify], int], has_cache: Callable[[str], bool]
) -> set[int]:
    """The calls (``id``s) to leave out of the next forward because an earlier queued call of
    their namespace is still prefilling at least one more block of their context than is cached
    for them now: once it has, they copy it (``runner``'s prefix cache) instead of computing it
    again. Only calls that would start their session's cache wait, and only behind calls that
    do not wait themselves, so the earliest always runs. Example: A (1,000-token system prompt +
    question a) and B (same prompt + question b) arrive together: B waits while A's chunks feed
    the prompt, then starts from a copy of it and feeds question b only."""
    leaders: list[tuple[BlockToVerify, int]] = []
    """(block, context tokens cached for it) of the calls that run."""
    waiting: set[int] = set()
    for call in queue:
        block = call.block
        if block.cache_namespace is None:
            continue
        cached = cached_length(block)
        if not has_cache(block.session_id) and any(
            _prefills_more_of(leader, leader_cached, block, cached) for leader, leader_cached in leaders
        ):
            waiting.add(id(call))
            continue
        leaders.append((block, cached))
    return waiting


def _prefills_more_of(leader: BlockToVerify, leader_cached: int, block: BlockToVerify, cached: int) -> bool:
    """Whether ``leader``'s prefill will cache at least one more block of ``block``'s context
    than the ``cached`` tokens it can copy now."""
    if leader.cache_namespace != block.cache_namespace:
        return False
    shared = min(common_prefix_length(leader.context_token_ids, block.context_token_ids), len(leader.context_token_ids) - 1)
    return leader_cached < shared and shared - cached >= BLOCK_TOKENS


def feeds_big_chunk(planned: list[tuple[PendingCall, int]], need_of: Callable[[PendingCall], int], limits: SchedulerLimits) -> bool:
    """Whether a forward gives a big call more than ``TUNING.min_chunk_rows`` rows (see ``plan_forward``)."""
    return any(allowance > TUNING.min_chunk_rows and need_of(call) > limits.max_block_rows for call, allowance in planned)


def feeds_blocks_only(planned: list[tuple[PendingCall, int]], results: list[ShareResult]) -> bool:
    """Whether a forward fed blocks alone (each call its drafted tokens and the one before them:
    a verify call or a target-only step), no prompt rows. Only such forwards teach the cost
    curve t(R) that holding and the advice plan with: a prompt's forward also pays its rows'
    attention over a context built in the same forward, and its few long forwards are not the
    ones being planned."""
    return all(result.num_rows <= call.block.num_drafted + 1 for (call, _), result in zip(planned, results, strict=True))
