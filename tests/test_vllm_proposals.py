"""The proposal board (shared memory between the service and vLLM's engine processes) and the
alignment of a proposal to where a request stands: no vLLM needed (the proposer inside vLLM is
exercised by tests/test_vllm_session_probe.py in the vLLM suite)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from spade_core.proposals import Proposal, aligned_proposal
from verifier_service.backends.vllm.proposals import ProposalBoard, session_key


@pytest.fixture
def board():
    created = ProposalBoard.create(num_slots=3, max_tokens=8)
    yield created
    created.close()


def test_a_posted_proposal_is_read_back_by_its_session_and_by_no_other(board):
    assert board.post("sessionA", 40, [5, 6, 7]) == 3
    board.post("sessionB", 12, [9])
    read = board.read("sessionA")
    assert read.start == 40 and read.token_ids.tolist() == [5, 6, 7]
    assert board.read("sessionB").token_ids.tolist() == [9]
    assert board.read("sessionC") is None
    board.post("sessionA", 43, [8, 8])  # replaces its last
    assert (board.read("sessionA").start, board.read("sessionA").token_ids.tolist()) == (43, [8, 8])


def test_the_board_is_bounded_in_sessions_and_tokens_and_a_retired_slot_is_reused(board):
    assert board.post("a", 0, range(20)) == 8  # cut to max_tokens
    assert board.read("a").token_ids.tolist() == list(range(8))
    board.post("b", 0, [1])
    board.post("c", 0, [1])
    with pytest.raises(RuntimeError, match="full"):
        board.post("d", 0, [1])
    board.retire("b")
    assert board.read("b") is None
    board.post("d", 0, [4])
    assert board.read("d").token_ids.tolist() == [4] and board.read("a") is not None and board.read("c") is not None
    with pytest.raises(ValueError):
        board.post("", 0, [1])
    with pytest.raises(ValueError):
        board.post("x" * 49, 0, [1])


def test_a_file_that_is_not_a_board_is_refused(tmp_path):
    other = tmp_path / "not-a-board"
    other.write_bytes(bytes(256))
    with pytest.raises(ValueError, match="not a proposal board"):
        ProposalBoard.attach(other)


def test_a_vllm_request_id_maps_to_its_session_key_and_keys_are_checked():
    assert session_key("3f9ab2c4d5e6f708-a1b2c3d4") == "3f9ab2c4d5e6f708"  # the engine's suffix removed
    assert session_key("3f9ab2c4d5e6f708") == "3f9ab2c4d5e6f708"
    board = ProposalBoard.create(num_slots=1, max_tokens=2)
    try:
        with pytest.raises(ValueError):
            board.post("with-dash", 0, [1])  # would not survive the engine's suffix
    finally:
        board.close()
    assert not board.path.exists()  # the service's close removes the file


def _reader(name: str, key: str, rounds: int, results) -> None:
    board = ProposalBoard.attach(name)
    torn = seen = 0
    last = -1
    for _ in range(rounds):
        proposal = board.read(key)
        if proposal is None:
            continue
        seen += 1
        values = set(proposal.token_ids.tolist())
        # the writer posts (start=v, tokens [v] * (1 + v % 8)): any mix of two posts shows here
        if values != {proposal.start} or len(proposal.token_ids) != 1 + proposal.start % 8 or proposal.start < last:
            torn += 1
        last = proposal.start
    board.close()
    results.put((seen, torn))


def test_a_reader_in_another_process_never_sees_half_a_proposal_while_the_writer_rewrites_it(board):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    reader = context.Process(target=_reader, args=(board.name, "sessionA", 200_000, results))
    board.post("sessionA", 0, [0])
    reader.start()
    value = 0
    while reader.is_alive() and value < 2_000_000:
        value += 1
        board.post("sessionA", value, [value] * (1 + value % 8))
    reader.join(timeout=60)
    seen, torn = results.get(timeout=10)
    assert seen > 0 and torn == 0
    assert value > 1000  # the writer really rewrote it while the reader read


def test_the_board_outlives_a_reader_that_attached_and_closed(board):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    board.post("k", 3, [1, 2])
    reader = context.Process(target=_reader, args=(board.name, "nobody", 10, results))
    reader.start()
    reader.join(timeout=60)
    assert results.get(timeout=10) == (0, 0)
    assert board.read("k").token_ids.tolist() == [1, 2]  # still there: the reader's exit did not unlink it


ROW = np.array([1, 2, 3, 4, 5, 6, 0, 0, 0], dtype=np.int32)  # a request's tokens; it stands at 6


@pytest.mark.parametrize(
    ("start", "tokens", "limit", "expected", "why"),
    [
        (6, [7, 8, 9], 3, [7, 8, 9], "starts where the request stands"),
        (6, [7, 8, 9], 2, [7, 8], "at most the limit"),
        (4, [5, 6, 7, 8], 3, [7, 8], "the passed part confirmed"),
        (4, [5, 9, 7, 8], 3, [], "the passed part contradicted"),
        (2, [3, 4, 5, 6], 3, [], "passed entirely"),
        (7, [8, 9], 3, [], "starts past the request: a gap"),
        (6, [7], 0, [], "no room for speculation"),
    ],
)
def test_a_proposal_is_aligned_to_where_the_request_stands(start, tokens, limit, expected, why):
    proposal = Proposal(start, np.array(tokens, dtype=np.int32))
    assert aligned_proposal(ROW, 6, proposal, limit) == expected, why
