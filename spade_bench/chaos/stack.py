"""The processes of a chaos run, each restartable at its own address: two verifier replicas, the
shipped nginx pool config in front of them, the edges (the first ``num_linked_edges`` reach nginx
through a fault proxy and a delay proxy, the rest directly), and a way to start one more edge of
another wire version."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from spade_bench.chaos.plan import ChaosConfig
from spade_bench.fault_proxy import FaultProxy
from spade_bench.loopback import LoopbackServer
from spade_bench.nginx_pool import render_pool_config
from spade_bench.proxy import LinkConfig, ProxyThread
from spade_bench.services import Service, ServiceSpec, edge_command, free_port, verifier_command

logger = logging.getLogger(__name__)

REPLICAS = ("verifier-a", "verifier-b")
"""The replica names of docker/nginx/verifier-pool.conf."""
KV_BYTES_PER_TOKEN_TINY = 512
"""The tiny target's KV bytes per token (2 layers x 2 KV heads x 16 dims x K and V x 4 bytes)."""


@dataclass(frozen=True)
class Models:
    target: str
    draft: str


@dataclass
class Link:
    """A linked edge's way to the pool: edge -> fault proxy (HTTP, rewrites) -> delay proxy (TCP:
    delay, jitter, cut) -> nginx."""

    fault_proxy: FaultProxy
    fault_server: LoopbackServer
    delay: ProxyThread

    @property
    def url(self) -> str:
        return self.fault_server.url

    def close(self) -> None:
        self.fault_server.stop()
        self.delay.close()


class Nginx:
    """nginx in the foreground on the rendered pool config, restartable on the same port."""

    def __init__(self, binary: str, directory: Path, replica_ports: dict[str, int]) -> None:
        self.binary = binary
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.config = render_pool_config(directory, self.port, replica_ports)
        self.process: subprocess.Popen | None = None
        self.log = directory / "nginx.stderr.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def start(self, timeout_s: float = 30.0) -> None:
        with self.log.open("a") as stderr:
            self.process = subprocess.Popen([self.binary, "-c", str(self.config), "-p", str(self.config.parent)], stderr=stderr)
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("nginx did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Stack:
    """Everything running; ``replicas`` and ``edges`` are replaced in place when restarted."""

    config: ChaosConfig
    models: Models
    log_dir: Path
    replicas: dict[str, Service] = field(default_factory=dict)
    edges: list[Service] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    nginx: Nginx | None = None
    load_times_s: dict[str, float] = field(default_factory=dict)
    """Seconds from a start to healthy, per service (the first start): the recovery bound's base."""

    def replica_spec(self, name: str) -> ServiceSpec:
        budget = self.config.kv_budget_contexts * self.config.context_limit * KV_BYTES_PER_TOKEN_TINY
        command = verifier_command(self.models.target, None, "float32", 1)
        command += ("--max-kv-cache-bytes", str(budget), "--session-ttl-s", str(self.config.session_ttl_s))
        command += ("--audit-log", str(self.audit_path(name)))
        return ServiceSpec(name, command, _all_cores(), 1, self.log_dir)

    def edge_spec(self, index: int, verifier_url: str) -> ServiceSpec:
        command = edge_command(self.models.draft, None, "float32", 1, verifier_url, "auto")
        command += ("--max-concurrent-requests", str(self.config.max_concurrent_requests))
        return ServiceSpec(f"edge-{index:02d}", command, _all_cores(), 1, self.log_dir)

    def audit_path(self, replica: str) -> Path:
        """Where ``replica`` records its verdicts (``--audit-log``), restarts appending."""
        return self.log_dir / f"audit-{replica}.jsonl"

    @property
    def edge_urls(self) -> list[str]:
        return [edge.url for edge in self.edges]

    def start(self, nginx_binary: str, timeout_s: float) -> None:
        started = time.monotonic()
        self.replicas = {name: Service(self.replica_spec(name)).start() for name in REPLICAS}
        for name, service in self.replicas.items():
            service.wait_healthy(timeout_s)
            self.load_times_s[name] = time.monotonic() - started
        self.nginx = Nginx(nginx_binary, self.log_dir / "nginx", {name: s.spec.port for name, s in self.replicas.items()})
        self.nginx.start()
        for index in range(self.config.num_linked_edges):
            self.links.append(_start_link(self.nginx.port, seed=self.config.seed + index))
        started = time.monotonic()
        for index in range(self.config.num_edges):
            url = self.links[index].url if index < len(self.links) else self.nginx.url
            self.edges.append(Service(self.edge_spec(index, url)).start())
        for edge in self.edges:
            edge.wait_healthy(timeout_s)
        self.load_times_s["edges"] = time.monotonic() - started

    def processes(self) -> dict[str, int]:
        """Name -> pid of every live process of the stack (nginx: its master)."""
        pids = {name: service.pid for name, service in self.replicas.items() if service.is_running}
        pids |= {edge.spec.name: edge.pid for edge in self.edges if edge.is_running}
        if self.nginx is not None and self.nginx.pid is not None:
            pids["nginx"] = self.nginx.pid
        pids["runner"] = os.getpid()
        return pids

    # --- faults ---------------------------------------------------------------------------

    def kill_replica(self, name: str) -> None:
        os.kill(self.replicas[name].pid, signal.SIGKILL)
        self.replicas[name].stop()  # reaps it and closes its log

    def restart_replica(self, name: str, timeout_s: float) -> None:
        self.replicas[name] = Service(self.replicas[name].spec).start()  # the same spec: the same port
        self.replicas[name].wait_healthy(timeout_s)

    def terminate_edge(self, index: int) -> None:
        """SIGTERM (the edge drains what it can within its grace) and wait for the exit."""
        self.edges[index].stop()

    def restart_edge(self, index: int, timeout_s: float) -> None:
        self.edges[index] = Service(self.edges[index].spec).start()  # the same spec: the same port
        self.edges[index].wait_healthy(timeout_s)

    def set_link(self, index: int, link: LinkConfig) -> None:
        self.links[index].delay.set_link(link)

    def set_rewrite_rate(self, index: int, rate: float) -> None:
        self.links[index].fault_proxy.rate = rate

    def other_wire_edge(self, wire_version: int) -> ServiceSpec:
        """An edge whose wire version is ``wire_version`` (as if of another release), pointing at
        the pool: it must refuse the verifier at start with a message naming both versions."""
        argv = edge_command(self.models.draft, None, "float32", 1, self.nginx.url if self.nginx else "", "auto")[1:]
        if argv and argv[0] == "-c":  # console_command's fallback: python -c "...main()" ARGS
            argv = argv[2:]
        code = (
            "import sys, verifier_service.protocol as wire; "
            f"wire.WIRE_VERSION = {wire_version}; "
            "from edge_agent.cli import main; sys.exit(main())"
        )
        command = (sys.executable, "-c", code, *argv, "--startup-timeout-s", "60")
        return ServiceSpec("edge-other-wire", command, _all_cores(), 1, self.log_dir)

    def unwritable_cache_replica(self) -> ServiceSpec:
        """A third verifier (outside the pool) whose cache directory cannot be created: it must
        still start and serve, its kernel built elsewhere."""
        blocker = self.log_dir / "cache-blocker"
        blocker.write_text("a file where the cache directory's parent should be")
        spec = self.replica_spec("verifier-unwritable-cache")
        return ServiceSpec(spec.name, spec.command, spec.cores, 1, self.log_dir, extra_env=(("SPADE_CACHE_DIR", str(blocker / "cache")),))

    def stop(self) -> None:
        for edge in self.edges:
            edge.stop()
        for link in self.links:
            with contextlib.suppress(Exception):
                link.close()
        if self.nginx is not None:
            self.nginx.stop()
        for service in self.replicas.values():
            service.stop()


def _start_link(nginx_port: int, seed: int) -> Link:
    delay = ProxyThread("127.0.0.1", nginx_port, LinkConfig(handshake=False), seed=seed).start()
    proxy = FaultProxy(f"http://127.0.0.1:{delay.port}", rate=0.0, seed=seed)
    server = LoopbackServer()
    server.start(proxy, ready_path=None)
    return Link(proxy, server, delay)


def _all_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))
