"""The prefix store's index (``backends.transformers.prefix_store``), without a model: the
longest cached prefix (found by whole blocks, then token by token), namespaces that never meet, hits checked token by token
(a hash collision is a miss), sources that change, and retained sources bounded, least recently
used out first, with live ones never dropped."""

from __future__ import annotations

import pytest

from verifier_service.backends.transformers import prefix_store
from verifier_service.backends.transformers.prefix_store import BLOCK_TOKENS, PrefixHit, PrefixStore
from verifier_service.prefix_sharing import prefix_namespace

B = BLOCK_TOKENS


def tokens(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_prefix_is_found_by_whole_blocks_then_runs_token_by_token_capped_by_max_tokens():
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("a", "ns", tokens(0, 3 * B + 5))
    context = tokens(0, 2 * B + 3) + [99_999] * B
    assert store.longest_prefix("ns", context, len(context) - 1) == PrefixHit("a", 2 * B + 3)
    assert store.longest_prefix("ns", tokens(0, 4 * B), 3 * B - 1) == PrefixHit("a", 3 * B - 1)
    assert store.longest_prefix("ns", tokens(0, 4 * B), 4 * B - 1) == PrefixHit("a", 3 * B + 5)  # the source's partial block too
    assert store.longest_prefix("ns", tokens(0, B), B - 1) is None  # less than a block to reuse
    assert store.longest_prefix("ns", [7] + tokens(1, 3 * B), 3 * B) is None  # differs in the first block


def test_the_deepest_source_wins():
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("short", "ns", tokens(0, B))
    store.publish("long", "ns", tokens(0, 3 * B))
    assert store.longest_prefix("ns", tokens(0, 4 * B), 4 * B - 1) == PrefixHit("long", 3 * B)


def test_namespaces_never_share():
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("a", prefix_namespace("per-key", "key-1", None), tokens(0, 2 * B))
    same_key = prefix_namespace("per-key", "key-1", None)
    assert store.longest_prefix(same_key, tokens(0, 3 * B), 3 * B - 1) == PrefixHit("a", 2 * B)
    for other in (prefix_namespace("per-key", "key-2", None), prefix_namespace("per-key", "key-1", "salt")):
        assert store.longest_prefix(other, tokens(0, 3 * B), 3 * B - 1) is None


def test_the_sharing_modes_namespaces():
    assert prefix_namespace("off", "key-1", "salt") is None
    assert prefix_namespace("global", "key-1", "s") == prefix_namespace("global", "key-2", "s")
    assert prefix_namespace("per-key", "key-1", "s") != prefix_namespace("per-key", "key-2", "s")
    assert prefix_namespace("per-key", "", None) == prefix_namespace("global", "", None)  # no keys: one tenant
    # The parts are framed: a key id ending like a salt cannot forge another (key, salt) pair.
    assert prefix_namespace("per-key", "k", "1x") != prefix_namespace("per-key", "k1", "x")
    with pytest.raises(ValueError):
        prefix_namespace("everyone", "", None)  # type: ignore[arg-type]


def test_a_hash_collision_is_a_miss_never_a_wrong_cache(monkeypatch):
    # Every block of every sequence gets the same keys: only the token check tells them apart.
    monkeypatch.setattr(prefix_store, "extended_chain", lambda keys, namespace, token_ids, num_blocks: [b"same"] * num_blocks)
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("a", "ns", tokens(0, 2 * B))
    assert store.longest_prefix("ns", tokens(1000, 3 * B), 3 * B - 1) is None
    assert store.longest_prefix("ns", tokens(0, B) + tokens(1000, 2 * B), 3 * B - 1) == PrefixHit("a", B)


def test_a_source_that_grows_or_is_cut_is_indexed_by_what_it_holds_now():
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("a", "ns", tokens(0, B + 2))
    store.publish("a", "ns", tokens(0, 3 * B))  # a verify call committed more
    assert store.longest_prefix("ns", tokens(0, 4 * B), 4 * B - 1) == PrefixHit("a", 3 * B)
    store.publish("a", "ns", tokens(0, B) + tokens(500, 2 * B))  # its context diverged after one block
    assert store.longest_prefix("ns", tokens(0, 4 * B), 4 * B - 1) == PrefixHit("a", B)
    store.withdraw("a")
    assert store.longest_prefix("ns", tokens(0, 4 * B), 4 * B - 1) is None
    assert store.num_sources == 0


def test_retained_sources_are_bounded_least_recently_used_out_first():
    store = PrefixStore(max_retained_tokens=6 * B)
    for name, start in (("x", 0), ("y", 1000), ("z", 2000)):
        store.publish(name, "ns", tokens(start, 2 * B))
        assert store.retain(name) == []
    assert store.num_retained_tokens == 6 * B
    store.longest_prefix("ns", tokens(0, 3 * B), 3 * B - 1)  # x is used: y is now the oldest
    store.publish("w", "ns", tokens(3000, 2 * B))
    assert store.retain("w") == ["y"]  # 8 blocks held against a bound of 6: the oldest goes
    assert store.num_retained_tokens == 6 * B
    assert store.shrink_retained(2 * B) == ["z", "x"]
    assert store.longest_prefix("ns", tokens(0, 3 * B), 3 * B - 1) is None
    assert store.longest_prefix("ns", tokens(3000, 3 * B), 3 * B - 1) == PrefixHit("w", 2 * B)


def test_live_sources_never_count_and_are_never_dropped():
    store = PrefixStore(max_retained_tokens=0)
    store.publish(("live", "s"), "ns", tokens(0, 4 * B))
    assert store.shrink_retained(0) == []
    assert store.num_retained_tokens == 0
    assert store.longest_prefix("ns", tokens(0, 5 * B), 5 * B - 1) == PrefixHit(("live", "s"), 4 * B)


def test_a_retained_source_that_another_extends_adds_nothing_and_goes():
    store = PrefixStore(max_retained_tokens=10_000)
    store.publish("turn-1", "ns", tokens(0, 2 * B + 3))
    store.retain("turn-1")
    store.publish("turn-2", "ns", tokens(0, 5 * B))  # the conversation's next turn, prefix included
    assert store.retain("turn-2") == ["turn-1"]
    assert store.num_retained_tokens == 5 * B
    store.publish("other", "other-ns", tokens(0, B))  # the same tokens elsewhere are not covered
    assert store.retain("other") == []


def test_a_source_too_large_for_the_bound_is_dropped_at_once():
    store = PrefixStore(max_retained_tokens=B)
    store.publish("big", "ns", tokens(0, 2 * B))
    assert store.retain("big") == ["big"]
    assert store.num_sources == 0
