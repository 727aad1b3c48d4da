"""Prefix reuse on the draft side (issue 23 item 3): a request's draft starts from the longest
prefix of its context that another sequence already holds (a live request's, or a finished one
kept for this), so a shared system prompt or a chat's earlier turns are decoded once.

Glossary: a *sequence* holds the KV of ``token_ids`` at positions 0, 1, ...; a *retained*
sequence is a finished request's, kept only as a prefix to copy from until room is needed (least
recently used out first); an *owner* is the isolation key of a request (its API key and
``cache_salt``): sequences share prefixes only with sequences of the same owner, since a prefix
hit shows in the time to the first token and would tell one tenant what another sent.

``CellLedger`` is the memory accounting of llama.cpp's unified KV cache when sequences share
cells: ``llama_memory_seq_cp`` does not copy a cell, it adds the destination sequence to the
cell's set, and ``llama_memory_seq_rm`` takes a sequence out of the set, freeing the cell only when
the set is empty. Example: A holds cells c0..c9; B copies A's first 6 -> 10 cells used, not 16;
A is removed -> c0..c5 stay (B's), 6 used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.engine import GenerationRequest
from spade_models.kv_cache import common_prefix_length

Key = TypeVar("Key", bound=Hashable)
Held = TypeVar("Held")


def prefix_owner(cache_owner: str = "", cache_salt: str | None = None) -> str:
    """The isolation key of a request: its API key id and its ``cache_salt`` (the verifier's
    namespace, applied to the draft's prefixes too). Example: key "k1", no salt -> "k1|";
    key "k1", salt "s" -> "k1|s"."""
    return f"{cache_owner}|{cache_salt or ''}"


def request_prefix_owner(request: GenerationRequest) -> str:
    """The owner of a request: its ``cache_owner`` (the caller's API key id) and ``cache_salt``,
    the same isolation the verifier's prefix store applies."""
    return prefix_owner(request.cache_owner, request.cache_salt)


@dataclass(frozen=True)
class PrefixMatch(Generic[Key]):
    source: Key
    """The sequence (or retained cache) that holds the prefix."""
    length: int


def longest_prefix(context: list[int], candidates: Iterable[tuple[Key, list[int]]]) -> PrefixMatch[Key] | None:
    """The candidate sharing the longest prefix with ``context``, capped one short of it (the
    last context token is always fed: its logits start the block); None when none shares a
    token. Ties go to the first candidate."""
    best: PrefixMatch[Key] | None = None
    cap = len(context) - 1
    for key, token_ids in candidates:
        length = min(common_prefix_length(token_ids, context), cap)
        if length > 0 and (best is None or length > best.length):
            best = PrefixMatch(key, length)
    return best


@dataclass
class CellLedger:
    """Which KV cells each sequence holds, a shared cell counted once (the module docstring)."""

    _cells: dict[int, list[int]] = field(default_factory=dict)
    """Per sequence, its cells by position (abstract ids, as llama.cpp's cells are to us)."""
    _num_holders: dict[int, int] = field(default_factory=dict)
    """Per occupied cell, how many sequences hold it."""
    _next_cell: int = 0

    @property
    def num_used(self) -> int:
        """Occupied cells: what counts against the context's ``n_ctx``."""
        return len(self._num_holders)

    def num_held(self, seq_id: int) -> int:
        return len(self._cells.get(seq_id, []))

    def num_only_held(self, seq_id: int) -> int:
        """Cells that removing ``seq_id`` would free (those no other sequence holds)."""
        return sum(1 for cell in self._cells.get(seq_id, []) if self._num_holders[cell] == 1)

    def append(self, seq_id: int, num_new: int) -> None:
        """``num_new`` freshly decoded cells after the sequence's last position."""
        new_cells = list(range(self._next_cell, self._next_cell + num_new))
        self._next_cell += num_new
        self._cells.setdefault(seq_id, []).extend(new_cells)
        self._num_holders.update(dict.fromkeys(new_cells, 1))

    def truncate(self, seq_id: int, length: int) -> None:
        """The sequence keeps its first ``length`` positions (``memory_seq_rm(seq_id, length, -1)``)."""
        cells = self._cells.get(seq_id, [])
        for cell in cells[length:]:
            self._num_holders[cell] -= 1
            if self._num_holders[cell] == 0:
                del self._num_holders[cell]
        del cells[length:]

    def share(self, source_id: int, seq_id: int, length: int) -> None:
        """An empty sequence takes the source's first ``length`` cells (``memory_seq_cp``)."""
        if self.num_held(seq_id):
            raise ValueError(f"sequence {seq_id} must be empty to take a prefix, it holds {self.num_held(seq_id)} cells")
        shared = self._cells[source_id][:length]
        if len(shared) != length:
            raise ValueError(f"sequence {source_id} holds {len(shared)} cells, not the {length} to share")
        self._cells[seq_id] = list(shared)
        for cell in shared:
            self._num_holders[cell] += 1


@dataclass
class Retained(Generic[Held]):
    """A finished request's sequence, kept as a prefix to copy from."""

    owner: str
    token_ids: list[int]
    held: Held
    """What holds the KV: a llama.cpp sequence id, or a transformers cache."""


@dataclass
class RetainedPrefixes(Generic[Key, Held]):
    """Finished sequences in least recently used order (first out first)."""

    entries: OrderedDict[Key, Retained[Held]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(len(entry.token_ids) for entry in self.entries.values())

    def add(self, key: Key, entry: Retained[Held]) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)

    def candidates(self, owner: str) -> list[tuple[Key, list[int]]]:
        return [(key, entry.token_ids) for key, entry in self.entries.items() if entry.owner == owner]

    def touch(self, key: Key) -> None:
        """A prefix was copied from it: it becomes the most recently used."""
        self.entries.move_to_end(key)

    def pop_least_recent(self) -> tuple[Key, Retained[Held]] | None:
        return self.entries.popitem(last=False) if self.entries else None
