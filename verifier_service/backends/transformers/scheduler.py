"""The transformers backend's scheduler: gathers pending calls into forwards and runs them, one at
a time; decides when a forward waits for company and what each session is advised to draft next.
Which calls share a forward is ``plan`` (chunked prompts, shared prefixes arriving together);
each session's gaps and pace is ``pace``; the arithmetic of holding is ``hold`` and of the advice
``advice``. A call whose caller went away is dropped before it costs a row.

Holding (forwards that serve many sessions): the scheduler yields to the event loop before
planning each forward, so a step a service continues a session by, submitted the moment its
session is answered, joins the next forward. When a forward is about to start, it waits for the
sessions not yet queued that are due soon (``pace``) while ``hold.latest_worth_holding`` says the
expected wait costs less than merging the forwards saves (scaled by ``hold_scale``; queued
continued steps are ``returning``: their sessions come back at once): N edges' calls then meet in
one forward instead of alternating. The forward cost t(R) both the hold rule and the advice plan
with is the curve measured per row count (``advice.ForwardCurve``), from forwards of blocks alone
(``plan.feeds_blocks_only``).

Advice: after each forward, every answered call's session gets ``advice.advised_lengths`` for
its next block (the verifier's limit while the target is not saturated). A session its service
continues gets the block worth leaving its forwards for, or 0: while every active session fits
in a forward, ``advice.departure_length`` on the forwards as measured (``advice.ForwardLoad``)
and the edges' time away (``advice.TimeAway``); where they do not (its place goes to a waiting
session), its planned block if ``advice.departure_pays`` on the plan's row price.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from spade_core.block_yield import expected_tokens
from verifier_service.backends.base import BlockToVerify, BlockVerdict, ForwardObserver, ForwardRecord
from verifier_service.backends.transformers.advice import (
    BusyFraction,
    ForwardCurve,
    ForwardLoad,
    Saturation,
    TimeAway,
    advised_lengths,
    departure_length,
    departure_pays,
    forwards_missed,
    newcomer_length,
    plan_load,
    row_price,
)
from verifier_service.backends.transformers.hold import Sessions, latest_worth_holding
from verifier_service.backends.transformers.pace import GapEstimate, SessionPace
from verifier_service.backends.transformers.plan import (
    PendingCall,
    SchedulerLimits,
    feeds_big_chunk,
    feeds_blocks_only,
    plan_forward,
    waiting_for_shared_prefix,
)
from verifier_service.backends.transformers.runner import ModelRunner, Share, ShareResult
from verifier_service.tuning import TUNING

logger = logging.getLogger(__name__)


class Scheduler:
    """Gathers pending calls into forwards and runs them, one at a time, on ``executor``."""

    def __init__(self, runner: ModelRunner, executor: Executor, limits: SchedulerLimits) -> None:
        self._runner = runner
        self._executor = executor
        self.limits = limits
        self.observe_forward: ForwardObserver | None = None
        """Called with every forward (the service's metrics), on the event loop."""
        self._queue: list[PendingCall] = []
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._paces: dict[str, SessionPace] = {}
        self._typical_gap = GapEstimate(TUNING.typical_gap_decay)
        self._cost = ForwardCurve()
        self._load = ForwardLoad()
        self._away = TimeAway()
        self._busy = BusyFraction()
        self._saturation = Saturation()
        self._after_chunk = False
        """The last forward fed a big chunk of a prompt (``plan_forward``)."""
        self._in_forward: set[str] = set()
        """The sessions of the forward running now."""

    async def submit(self, block: BlockToVerify, queued_at: float) -> BlockVerdict:
        future = asyncio.get_running_loop().create_future()
        pace = self._pace(block.session_id)
        if block.continued_step:  # no round trip before it: not a gap of the session's edge
            pace.answered_at = None
        elif block.ahead_step:  # its edge's call is still awaited, from that call's answer on
            pass
        else:
            gap_s = pace.arrived(queued_at)
            if gap_s is not None:
                self._typical_gap.observe(gap_s)
                self._away.observe(block.num_drafted, gap_s)
        self._queue.append(PendingCall(block, queued_at, future))
        self._ensure_worker()
        self._arrived.set()
        return await future

    def is_in_forward(self, session_id: str) -> bool:
        return session_id in self._in_forward

    def call_arrived(self, session_id: str, arrived_at: float, num_drafted: int) -> None:
        """A call of a session stepped ahead reached the service at ``arrived_at``: its gap is
        learnt from then, not from when (if at all) the call is submitted here, which may wait for
        the session's step in the running forward (a gap that counted that wait would tell the
        hold rule the edge comes too late to hold for, and the step would delay it every time)."""
        pace = self._pace(session_id)
        gap_s = pace.arrived(arrived_at)
        if gap_s is not None:
            self._typical_gap.observe(gap_s)
            self._away.observe(num_drafted, gap_s)
        self._arrived.set()  # a forward held for it stops waiting (the service withdraws or awaits its step first)

    def answered_without_forward(self, session_id: str) -> None:
        """The service answered a call of this session by itself (from steps decided ahead):
        its next call is awaited from now."""
        self._pace(session_id).answered_at = time.perf_counter()

    def advice_for(self, session_id: str) -> int | None:
        """The block length this session is advised to draft next (None: no advice yet)."""
        pace = self._paces.get(session_id)
        return None if pace is None else pace.advice

    def forget_session(self, session_id: str) -> bool:
        """The session was released: it is no longer awaited, and its waiting call (if any)
        keeps no cache once answered or abandoned (the scheduler frees it then: a prompt being
        prefilled in chunks continues from its partial cache meanwhile). True if a call waits."""
        self._paces.pop(session_id, None)
        waiting = [call for call in self._queue if call.block.session_id == session_id]
        for call in waiting:
            call.keep_cache = False
        return bool(waiting)

    def _ensure_worker(self) -> None:
        """The task serving the queue, on the running loop (a backend may outlive an event loop:
        the benchmarks run one per measurement)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._serve())

    async def aclose(self) -> None:
        if self._worker is not None and self._worker.get_loop() is asyncio.get_running_loop():
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for call in self._queue:
            if not call.future.done():
                call.future.cancel()
        self._queue.clear()

    def _pace(self, session_id: str) -> SessionPace:
        return self._paces.setdefault(session_id, SessionPace())

    def _need(self, call: PendingCall) -> int:
        context = call.block.context_token_ids
        return len(context) - self._runner.cached_length(call.block) + call.block.num_drafted

    async def _serve(self) -> None:
        try:
            await self._serve_queue()
        except Exception as error:  # a fault of the scheduler itself: no caller may wait forever
            for call in self._queue:
                self._release_if_forgotten(call)
                settle(call.future, error=error)
            self._queue.clear()
            raise

    async def _serve_queue(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            # The sessions just answered that their service continues submit their next steps
            # now, in time for the next forward (else it starts without them whenever another
            # call is queued, and they miss every other forward).
            # Two turns: a session its service steps ahead (``steps_ahead``) starts its stepping
            # task as its call returns, one turn after the answer, and submits one turn later.
            for _ in range(2):
                await asyncio.sleep(0)
            gather_started = time.perf_counter()
            await self._gather()
            self._drop_abandoned()
            planned = plan_forward(self._ready(), self._need, self.limits, self._after_chunk)
            if not planned:
                continue
            self._after_chunk = feeds_big_chunk(planned, self._need, self.limits)
            shares = [Share(call.block, allowance, call.keep_cache) for call, allowance in planned]
            started = time.perf_counter()
            self._in_forward = {call.block.session_id for call, _ in planned}
            try:
                results, record = await loop.run_in_executor(self._executor, self._runner.run, shares)
                log_forward(planned, results, record, started, started - gather_started)
                self._account(record, started, time.perf_counter(), planned, results)
                self._answer([call for call, _ in planned], results, record, started)
            except Exception as error:  # every caller of the forward still waiting gets the error
                logger.warning("a forward of %d call(s) failed", len(planned), exc_info=True)
                for call, _ in planned:
                    if call in self._queue:
                        self._queue.remove(call)
                        self._release_if_forgotten(call)
                    settle(call.future, error=error)
            finally:
                self._in_forward = set()

    def _ready(self) -> list[PendingCall]:
        """The queue but the calls waiting for a shared prefix another call is prefilling."""
        if not self._runner.shares_prefixes:
            return self._queue
        waiting = waiting_for_shared_prefix(self._queue, self._runner.cached_length, self._runner.has_cache)
        return [call for call in self._queue if id(call) not in waiting]

    def _drop_abandoned(self) -> None:
        """Calls whose caller left cost nothing more; a released session's partial prefill goes too."""
        for call in [call for call in self._queue if call.future.done()]:
            self._queue.remove(call)
            self._release_if_forgotten(call)

    def _release_if_forgotten(self, call: PendingCall) -> None:
        """A call of a released session is done with: free what its forwards cached."""
        if not call.keep_cache:
            self._executor.submit(self._runner.release, call.block.session_id)

    def _answer(self, calls: list[PendingCall], results: list[ShareResult], record: ForwardRecord, started: float) -> None:
        """Settle the calls the forward answered; chunked ones stay queued, in place."""
        answered = []
        for call, result in zip(calls, results, strict=True):
            call.rows_fed += result.num_rows
            call.num_cached_tokens += result.num_cached_tokens
            if result.acceptance is None:
                continue
            self._queue.remove(call)
            self._release_if_forgotten(call)
            answered.append(call.block.session_id)
            if call.block.ahead_step:  # the session's blocks and gaps are its edge's calls'
                settle(call.future, verdict=verdict_of(call, result, record, started))
                continue
            pace = self._pace(call.block.session_id) if call.keep_cache else SessionPace()
            pace.acceptance.observe(call.block.num_drafted, result.acceptance.num_accepted)
            pace.drafts = pace.drafts or call.block.num_drafted > 0
            pace.drafted = call.block.num_drafted
            if call.block.continued_step or call.block.num_drafted > 0:
                pace.continued = call.block.continued_step
            pace.answered_at = time.perf_counter()
            pace.rows = min(result.num_rows, self.limits.max_block_rows)
            settle(call.future, verdict=verdict_of(call, result, record, started))
        self._advise(answered)

    def _account(
        self, record: ForwardRecord, started: float, ended: float, planned: list[tuple[PendingCall, int]], results: list[ShareResult]
    ) -> None:
        if feeds_blocks_only(planned, results):  # the cost and load of the forwards the advice and the hold rule plan
            self._cost.observe(record.num_rows, record.model_s)
            self._load.observe(record.num_rows, sum(result.acceptance.num_accepted + 1 for result in results if result.acceptance))
        self._busy.observe(started, ended)
        self._saturation.observe(self._busy.fraction)
        if self.observe_forward is not None:
            self.observe_forward(record)

    def _advise(self, answered: list[str]) -> None:
        """Each answered session's next block length, from all active sessions' acceptance; the
        verifier's limit while it is not saturated or serves one session alone (whose rows
        delay nobody else: its edge's own policy chooses its speed); for a continued session,
        the block worth leaving its forwards for, or 0 (module docstring)."""
        planning = self._cost.is_known and self._saturation.is_saturated  # else no session list is needed
        active = [self._paces[session_id] for session_id in self._active_sessions()] if planning else []
        if len(active) < 2:
            for session_id in answered:
                if session_id in self._paces:
                    self._paces[session_id].advice = self.limits.max_draft_length
            return
        alphas = {id(pace): pace.acceptance.alpha for pace in active if pace.drafts}
        prefill_rows = sum(max(0, self._need(call) - self.limits.max_block_rows) for call in self._queue)
        # Sessions that do not draft (target-only steps) feed one row a forward, like a prompt's chunk.
        num_stepping = sum(not pace.drafts for pace in active)
        other_rows = min(prefill_rows, self.limits.max_forward_rows) + num_stepping
        lengths = advised_lengths(alphas, self._cost, other_rows, self.limits.max_draft_length)
        forwards_full = len(active) > self.limits.max_batch_sessions
        if forwards_full:  # the plan's forward, for continued sessions' departures
            plan_rows, plan_tokens = plan_load(alphas, lengths, other_rows, num_stepping)
            plan_forward_s, plan_price = self._cost.seconds(plan_rows), row_price(self._cost, plan_rows, plan_tokens)
        # Sessions that never drafted share their prior acceptance: one plan per forward, however
        # many target-only steps it answered.
        newcomer_lengths: dict[float, int] = {}
        for session_id in answered:
            pace = self._paces.get(session_id)
            if pace is None:
                continue
            alpha = pace.acceptance.alpha
            if pace.drafts:
                pace.advice = lengths.get(id(pace), self.limits.max_draft_length)
            else:  # not drafted yet (a prompt-only call; a target-only step, which ignores it)
                if alpha not in newcomer_lengths:
                    newcomer_lengths[alpha] = newcomer_length(alphas, alpha, self._cost, other_rows - 1, self.limits.max_draft_length)
                pace.advice = newcomer_lengths[alpha]
            if pace.continued and forwards_full:  # leaving frees a place another session takes: the plan's frame
                missed = forwards_missed(self._away.seconds(pace.advice), plan_forward_s)
                if not departure_pays(alpha, pace.advice, missed, plan_price):
                    pace.advice = 0
            elif pace.continued:  # part of every forward: it leaves only for a block that pays for the time away
                pace.advice = departure_length(alpha, self._away, self._cost, self._load, self.limits.max_draft_length)

    def _expected_tokens(self, call: PendingCall, need: int) -> float:
        """What answering ``call`` (whose ``need`` is the rows it still has to feed) commits on
        average: E(d) of its block; nothing for a prompt's chunk that does not finish it (counted
        as nothing whenever its need exceeds a block)."""
        if need > self.limits.max_block_rows:
            return 0.0
        pace = self._paces.get(call.block.session_id)
        alpha = pace.acceptance.alpha if pace is not None else 0.0
        return expected_tokens(alpha, call.block.num_drafted)

    def _active_sessions(self) -> list[str]:
        now = time.perf_counter()
        queued = {call.block.session_id for call in self._queue}
        recent = [
            session_id
            for session_id, pace in self._paces.items()
            if pace.answered_at is not None and now - pace.answered_at < TUNING.active_s
        ]
        return sorted(queued.union(recent) & self._paces.keys())

    async def _gather(self) -> None:
        """Before a forward: wait for company while the target was idle (``batch_wait_s``), and
        hold for the sessions due soon that are worth it (``_hold_until``)."""
        wait_until = time.perf_counter() + self.limits.batch_wait_s
        while len({call.block.session_id for call in self._queue}) < self.limits.max_batch_sessions:
            remaining = max(wait_until, self._hold_until() or 0.0, self._ahead_hold_until() or 0.0) - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _ahead_hold_until(self) -> float | None:
        """Until when a forward of steps ahead alone (``ahead_step``) waits instead: while the
        edge of a stepped session is expected before that forward would end, the step would hold
        its block back by a whole forward for one token, where waiting costs the verifier only the
        idle time to its arrival. The edge is awaited up to that forward's time past its mean gap
        (its gaps are bimodal: a block drafted ahead during the call goes at once, a miss is
        drafted first); later, the steps run. None: run them now (a forward that runs for other
        calls anyway takes the steps along)."""
        if not self._queue or not self._cost.is_known or not all(call.block.ahead_step for call in self._queue):
            return None
        now = time.perf_counter()
        forward_s = self._cost.seconds(len(self._queue))
        latest = None
        for call in self._queue:
            pace = self._paces.get(call.block.session_id)
            if pace is None or pace.answered_at is None:
                continue
            gap = pace.gap if pace.gap.mean_s is not None else self._typical_gap
            due_at = pace.answered_at + (gap.mean_s or 0.0)  # no gap learnt yet: its edge may be back at once
            if due_at - now < forward_s:  # until a forward past its mean: an edge's gap is bimodal (drafted ahead or not)
                latest = due_at + forward_s if latest is None else max(latest, due_at + forward_s)
        return latest if latest is not None and latest > now else None

    def _hold_until(self) -> float | None:
        """Until when the next forward waits for the sessions due soon worth holding for, or None:
        the rule weighs their expected waits, and the forward then waits for them until the
        latest of their arrival windows (it starts as soon as they are all queued)."""
        cost = self._cost
        if not cost.is_known:
            return None
        # A session stepped ahead (``ahead_step``) is awaited, not queued: its edge's call, when
        # it comes, takes the step's place; holding for it weighs that call against the steps.
        calls = [call for call in self._queue if not call.block.ahead_step]
        queued = {call.block.session_id for call in calls}
        needs = [(call, self._need(call)) for call in calls]
        rows = sum(min(need, self.limits.max_forward_rows) for _, need in needs)
        now = time.perf_counter()
        late_deviations, max_late_s = self.limits.hold_late_deviations, cost.seconds(1)
        arrivals = [
            (arrival, pace)
            for session_id, pace in self._paces.items()
            if session_id not in queued and (arrival := pace.arrival(now, self._typical_gap, late_deviations, max_late_s)) is not None
        ]
        due = [(arrival.expected_s, pace.rows, expected_tokens(pace.acceptance.alpha, pace.drafted)) for arrival, pace in arrivals]
        tokens = sum(self._expected_tokens(call, need) for call, need in needs)
        returning = sum(call.block.continued_step for call in self._queue)  # their next step comes at once: one row
        wait_s = latest_worth_holding(
            due,
            cost,
            Sessions(len(queued), rows, tokens),
            self._saturation.is_saturated,
            self.limits.hold_scale,
            Sessions(returning, returning),
        )
        if wait_s is None:
            return None
        return now + max(arrival.latest_s for arrival, _ in arrivals if arrival.expected_s <= wait_s)


def log_forward(
    planned: list[tuple[PendingCall, int]], results: list[ShareResult], record: ForwardRecord, started: float, held_s: float
) -> None:
    """At debug level, one line per forward: when it started, how long it waited for company,
    its model time, and per share (session id's end, rows, and whether a call, a continued step or a step ahead)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    shares = [
        (
            call.block.session_id[-6:],
            result.num_rows,
            "continued" if call.block.continued_step else "ahead" if call.block.ahead_step else "call",
        )
        for (call, _), result in zip(planned, results, strict=True)
    ]
    logger.debug("forward at %.3f: held %.1f ms, %.1f ms of model, shares %s", started, held_s * 1e3, record.model_s * 1e3, shares)


def verdict_of(call: PendingCall, result: ShareResult, record: ForwardRecord, started: float) -> BlockVerdict:
    """The answered call's verdict: its acceptance, the rows it fed over all its chunks, and
    where its time went (waiting, including its earlier chunks, then its answering forward)."""
    acceptance = result.acceptance
    if acceptance is None:
        raise ValueError("a prefill chunk has no verdict")
    now = time.perf_counter()
    return BlockVerdict(
        num_accepted=acceptance.num_accepted,
        next_token_id=acceptance.next_token_id,
        is_bonus=acceptance.is_bonus,
        logprobs=result.logprobs,
        num_target_tokens=call.rows_fed,
        queue_s=started - call.queued_at,
        forward_s=now - started,
        num_batched=record.num_sessions,
        model_s=record.model_s,
        top_logprobs=result.top_logprobs,
        num_cached_tokens=call.num_cached_tokens,
    )


def settle(future: asyncio.Future, verdict: BlockVerdict | None = None, error: Exception | None = None) -> None:
    if future.done():  # the caller went away (cancelled); the work is simply dropped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(verdict)
