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

WATCHED_METRICS = ("spade_verifier_sessions", "spade_verifier_kv_cache_bytes", "spade_edge_active_requests")


def process_sample(at_s: float, process: str, pid: int, metrics: dict[str, float]) -> Sample | None:
    """RSS, descriptors and sockets of ``pid`` from /proc; None when it is gone."""
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
    return Sample(at_s, process, pid, rss_kib * 1024, len(links), sockets, metrics)


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
        for name, (pid, url) in self.targets().items():
            sample = process_sample(self.clock(), name, pid, scrape(url))
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
