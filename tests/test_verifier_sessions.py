"""Session eviction: least recently used beyond the session count or the token budget, and
idle sessions past their TTL; an evicted session is answered 409 (resync). Through the app with
small limits, and on the registry alone.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import OverloadedError
from servers import wait_until
from verifier_service.app import sweep_interval_s
from verifier_service.kv_budget import KvBudget
from verifier_service.sessions import SessionLimits, SessionRegistry, fair_share
from verifier_support import (
    Session,
    committed_after,
    open_session,
    post_verify,
    random_tokens,
    running_verifier,
    verify,
    verify_body,
)

# --- eviction: LRU and TTL --------------------------------------------------------------------


def follow_up_status(client, session: Session) -> int:
    return post_verify(client, verify_body(session.session_id, session.committed, [5])).status_code


def test_least_recently_used_session_is_evicted_beyond_max_sessions(tiny_pair, vocab_size):
    rng = random.Random(28)
    with running_verifier(tiny_pair, max_sessions=2) as client:
        first, second, third = (open_session(client, random_tokens(rng, 6, vocab_size), [5]) for _ in range(3))
        assert [follow_up_status(client, s) for s in (first, second, third)] == [409, 200, 200]


def test_a_recently_used_session_is_kept_over_an_older_one(tiny_pair, vocab_size):
    rng = random.Random(29)
    with running_verifier(tiny_pair, max_sessions=2) as client:
        first, second = (open_session(client, random_tokens(rng, 6, vocab_size), [5]) for _ in range(2))
        answer = verify(client, verify_body(first.session_id, first.committed, [5]))
        first.committed = committed_after(first.committed, [5], answer)
        third = open_session(client, random_tokens(rng, 6, vocab_size), [5])
        assert [follow_up_status(client, s) for s in (second, first, third)] == [409, 200, 200]


def test_sessions_are_evicted_beyond_the_total_token_budget(tiny_pair, vocab_size):
    rng = random.Random(30)
    with running_verifier(tiny_pair, max_session_tokens=30) as client:
        first, second = (open_session(client, random_tokens(rng, 20, vocab_size), [5]) for _ in range(2))
        assert [follow_up_status(client, s) for s in (first, second)] == [409, 200]


def test_idle_session_past_its_ttl_is_answered_409(tiny_pair, vocab_size):
    with running_verifier(tiny_pair, session_ttl_s=0.05) as client:
        session = open_session(client, random_tokens(random.Random(31), 6, vocab_size), [5])
        time.sleep(0.1)  # longer than the TTL, however slow the machine
        assert follow_up_status(client, session) == 409


def test_idle_session_past_its_ttl_is_evicted_by_other_traffic(tiny_pair, vocab_size):
    rng = random.Random(32)
    with running_verifier(tiny_pair, session_ttl_s=0.05) as client:
        idle = open_session(client, random_tokens(rng, 6, vocab_size), [5])
        time.sleep(0.1)
        open_session(client, random_tokens(rng, 6, vocab_size), [5])
        assert client.delete(f"/v1/sessions/{idle.session_id}").json()["deleted"] is False


def test_idle_session_past_its_ttl_is_dropped_with_its_kv_when_no_call_comes(tiny_pair, vocab_size):
    with running_verifier(tiny_pair, session_ttl_s=0.2) as client:
        open_session(client, random_tokens(random.Random(33), 6, vocab_size), [5])
        assert held(client) == (1, True)
        # No other call reaches this verifier: its sweep (every TTL / 4) drops the session.
        assert wait_until(lambda: held(client) == (0, False), timeout_s=30)


def held(client) -> tuple[int, bool]:
    """(sessions held, whether any KV cache bytes are held) from /metrics."""
    values = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    return int(values["spade_verifier_sessions"]), values["spade_verifier_kv_cache_bytes"] > 0


def test_the_sweep_runs_a_quarter_ttl_apart_and_at_least_every_minute():
    assert sweep_interval_s(0.2) == pytest.approx(0.05)
    assert sweep_interval_s(600.0) == 60.0


# --- fair shares per owner (API key), pure ---------------------------------------------------


def test_fair_share_splits_capacity_among_the_owners_holding_some():
    assert fair_share(256, {}, "") == 256
    assert fair_share(256, {"a": 200}, "a") == 256
    assert fair_share(256, {"a": 200}, "b") == 128
    assert fair_share(10, {"a": 1, "b": 1}, "c") == 4


def test_an_owner_at_its_share_with_every_session_busy_gets_429_and_others_still_get_in():
    registry = SessionRegistry(SessionLimits(max_sessions=4))
    a_sessions = [registry.get_or_create(f"a{i}", "a") for i in range(2)]
    b_sessions = [registry.get_or_create(f"b{i}", "b") for i in range(2)]
    busy = [asyncio.run(_acquired(session.lock)) for session in b_sessions]
    assert all(busy)
    with pytest.raises(OverloadedError, match="share of the verifier's sessions"):
        registry.get_or_create("b-new", "b")
    for session in a_sessions:  # a may still replace its own: it has idle sessions
        assert not session.lock.locked()
    registry.get_or_create("a-new", "a")
    assert registry.evict(keep="a-new") == ["a0"]  # a's own oldest goes, never one of b's


def test_without_keys_the_table_stays_least_recently_used():
    registry = SessionRegistry(SessionLimits(max_sessions=2))
    for name in ("x", "y", "z"):
        registry.get_or_create(name)
    assert registry.evict(keep="z") == ["x"]


def test_kv_room_is_never_taken_from_an_owner_within_its_share():
    registry = SessionRegistry(SessionLimits(), KvBudget(bytes_per_token=1, max_bytes=100))
    a_session, b_session = registry.get_or_create("a", "a"), registry.get_or_create("b", "b")
    a_session.token_ids, b_session.token_ids = list(range(30)), list(range(60))
    c_session = registry.get_or_create("c", "c")
    # 120 tokens asked of 100: a (30, within a third) is the least recently used but stays;
    # b (60, over its third) gives way.
    assert registry.reserve(c_session, 30) == ["b"]
    c_session.reserved_tokens, c_session.token_ids = 0, list(range(30))
    with pytest.raises(OverloadedError, match="within their share"):  # a and c hold 30 each: within a third
        registry.reserve(registry.get_or_create("d", "d"), 60)
    assert {"a", "c"} <= set(registry.owner_counts())


async def _acquired(lock: asyncio.Lock) -> bool:
    await lock.acquire()
    return lock.locked()


# --- the session registry, pure ---------------------------------------------------------------


def registry_with(limits: SessionLimits, sizes: dict[str, int]) -> SessionRegistry:
    """A registry holding sessions of the given token counts, created in that order."""
    registry = SessionRegistry(limits)
    for session_id, size in sizes.items():
        registry.get_or_create(session_id).token_ids = list(range(size))
    return registry


def test_registry_evicts_the_least_recently_used_beyond_max_sessions():
    registry = registry_with(SessionLimits(max_sessions=2), {"a": 1, "b": 1, "c": 1})
    registry.get("a")
    assert (registry.evict(keep="c"), registry.get("b")) == (["b"], None)


def test_registry_never_evicts_the_session_being_served():
    registry = registry_with(SessionLimits(max_sessions=1), {"a": 1, "b": 1})
    assert registry.evict(keep="a") == ["b"]


def test_registry_evicts_oldest_sessions_until_under_the_token_budget():
    registry = registry_with(SessionLimits(max_total_tokens=10), {"a": 4, "b": 4, "c": 4})
    assert (registry.evict(keep="c"), registry.num_tokens) == (["a"], 8)


def test_registry_does_not_return_a_session_idle_past_its_ttl():
    registry = registry_with(SessionLimits(ttl_s=60.0), {"a": 1})
    registry.get("a").last_used -= 61.0
    assert registry.get("a") is None


def test_registry_evicts_sessions_idle_past_their_ttl():
    registry = registry_with(SessionLimits(ttl_s=60.0), {"a": 1, "b": 1, "c": 1})
    registry.get("a").last_used -= 61.0
    registry.get("b").last_used -= 61.0
    assert (registry.evict(keep="c"), len(registry)) == (["a", "b"], 1)


def test_registry_replaces_an_expired_session_with_a_fresh_one():
    registry = registry_with(SessionLimits(ttl_s=60.0), {"a": 5})
    registry.get("a").last_used -= 61.0
    assert registry.get_or_create("a").token_ids == []


@pytest.mark.parametrize("bad", [dict(max_sessions=0), dict(max_total_tokens=0), dict(ttl_s=0.0)])
def test_session_limits_refuse_non_positive_values(bad):
    with pytest.raises(ValueError):
        SessionLimits(**bad)
