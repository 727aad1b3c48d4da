"""Sessions belong to the key that created them, and /health tells strangers only the status.

With keys configured, each key has its own namespace of verifier sessions (filed under a hash of
the key): another key's session is simply unknown (409 like any unknown session, ``deleted:
false``), and no 409 says anything of a session's contents. Rotating the edge's key mid-session
costs one resync: the session is unknown under the new key and the edge resends its context."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from edge_agent.app import build_engine
from edge_agent.drafter import DraftBlock
from edge_agent.metrics import EdgeMetrics
from edge_agent.settings import EdgeSettings
from edge_agent.verifier_client import ClientSettings, VerifierClient, VerifierKeyError, VerifierSession
from edge_support import edge_app
from gateway.security import key_id
from servers import serve
from spade_core.params import SamplingConfig
from verifier_support import committed_after, new_session_id, random_tokens, verifier_app, verify_body

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"


@pytest.fixture(scope="module")
def urls(tiny_pair):
    with serve(verifier_app(tiny_pair, api_key=f"{KEY_A},{KEY_B}")) as verifier_url:
        with serve(edge_app(tiny_pair, verifier_url, verifier_api_key=KEY_A, api_key=KEY_A)) as edge_url:
            yield verifier_url, edge_url


def _post(url: str, body: dict, key: str) -> httpx.Response:
    return httpx.post(url + "/v1/verify", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def _opened(url: str, key: str) -> tuple[str, list[int]]:
    """A session opened under ``key``: its id and its committed context."""
    session_id, context = new_session_id(), random_tokens(random.Random(7), 8, 300)
    answer = _post(url, verify_body(session_id, [], [5], new_tokens=context), key).json()
    return session_id, committed_after(context, [5], answer)


def test_another_keys_session_is_unknown_with_409(urls):
    session_id, committed = _opened(urls[0], KEY_A)
    error = _post(urls[0], verify_body(session_id, committed, [6]), KEY_B).json()["error"]
    assert (error["code"], error["message"]) == (
        "session_resync_required",
        f"unknown session {session_id!r}: resend the full context with prefix_length 0",
    )


def test_the_owner_still_continues_its_session(urls):
    session_id, committed = _opened(urls[0], KEY_A)
    _post(urls[0], verify_body(session_id, committed, [6]), KEY_B)
    assert _post(urls[0], verify_body(session_id, committed, [6]), KEY_A).status_code == 200


def test_another_key_cannot_delete_a_session(urls):
    session_id, committed = _opened(urls[0], KEY_A)
    deleted = httpx.delete(f"{urls[0]}/v1/sessions/{session_id}", headers={"authorization": f"Bearer {KEY_B}"}, timeout=60).json()
    assert (deleted["deleted"], _post(urls[0], verify_body(session_id, committed, [6]), KEY_A).status_code) == (False, 200)


def test_the_owner_deletes_its_session(urls):
    session_id, _ = _opened(urls[0], KEY_A)
    deleted = httpx.delete(f"{urls[0]}/v1/sessions/{session_id}", headers={"authorization": f"Bearer {KEY_A}"}, timeout=60).json()
    assert deleted["deleted"] is True


def test_a_diverged_session_409_discloses_nothing_of_its_contents(urls):
    session_id, committed = _opened(urls[0], KEY_A)
    error = _post(urls[0], verify_body(session_id, committed[:-1], [6]), KEY_A).json()["error"]
    assert (error["code"], error["message"]) == (
        "session_resync_required",
        f"session {session_id!r} does not hold the committed context that prefix_length and prefix_digest describe: "
        "resend the full context with prefix_length 0",
    )


def test_a_key_id_is_a_hash_that_does_not_contain_the_key():
    assert (KEY_A not in key_id(KEY_A.encode()), key_id(KEY_A.encode()) != key_id(KEY_B.encode())) == (True, True)


async def _rotate_mid_session(verifier_url: str) -> tuple[bool, bool, int, int]:
    """One session verified under key A, then continued by a client holding key B (the edge after
    a key rotation): (resynced before, after, verifier length after, expected length)."""
    context = random_tokens(random.Random(9), 8, 300)
    greedy = SamplingConfig(temperature=0)
    old = VerifierClient(verifier_url, ClientSettings(api_key=KEY_A))
    new = VerifierClient(verifier_url, ClientSettings(api_key=KEY_B))
    try:
        session = old.open_session()
        first = await session.verify(context, DraftBlock([5], None), greedy)
        context += [5][: first.verdict.num_accepted] + [first.verdict.next_token]
        rotated = VerifierSession(new, session.session_id, session.verifier_length, True, session.checked_digest)
        second = await rotated.verify(context, DraftBlock([6], None), greedy)
        return first.resynced, second.resynced, rotated.verifier_length, len(context) + second.verdict.num_accepted + 1
    finally:
        await old.aclose()
        await new.aclose()


def test_after_a_key_rotation_the_edge_resyncs_the_session_under_the_new_key(urls):
    resynced_before, resynced_after, length, expected = asyncio.run(_rotate_mid_session(urls[0]))
    assert (resynced_before, resynced_after, length) == (False, True, expected)


# --- a fair share of the session table per key ------------------------------------------------


def test_one_key_opening_many_sessions_never_evicts_another_keys_session(tiny_pair):
    # A table of 4 sessions shared by two keys: key B opening 10 sessions churns its own oldest,
    # key A's session is kept and continues without a resync.
    with serve(verifier_app(tiny_pair, api_key=f"{KEY_A},{KEY_B}", max_sessions=4)) as url:
        a_session, a_committed = _opened(url, KEY_A)
        b_opened = [_opened(url, KEY_B) for _ in range(10)]
        assert _post(url, verify_body(a_session, a_committed, [6]), KEY_A).status_code == 200
        b_statuses = [_post(url, verify_body(sid, committed, [6]), KEY_B).status_code for sid, committed in b_opened]
    assert b_statuses[:7] == [409] * 7 and b_statuses[7:] == [200] * 3  # B kept its newest 3, its share


# --- /health: the status for strangers, the details with a key -------------------------------


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no_key", "wrong_key"])
@pytest.mark.parametrize("service", [0, 1], ids=["verifier", "edge"])
def test_health_tells_a_caller_without_a_key_only_the_status(urls, service, key):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(urls[service] + "/health", headers=headers, timeout=30)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_health_gives_a_caller_with_a_key_the_details(urls):
    verifier, edge = (httpx.get(url + "/health", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30).json() for url in urls)
    assert ({"model", "vocab_size", "tokenizer_fingerprint"} <= set(verifier), {"verifier_url", "draft_model", "model"} <= set(edge)) == (
        True,
        True,
    )


def test_health_without_keys_configured_gives_anyone_the_details(tiny_pair):
    with serve(verifier_app(tiny_pair)) as url:
        assert "model" in httpx.get(url + "/health", timeout=30).json()


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no_key", "wrong_key"])
async def test_an_edge_without_a_valid_verifier_key_stops_its_start_up_naming_the_flag(tiny_pair, urls, key):
    settings = EdgeSettings(draft_model=str(tiny_pair.draft_dir), verifier_url=urls[0], verifier_api_key=key)
    with pytest.raises(VerifierKeyError, match="--verifier-api-key"):
        await build_engine(settings, EdgeMetrics())
