"""Samples every process of the stack from outside (``/proc``: RSS, open descriptors, sockets)
and its /metrics (the verifiers' sessions and KV bytes, the edges' requests in flight), on a
thread, every few seconds."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from spade_bench.chaos.checks import Sample
from spade_bench.services import parse_prometheus

WATCHED_METRICS = (
    "spade_verifier_sessions",
    "spade_verifier_kv_cache_bytes",
    "spade_edge_active_requests",
    "spade_edge_draft_sessions",
    "spade_edge_draft_retained_sessions",
    "spade_edge_draft_retained_tokens",
)


TCP_LISTEN = "0A"


def tcp_table() -> dict[str, tuple[int, str]]:
    """Socket inode -> (local port, state) of every TCP socket (/proc/net/tcp and tcp6)."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            table[fields[9]] = (int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return table


def connection_roles(links: list[str], table: dict[str, tuple[int, str]]) -> tuple[int, int]:
    """(connections opened, connections accepted) among a process's descriptor links: accepted
    ones have a local port the process listens on."""
    sockets = [table[link[len("socket:[") : -1]] for link in links if link.startswith("socket:[") and link[len("socket:[") : -1] in table]
    listening = {port for port, state in sockets if state == TCP_LISTEN}
    connected = [port for port, state in sockets if state != TCP_LISTEN]
    accepted = sum(1 for port in connected if port in listening)
    return len(connected) - accepted, accepted


def process_sample(
    at_s: float, process: str, pid: int, metrics: dict[str, float], table: dict[str, tuple[int, str]] | None = None
) -> Sample | None:
    """RSS, descriptors, sockets and TCP connections by role of ``pid`` from /proc; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fd_dir = Path(f"/proc/{pid}/fd")
        links = []
        for entry in os.listdir(fd_dir):
            try:
                links.append(os.readlink(fd_dir / entry))
            except OSError:
                continue  # closed while listed
    except OSError:
        return None
    rss_kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    sockets = sum(1 for link in links if link.startswith("socket:"))
    opened, accepted = connection_roles(links, tcp_table() if table is None else table)
    return Sample(at_s, process, pid, rss_kib * 1024, len(links), sockets, metrics, opened, accepted)


def scrape(url: str | None) -> dict[str, float]:
    if url is None:
        return {}
    try:
        values = parse_prometheus(httpx.get(url + "/metrics", timeout=3.0).text)
    except httpx.HTTPError:
        return {}
    return {name: values[name] for name in WATCHED_METRICS if name in values}


class Monitor:
    """``targets()`` -> {name: (pid, metrics URL or None)}; ``clock()`` -> seconds from the load's
    start. ``samples`` grows until ``stop()``."""

    def __init__(self, targets: Callable[[], dict[str, tuple[int, str | None]]], clock: Callable[[], float], interval_s: float) -> None:
        self.targets = targets
        self.clock = clock
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-monitor", daemon=True)

    def sample_now(self) -> list[Sample]:
        taken = []
        targets = self.targets()
        scraped = {name: scrape(url) for name, (_pid, url) in targets.items()}
        table = tcp_table()
        for name, (pid, _url) in targets.items():
            sample = process_sample(self.clock(), name, pid, scraped[name], table)
            if sample is not None:
                taken.append(sample)
        self.samples.extend(taken)
        return taken

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()
