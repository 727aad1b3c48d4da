"""A verifier pool on loopback for the pool benchmark: two verifier replicas (subprocesses), the
shipped nginx pool config in front of them (``spade_bench.nginx_pool``) and one edge pointing at
nginx. Everything started is stopped when the ``running_pool`` block ends, on an error too.

nginx's access log records, per request, the session header and the replica that answered
(``$upstream_addr``), so the split of requests over the replicas is observed, not inferred.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spade_bench.nginx_pool import render_pool_config, running_nginx
from spade_bench.services import Service, ServiceSpec, edge_command, free_port, verifier_command

REPLICAS = ("verifier-a", "verifier-b")
"""The replica names of docker/nginx/verifier-pool.conf."""
LOG_FORMAT = "$request_method|$uri|$http_x_spade_session|$upstream_addr"


@dataclass(frozen=True)
class PoolSpec:
    """What to run: the models, how they run, and how nginx routes."""

    draft: str
    target: str
    log_dir: Path
    """Service logs and nginx's files (config, access log) go here."""
    route_by_prefix: bool = True
    """True: the shipped config (X-Spade-Route, else the session); False: by session alone."""
    dtype: str = "float32"
    draft_length: str = "3"
    threads: int = 1
    """Torch threads of each service."""
    startup_timeout_s: float = 300.0

    @property
    def routing(self) -> str:
        return "prefix" if self.route_by_prefix else "session"


@dataclass
class Pool:
    edge_url: str
    replicas: dict[str, Service]
    access_log: Path

    def replica_metrics(self) -> dict[str, dict[str, float]]:
        """Each replica's /metrics (summed over label sets)."""
        return {name: service.metrics() for name, service in self.replicas.items()}

    def num_logged(self) -> int:
        """Requests nginx has logged so far (a mark for ``sessions_per_replica``)."""
        return len(self.access_log.read_text().splitlines()) if self.access_log.exists() else 0

    def sessions_per_replica(self, skip: int = 0) -> dict[str, int]:
        """Replica -> sessions whose verify calls it answered, after the first ``skip`` requests.

        One session is one chat request of the edge; a session seen on two replicas (one moved
        by a failure) counts on both."""
        names = {f"127.0.0.1:{service.spec.port}": name for name, service in self.replicas.items()}
        sessions = defaultdict(set)
        for line in self.access_log.read_text().splitlines()[skip:]:
            method, uri, session, upstreams = line.split("|")
            if method == "POST" and uri == "/v1/verify":
                for address in upstreams.split(","):
                    sessions[names[address.strip()]].add(session)
        return {name: len(sessions[name]) for name in self.replicas}


@contextlib.contextmanager
def running_pool(spec: PoolSpec, nginx: str) -> Iterator[Pool]:
    """Start the replicas and the edge at once, nginx once every replica answers; yield the pool
    when the edge is ready (it waits for its verifier, nginx, by itself).

    nginx starts only after the replicas: a replica that refused nginx's first call would be
    skipped for the config's fail_timeout, and its keys would land on the other."""
    directory = spec.log_dir / f"nginx-{spec.routing}"
    directory.mkdir(parents=True, exist_ok=True)
    listen_port = free_port()
    with contextlib.ExitStack() as stack:
        replicas = {
            name: stack.enter_context(_service(spec, name, verifier_command(spec.target, None, spec.dtype, spec.threads)))
            for name in REPLICAS
        }
        nginx_url = f"http://127.0.0.1:{listen_port}"
        edge = stack.enter_context(
            _service(spec, "edge", edge_command(spec.draft, None, spec.dtype, spec.threads, nginx_url, spec.draft_length))
        )
        for service in replicas.values():
            service.wait_healthy(spec.startup_timeout_s)
        ports = {name: service.spec.port for name, service in replicas.items()}
        config = render_pool_config(directory, listen_port, ports, route_by_prefix=spec.route_by_prefix, log_format=LOG_FORMAT)
        stack.enter_context(running_nginx(config, listen_port, nginx))
        edge.wait_healthy(spec.startup_timeout_s)
        yield Pool(edge.url, replicas, directory / "access.log")


def _service(spec: PoolSpec, name: str, command: tuple[str, ...]) -> Service:
    """A started service process on every core this process may use (stop it: a context manager)."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return Service(ServiceSpec(f"{spec.routing}-{name}", command, cores, spec.threads, spec.log_dir)).start()
