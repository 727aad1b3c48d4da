"""The pipelined-session wire on vLLM (``--backend vllm --pipelined-sessions``, experimental): one
long-lived vLLM request per edge session, in vLLM's running batch for the session's life, with
the edge's proposals as its speculative tokens.

On the transformers backend a pipelined session submits one verify block per forward
(``verifier_service.pipeline``). On vLLM the engine's own continuous batching already keeps every
running request in every step, one token each; what a session adds is its edge's proposals. Each
proposal goes to the engine's ``ProposalBoard``, and ``SessionProposer`` (vLLM's ``custom_class``
speculative method, in the model runner) hands the part of it that continues the request to
vLLM's rejection sampler at the request's next step
(``verifier_service.backends.vllm.proposals``). With nothing proposed a step decodes one token,
as vLLM's own decoding does. The engine is started with the proposer when the verifier serves
pipelined sessions (``vllm_engine_options``); its verify and target-only routes are unchanged
(their requests have no proposals on the board).

Exactness. vLLM verifies every proposed token with its rejection sampler against the target's
distribution, with a one-hot q (the hook carries token ids only): accept x with probability
p(x), at a rejection sample p with x removed. Greedy text is vLLM's own greedy text. At
temperature > 0 the text follows the target's distribution; the request's seed seeds vLLM's
per-request generator, but which positions a proposal covers depends on timing, so a seed no
longer fixes the text (as on the transformers backend's pipelined sessions).

Bounded work. vLLM cannot pause a running request: a session whose edge falls ``window_tokens``
behind is aborted (closing its output stream aborts it in vLLM) and added again from its decided
tokens once the edge acknowledges more. vLLM's prefix cache serves that context again (it
recomputes the last partial KV block). The overshoot past the window is what vLLM decided before
the abort landed: a step or two, up to ``num_speculative_tokens`` + 1 tokens a step. It is decided
text like any other and goes to the edge. A request added again is seeded anew
(``spade_core.params.continued_seed``): vLLM's generator restarts with each request, and the session's seed again
would reuse the uniforms of earlier positions. Closing a session, its idle TTL and the service's
shutdown abort its request.

What it counts. While the session reads promptly, each output delta of its request is one vLLM
step's tokens: the tokens after a delta's first are counted as accepted proposals
(``spade_verifier_pipeline_tokens_total{source="proposal"}``). That is an estimate: vLLM counts
speculation per engine, not per request, and deltas merge when the service falls behind (which
undercounts). What became of each proposal (used, stale, ...) is decided inside the engine and is
not counted here; vLLM's own ``spec_decode`` counters are in its log.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

from spade_core.params import SamplingConfig, continued_seed
from verifier_service.backends.vllm.backend import VllmBackend
from verifier_service.backends.vllm.native import openai_errors
from verifier_service.backends.vllm.requests import token_prompt, vllm_cache_salt
from verifier_service.pipeline import PipelinedSession, ProposalOutcome
from verifier_service.pipeline_protocol import FinishReason, PipelineProposal

logger = logging.getLogger(__name__)


def session_params(sampling: SamplingConfig, max_tokens: int, eos_token_ids: frozenset[int], num_generated: int = 0) -> Any:
    """vLLM's SamplingParams for a session's request added after ``num_generated`` tokens:
    ``max_tokens`` more tokens at most, the model's end tokens as stop tokens (kept in the output,
    as the verifier's decided tokens keep them), streamed in deltas."""
    from vllm.sampling_params import RequestOutputKind

    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=None if sampling.is_greedy else continued_seed(sampling.seed, num_generated),
        max_tokens=max_tokens,
        stop_token_ids=sorted(eos_token_ids),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def finish_of(vllm_reason: str | None) -> FinishReason:
    """vLLM's finish reason as the wire's: an end token (stop), max_tokens (length), anything
    else (an abort we did not ask for) an error."""
    return {"stop": "stop", "length": "length"}.get(vllm_reason or "", "error")  # type: ignore[return-value]


class VllmPipelinedSession(PipelinedSession):
    """One session as one long-lived vLLM request (see the module's docstring). ``board_key`` is
    its request id and its slot on the proposal board (vLLM appends its own suffix to the id)."""

    def __init__(self, backend: VllmBackend, *args: Any, **kwargs: Any) -> None:
        board = backend.proposal_board
        if board is None:
            raise RuntimeError("the vLLM engine was started without session proposals (VllmEngineOptions.session_proposals)")
        self._board = board
        self._vllm = backend
        self.board_key = uuid.uuid4().hex
        super().__init__(backend, *args, **kwargs)

    def propose(self, proposal: PipelineProposal) -> None:
        """As the base class; a proposal taken as the latest goes to the board at once (none
        once the session has finished: its slot is free for another)."""
        current = self._proposal
        super().propose(proposal)
        if self._proposal is not None and self._proposal is not current and self.finish_reason is None:
            self._board.post(self.board_key, self._proposal.start, self._proposal.token_ids)

    def close(self, reason: FinishReason = "closed") -> None:
        super().close(reason)
        self._board.retire(self.board_key)  # now: a task cancelled before it ran has no finally

    def _drop_proposal(self, outcome: ProposalOutcome) -> None:
        """The engine's proposer reads the board: what became of a proposal is not known here."""
        self._proposal = None

    def _ended(self) -> None:
        self._board.retire(self.board_key)

    async def _advance(self, context: list[int], room: int) -> None:
        """One vLLM request from ``context``, until it finishes or the window fills (leaving
        the ``async with`` closes its stream, which aborts it in vLLM)."""
        salt = vllm_cache_salt(self.template.cache_namespace, self.session_id)
        params = session_params(self.template.sampling, room, self._vllm.model.eos_token_ids, len(self.generated))
        outputs = self._vllm.engine.generate(token_prompt(context, salt), params, self.board_key)
        async with contextlib.aclosing(openai_errors(outputs)) as stream:
            async for output in stream:
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                finish = finish_of(completion.finish_reason) if output.finished else None
                if tokens or finish is not None:
                    num_from_proposal = max(0, len(tokens) - 1)
                    self._on_step(None, None, tokens, num_from_proposal)
                    self._decide(tokens, num_from_proposal, finish)
                if finish is not None or self.window_full():
                    return
