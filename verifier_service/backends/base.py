"""The contract every verifier backend implements (transformers, vLLM).

The service (``verifier_service.service``) owns the wire: validation, the session registry,
digests, retries. A backend owns the target model and whatever cache it keeps per session, and
answers one question: for this committed context and drafted block, how many drafted tokens
are accepted and what is the next token. It must answer with exactly the distribution of
sampling from the target alone (see ``spade_core.acceptance``).

A block with no drafted tokens is one step of target-only decoding: nothing is accepted and
the next token is the bonus drawn from the target's distribution after the context, with the
seeded draws of that position. The verifier's own OpenAI routes decode that way, and the edge's
first verify call of a generation carries the prompt alone.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gateway.engine import TopLogprobs
from gateway.model import ModelDescription
from spade_core.params import SamplingConfig


@dataclass(frozen=True)
class BlockToVerify:
    """What the service asks a backend: one session's whole committed context and a drafted
    block (with the distributions the draft sampled it from, or none for a greedy draft), under
    the request's sampling; an empty block asks for one step of target-only decoding."""

    session_id: str
    context_token_ids: list[int]
    """The whole committed context (prompt + tokens generated so far), at least one token."""
    draft_token_ids: list[int]
    """The drafted block; empty for one step of target-only decoding."""
    draft_probs: torch.Tensor | None
    """[num_drafted, vocab] float32, each row the distribution the drafted token was sampled
    from (after the edge's transform and top-N truncation); None = greedy draft (one-hot)."""
    sampling: SamplingConfig
    num_top_logprobs: int | None = None
    """None: no logprobs wanted (none computed); N: the emitted tokens' logprobs
    (``spade_core.sampling.reported_logprobs``) and N alternatives each."""
    cache_namespace: str | None = None
    """Where the backend may share this context's KV with other sessions
    (``prefix_store.prefix_namespace``: salt and key); None shares nothing."""
    continued_step: bool = False
    """A step the service runs on by itself right after its session's answer
    (``VerifierService.continued``): no round trip came before it, so it says nothing of when
    the session's edge calls."""
    ahead_step: bool = False
    """A step the service decodes a session by between its edge's calls (``steps_ahead``): like
    a continued step it follows no round trip, and it says nothing of the session's blocks."""

    @property
    def num_drafted(self) -> int:
        return len(self.draft_token_ids)

    @property
    def first_draft_position(self) -> int:
        """Absolute position of the first drafted token (seeds its random draws)."""
        return len(self.context_token_ids)


@dataclass(frozen=True)
class BlockVerdict:
    """A backend's answer to a ``BlockToVerify``: how many drafted tokens the target accepted and
    the next token (the correction at the first rejection, or the bonus after a fully accepted
    block), with the logprobs asked for and what the forward cost (queue, forward, batching)."""

    num_accepted: int
    next_token_id: int
    is_bonus: bool
    """True when all drafted tokens were accepted and next_token_id is the bonus token."""
    logprobs: list[float] | None
    """With ``num_top_logprobs``: the target's log-probabilities of the emitted tokens (accepted
    drafts then next, ``spade_core.sampling.reported_logprobs``), length num_accepted + 1;
    otherwise None."""
    num_target_tokens: int
    """Tokens that went through the target's forward pass for this block."""
    queue_s: float
    forward_s: float
    num_batched: int = 1
    """Sessions whose calls shared this forward (1 = verified alone)."""
    model_s: float | None = None
    """The model call alone (forward_s less the acceptance math); None where not measured."""
    top_logprobs: list[TopLogprobs] | None = None
    """With ``num_top_logprobs``: per emitted token, that many most likely alternatives."""
    num_cached_tokens: int = 0
    """Context tokens this call did not feed because another session's KV (a shared prefix) was
    copied for them: 0 unless the call started a cache (new session, resync, target-only)."""


@dataclass(frozen=True)
class ForwardRecord:
    """One model forward: how many sessions and rows shared it, and the model call's time."""

    num_sessions: int
    num_rows: int
    model_s: float


ForwardObserver = Callable[[ForwardRecord], None]


class VerifierBackend(abc.ABC):
    """One target model behind the verify contract."""

    name: str = "base"
    prefers_pipelined_sessions: bool = False
    """Whether edges do better on the pipelined-session wire than on the verify wire with this
    backend, where the verifier serves both (``--pipelined-sessions``): ``/health``'s
    ``preferred_wire``, which edges on ``--verifier-wire auto`` follow."""

    @property
    @abc.abstractmethod
    def model(self) -> ModelDescription:
        """The served model (the id clients pass, limits, end tokens, which blocks may ask for
        logprobs): what ``/health``, the OpenAI routes and, through ``/health``, the edge use."""

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """A transformers tokenizer (chat template, decoding) for the OpenAI routes."""

    @abc.abstractmethod
    async def verify_block(self, block: BlockToVerify) -> BlockVerdict:
        """Score the block with one forward pass and apply the acceptance rule."""

    @abc.abstractmethod
    def release_session(self, session_id: str, retain: bool = True) -> None:
        """Drop whatever the backend caches for the session (idempotent). ``retain``: the
        backend may keep its KV as a shared prefix's source (False: the memory is wanted)."""

    def observe_forwards(self, observer: ForwardObserver) -> None:  # noqa: B027 -- optional
        """Call ``observer`` after every model forward (the service's metrics); a backend whose
        forwards are not its own to count (vLLM) keeps this no-op."""

    def is_in_forward(self, session_id: str) -> bool:
        """Whether a forward running now includes a call of this session (its verdict comes at
        the forward's end; a call only queued could still be withdrawn at no cost)."""
        return False

    def call_arrived(self, session_id: str, arrived_at: float, num_drafted: int) -> None:  # noqa: B027 -- optional
        """A call of a session the service steps ahead (``steps_ahead``) arrived: a backend that
        learns when each session's calls come (the transformers scheduler) notes it."""

    def answered_without_forward(self, session_id: str) -> None:  # noqa: B027 -- optional
        """The service answered a call of this session by itself, from steps decided ahead."""

    def advised_draft_length(self, session_id: str) -> int | None:
        """The longest block this session should draft next, from the backend's load; None: the
        backend advises nothing (the verifier's ``--max-draft-length`` bounds the block)."""
        return None

    async def aclose(self) -> None:  # noqa: B027 -- optional: a backend holding nothing to free keeps this
        """Free the model and worker threads."""
