"""The edge on the pipelined-session wire (``--verifier-wire pipelined``, experimental; the wire is
``verifier_service.pipeline_protocol``, and the verifier must run with ``--pipelined-sessions``).

On the verify wire the edge drafts a block, waits for its verdict, and drafts the next: its
session leaves the verifier's forwards for every round trip. Here the verifier decodes the
session itself in every forward (on vLLM, as one long-lived request in its running batch) and
streams the decided tokens; the edge drafts continuously, up to ``lead_tokens`` past the decided
tokens it holds, and posts what it has drafted as a proposal whenever none is in flight. A forward
verifies the part of the latest proposal that continues what it has decided; when decided tokens
arrive the edge keeps the drafts they confirm and drafts on after them, or, at a contradiction,
drafts again after the decided tokens (``rebased_drafts``; the drafter's cache follows the context
it is given, so it is rolled back there).

Exactness comes from the verifier: every streamed token is one it decided (each event checked
against its digest, ``PipelineClient.decided``); proposals are token ids verified with a one-hot
q, which is exact whatever drafted them (as long as the draft does not depend on the target's p),
at any temperature. So the drafter drafts greedily at every temperature (``DRAFTS``): a greedy
draft is accepted with probability p(argmax q), a draft sampled from q with sum p.q, which is lower
on the real pair (``spade_bench.micro.onehot_acceptance``, docs/benchmarks.md). A seed no longer
fixes a sampled text (which positions a proposal covers depends on timing): docs/api.md says so.

What it leaves to the verify wire (``SpeculativeEngine``, which it wraps): requests asking for
logprobs (not on this wire yet), and every request once a verifier has answered that it does not
serve the wire, or serves another version of it (logged once). Stop strings and EOS are the gateway's as on the verify wire; when
the caller goes or a stop string ends the request, the session is closed on the verifier.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from edge_agent.accounting import record_request_started
from edge_agent.draft_prefixes import request_prefix_owner
from edge_agent.drafter import Drafter, DraftSession
from edge_agent.engine import SpeculativeEngine
from edge_agent.metrics import EdgeMetrics
from edge_agent.pipeline_client import PipelineClient, PipelineUnsupported, RemoteSession
from edge_agent.verifier_client import wire_cache_salt
from gateway.affinity import route_key
from gateway.engine import GeneratedTokens, GenerationRequest
from gateway.errors import ServiceUnavailableError
from gateway.model import ModelDescription
from gateway.protocol import SpadeStats
from spade_core.params import SamplingConfig
from spade_core.proposals import rebased_drafts
from verifier_service.pipeline_protocol import PIPELINE_WIRE_VERSION, DecidedTokens, PipelineOpen, PipelineProposal
from verifier_service.protocol import VerifierHealth, WireSampling

logger = logging.getLogger(__name__)

DRAFTS = SamplingConfig(temperature=0.0)
"""How the edge drafts on this wire, whatever the request's sampling: greedily. The verifier
verifies token ids one-hot, so any draft that does not depend on p is exact, and the greedy one
is accepted more often than a sample of q at temperature > 0 (the module's docstring)."""


def chosen_wire(setting: str, health: VerifierHealth) -> str:
    """The wire the edge speaks to a verifier: ``--verifier-wire``, or for ``auto`` the one the
    verifier's ``/health`` prefers (``preferred_wire``: pipelined on a vLLM verifier serving
    pipelined sessions, else verify).

    Example: auto and a verifier preferring pipelined -> pipelined; auto and an older verifier,
    whose /health says nothing -> verify; pipelined -> pipelined whatever the verifier prefers."""
    return health.preferred_wire if setting == "auto" else setting


@dataclass
class DecidedSoFar:
    """The decided tokens the edge holds for one request, and a wake-up for its drafting."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, event: DecidedTokens) -> None:
        self.tokens += event.token_ids
        self.finish_reason = event.finish_reason
        self.notify()

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class Proposer:
    """At most one proposal POST in flight; the newest drafts wait for it and go next (older
    ones are dropped: only the latest proposal counts)."""

    client: PipelineClient
    session: RemoteSession
    sequence: int = 0
    pending: PipelineProposal | None = None
    sending: asyncio.Task | None = None

    def post(self, start: int, drafts: list[int], seen: int) -> None:
        self.sequence += 1
        self.pending = PipelineProposal(start=start, draft_tokens=drafts, seen=seen, sequence=self.sequence)
        if self.sending is None or self.sending.done():
            self.sending = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        while self.pending is not None:
            proposal, self.pending = self.pending, None
            await self.client.propose(self.session, proposal)

    def cancel(self) -> None:
        if self.sending is not None:
            self.sending.cancel()


class PipelinedEngine:
    """The edge's engine on the pipelined-session wire (see the module's docstring)."""

    def __init__(
        self,
        verify_wire: SpeculativeEngine,
        drafter: Drafter,
        client: PipelineClient,
        metrics: EdgeMetrics,
        executor: Executor,
        lead_tokens: int,
    ) -> None:
        self._verify_wire = verify_wire
        self._drafter = drafter
        self._client = client
        self._metrics = metrics
        self._executor = executor
        self.lead_tokens = lead_tokens
        self._unsupported = False
        self._closing: set[asyncio.Task] = set()

    @property
    def model(self) -> ModelDescription:
        return self._verify_wire.model

    @property
    def tokenizer(self):
        return self._verify_wire.tokenizer

    @property
    def verifier_reachable(self) -> bool:
        return self._verify_wire.verifier_reachable

    @property
    def prefill_first(self) -> bool:
        return self._verify_wire.prefill_first

    async def generate(self, request: GenerationRequest, stats: SpadeStats) -> AsyncGenerator[GeneratedTokens, None]:
        if request.num_top_logprobs is not None or self._unsupported or request.max_tokens < 1:
            async for batch in self._verify_wire.generate(request, stats):
                yield batch
            return
        cache_salt = wire_cache_salt(request.cache_owner, request.cache_salt)
        opening = PipelineOpen(
            session_id=f"edge-{uuid.uuid4().hex}",
            prompt_tokens=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            sampling=WireSampling.from_config(request.sampling),
            cache_salt=cache_salt,
        )
        session = RemoteSession(opening, route_key(request.prefix_key, cache_salt))
        try:
            opened = await self._client.open(session)
            if opened.wire_version != PIPELINE_WIRE_VERSION:
                self._close_soon(session)
                raise PipelineUnsupported(
                    f"the verifier speaks pipelined-session wire {opened.wire_version}, this edge {PIPELINE_WIRE_VERSION}"
                )
        except PipelineUnsupported as error:
            logger.warning("%s: serving on the verify wire instead", error)
            self._unsupported = True
            async for batch in self._verify_wire.generate(request, stats):
                yield batch
            return
        except BaseException:  # the caller went while the session opened: it may exist anyway
            self._close_soon(session)
            raise
        record_request_started(self._metrics, len(request.prompt_token_ids))
        decided = DecidedSoFar()
        draft_session = self._drafter.start_session(request_prefix_owner(request))
        proposer = Proposer(self._client, session)
        drafting = asyncio.get_running_loop().create_task(
            self._draft_on(request, draft_session, decided, proposer, opened.window_tokens, stats)
        )
        drafting.add_done_callback(_report_drafting_failure)
        try:
            async for event in self._client.decided(session):
                decided.add(event)
                self._account(event, stats)
                if event.token_ids:
                    yield GeneratedTokens(list(event.token_ids))
                if event.finish_reason == "error":
                    raise ServiceUnavailableError(
                        f"the verifier ended the session ({event.finish_reason}) after {len(decided.tokens)} tokens",
                        code="verifier_unavailable",
                    )
                if event.finish_reason is not None:
                    break
        finally:  # nothing awaited here: a cancelled caller's scope would cancel every await
            decided.finish_reason = decided.finish_reason or "closed"
            decided.notify()
            drafting.cancel()
            proposer.cancel()
            self._close_soon(session)
            stats.resyncs += session.num_resumes
            self._metrics.resyncs.inc(session.num_resumes)
            self._metrics.rejected_answers.inc(session.num_bad_events)
            self._verify_wire.close_draft_session(draft_session)  # after a draft forward still running
            self._metrics.active_requests.dec()

    def _close_soon(self, session: RemoteSession) -> None:
        """DELETE the session in the background: a finishing or cancelled request must not wait."""
        task = asyncio.get_running_loop().create_task(self._client.close(session))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _draft_on(
        self,
        request: GenerationRequest,
        draft_session: DraftSession,
        decided: DecidedSoFar,
        proposer: Proposer,
        window: int,
        stats: SpadeStats,
    ) -> None:
        """Draft up to ``lead_tokens`` past the decided tokens held, one token a draft forward,
        proposing as it goes; acknowledge alone before the verifier would reach its window."""
        prompt, loop = list(request.prompt_token_ids), asyncio.get_running_loop()
        base, acknowledged = 0, 0
        drafts: list[int] = []
        while decided.finish_reason is None:
            if len(decided.tokens) != base:  # decided tokens arrived: keep the drafts they confirm
                drafts, base = rebased_drafts(decided.tokens, base, drafts), len(decided.tokens)
                if drafts:
                    proposer.post(len(prompt) + base, drafts, base)
                    acknowledged = base
            if base + len(drafts) < request.max_tokens and len(drafts) < self.lead_tokens:
                context = prompt + decided.tokens[:base] + drafts
                block = await loop.run_in_executor(self._executor, draft_session.propose, context, 1, DRAFTS)
                stats.drafted_tokens += len(block.token_ids)
                self._metrics.drafted_tokens.inc(len(block.token_ids))
                drafts = drafts + block.token_ids
                if len(decided.tokens) == base:  # else rebase first: the draft stands where they confirm it
                    proposer.post(len(prompt) + base, drafts, base)
                    acknowledged = base
                continue
            if len(decided.tokens) - acknowledged >= max(1, window // 2):
                proposer.post(len(prompt) + base, [], len(decided.tokens))
                acknowledged = len(decided.tokens)
            changed = decided.changed
            await changed.wait()

    def _account(self, event: DecidedTokens, stats: SpadeStats) -> None:
        """One decided event: a forward of the verifier's that brought this request's tokens."""
        if not event.token_ids:
            return
        stats.verify_calls += 1
        stats.accepted_tokens += event.num_from_proposal
        self._metrics.verify_calls.inc()
        self._metrics.accepted_tokens.inc(event.num_from_proposal)
        self._metrics.generated_tokens.inc(len(event.token_ids))

    async def aclose(self) -> None:
        if self._closing:  # sessions still being closed: they go before the connection does
            await asyncio.wait(set(self._closing), timeout=5)
        await self._verify_wire.aclose()


def _report_drafting_failure(task: asyncio.Task) -> None:
    """A drafting loop that failed leaves the request to the verifier's own steps (still exact,
    slower): logged, not raised."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("drafting stopped: %s", task.exception(), exc_info=task.exception())
