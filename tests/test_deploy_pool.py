"""Two verifier replicas behind the shipped nginx pool config (docker/nginx/verifier-pool.conf),
run by a real nginx on loopback: each session is pinned to one replica, and a replica restarted
in the middle of a stream costs exactly one 409 resync while the output stays the target's; on
the pipelined-session wire, whose decided stream is long-lived, a replica killed mid-stream costs
one 404 and the session opened again on the next replica from the tokens the edge holds.

The replicas are real uvicorn servers on the tiny target (threads of this process, each with its
own event loop and port); the edge is the real speculative engine whose verifier client talks
HTTP to nginx. nginx's access log records, per request, the session header and the replica
that answered ($upstream_addr), so the routing itself is observed, not inferred.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from deploy_support import free_port, render_pool_config, running_nginx
from edge_agent.settings import EdgeSettings
from edge_agent.verifier_client import SESSION_HEADER
from edge_support import edge_app, generate_once, verifier_app
from gateway.affinity import chat_prefix_key
from gateway.protocol import SpadeStats
from servers import LoopbackServer, serve
from verifier_support import greedy_continuation

KEY = "pool-key-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The edge drafts"
MAX_TOKENS = 60
RESTART_BEFORE_POST = 4
"""The replica holding the session restarts after the stream's third verify call."""
ACCESS_LOG_FORMAT = "log_format routing '$request_method|$uri|$http_x_spade_session|$upstream_addr|$upstream_status|$http_x_spade_route';"


@dataclass
class Pool:
    url: str
    replicas: dict[str, LoopbackServer]
    access_log: Path
    tiny_pair: object

    def replica_at(self, addresses: str) -> str:
        """``127.0.0.1:PORT`` -> its replica's name; nginx lists every replica it tried."""
        names = {f"127.0.0.1:{server.port}": name for name, server in self.replicas.items()}
        return " > ".join(names[address.strip()] for address in addresses.split(","))

    def routes(self, skip: int = 0) -> list[tuple[str, str, str, str, str]]:
        """(method, path, session header, replica, status) per request, in order, after the
        first ``skip`` requests."""
        rows = []
        for line in self.access_log.read_text().splitlines()[skip:]:
            method, path, session, upstream, status, _ = line.split("|")
            rows.append((method, path, session, self.replica_at(upstream), status))
        return rows

    def replicas_by_route(self, skip: int = 0) -> dict[str, set[str]]:
        """Prefix key (X-Spade-Route) -> the replicas its requests reached, after ``skip`` requests."""
        replicas = defaultdict(set)
        for line in self.access_log.read_text().splitlines()[skip:]:
            _, _, _, upstream, _, route = line.split("|")
            if route not in ("", "-"):
                replicas[route].add(self.replica_at(upstream))
        return dict(replicas)

    def num_requests(self) -> int:
        return len(self.access_log.read_text().splitlines())

    def restart(self, name: str) -> None:
        """Stop replica ``name`` (if it runs) and start it again on its port, holding no sessions."""
        server = self.replicas[name]
        server.stop()
        server.start(replica_app(self.tiny_pair))


def replica_app(tiny_pair):
    """A replica serving both wires: the verify wire and the pipelined-session wire."""
    return verifier_app(tiny_pair, api_key=KEY, pipelined_sessions=True)


@pytest.fixture(scope="module")
def pool(tiny_pair, tmp_path_factory):
    replicas = {"verifier-a": LoopbackServer(), "verifier-b": LoopbackServer()}
    directory = tmp_path_factory.mktemp("nginx")
    listen_port = free_port()
    try:
        for server in replicas.values():
            server.start(replica_app(tiny_pair))
        config = render_pool_config(directory, listen_port, {name: server.port for name, server in replicas.items()})
        text = config.read_text().replace("http {\n", f"http {{\n    {ACCESS_LOG_FORMAT}\n")
        config.write_text(re.sub(r"access_log (\S+);", r"access_log \1 routing;", text))
        with running_nginx(config, listen_port) as url:
            yield Pool(url, replicas, directory / "access.log", tiny_pair)
    finally:
        for server in replicas.values():
            server.stop()


def metrics_of(server: LoopbackServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return {name: float(value) for name, value in re.findall(r"^(spade_verifier_\w+) (\S+)$", text, flags=re.MULTILINE)}


# --- pinning ----------------------------------------------------------------------------------


def test_requests_of_one_session_reach_one_replica_and_sessions_spread(pool):
    session_ids = [f"edge-{uuid.uuid4().hex}" for _ in range(32)]
    with httpx.Client(base_url=pool.url, headers=AUTH, timeout=30) as client:
        for _ in range(2):
            for session_id in session_ids:
                assert client.get("/health", headers={SESSION_HEADER: session_id}).status_code == 200
        for session_id in session_ids:  # the DELETE ending a session, without the header
            assert client.delete(f"/v1/sessions/{session_id}").status_code == 200
    replicas_of = defaultdict(set)
    for method, path, session, replica, _ in pool.routes():
        if session in session_ids:
            replicas_of[session].add(replica)
        elif method == "DELETE" and path.removeprefix("/v1/sessions/") in session_ids:
            replicas_of[path.removeprefix("/v1/sessions/")].add(replica)
    assert all(len(replicas) == 1 for replicas in replicas_of.values()) and len(replicas_of) == 32
    assert set().union(*replicas_of.values()) == {"verifier-a", "verifier-b"}  # all on one: p = 2^-31


# --- a replica restarted mid-stream -------------------------------------------------------------


class RestartingTransport(httpx.AsyncHTTPTransport):
    """The edge's real HTTP transport; before the verify POST numbered ``at`` it restarts the
    replica holding the session (in a thread, while the stream waits between two calls)."""

    def __init__(self, pool: Pool, at: int) -> None:
        super().__init__()
        self.pool, self.at = pool, at
        self.num_posts = 0
        self.before_restart: dict[str, dict[str, float]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/verify":
            self.num_posts += 1
            if self.num_posts == self.at:
                await asyncio.to_thread(self._restart_the_holder)
        return await super().handle_async_request(request)

    def _restart_the_holder(self) -> None:
        self.before_restart = {name: metrics_of(server) for name, server in self.pool.replicas.items()}
        holder = next(name for name, values in self.before_restart.items() if values["spade_verifier_sessions"] == 1)
        self.pool.restart(holder)


@dataclass(frozen=True)
class RestartedStream:
    prompt_ids: list[int]
    eos_token_ids: frozenset[int]
    token_ids: list[int]
    stats: SpadeStats
    before_restart: dict[str, dict[str, float]]
    after: dict[str, dict[str, float]]
    routes: list[tuple[str, str, str, str, str]]
    """This stream's requests through nginx."""


async def _stream_through_a_restart(pool: Pool) -> RestartedStream:
    transport = RestartingTransport(pool, RESTART_BEFORE_POST)
    earlier_requests = len(pool.routes())
    settings = EdgeSettings(draft_model=str(pool.tiny_pair.draft_dir), verifier_url=pool.url, draft_length="3", verifier_api_key=KEY)
    generation = await generate_once(settings, PROMPT, MAX_TOKENS, transport=transport)  # the session's DELETE awaited
    routes = [row for row in pool.routes(earlier_requests) if row[1] != "/health"]
    after = {name: metrics_of(server) for name, server in pool.replicas.items()}
    return RestartedStream(
        generation.prompt_ids, generation.eos_token_ids, generation.token_ids, generation.stats, transport.before_restart, after, routes
    )


@pytest.fixture(scope="module")
def restarted(pool, target_model) -> tuple[RestartedStream, list[int]]:
    stream = asyncio.run(_stream_through_a_restart(pool))
    return stream, greedy_continuation(target_model.model, stream.prompt_ids, MAX_TOKENS, stream.eos_token_ids)


def holder_of(stream: RestartedStream) -> str:
    return next(name for name, values in stream.before_restart.items() if values["spade_verifier_sessions"] == 1)


def test_the_output_through_the_restart_is_the_targets_own(restarted):
    stream, target_only = restarted
    assert stream.token_ids == target_only
    assert len(stream.token_ids) > 0 and stream.stats.verify_calls > RESTART_BEFORE_POST


def test_the_restart_cost_exactly_one_resync(restarted):
    stream, _ = restarted
    assert stream.stats.resyncs == 1
    holder = holder_of(stream)
    assert stream.after[holder]["spade_verifier_resyncs_total"] == 1
    assert stream.after[holder]["spade_verifier_verify_calls_total"] == stream.stats.verify_calls - (RESTART_BEFORE_POST - 1)


def test_every_call_of_the_stream_reached_the_replica_holding_the_session(restarted):
    stream, _ = restarted
    holder = holder_of(stream)
    other = ({"verifier-a", "verifier-b"} - {holder}).pop()
    assert stream.before_restart[holder]["spade_verifier_verify_calls_total"] == RESTART_BEFORE_POST - 1
    assert stream.before_restart[other]["spade_verifier_verify_calls_total"] == 0
    assert stream.after[other]["spade_verifier_verify_calls_total"] == 0
    posts = [(replica, status) for method, path, _, replica, status in stream.routes if method == "POST"]
    num_posts_after_restart = stream.stats.verify_calls - RESTART_BEFORE_POST + 1
    assert posts == [(holder, "200")] * (RESTART_BEFORE_POST - 1) + [(holder, "409")] + [(holder, "200")] * num_posts_after_restart
    assert len({session for method, _, session, _, _ in stream.routes if method == "POST"}) == 1


def test_the_session_ends_on_the_replica_holding_it(restarted):
    stream, _ = restarted
    holder = holder_of(stream)
    deletes = [(replica, status) for method, _, _, replica, status in stream.routes if method == "DELETE"]
    assert deletes == [(holder, "200")]
    assert {name: values["spade_verifier_sessions"] for name, values in stream.after.items()} == {"verifier-a": 0, "verifier-b": 0}


# --- routing by prefix: requests that share one meet -----------------------------------------------


def test_requests_sharing_a_prefix_meet_on_one_replica_and_prefixes_spread(pool):
    """Through a real edge and its OpenAI route: a chat's two turns, and two users under one
    system prompt, reach one replica (every call, and the DELETE); 16 system prompts spread.
    Last in the module: the restart tests count every verify call the replicas have served."""
    skip = pool.num_requests()
    shared_system = {"role": "system", "content": "You answer in one line."}
    turn_1 = [{"role": "user", "content": "The edge drafts"}]
    turn_2 = turn_1 + [{"role": "assistant", "content": "tokens"}, {"role": "user", "content": "and then?"}]
    user_a, user_b = [shared_system, {"role": "user", "content": "Hi"}], [shared_system, {"role": "user", "content": "Why?"}]
    others = [[{"role": "system", "content": f"You are assistant {index}."}, {"role": "user", "content": "Hi"}] for index in range(16)]
    with serve(edge_app(pool.tiny_pair, pool.url, verifier_api_key=KEY)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for messages in [turn_1, turn_2, user_a, user_b, *others]:
            client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    replicas = pool.replicas_by_route(skip)
    chat, system = chat_prefix_key(turn_1), chat_prefix_key(user_a)
    assert chat == chat_prefix_key(turn_2) and system == chat_prefix_key(user_b) and chat != system
    assert len(replicas[chat]) == 1 and len(replicas[system]) == 1
    other_keys = {chat_prefix_key(messages) for messages in others}
    assert len(other_keys) == 16 and all(len(replicas[key]) == 1 for key in other_keys)
    assert set().union(*(replicas[key] for key in other_keys)) == {"verifier-a", "verifier-b"}  # all on one: p = 2^-15
    sessions = defaultdict(set)
    for method, _, session, replica, _ in pool.routes(skip):
        if method in ("POST", "DELETE"):
            sessions[session].add(replica)
    assert len(sessions) == 20 and all(len(replicas_of_session) == 1 for replicas_of_session in sessions.values())


# --- the pipelined-session wire through the pool: a replica killed mid-stream ----------------------

RESTART_AT_SEEN = 8
"""The replica holding the session is killed before the first proposal that acknowledges this
many decided tokens: the edge holds them, and the verifier's session is gone with its process.
It stays down until the stream ends, so the pool moves the session to the next replica on its
ring, where the edge opens it again (a replica restarted in time would take it back instead)."""


class KillingTransport(httpx.AsyncHTTPTransport):
    """The edge's real HTTP transport; before the first proposal acknowledging ``at_seen``
    tokens it kills the replica holding the session (its decided stream breaks, as a crashed
    process's would). The test starts it again once the stream is over."""

    def __init__(self, pool: Pool, at_seen: int) -> None:
        super().__init__()
        self.pool, self.at_seen = pool, at_seen
        self.holder: str | None = None
        self.num_tokens_held_then = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.holder is None and request.method == "POST" and request.url.path.endswith("/proposals"):
            seen = json.loads(request.content)["seen"]
            if seen >= self.at_seen:
                self.num_tokens_held_then = seen
                await asyncio.to_thread(self._kill_the_holder)
        return await super().handle_async_request(request)

    def _kill_the_holder(self) -> None:
        sessions = {name: metrics_of(server)["spade_verifier_pipeline_sessions"] for name, server in self.pool.replicas.items()}
        self.holder = next(name for name, count in sessions.items() if count == 1)
        self.pool.replicas[self.holder].stop(force=True)


@dataclass(frozen=True)
class KilledStream:
    prompt_ids: list[int]
    eos_token_ids: frozenset[int]
    token_ids: list[int]
    stats: SpadeStats
    holder: str | None
    num_tokens_held_then: int
    routes: list[tuple[str, str, str, str, str]]
    after: dict[str, dict[str, float]]


async def _pipelined_stream_through_a_kill(pool: Pool) -> KilledStream:
    transport = KillingTransport(pool, RESTART_AT_SEEN)
    earlier_requests = len(pool.routes())
    settings = EdgeSettings(
        draft_model=str(pool.tiny_pair.draft_dir), verifier_url=pool.url, verifier_wire="pipelined", verifier_api_key=KEY
    )
    generation = await generate_once(settings, PROMPT, MAX_TOKENS, transport=transport)  # the session's DELETE awaited
    if transport.holder is not None:  # back, empty, for the tests after these
        await asyncio.to_thread(pool.restart, transport.holder)
    routes = [row for row in pool.routes(earlier_requests) if row[1] != "/health"]
    after = {name: metrics_of(server) for name, server in pool.replicas.items()}
    return KilledStream(
        generation.prompt_ids,
        generation.eos_token_ids,
        generation.token_ids,
        generation.stats,
        transport.holder,
        transport.num_tokens_held_then,
        routes,
        after,
    )


@pytest.fixture(scope="module")
def killed(pool, target_model) -> tuple[KilledStream, list[int]]:
    stream = asyncio.run(_pipelined_stream_through_a_kill(pool))
    return stream, greedy_continuation(target_model.model, stream.prompt_ids, MAX_TOKENS, stream.eos_token_ids)


def test_the_pipelined_output_through_the_kill_is_the_targets_own(killed):
    stream, target_only = killed
    assert stream.holder is not None and stream.num_tokens_held_then >= RESTART_AT_SEEN
    assert stream.token_ids == target_only and len(target_only) > RESTART_AT_SEEN


def other_replica(name: str) -> str:
    return ({"verifier-a", "verifier-b"} - {name}).pop()


def test_the_kill_cost_one_404_and_the_session_opened_once_more_on_the_next_replica(killed):
    stream, _ = killed
    assert stream.stats.resyncs == 1
    opens = [(replica, status) for method, path, _, replica, status in stream.routes if (method, path) == ("POST", "/v1/pipeline/sessions")]
    expected = [(stream.holder, "201"), (other_replica(stream.holder), "201")]
    assert [(replica.split(" > ")[-1], status) for replica, status in opens] == expected
    not_found = [(method, path.rsplit("/", 1)[-1]) for method, path, _, _, status in stream.routes if status == "404"]
    assert ("GET", "decided") in not_found
    assert all(method in ("GET", "POST") for method, _ in not_found)  # the stream's re-read, and proposals posted meanwhile


def test_every_call_of_the_pipelined_session_carried_its_id_and_reached_the_replica_holding_it(killed):
    """Up to the kill every call reached the replica holding the session; from the open on the
    next replica, every call reached that one (nginx lists the dead replica first where it tried it)."""
    stream, _ = killed
    assert {method for method, *_ in stream.routes} == {"POST", "GET", "DELETE"}
    assert len({session for _, _, session, _, _ in stream.routes}) == 1
    answered_by = [replica.split(" > ")[-1] for *_, replica, _ in stream.routes]
    reopened = [index for index, (method, path, *_) in enumerate(stream.routes) if (method, path) == ("POST", "/v1/pipeline/sessions")][1]
    assert set(answered_by[reopened:]) == {other_replica(stream.holder)}
    first_failover = next(index for index, (*_, replica, _) in enumerate(stream.routes) if " > " in replica)
    assert set(answered_by[:first_failover]) == {stream.holder}


def test_no_pipelined_session_is_left_on_either_replica(killed):
    stream, _ = killed
    deletes = [(replica, status) for method, _, _, replica, status in stream.routes if method == "DELETE"]
    assert deletes == [(other_replica(stream.holder), "200")]
    assert {name: values["spade_verifier_pipeline_sessions"] for name, values in stream.after.items()} == {"verifier-a": 0, "verifier-b": 0}


# --- the pipelined wire through nginx terminating TLS ------------------------------------------------


@pytest.fixture(scope="module")
def tls_pool(pool, tmp_path_factory):
    """The same replicas behind a second nginx that terminates TLS (a self-signed certificate for
    127.0.0.1, which the edge trusts through SSL_CERT_FILE, as httpx reads it): the remote-cloud
    deployment's front (docs/design.md, "A remote cloud")."""
    directory = tmp_path_factory.mktemp("nginx-tls")
    certificate, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(certificate)],
        check=True,
        capture_output=True,
    )
    listen_port = free_port()
    config = render_pool_config(directory, listen_port, {name: server.port for name, server in pool.replicas.items()})
    served = directory / "verifier-pool.conf"
    listen = f"listen 127.0.0.1:{listen_port};"
    tls = f"listen 127.0.0.1:{listen_port} ssl;\n    ssl_certificate {certificate};\n    ssl_certificate_key {key};"
    served.write_text(served.read_text().replace(listen, tls))
    with running_nginx(config, listen_port):
        yield f"https://127.0.0.1:{listen_port}", certificate


def test_a_pipelined_stream_through_nginx_terminating_tls_is_the_targets_own(tls_pool, pool, target_model, monkeypatch):
    url, certificate = tls_pool
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate))
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # over TLS, trusting the certificate

    settings = EdgeSettings(draft_model=str(pool.tiny_pair.draft_dir), verifier_url=url, verifier_wire="pipelined", verifier_api_key=KEY)
    generation = asyncio.run(generate_once(settings, PROMPT, MAX_TOKENS))
    assert generation.token_ids == greedy_continuation(target_model.model, generation.prompt_ids, MAX_TOKENS, target_model.eos_token_ids)
    assert generation.stats.verify_calls > 0 and generation.stats.resyncs == 0
