"""Continuation: the target-only steps the verifier decodes a session on by itself where its
advice is 0 (its forwards are past the point where a drafted row pays), instead of one verify
call per token (wire: ``max_continued_tokens``), and decoding ahead (``max_ahead_tokens``).

A call's continued tokens come from a ``SessionDecoder``: a task that runs one block-less step
of the session per forward of the backend's scheduler, each submitted the moment the one before
is answered, so the session is part of every forward while it is continued. Each step is exactly
what a block-less verify call at that point would run (the same context, sampling and seeded
draws of its position), so the tokens are those calls' tokens.

Decoding ahead. Without it a continued session left the forwards at every call: the call
returned after its allowance, and its edge's next call came a round trip later, after the next
forward had started without it (at N = 8 on this project's CPU, with 8 tokens a call, one
forward in nine; docs/benchmarks.md, "Run O"). With ``max_ahead_tokens`` the decoder goes on
past the call's allowance, by at most that many steps, while the answer and the edge's next
call travel. That call, block-less with the same sampling, takes the steps decoded meanwhile
(its verdict is the first, its continued tokens the next) and the decoder goes on for it. A
next call of any other kind (a drafted block, other sampling, a resync) stops the decoder and
discards what it decoded ahead; the session's cache gives those tokens back at its next forward
(a forward keeps only the prefix its context shares with the cache). The edge allows as many as
its budget leaves after the call, so a generation that ends by its token budget wastes none; one
that ends otherwise (a stop string, the client gone) wastes at most that many steps.

Example, the verifier saturated, a call allowing 4 continued tokens and 4 ahead: it answers
next + 4 continued tokens after five steps; the decoder runs a sixth while the answer travels;
the edge's next call (block-less) is answered from the sixth (its next token) as soon as it
arrives, and the decoder's seventh step, already queued, is its first continued token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gateway.engine import TopLogprobs
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend

logger = logging.getLogger(__name__)


@dataclass
class Continuation:
    """The continued steps one call answers after its verdict (``SessionDecoder.take``)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    num_target_tokens: int = 0
    forward_s: float = 0.0

    def add(self, verdict: BlockVerdict) -> None:
        self.token_ids.append(verdict.next_token_id)
        self.logprobs += verdict.logprobs or []
        self.top_logprobs += verdict.top_logprobs or []
        self.num_target_tokens += verdict.num_target_tokens
        self.forward_s += verdict.forward_s


def continued_step(block: BlockToVerify, context: list[int]) -> BlockToVerify:
    """The block-less step after ``context`` under ``block``'s sampling, logprobs and namespace."""
    return replace(block, context_token_ids=context, draft_token_ids=[], draft_probs=None, continued_step=True)


class SessionDecoder:
    """Decodes one session on from a committed context, one block-less step per forward, until
    ``limit`` steps, an end-of-sequence token, the session's advice above 0 (``keeps_going``
    false) or a failed step (what came before it stands). Consumers ``take`` the steps in order;
    ``limit`` may be raised (``allow``), which starts the decoder again where it stopped for it.

    Example: decoding after context [5, 6] with limit 2 runs steps on [5, 6] and [5, 6, t1]; a
    ``take(1)`` returns the first verdict at once, and ``allow(3)`` then lets it run two more."""

    def __init__(
        self,
        backend: VerifierBackend,
        block: BlockToVerify,
        context: list[int],
        keeps_going: Callable[[], bool],
        end_token_ids: frozenset[int],
        max_steps: int,
    ) -> None:
        """``block``: the call whose sampling, logprobs and namespace the steps share;
        ``max_steps``: the most it may ever decode (the context limit's room)."""
        self._backend = backend
        self._block = block
        self._context = list(context)
        self._num_committed = len(context)
        self._keeps_going = keeps_going
        self._end_token_ids = end_token_ids
        self._max_steps = max(0, max_steps)
        self.verdicts: list[BlockVerdict] = []
        self.num_taken = 0
        self.limit = 0
        self.has_ended = False
        """It stopped for good: an end-of-sequence token, the advice above 0, a failure."""
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_ready(self) -> int:
        """Steps decoded and not yet taken."""
        return len(self.verdicts) - self.num_taken

    @property
    def num_ahead(self) -> int:
        """Steps decoded or under way past those taken."""
        return self.num_ready + (1 if self.is_running else 0)

    @property
    def taken_context(self) -> list[int]:
        """The committed context after the steps taken: where the next consumer continues."""
        return self._context[: self._num_committed + self.num_taken]

    def allow(self, num_steps: int) -> None:
        """Let it decode up to ``num_steps`` past the steps taken (within its room); it starts
        again if it had stopped for its limit."""
        self.limit = min(self._max_steps, max(self.limit, self.num_taken + num_steps))
        if not self.has_ended and not self.is_running and len(self.verdicts) < self.limit:
            self._task = asyncio.get_running_loop().create_task(self._decode())

    async def take(self, num_steps: int) -> list[BlockVerdict]:
        """The next ``num_steps`` steps past those taken, or fewer where the decoder stops first
        (an end token, the advice, a failure, the room); waits for them to be decoded."""
        self.allow(num_steps)
        while self.num_ready < num_steps and self.is_running:
            self._changed.clear()
            await self._changed.wait()
        taken = self.verdicts[self.num_taken : self.num_taken + num_steps]
        self.num_taken += len(taken)
        return taken

    def continues(self, block: BlockToVerify) -> bool:
        """Whether ``block`` is a block-less call after the steps taken, asking what the steps
        were decoded with: then the steps decoded ahead are exactly its own."""
        mine = self._block
        return (
            not block.draft_token_ids
            and (block.sampling, block.num_top_logprobs, block.cache_namespace)
            == (mine.sampling, mine.num_top_logprobs, mine.cache_namespace)
            and block.context_token_ids == self.taken_context
        )

    def cancel(self) -> list[BlockVerdict]:
        """Stop decoding now; returns the steps decoded and never taken (a step in flight is
        dropped by the scheduler, or its result is)."""
        if self._task is not None:
            self._task.cancel()
        self.has_ended = True
        return self.verdicts[self.num_taken :]

    async def stop(self) -> list[BlockVerdict]:
        """``cancel``, waiting for the decoding task to be gone."""
        untaken = self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return untaken

    async def _decode(self) -> None:
        try:
            while len(self.verdicts) < self.limit:
                verdict = await self._backend.verify_block(continued_step(self._block, list(self._context)))
                self.verdicts.append(verdict)
                self._context.append(verdict.next_token_id)
                self._changed.set()
                if verdict.next_token_id in self._end_token_ids or not self._keeps_going():
                    self.has_ended = True
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # the steps before it stand; the session's next call goes on
            logger.warning("session %s: continuing failed after %d steps", self._block.session_id, len(self.verdicts), exc_info=True)
            self.has_ended = True
        finally:
            self._changed.set()
