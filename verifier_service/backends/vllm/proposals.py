"""Edge proposals for vLLM's running requests, delivered into its engine process (experimental: the
vLLM session route, ``verifier_service.backends.vllm.sessions``, posts them).

The vLLM session route keeps one long-lived vLLM request per edge session in vLLM's running batch.
The edge's proposals (token ids from a start position) must reach the model runner, which runs in
vLLM's engine-core process (one per rank under tensor parallelism), at every step, without a copy
of the context. Here they go through a ``ProposalBoard``: one shared file mapping, one slot per
session, written by the verifier service and read by ``SessionProposer``, the class vLLM's
``custom_class`` speculative method loads in the runner (``speculative_config={"method":
"custom_class", "model": "verifier_service.backends.vllm.proposals.SessionProposer", ...}``).

Bounded: ``num_slots`` sessions, ``max_tokens`` token ids a proposal (a longer one is cut).

Consistent: each slot has a sequence number (a seqlock). The one writer (the service's event loop)
makes it odd, writes the slot, makes it even; a reader copies the slot and keeps the copy only when
the number was even and the same before and after. A reader never sees half a proposal; it may see
the previous one, which is as valid (a proposal is only a guess: vLLM verifies every token it
takes). Numpy's stores and loads of aligned 8-byte fields are single instructions and x86-64 keeps
stores in order and loads in order; a weaker memory model (ARM) would need fences around the
sequence number, which Python cannot place: the route is tested on x86-64 only.

Ranks: under tensor or pipeline parallelism only the output rank reads the board
(``is_output_rank``): vLLM schedules that rank's drafts for every rank, so the ranks verify the same
tokens. The board is a file on the verifier's node, so that rank must run there (tensor
parallelism within a node does; across nodes, vLLM's output rank is the first rank of the last
pipeline stage, which must then be on the verifier's node).

Rows to sessions: vLLM hands the proposer batch rows (its input batch's token array), not request
ids. ``SessionProposer`` reads the rows' request ids from the runner that calls it (the caller's
``input_batch.req_ids``, found once from the frame that calls ``load_model``): two sessions with the
same prompt are two request ids and never swap proposals.

Alignment (``spade_core.proposals.aligned_proposal``, pure): a proposal starts at the position its edge had decided when
it drafted; by the time a step reads it the request may stand further on. The part the request has
passed is compared with the request's own tokens there (bounded by ``max_tokens``, never the
context): a contradicted proposal is dropped (the request decodes one token as target-only would),
a confirmed one gives its next tokens, at most ``num_speculative_tokens``.

Token ids only: the hook takes no draft probabilities, so at temperature > 0 vLLM's rejection
sampler treats each proposal as certain (one-hot q): still exact, with acceptance sum p.q instead
of sum min(p, q).
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spade_core.proposals import Proposal, aligned_proposal
from verifier_service.backends.vllm.workarounds import fix_rejection_sampling

BOARD_ENV = "SPADE_PROPOSAL_BOARD"
"""The environment variable that gives ``SessionProposer`` the board's path (vLLM gives the class
only its config; the engine-core processes inherit the service's environment)."""
PROPOSER_CLASS = "verifier_service.backends.vllm.proposals.SessionProposer"
MAGIC = b"SPADEPB1"
HEADER_BYTES = 64
KEY_BYTES = 48


@dataclass(frozen=True)
class SessionProposals:
    """How a vLLM engine takes edge proposals: a board of ``num_slots`` sessions holding
    ``max_tokens`` token ids each, and at most ``num_speculative_tokens`` of a proposal verified
    per request a step (vLLM sizes its step's buffers for that many)."""

    num_slots: int
    max_tokens: int
    num_speculative_tokens: int

    def speculative_config(self) -> dict[str, Any]:
        """vLLM's ``speculative_config`` that loads ``SessionProposer`` in its model runner."""
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": self.num_speculative_tokens}


def slot_dtype(max_tokens: int) -> np.dtype:
    return np.dtype(
        [("seq", "<u8"), ("key", f"S{KEY_BYTES}"), ("start", "<i8"), ("count", "<i4"), ("pad", "<i4"), ("tokens", "<i4", (max_tokens,))],
        align=True,
    )


class ProposalBoard:
    """Sessions' latest proposals in a shared file mapping (``/dev/shm`` where the system has it):
    ``create`` in the service (the one writer, which removes the file on ``close``), ``attach`` in
    the readers (vLLM's engine processes) by the file's path."""

    def __init__(self, path: Path, mapping: mmap.mmap, owner: bool) -> None:
        if mapping[:8] != MAGIC:
            mapping.close()
            raise ValueError(f"{path} is not a proposal board")
        header = np.frombuffer(mapping, dtype="<i8", count=2, offset=8)
        self.num_slots, self.max_tokens = int(header[0]), int(header[1])
        self.path = path
        self.mapping = mapping
        self.owner = owner
        self.slots = np.ndarray((self.num_slots,), dtype=slot_dtype(self.max_tokens), buffer=mapping, offset=HEADER_BYTES)
        self._slot_of: dict[bytes, int] = {}

    @classmethod
    def create(cls, num_slots: int, max_tokens: int, directory: str | Path | None = None) -> ProposalBoard:
        if num_slots < 1 or max_tokens < 1:
            raise ValueError("a proposal board needs at least one slot of at least one token")
        size = HEADER_BYTES + num_slots * slot_dtype(max_tokens).itemsize
        shm = Path("/dev/shm")
        folder = (
            Path(directory) if directory is not None else (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir()))
        )
        descriptor, name = tempfile.mkstemp(prefix="spade-proposals-", dir=folder)
        try:
            os.ftruncate(descriptor, size)
            mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        mapping[:8] = MAGIC
        np.frombuffer(mapping, dtype="<i8", count=2, offset=8)[:] = (num_slots, max_tokens)
        return cls(Path(name), mapping, owner=True)

    @classmethod
    def attach(cls, path: str | Path) -> ProposalBoard:
        with open(path, "r+b") as file:
            mapping = mmap.mmap(file.fileno(), 0)
        return cls(Path(path), mapping, owner=False)

    @property
    def name(self) -> str:
        """What a reader attaches by (the file's path)."""
        return str(self.path)

    def post(self, key: str, start: int, token_ids: Any) -> int:
        """Writes ``key``'s proposal (replacing its last); returns how many tokens it kept (at most
        ``max_tokens``). Raises when every slot holds another session."""
        encoded = _encoded(key)
        index = self._slot_of.get(encoded)
        if index is None:
            free = np.flatnonzero(self.slots["key"] == b"")
            if not len(free):
                raise RuntimeError(f"the proposal board is full ({self.num_slots} sessions)")
            index = self._slot_of[encoded] = int(free[0])
        tokens = np.asarray(token_ids, dtype="<i4")[: self.max_tokens]
        self._write(index, encoded, start, tokens)
        return len(tokens)

    def retire(self, key: str) -> None:
        """Frees ``key``'s slot (its session ended)."""
        index = self._slot_of.pop(_encoded(key), None)
        if index is not None:
            self._write(index, b"", 0, np.zeros(0, dtype="<i4"))

    def _write(self, index: int, encoded: bytes, start: int, tokens: np.ndarray) -> None:
        slot = self.slots[index : index + 1]
        sequence = int(slot["seq"][0])
        slot["seq"] = sequence + 1  # odd: being written
        slot["key"], slot["start"], slot["count"] = encoded, start, len(tokens)
        slot["tokens"][0, : len(tokens)] = tokens
        slot["seq"] = sequence + 2

    def read(self, key: str, attempts: int = 8) -> Proposal | None:
        """``key``'s latest proposal, or None (no slot, or a slot rewritten on every attempt)."""
        encoded = _encoded(key)
        index = self._slot_of.get(encoded)
        if index is None or self.slots["key"][index] != encoded:
            found = np.flatnonzero(self.slots["key"] == encoded)
            if not len(found):
                return None
            index = self._slot_of[encoded] = int(found[0])
        slot = self.slots[index : index + 1]
        for _ in range(attempts):
            before = int(slot["seq"][0])
            if before % 2:
                continue
            copied = slot.copy()
            if int(slot["seq"][0]) == before:
                if copied["key"][0] != encoded:
                    return None
                return Proposal(int(copied["start"][0]), copied["tokens"][0, : int(copied["count"][0])])
        return None

    def close(self) -> None:
        self.slots = None  # type: ignore[assignment]  # no view may outlive the mapping
        self.mapping.close()
        if self.owner:
            self.path.unlink(missing_ok=True)


def session_key(request_id: str) -> str:
    """The board key of a vLLM request: vLLM's engine appends "-" and 8 random characters to the
    id a request was added with (``assign_request_id``); session keys never contain "-"."""
    return request_id.split("-", 1)[0]


def _encoded(key: str) -> bytes:
    encoded = key.encode()
    if not encoded or len(encoded) > KEY_BYTES or "-" in key:
        raise ValueError(f"a session key is 1 to {KEY_BYTES} bytes without '-', got {key!r}")
    return encoded


class SessionProposer:
    """vLLM's ``custom_class`` proposer: each running request's proposal from the board named by
    ``$SPADE_PROPOSAL_BOARD``, aligned to where the request stands."""

    def __init__(self, vllm_config: Any, reads_board: bool | None = None) -> None:
        """``reads_board``: whether this rank's drafts are the ones vLLM schedules (None: asked of
        vLLM's parallel state, ``is_output_rank``); another rank proposes nothing and never
        attaches the board, which need not exist on its node."""
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.reads_board = is_output_rank() if reads_board is None else reads_board
        self.board = ProposalBoard.attach(os.environ[BOARD_ENV]) if self.reads_board else None
        fix_rejection_sampling()
        self.runner: Any = None
        self.calls = self.proposed_tokens = 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Called by the model runner: remembers it (its input batch names the rows' requests)."""
        self.runner = _calling_runner()

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        return None

    def propose(self, sampled_token_ids: list, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, **kwargs: Any) -> list[list[int]]:
        self.calls += 1
        if self.board is None:  # not the output rank: vLLM takes the output rank's drafts alone
            return [[] for _ in sampled_token_ids]
        runner = self.runner if self.runner is not None else _calling_runner()
        request_ids = runner.input_batch.req_ids
        proposals: list[list[int]] = []
        for row in range(len(sampled_token_ids)):
            request_id = request_ids[row] if row < len(request_ids) else None  # None: an empty row of the batch
            proposal = self.board.read(session_key(request_id)) if request_id else None
            tokens = (
                []
                if proposal is None
                else aligned_proposal(token_ids_cpu[row], int(num_tokens_no_spec[row]), proposal, self.num_speculative_tokens)
            )
            proposals.append(tokens)
            self.proposed_tokens += len(tokens)
        return proposals


def is_output_rank() -> bool:
    """Whether this model runner's drafts are the ones vLLM schedules: under tensor and pipeline
    parallelism every rank of the last stage runs the proposer, but vLLM's executor takes the
    drafts of one rank (``take_draft_token_ids`` with ``unique_reply_rank``: the first tensor rank
    of the last pipeline stage), and its scheduler sends those same tokens to every rank in the
    next step (vLLM disables async scheduling for ``custom_class``, the path where a runner would
    scatter its own drafts). So every rank verifies the same proposal however the board changes
    between their reads, and only this rank needs to read it."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_tp_group().rank_in_group == 0 and get_pp_group().is_last_rank


def _calling_runner() -> Any:
    """The model runner two frames up (the method that called this proposer's method)."""
    frame = sys._getframe(2)
    runner = frame.f_locals.get("self")
    if runner is None or not hasattr(runner, "input_batch"):
        raise RuntimeError("SessionProposer must be called by vLLM's model runner (its input batch names the rows' requests)")
    return runner
