"""Stepping ahead (experimental, ``--step-ahead-tokens``): the verifier goes on decoding a session
by itself between its edge's calls, one target-only step per forward, so the session stays in
the verifier's forwards while its answer travels and its edge drafts, instead of leaving them for
every round trip.

The edge's next call is on today's wire: a block drafted after the committed context, which
does not know the tokens the verifier decided meanwhile. They are settled against the block
(``settle_block``):

- the drafted tokens that equal the decided ones are accepted without a row (they are the
  target's own tokens);
- at the first decided token that differs from its draft, or past the block's end, the call is
  answered at once from the decided tokens: the drafts up to there accepted, the decided token
  there the next token, those after it continued tokens (within the call's
  ``max_continued_tokens``; the rest stay decided for the call after);
- only where every decided token confirms a draft and drafts remain does the rest of the block
  go to a forward, after the decided tokens, as a verify call of its own.

Exactness. Each decided token was sampled from the target's distribution after exactly the
tokens before it (a block-less step is target-only decoding), so taking them, whatever the
drafts say, is sampling from the target. The drafts verified in a forward follow a prefix equal
to their own drafts, so their q is conditioned on exactly the decided prefix, and how many of
them reach the forward depends on the decided tokens (before them) and on timing, never on the
target's p at the positions being verified. Where the answer stops (the first contradiction, the
call's allowance) depends only on tokens up to it: a stopping time of the target's own sampling.
Greedy text is the target's at any timing. At temperature > 0 the text is the target's
distribution but not today's per-seed text: a token the verifier decides alone is the seeded
draw of the target at its position, where lock-step would have drawn the acceptance rule's.

Bounded work: at most ``max_ahead`` steps past what the edge has taken (the verifier's window
within each call's ``max_continued_tokens``, which the edge bounds by the request's budget; after
a request's first call, which allows none, the whole window); the session's end, its
eviction, a call that does not continue its committed context (other sampling, a resync) or a
failed step stop it and drop what it decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from spade_models.kv_cache import common_prefix_length
from verifier_service.backends.base import BlockToVerify, BlockVerdict, VerifierBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecidedAnswer:
    """A call answered from decided tokens alone: ``num_accepted`` drafts, then the decided token
    at that index as the next token, then ``num_used - num_accepted - 1`` continued tokens."""

    num_accepted: int
    num_used: int


def answer_from_decided(draft_tokens: list[int], decided_tokens: list[int], max_continued: int) -> DecidedAnswer | None:
    """How a call whose block was drafted after the committed context is answered from the
    tokens the verifier decided after that context, or None when they do not settle it: none
    decided, or every decided token confirms a draft and drafts remain (those go to a forward).

    Example: drafts [7, 8, 9], decided [7, 5, 6, 4], 1 continued allowed: 7 accepted, 5 the next
    token, 6 continued; 4 stays decided for the next call (``DecidedAnswer(1, 3)``)."""
    num_confirmed = common_prefix_length(draft_tokens, decided_tokens)
    if num_confirmed == len(decided_tokens):
        return None
    num_continued = min(len(decided_tokens) - num_confirmed - 1, max_continued)
    return DecidedAnswer(num_confirmed, num_confirmed + 1 + num_continued)


def ahead_step(block: BlockToVerify, context: list[int]) -> BlockToVerify:
    """The block-less step after ``context`` under ``block``'s sampling, logprobs and namespace."""
    return replace(block, context_token_ids=context, draft_token_ids=[], draft_probs=None, continued_step=False, ahead_step=True)


class SessionStepper:
    """Decodes one session on from its committed context, one block-less step per forward
    (each submitted the moment the one before is answered, so the session is in every forward),
    until ``max_ahead`` steps are decided and not taken, an end-of-sequence token, the context's
    room, a failed step or ``stop``. ``take`` moves the committed context past decided tokens a
    call used; the steps go on from there.

    Example: after context [5, 6] with max_ahead 2 it decides t1 (on [5, 6]) and t2 (on
    [5, 6, t1]) and waits; ``take(1)`` commits t1, and it decides t3 on [5, 6, t1, t2]."""

    def __init__(
        self,
        backend: VerifierBackend,
        template: BlockToVerify,
        context: list[int],
        max_ahead: int,
        max_steps: int,
        on_step: Callable[[list[int], BlockVerdict], None] = lambda context, verdict: None,
    ) -> None:
        """``template``: the call whose sampling, logprobs and namespace the steps share;
        ``max_steps``: the most it may ever decode (the context's room); ``on_step``: told of each
        decided step and the context it was decided after (metrics, the audit)."""
        self._backend = backend
        self.template = template
        self.committed = list(context)
        self.decided: list[BlockVerdict] = []
        self._max_ahead = max_ahead
        self._room = max(0, max_steps)
        self._on_step = on_step
        self._ended = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._resume()

    @property
    def decided_tokens(self) -> list[int]:
        return [verdict.next_token_id for verdict in self.decided]

    @property
    def is_stepping(self) -> bool:
        """A step is submitted and not yet decided."""
        return self._task is not None and not self._task.done()

    def continues(self, context: list[int], block: BlockToVerify) -> bool:
        """Whether a call after ``context`` under ``block``'s sampling continues this stepper's
        committed context with what its steps were decoded with."""
        mine = self.template
        return context == self.committed and (block.sampling, block.num_top_logprobs, block.cache_namespace) == (
            mine.sampling,
            mine.num_top_logprobs,
            mine.cache_namespace,
        )

    async def next_step(self) -> None:
        """Wait for the step under way (if any) to be decided, or for the stepping to end."""
        if self.is_stepping:
            self._changed.clear()
            await self._changed.wait()

    def take(self, num_tokens: int) -> list[BlockVerdict]:
        """Commit the first ``num_tokens`` decided steps (a call used them) and go on after them."""
        taken, self.decided = self.decided[:num_tokens], self.decided[num_tokens:]
        self.committed = self.committed + [verdict.next_token_id for verdict in taken]
        self._room -= len(taken)
        self._resume()
        return taken

    def cancel(self) -> list[BlockVerdict]:
        """Stop now; returns the steps decided and never taken (a step in a forward is dropped
        by the scheduler, or its result is)."""
        self._ended = True
        if self._task is not None:
            self._task.cancel()
        dropped, self.decided = self.decided, []
        return dropped

    async def stop(self) -> list[BlockVerdict]:
        """``cancel``, waiting for its task to be gone."""
        dropped = self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return dropped

    def _resume(self) -> None:
        if not self._ended and not self.is_stepping and self._wants_more():
            self._task = asyncio.get_running_loop().create_task(self._step())

    def _wants_more(self) -> bool:
        return len(self.decided) < min(self._max_ahead, self._room)

    async def _step(self) -> None:
        try:
            while not self._ended and self._wants_more():
                context = self.committed + self.decided_tokens
                verdict = await self._backend.verify_block(ahead_step(self.template, context))
                if self._ended or context != self.committed + self.decided_tokens:
                    return  # taken or cancelled meanwhile in a way that moved the context: not ours
                self.decided.append(verdict)
                self._on_step(context, verdict)
                self._changed.set()
                if verdict.next_token_id in self._backend.model.eos_token_ids:
                    self._ended = True
        except asyncio.CancelledError:
            raise
        except Exception:  # what was decided before it stands; the session's next call goes on
            logger.warning("session %s: stepping ahead failed after %d steps", self.template.session_id, len(self.decided), exc_info=True)
            self._ended = True
        finally:
            self._changed.set()
