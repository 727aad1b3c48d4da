"""The verifier's ``SessionDecoder`` and the service around it, forward by forward: a session it
continues has its next step queued by the time the scheduler plans the next forward (within
``HANDOFF_YIELDS`` turns of the event loop after a forward is answered), through a call's own
continued steps, the steps ahead after them, and the next call taking those over. A step that
came a turn too late would miss the forward, and the session would fall out of every other one."""

from __future__ import annotations

import asyncio

from gateway.model import ModelDescription
from verifier_service.backends.base import BlockToVerify, BlockVerdict
from verifier_service.backends.transformers.scheduler import HANDOFF_YIELDS
from verifier_service.metrics import VerifierMetrics
from verifier_service.protocol import VerifyRequest, VerifyResponse, context_digest
from verifier_service.service import VerifierService, VerifyLimits
from verifier_service.sessions import SessionLimits, SessionRegistry

END_TOKEN = 99


def next_token(context: list[int]) -> int:
    """The stepped target's rule: a token from the context's length (never the end token)."""
    return 10 + len(context) % 50


class SteppedBackend:
    """A backend whose steps wait until the test runs a forward, as the scheduler's do."""

    def __init__(self) -> None:
        self.model = ModelDescription("stepped", 100, 1_000, frozenset({END_TOKEN}))
        self.pending: list[tuple[BlockToVerify, asyncio.Future]] = []

    def advised_draft_length(self, session_id: str) -> int:
        return 0  # saturated: every session is continued

    def release_session(self, session_id: str, retain: bool = True) -> None:
        pass

    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((block, future))
        return await future

    async def forward(self) -> int:
        """Answer every queued step, then give the loop the scheduler's turns; returns how many
        steps the forward took."""
        answered, self.pending = self.pending, []
        for block, future in answered:
            if not future.done():
                future.set_result(BlockVerdict(0, next_token(block.context_token_ids), True, None, 1, 0.0, 0.0))
        for _ in range(HANDOFF_YIELDS):
            await asyncio.sleep(0)
        return len(answered)


def request(context: list[int], known: int, continued: int, ahead: int) -> VerifyRequest:
    return VerifyRequest(
        session_id="s",
        prefix_length=known,
        prefix_digest=context_digest(context[:known]),
        new_tokens=context[known:],
        draft_tokens=[],
        max_continued_tokens=continued,
        max_ahead_tokens=ahead,
    )


def tokens_after(context: list[int], count: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(next_token(context + tokens))
    return tokens


def emitted(answer: VerifyResponse) -> list[int]:
    return [answer.next_token, *answer.continued_tokens]


async def until_queued(backend: SteppedBackend) -> None:
    for _ in range(100):
        if backend.pending:
            return
        await asyncio.sleep(0)
    raise AssertionError("no step was queued")


async def test_a_continued_session_has_a_step_in_every_forward_across_calls():
    backend, metrics = SteppedBackend(), VerifierMetrics()
    service = VerifierService(backend, SessionRegistry(SessionLimits()), VerifyLimits(), metrics)
    context = [1, 2, 3]
    first = asyncio.create_task(service.verify(request(context, 0, continued=2, ahead=3)))
    await until_queued(backend)
    # The call's verdict and its 2 continued steps, then 3 steps ahead: one step in each forward.
    assert [await backend.forward() for _ in range(3)] == [1, 1, 1]
    assert first.done()
    assert emitted(first.result()) == tokens_after(context, 3)
    committed = context + emitted(first.result())
    assert await backend.forward() == 1  # the first step ahead, while the answer travels
    second = asyncio.create_task(service.verify(request(committed, len(committed), continued=2, ahead=0)))
    # The next call takes the step decoded ahead (its verdict) and the one under way; one more.
    assert [await backend.forward() for _ in range(2)] == [1, 1]
    assert second.done()
    assert emitted(second.result()) == tokens_after(committed, 3)
    assert await backend.forward() == 0  # allowed nothing ahead: the decoder stopped
    assert metrics.ahead_tokens._value.get() == 2  # one decoded, one under way when the call came


async def test_steps_ahead_stop_at_their_allowance():
    backend = SteppedBackend()
    service = VerifierService(backend, SessionRegistry(SessionLimits()), VerifyLimits(), VerifierMetrics())
    call = asyncio.create_task(service.verify(request([4, 5], 0, continued=1, ahead=2)))
    await until_queued(backend)
    assert [await backend.forward() for _ in range(5)] == [1, 1, 1, 1, 0]
    assert call.done()


async def test_a_call_taking_over_the_last_step_ahead_keeps_the_session_in_every_forward():
    backend = SteppedBackend()
    service = VerifierService(backend, SessionRegistry(SessionLimits()), VerifyLimits(), VerifierMetrics())
    context = [7, 8, 9]
    first = asyncio.create_task(service.verify(request(context, 0, continued=2, ahead=1)))
    await until_queued(backend)
    assert [await backend.forward() for _ in range(3)] == [1, 1, 1]
    committed = context + emitted(first.result())
    # The one step ahead is under way when the next call comes: it goes on past it at once.
    second = asyncio.create_task(service.verify(request(committed, len(committed), continued=3, ahead=0)))
    await asyncio.sleep(0)
    assert [await backend.forward() for _ in range(4)] == [1, 1, 1, 1]
    assert emitted(second.result()) == tokens_after(committed, 4)
