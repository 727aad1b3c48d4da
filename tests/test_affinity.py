"""The prefix key (gateway.affinity): requests that share a first block share a key, others
do not; the edge sends it on every call of the request's session (X-Spade-Route)."""

from __future__ import annotations

import httpx

from edge_agent.verifier_client import ROUTE_HEADER, SESSION_HEADER, ClientSettings, VerifierClient
from gateway.affinity import FIRST_BLOCK_TOKENS, chat_prefix_key, prompt_prefix_key, route_key
from verifier_service.protocol import VerifyRequest, WireSampling

SYSTEM = {"role": "system", "content": "You are terse."}


def test_a_chats_turns_share_the_key_of_its_first_message():
    turn_1 = [{"role": "user", "content": "Hello"}]
    turn_2 = turn_1 + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}]
    assert chat_prefix_key(turn_1) == chat_prefix_key(turn_2)
    assert chat_prefix_key(turn_1) != chat_prefix_key([{"role": "user", "content": "Hello!"}])


def test_users_of_one_system_prompt_share_its_key_and_other_prompts_do_not():
    user_a, user_b = [SYSTEM, {"role": "user", "content": "a"}], [SYSTEM, {"role": "user", "content": "b"}]
    assert chat_prefix_key(user_a) == chat_prefix_key(user_b)
    assert chat_prefix_key(user_a) != chat_prefix_key([{"role": "system", "content": "You are verbose."}, {"role": "user", "content": "a"}])
    # The same text in another role is another prefix.
    assert chat_prefix_key([SYSTEM]) != chat_prefix_key([{"role": "user", "content": SYSTEM["content"]}])
    assert chat_prefix_key([]) is None


def test_a_completion_prompt_is_keyed_by_its_first_block():
    prompt = list(range(FIRST_BLOCK_TOKENS))
    assert prompt_prefix_key(prompt + [1, 2]) == prompt_prefix_key(prompt + [3])
    assert prompt_prefix_key([9] + prompt[1:]) != prompt_prefix_key(prompt)
    assert prompt_prefix_key([]) is None


def test_a_salt_separates_prefixes_that_may_not_be_shared():
    key = chat_prefix_key([SYSTEM])
    assert route_key(key, "tenant-a") != route_key(key, "tenant-b")
    assert route_key(key, "tenant-a") == route_key(key, "tenant-a") != key
    assert route_key(key, None) == key and route_key(None, "tenant-a") is None


async def test_every_call_and_the_delete_of_a_session_carry_its_route_key():
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})

    client = VerifierClient("http://verifier", ClientSettings(), transport=httpx.MockTransport(answer))
    keyed, plain = client.open_session(route_key="abc"), client.open_session()
    await client.post_verify(_body(keyed.session_id), keyed.routing_headers)
    keyed.has_called = plain.has_called = True
    keyed.close()
    plain.close()
    await client.aclose()
    assert [(r.method, r.headers.get(ROUTE_HEADER), r.headers[SESSION_HEADER]) for r in seen] == [
        ("POST", "abc", keyed.session_id),
        ("DELETE", "abc", keyed.session_id),
        ("DELETE", None, plain.session_id),
    ]


def _body(session_id: str) -> VerifyRequest:
    return VerifyRequest(session_id=session_id, prefix_length=0, prefix_digest="", new_tokens=[1], draft_tokens=[], sampling=WireSampling())
