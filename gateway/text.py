"""Tokens -> text for streaming: incremental detokenization and stop strings.

Both are pure state machines fed one token (or text delta) at a time, so they are tested
without a server.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas without breaking UTF-8 across tokens.

    Keeps two offsets into the token list (as TGI and vLLM do): text is decoded from
    ``prefix_offset`` so that tokenizers whose pieces depend on their neighbours (leading
    spaces, byte fallback) decode correctly, and a delta is released only once it no longer
    ends in an incomplete character. Example with a byte-level BPE: "é" split into two byte
    tokens -> the first add() returns "" (decodes to U+FFFD), the second returns "é".
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)


@dataclass
class StopStringFilter:
    """Cuts the text at the first stop string, even one split across deltas, and never
    releases text that could still turn out to be the start of a stop string.

    Example, stop "END": append("abcE") -> "abc" (the "E" is held), append("ND more") -> "" and
    stopped: "END" never reaches the client.
    """

    stop_strings: list[str]
    text: str = ""
    num_released: int = 0
    is_stopped: bool = False

    def append(self, delta: str) -> str:
        if self.is_stopped:
            return ""
        search_from = max(0, len(self.text) - self._longest_stop() + 1)
        self.text += delta
        stop_at = self._first_stop_index(search_from)
        if stop_at is not None:
            self.text = self.text[:stop_at]
            self.is_stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_stop_suffix())

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        released = self.text[self.num_released : end] if end > self.num_released else ""
        self.num_released = max(self.num_released, end)
        return released

    def _longest_stop(self) -> int:
        return max((len(stop) for stop in self.stop_strings), default=1)

    def _first_stop_index(self, search_from: int) -> int | None:
        found = [self.text.find(stop, search_from) for stop in self.stop_strings]
        found = [index for index in found if index >= 0]
        return min(found) if found else None

    def _partial_stop_suffix(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
