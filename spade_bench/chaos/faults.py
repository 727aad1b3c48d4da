"""Carrying out the fault schedule against the running stack, on a thread: each fault at its
time (or when the previous one is over), logged with timestamps, followed by a probe that times
how long the affected edges take to answer again."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from spade_bench.chaos.checks import FaultRecord
from spade_bench.chaos.plan import FaultPlan
from spade_bench.chaos.stack import REPLICAS, Stack
from spade_bench.proxy import LinkConfig
from spade_bench.services import Service

logger = logging.getLogger(__name__)

DELAYED_LINK = LinkConfig(rtt_ms=300.0, jitter_ms=150.0, handshake=False)
HEALTHY_LINK = LinkConfig(handshake=False)
REWRITE_RATE = 0.3
OTHER_WIRE_VERSION = 999


@dataclass(frozen=True)
class LoadHooks:
    """What faults that are load ask of the clients (run on the load's event loop)."""

    burst: Callable[[int], concurrent.futures.Future]
    """edge -> its burst past the concurrency limit, done when every request of it ended."""
    long_prompts: Callable[[], concurrent.futures.Future]
    """One prompt near the context limit to every edge at once."""
    probe: Callable[[int], bool]
    """edge -> whether a short greedy request through it was answered (synchronous)."""


class FaultRunner:
    def __init__(
        self,
        stack: Stack,
        plans: list[FaultPlan],
        clock: Callable[[], float],
        hooks: LoadHooks,
        recovery_bound_s: float,
        start_bound_s: float,
    ) -> None:
        """Runs ``plans`` in order, each at its start or, when the ones before it ran long, as soon
        as they are over: none is skipped (the load runs on until every one is over, ``load_running``).
        ``start_bound_s``: how long a process a fault (re)starts may take to answer its health
        check: under the load the CPUs are shared with every other process, as they were when all
        the edges started at once."""
        self.stack = stack
        self.plans = plans
        self.finished_at_s: float | None = None
        """When the last fault was over and probed (None while faults remain)."""
        self.clock = clock
        self.hooks = hooks
        self.recovery_bound_s = recovery_bound_s
        self.start_bound_s = start_bound_s
        self.records: list[FaultRecord] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)

    def start(self) -> FaultRunner:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No fault starts after this; the one running (and its probe) finishes first."""
        self._stop.set()
        self._thread.join(timeout=600)

    def _run(self) -> None:
        try:
            self._run_plans()
        finally:
            self.finished_at_s = self.clock()

    def _run_plans(self) -> None:
        for plan in self.plans:
            if self._stop.wait(max(0.0, plan.start_s - self.clock())):
                return
            started = self.clock()
            logger.warning("chaos: %s (target %d) at %.1f s", plan.kind, plan.target, started)
            try:
                record = self.execute(plan, started)
            except Exception as error:  # a fault that could not be carried out is a failed expectation
                logger.exception("chaos: %s failed", plan.kind)
                record = FaultRecord(plan.kind, started, self.clock(), None, f"could not be carried out: {error!r}", None, False)
            record = self._probed(record)
            self.records.append(record)
            logger.warning("chaos: %s over at %.1f s, answered again after %s s", plan.kind, record.ended_s, record.recovered_s)

    def execute(self, plan: FaultPlan, started: float) -> FaultRecord:
        stack, timeout = self.stack, self.start_bound_s
        kind, target = plan.kind, plan.target
        if kind in ("replica_kill", "verifier_kill"):
            names = [REPLICAS[target]] if kind == "replica_kill" else list(REPLICAS)
            for name in names:
                stack.kill_replica(name)
            time.sleep(plan.duration_s)
            for name in names:
                stack.restart_replica(name, timeout)
            return FaultRecord(kind, started, self.clock(), None, f"SIGKILL {', '.join(names)}, down {plan.duration_s:.0f} s, restarted")
        if kind == "nginx_restart":
            assert stack.nginx is not None
            stack.nginx.stop()
            time.sleep(plan.duration_s)
            stack.nginx.start()
            return FaultRecord(kind, started, self.clock(), None, f"nginx stopped, down {plan.duration_s:.0f} s, started")
        if kind == "edge_term":
            stack.terminate_edge(target)
            stack.restart_edge(target, timeout)
            return FaultRecord(kind, started, self.clock(), (target,), f"SIGTERM edge {target} (streams in flight), restarted")
        if kind in ("link_delay", "link_drop", "link_rewrite"):
            if kind == "link_rewrite":
                stack.set_rewrite_rate(target, REWRITE_RATE)
            else:
                stack.set_link(target, DELAYED_LINK if kind == "link_delay" else LinkConfig(down=True))
            time.sleep(plan.duration_s)
            stack.set_link(target, HEALTHY_LINK)
            stack.set_rewrite_rate(target, 0.0)
            detail = {"link_delay": f"RTT {DELAYED_LINK.rtt_ms:.0f} ms +/- {DELAYED_LINK.jitter_ms:.0f}", "link_drop": "cut"}.get(
                kind, f"{REWRITE_RATE:.0%} of verify answers rewritten"
            )
            return FaultRecord(kind, started, self.clock(), (target,), f"edge {target}'s link: {detail} for {plan.duration_s:.0f} s")
        if kind == "rate_burst":
            self.hooks.burst(target).result(timeout=self.recovery_bound_s * 4)
            return FaultRecord(kind, started, self.clock(), (target,), f"a burst past edge {target}'s concurrency limit")
        if kind == "kv_exhaustion":
            self.hooks.long_prompts().result(timeout=self.recovery_bound_s * 4)
            return FaultRecord(kind, started, self.clock(), None, "a prompt near the context limit to every edge at once")
        if kind == "wire_mismatch_edge":
            return self._other_wire_edge(started)
        if kind == "unwritable_cache":
            return self._unwritable_cache(started)
        raise ValueError(f"unknown fault {kind!r}")

    def _other_wire_edge(self, started: float) -> FaultRecord:
        """An edge of another wire version joins: it must refuse the pool at start, naming both
        versions, and disturb no one."""
        service = Service(self.stack.other_wire_edge(OTHER_WIRE_VERSION)).start()
        code = service.wait_exit(120)
        log = service.log_tail()
        service.stop()
        met = code not in (None, 0) and f"wire version {OTHER_WIRE_VERSION}" in log
        detail = f"exited with {code}; " + ("named both versions" if met else f"log tail: {log[-300:]!r}")
        return FaultRecord("wire_mismatch_edge", started, self.clock(), (), detail, 0.0, met)

    def _unwritable_cache(self, started: float) -> FaultRecord:
        """A verifier whose cache directory cannot be written starts: it must come up, serve a
        request, and say in its log where it built its kernel instead."""
        service = Service(self.stack.unwritable_cache_replica()).start()
        try:
            service.wait_healthy(self.start_bound_s)
            body = {"model": "any", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2, "temperature": 0}
            models = httpx.get(service.url + "/v1/models", timeout=30).json()["data"]
            answered = httpx.post(service.url + "/v1/chat/completions", json=body | {"model": models[0]["id"]}, timeout=60).status_code
            log = service.log_tail()
            met = answered == 200 and "cannot build or load in" in log
            detail = f"started and answered {answered}; " + (
                "built its kernel in the fallback directory" if met else f"log tail {log[-300:]!r}"
            )
        except (TimeoutError, RuntimeError, httpx.HTTPError) as error:
            met, detail = False, f"did not serve: {error!r}"[:400]
        finally:
            service.stop()
        return FaultRecord("unwritable_cache", started, self.clock(), (), detail, 0.0, met)

    def _probed(self, record: FaultRecord) -> FaultRecord:
        """``record`` with the time until an affected edge answers a short greedy request."""
        if record.edges == ():
            return record
        edge = record.edges[0] if record.edges else len(self.stack.edges) - 1
        deadline = time.monotonic() + self.recovery_bound_s
        while time.monotonic() < deadline:
            try:
                if self.hooks.probe(edge):
                    return replace(record, recovered_s=round(self.clock() - record.ended_s, 2))
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return record
