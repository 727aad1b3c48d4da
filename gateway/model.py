"""The served model, described once: what the verifier's backends produce, what its ``/health``
carries over the wire and what the edge serves under (the target's id, limits and end tokens).

It also holds the one context-limit rule. A sequence the target holds never exceeds
``max_context_length`` tokens, counting what a request may add to what is already there:

- an OpenAI request: the prompt plus its token budget (``max_tokens``);
- a verify call: the committed context plus the drafted block, the tokens the forward is fed.
  The next token the call returns is emitted, not fed, so a block may end exactly at the limit.
  That is what lets the edge finish a budget that ends at the limit: with one token left it
  still sends one drafted token (only a generation's first, prompt-only call carries an empty
  block), and context + 1 = the limit.

Example, max_context_length 32: a 30-token prompt may ask for max_tokens 2, not 3; a verify
call with 29 committed tokens may carry 3 drafted tokens (32 fed), not 4.

A backend that cannot score a full context (vLLM needs room for the token it returns) describes
its context as one token shorter instead of bending the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.errors import InvalidRequestError

LogprobsSupport = Literal["none", "greedy", "all"]
"""Which requests an engine can report exact logprobs for: all, greedy ones only (the vLLM
backend's sample_match route samples inside vLLM and never sees the distribution), or none (what
a verifier's /health says while it is still loading its model)."""

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class ModelDescription:
    model_id: str
    """The id users pass as ``model`` and ``/v1/models`` lists (``--served-model-name`` if set)."""
    vocab_size: int
    """Rows of the model's output distribution; valid token ids are below it."""
    max_context_length: int
    """The longest sequence the model holds (see the module docstring for what counts)."""
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Every id that ends a generation (``spade_models.loader.eos_token_ids``)."""
    tokenizer_fingerprint: str = ""
    """``spade_models.loader.tokenizer_fingerprint`` of the model's tokenizer."""
    logprobs_support: LogprobsSupport = "all"

    def room(self, num_held: int) -> int:
        """Tokens that may still be added to a sequence of ``num_held``."""
        return self.max_context_length - num_held

    def check_fits(self, num_held: int, num_added: int, param: str) -> None:
        """The context-limit rule: ``num_held`` tokens (a prompt, a committed context) plus the
        ``num_added`` a request may add (a token budget, a drafted block) must fit. Refused as a
        client's mistake: 400 ``context_length_exceeded``, naming ``param``."""
        if num_added > self.room(num_held):
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_context_length} tokens; "
                f"the request needs {num_held + num_added} ({num_held} already in the context)",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
