"""``spade-bench chaos``: start the stack, take target-only references, run the load with the
faults and the monitor, let the services idle, check, report; exit 1 when a check failed."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import platform
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from spade_bench.chaos import checks
from spade_bench.chaos.faults import FaultRunner, LoadHooks
from spade_bench.chaos.load import Client, RequestRecord, request_body, route
from spade_bench.chaos.monitor import Monitor
from spade_bench.chaos.plan import ChaosConfig, Endpoint, RequestMix, RequestPlan, fault_schedule, load_running, prompt_text
from spade_bench.chaos.report import markdown, plot, write_results
from spade_bench.chaos.stack import Models, Stack
from spade_bench.nginx_pool import find_nginx

logger = logging.getLogger(__name__)

THINK_S = (0.0, 0.3)
"""A client's pause between two requests, drawn uniformly."""
LONG_PROMPT_SHARE_OF_CONTEXT = 0.8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spade-bench chaos", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (3 for CI's slow suite)")
    parser.add_argument("--edges", type=int, default=16, help="real edges (subprocesses) on the tiny pair")
    parser.add_argument("--linked-edges", type=int, default=4, help="edges whose link runs through the fault and delay proxies")
    parser.add_argument(
        "--fault-interval-s", type=float, default=None, help="seconds between scheduled faults (default: 60, or 15 below 10 minutes)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule and the request mix")
    parser.add_argument("--output", type=Path, default=Path("chaos_results"))
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--audit-limit", type=int, default=2000, help="verdicts re-checked against the acceptance rule after the run (a seeded sample)"
    )
    return parser


def config_from(args: argparse.Namespace) -> ChaosConfig:
    duration = args.minutes * 60
    interval = args.fault_interval_s or (60.0 if duration >= 600 else 15.0)
    return ChaosConfig(
        duration_s=duration,
        num_edges=args.edges,
        num_linked_edges=args.linked_edges,
        seed=args.seed,
        fault_interval_s=interval,
        audit_limit=args.audit_limit,
    )


def long_words_for(tokenizer_dir: str, config: ChaosConfig) -> int:
    """Words of padding that bring a long prompt to ~80 % of the context, by the target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    probe_words = 200
    per_word = (
        len(tokenizer(prompt_text(0, True, probe_words))["input_ids"]) - len(tokenizer(prompt_text(0, False, 0))["input_ids"])
    ) / probe_words
    budget = LONG_PROMPT_SHARE_OF_CONTEXT * config.context_limit - config.max_tokens_long
    return max(1, int(budget / per_word))


def greedy_plans(config: ChaosConfig, num_prompts: int) -> list[RequestPlan]:
    """One greedy plan per reference key the mix can draw."""
    plans = []
    endpoints: tuple[Endpoint, ...] = ("chat", "completions")
    for endpoint in endpoints:
        for prompt_id in range(num_prompts):
            for shared_system in (False, True):
                for long_prompt in (False, True):
                    for max_tokens in (config.max_tokens_short, config.max_tokens_long):
                        plans.append(
                            RequestPlan(
                                0, 0, endpoint, False, 0.0, 0, max_tokens, prompt_id, shared_system, long_prompt, False, 1, "normal"
                            )
                        )
    return plans


def target_only_references(verifier_url: str, model: str, plans: list[RequestPlan], long_words: int) -> dict[tuple, str]:
    """Each greedy plan's text from the verifier's own OpenAI route (target-only decoding)."""
    references = {}
    with httpx.Client(timeout=120) as http:
        for plan in plans:
            response = http.post(verifier_url + route(plan), json=request_body(plan, model, long_words))
            response.raise_for_status()
            choice = response.json()["choices"][0]
            references[plan.reference_key()] = choice["text"] if plan.endpoint == "completions" else choice["message"]["content"] or ""
    return references


class Load:
    """The clients on one event loop: a worker per edge, plus the bursts faults ask for."""

    def __init__(self, config: ChaosConfig, stack: Stack, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.stack = stack
        self.client = client
        self.loop = loop
        self.records: list[RequestRecord] = []
        self._extra_mix = RequestMix(config, seed=10_000 + config.seed)

    async def worker(self, edge: int, faults: FaultRunner) -> None:
        mix = RequestMix(self.config, seed=self.config.seed * 1000 + edge + 1)
        rng = random.Random(mix.seed)
        while load_running(self.client.clock(), self.config, faults.finished_at_s):
            plan = mix.next(edge)
            self.records.append(await self.client.send(plan, self.stack.edges[edge].url))
            await asyncio.sleep(rng.uniform(*THINK_S))

    async def _many(self, plans: list[RequestPlan]) -> None:
        records = await asyncio.gather(*(self.client.send(plan, self.stack.edges[plan.edge].url) for plan in plans))
        self.records.extend(records)

    def burst(self, edge: int) -> concurrent.futures.Future:
        plans = [self._extra_mix.next(edge, burst=True) for _ in range(3 * self.config.max_concurrent_requests)]
        return asyncio.run_coroutine_threadsafe(self._many(plans), self.loop)

    def long_prompts(self) -> concurrent.futures.Future:
        plans = [self._extra_mix.next(edge, long_prompt=True, burst=True) for edge in range(self.config.num_edges)]
        return asyncio.run_coroutine_threadsafe(self._many(plans), self.loop)


def probe(stack: Stack, model: str, edge: int) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2, "temperature": 0}
    return httpx.post(stack.edges[edge].url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A SIGTERM (CI's timeout, a stopped job) unwinds like Ctrl-C, so the processes it started stop too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from(args)
    nginx = find_nginx()
    if nginx is None:
        print("chaos run NOT RUN: nginx is not installed (apt-get install nginx): the pool faults need it", file=sys.stderr)
        return 2
    from spade_models.tiny import build_tiny_pair

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    target, draft = build_tiny_pair(output / "tiny-models")
    stack = Stack(config, Models(str(target), str(draft)), output / "logs")
    print(
        f"chaos: starting 2 verifier replicas, nginx and {config.num_edges} edges ({config.num_linked_edges} through proxies)", flush=True
    )
    try:
        stack.start(nginx, args.startup_timeout_s)
        return run_started(config, stack, output, long_words_for(str(target), config))
    finally:
        stack.stop()


def run_started(config: ChaosConfig, stack: Stack, output: Path, long_words: int) -> int:
    model = httpx.get(stack.edges[0].url + "/v1/models", timeout=30).json()["data"][0]["id"]
    load_time_s = max(seconds for name, seconds in stack.load_times_s.items() if name != "edges")
    recovery_bound_s = load_time_s + 30.0
    start_bound_s = max(stack.load_times_s.values()) + 30.0
    hung_deadline_s = recovery_bound_s + 30.0
    plans = greedy_plans(config, RequestMix(config, 0).shares.num_prompts)
    started = time.monotonic()
    references = target_only_references(stack.replicas["verifier-a"].url, model, plans, long_words)
    print(f"chaos: {len(references)} target-only references in {time.monotonic() - started:.1f} s", flush=True)

    origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - origin

    def targets() -> dict[str, tuple[int, str | None]]:
        urls = {name: service.url for name, service in stack.replicas.items()} | {edge.spec.name: edge.url for edge in stack.edges}
        return {name: (pid, urls.get(name)) for name, pid in stack.processes().items()}

    monitor = Monitor(targets, clock, config.sample_interval_s)
    idle_before = monitor.sample_now()
    schedule = fault_schedule(config)
    print(
        f"chaos: load for {config.duration_s:.0f} s, {len(schedule)} faults, recovery bound {recovery_bound_s:.0f} s "
        f"(a verifier's start to healthy {load_time_s:.1f} s, plus 30 s; {config.num_edges} edges started in "
        f"{stack.load_times_s['edges']:.1f} s: a restart may take {start_bound_s:.0f} s), "
        f"hung after {hung_deadline_s:.0f} s without a byte",
        flush=True,
    )
    records, fault_records = asyncio.run(
        _load(config, stack, model, long_words, hung_deadline_s, clock, monitor, schedule, recovery_bound_s, start_bound_s)
    )
    load_end_s = clock()
    time.sleep(config.idle_s)
    idle_after = monitor.sample_now()
    monitor.stop()

    results = [
        checks.check_greedy_exact(records, references),
        checks.check_no_server_errors(records),
        checks.check_errors_shaped(records),
        checks.check_not_hung(records, hung_deadline_s),
        checks.check_failures_in_windows(records, fault_records, recovery_bound_s),
        checks.check_fault_expectations(fault_records, schedule),
        checks.check_flat(monitor.samples, config.warmup_s, load_end_s, server_bound=harness_keepalive(config)),
        checks.check_back_to_idle(idle_before, idle_after, server_bound=harness_keepalive(config)),
    ]
    results.append(audit_check(stack, config, stack.models.target))
    minutes = checks.per_minute(records)
    header = [
        f"Machine: {platform.node()}, {_cpu_model()}; {config.num_edges} edges ({config.num_linked_edges} through the fault and "
        f"delay proxies), two verifier replicas behind the shipped nginx pool config, the tiny pair, seed {config.seed}.",
        f"Load {load_end_s:.0f} s ({config.duration_s:.0f} s planned, on until every fault was over), "
        f"warm-up {config.warmup_s:.0f} s, idle after {config.idle_s:.0f} s. Recovery bound "
        f"{recovery_bound_s:.0f} s after a fault is over (a verifier's start to healthy, {load_time_s:.1f} s, plus 30 s); "
        f"hung deadline {hung_deadline_s:.0f} s.",
        "Sampled requests are checked through the verifiers' verdicts: a seeded sample of them recomputed offline "
        f"from their recorded inputs (at most {config.audit_limit}).",
    ]
    report = markdown(header, results, fault_records, records, minutes, recovery_bound_s)
    (output / "chaos_report.md").write_text(report)
    write_results(
        output / "results.json", records, fault_records, monitor.samples, {"config": asdict(config), "references": len(references)}
    )
    plot(output / "plots", records, fault_records, monitor.samples, minutes)
    print(report, flush=True)
    status, lines = verdict(results, output / "chaos_report.md")
    for line in lines:
        print(line, flush=True)
    return status


def verdict(results: list[checks.Check], report: Path) -> tuple[int, list[str]]:
    """The run's exit status (1 when any check failed) and its last lines, the ones CI shows:
    what failed, not only that it did."""
    failed = [check for check in results if not check.passed]
    summary = "FAILED: " + ", ".join(check.name for check in failed) if failed else "every check passed"
    lines = [f"chaos: {summary} (report: {report})"]
    lines += [f"chaos: {check.name}: {check.summary}; " + "; ".join(check.violations) for check in failed]
    return (1 if failed else 0), lines


async def _load(config, stack, model, long_words, hung_deadline_s, clock, monitor, schedule, recovery_bound_s, start_bound_s):
    limits = httpx.Limits(
        max_connections=8 * config.num_edges * config.max_concurrent_requests, max_keepalive_connections=harness_keepalive(config)
    )
    async with httpx.AsyncClient(limits=limits) as http:
        client = Client(http, model, long_words, hung_deadline_s, clock)
        load = Load(config, stack, client, asyncio.get_running_loop())
        hooks = LoadHooks(load.burst, load.long_prompts, lambda edge: probe(stack, model, edge))
        faults = FaultRunner(stack, schedule, clock, hooks, recovery_bound_s, start_bound_s)
        monitor.start()
        faults.start()
        try:
            await asyncio.gather(*(load.worker(edge, faults) for edge in range(config.num_edges)))
        finally:
            await asyncio.to_thread(faults.stop)
        return load.records, faults.records


def audit_check(stack: Stack, config: ChaosConfig, target_dir: str) -> checks.Check:
    """Every replica's recorded verdicts (a seeded sample of ``audit_limit``) re-checked offline."""
    from spade_bench.chaos.audit import load_target, recheck, sampled_audits

    paths = [str(stack.audit_path(name)) for name in stack.replicas if stack.audit_path(name).exists()]
    num_recorded = len(sampled_audits(paths, None))
    started = time.monotonic()
    result = recheck(load_target(target_dir), sampled_audits(paths, config.audit_limit, config.seed))
    print(f"chaos: {result.num_checked} verdicts re-checked in {time.monotonic() - started:.0f} s", flush=True)
    return checks.check_verdicts(result.num_checked, result.num_sampled, num_recorded, result.mismatches)


def harness_keepalive(config: ChaosConfig) -> int:
    """Keep-alive connections the run's clients may hold in all: what an edge may have accepted
    and keep open while idle without a leak of its own."""
    return 4 * config.num_edges


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
