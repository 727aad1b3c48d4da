"""OpenAI ``logprobs`` for the generated text: which tokens each text delta reports, and the chat
and completions shapes built from them.

The values are the engine's (the target's, ``spade_core.sampling.reported_logprobs``); this
module only decides where each one goes.

Which delta reports a token. Text reaches the client through two hold-backs: the incremental
detokenizer keeps back a token that ends inside a UTF-8 character (its text comes out with a
later token's), and the stop-string filter keeps back text that may begin a stop string. A
token is reported with the delta that releases the last character of its text, so each token
is reported once, never before its text, and a stream's chunks report exactly the tokens of a
non-streamed answer. Example, stop "END", tokens "ab" "cE" "ND": "ab" is released and reported
at once; "cE" is held ("E" may begin "END"), then cut: the text ends "abc" and only "ab" is
reported. Not reported: tokens whose text a stop string cuts (wholly or in part, so the text
may end with characters of an unreported token, "c" above), tokens after it, and the EOS token.
Tokens that decode to no text at all (a skipped special token) go with the next delta; at the
very end of a stream they get a chunk of empty text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.engine import TopLogprobs
from gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

SMALLEST_LOGPROB = -9999.0
"""JSON has no -infinity: a -inf logprob (never expected for an emitted or listed token) is sent
as this, as vLLM does."""


@dataclass(frozen=True)
class ReportedToken:
    """One output token as the logprobs report it."""

    token_id: int
    logprob: float
    top: TopLogprobs
    text_offset: int
    """Where its text starts in the choice's text (characters)."""


@dataclass(frozen=True)
class TokenSpan:
    index: int
    """The token's position in the output."""
    start: int
    end: int
    """Its text is characters [start, end) of the detokenized output."""


@dataclass
class TokenSpans:
    """Where each token's text lies in the detokenized output, and which tokens a stop-string
    filter's released prefix covers (see the module docstring). Fed, per token, the length of
    the text the detokenizer returned for it."""

    text_length: int = 0
    num_tokens: int = 0
    waiting: list[int] = field(default_factory=list)
    """Tokens whose text the detokenizer still holds back."""
    unreleased: list[TokenSpan] = field(default_factory=list)

    def add(self, num_new_chars: int) -> None:
        """One more token, for which the detokenizer returned ``num_new_chars`` characters:
        they end the text of every token waiting, this one included."""
        self.waiting.append(self.num_tokens)
        self.num_tokens += 1
        if num_new_chars:
            self.flush(num_new_chars)

    def flush(self, num_new_chars: int) -> None:
        """``num_new_chars`` characters came out of the detokenizer (also what it still held at
        the end): they end the waiting tokens' text, an empty one for tokens that decode to
        nothing."""
        start, self.text_length = self.text_length, self.text_length + num_new_chars
        self.unreleased += [TokenSpan(index, start, self.text_length) for index in self.waiting]
        self.waiting = []

    def release(self, num_released_chars: int) -> list[TokenSpan]:
        """The tokens whose text ends within the first ``num_released_chars`` characters, in
        order, each once."""
        released = [span for span in self.unreleased if span.end <= num_released_chars]
        self.unreleased = self.unreleased[len(released) :]  # ends never decrease: a prefix is released
        return released


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text: its id decoded alone, special tokens kept (vLLM's choice); a piece of
    a multi-byte character decodes to U+FFFD (its ``bytes`` are exact)."""
    return tokenizer.decode([token_id])


def token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    """A byte-level BPE token's own bytes (so that the bytes of the tokens of a character split
    across tokens join into it), else the UTF-8 of its text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    if is_byte_level(tokenizer) and token_id not in added:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if piece and all(char in BYTE_OF_CHAR for char in piece):
            return [BYTE_OF_CHAR[char] for char in piece]
    return list(text.encode("utf-8"))


def is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> character table (``bytes_to_unicode``), character -> byte: printable
    bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(256 + rank): byte for rank, byte in enumerate(others)}


BYTE_OF_CHAR: Mapping[str, int] = MappingProxyType(_byte_level_alphabet())


def _clamped(logprob: float) -> float:
    return max(logprob, SMALLEST_LOGPROB)


def _top_logprob(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=_clamped(logprob), bytes=token_bytes(tokenizer, token_id, text))


def chat_logprobs(tokenizer, tokens: list[ReportedToken]) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat answer (or chunk) reporting ``tokens``."""
    content = []
    for token in tokens:
        chosen = _top_logprob(tokenizer, token.token_id, token.logprob)
        alternatives = [_top_logprob(tokenizer, token_id, logprob) for token_id, logprob in token.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer, tokens: list[ReportedToken]) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion (or chunk): per token its text, logprob,
    ``{text: logprob}`` of itself and its alternatives (OpenAI's legacy API lists the chosen
    token too: up to N + 1 entries; tokens of the same text share an entry), and text offset."""
    texts = [token_text(tokenizer, token.token_id) for token in tokens]
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[_clamped(token.logprob) for token in tokens],
        top_logprobs=[_by_text(tokenizer, text, token) for text, token in zip(texts, tokens, strict=True)],
        text_offset=[token.text_offset for token in tokens],
    )


def _by_text(tokenizer, text: str, token: ReportedToken) -> dict[str, float]:
    """The chosen token first, then its alternatives; where two share a text, the first stays."""
    entries = {text: _clamped(token.logprob)}
    for token_id, logprob in token.top:
        entries.setdefault(token_text(tokenizer, token_id), _clamped(logprob))
    return entries
