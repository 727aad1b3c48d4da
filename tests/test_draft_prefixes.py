"""The pure parts of the draft's prefix reuse (``edge_agent.draft_prefixes``): the cell ledger that
counts a cell shared by several sequences once, the choice of the longest prefix, the owner key,
and the retained sequences' least-recently-used order."""

from __future__ import annotations

import pytest

from edge_agent.draft_prefixes import CellLedger, PrefixMatch, Retained, RetainedPrefixes, longest_prefix, prefix_owner


def test_a_shared_cell_counts_once_and_stays_until_its_last_holder_drops_it():
    ledger = CellLedger()
    ledger.append(0, 10)
    ledger.share(0, 1, 6)
    assert (ledger.num_used, ledger.num_held(1)) == (10, 6)
    ledger.append(1, 3)
    assert ledger.num_used == 13
    assert (ledger.num_only_held(0), ledger.num_only_held(1)) == (4, 3)
    ledger.truncate(0, 0)  # sequence 0 finished and freed: its 6 shared cells are still sequence 1's
    assert (ledger.num_used, ledger.num_only_held(1)) == (9, 9)
    ledger.truncate(1, 2)
    assert ledger.num_used == 2
    ledger.truncate(1, 0)
    assert ledger.num_used == 0


def test_a_rolled_back_source_keeps_what_it_shared():
    ledger = CellLedger()
    ledger.append(0, 8)
    ledger.share(0, 1, 8)
    ledger.share(0, 2, 4)
    ledger.truncate(0, 2)  # a rejected block rolled back in the source
    assert ledger.num_used == 8
    ledger.append(0, 5)  # new cells: the shared ones are never written again
    assert ledger.num_used == 13
    assert ledger.num_held(1) == 8 and ledger.num_held(2) == 4


def test_sharing_needs_an_empty_destination_and_enough_source_cells():
    ledger = CellLedger()
    ledger.append(0, 3)
    ledger.append(1, 1)
    with pytest.raises(ValueError, match="must be empty"):
        ledger.share(0, 1, 2)
    with pytest.raises(ValueError, match="holds 3 cells, not the 5"):
        ledger.share(0, 2, 5)


@pytest.mark.parametrize(
    ("context", "candidates", "expected"),
    [
        ([1, 2, 3, 4], [("a", [1, 2, 9]), ("b", [1, 2, 3, 7])], PrefixMatch("b", 3)),
        ([1, 2, 3], [("a", [1, 2, 3, 4, 5])], PrefixMatch("a", 2)),  # the last context token is always fed
        ([1, 2], [("a", [5, 6])], None),
        ([1], [("a", [1])], None),
        ([1, 2, 3], [("a", [1, 2]), ("b", [1, 2])], PrefixMatch("a", 2)),
        ([1, 2, 3], [], None),
    ],
)
def test_the_longest_prefix_is_chosen_one_short_of_the_context(context, candidates, expected):
    assert longest_prefix(context, candidates) == expected


def test_owners_combine_the_key_and_the_salt():
    assert prefix_owner() == "|"
    assert prefix_owner("k1") != prefix_owner("k2")
    assert prefix_owner("k1", "s") != prefix_owner("k1")
    assert prefix_owner("k1", None) == prefix_owner("k1", "")


def test_retained_prefixes_leave_least_recently_used_first_and_only_to_their_owner():
    retained: RetainedPrefixes[int, None] = RetainedPrefixes()
    retained.add(1, Retained("x", [1, 2], None))
    retained.add(2, Retained("y", [3], None))
    retained.add(3, Retained("x", [4, 5, 6], None))
    assert retained.candidates("x") == [(1, [1, 2]), (3, [4, 5, 6])]
    assert retained.num_tokens == 6
    retained.touch(1)
    assert [key for key, _ in (retained.pop_least_recent(), retained.pop_least_recent())] == [2, 3]
    assert retained.pop_least_recent()[0] == 1
    assert retained.pop_least_recent() is None
