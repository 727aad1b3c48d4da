"""What a chaos run does, fixed before it starts: its settings, the fault schedule and the request
mix. Pure: the same seed gives the same schedule and the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

FaultKind = Literal[
    "replica_kill",
    "verifier_kill",
    "nginx_restart",
    "edge_term",
    "link_delay",
    "link_drop",
    "link_rewrite",
    "rate_burst",
    "kv_exhaustion",
    "wire_mismatch_edge",
    "unwritable_cache",
]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "replica_kill",
    "link_delay",
    "rate_burst",
    "edge_term",
    "link_drop",
    "kv_exhaustion",
    "nginx_restart",
    "link_rewrite",
    "verifier_kill",
    "wire_mismatch_edge",
    "unwritable_cache",
)
"""Every kind, in the order a schedule first cycles through them."""

LINK_FAULTS = frozenset({"link_delay", "link_drop", "link_rewrite"})
"""Faults aimed at one linked edge's link (its proxies)."""

Endpoint = Literal["chat", "completions"]
ClientBehaviour = Literal["normal", "disconnect", "slow"]


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 1800.0
    """How long the load runs (faults fire inside it)."""
    num_edges: int = 16
    num_linked_edges: int = 4
    """Edges whose link to the pool runs through a fault proxy and a delay proxy."""
    seed: int = 0
    fault_interval_s: float = 60.0
    """Scheduled faults start this far apart; a random one may fall between two of them."""
    max_concurrent_requests: int = 4
    """Each edge's --max-concurrent-requests: a rate burst goes past it."""
    max_tokens_short: int = 16
    max_tokens_long: int = 64
    context_limit: int = 2048
    """The target's context length (the tiny target's): long prompts come near it."""
    kv_budget_contexts: int = 6
    """Each replica's --max-kv-cache-bytes, in full contexts: the KV-exhaustion fault passes it."""
    audit_limit: int = 2000
    """Verdicts re-checked against the acceptance rule after the run (a seeded sample, sampled
    calls first; every one when fewer were recorded)."""
    sample_interval_s: float = 5.0
    session_ttl_s: float = 45.0
    """The replicas' --session-ttl-s: sessions orphaned by a fault (an edge killed, a link cut
    before its DELETE) are dropped this long after their last call."""
    idle_s: float = 75.0
    """After the load: how long the services idle before the "back to idle" samples (longer than
    the session TTL and its sweep, a quarter of it)."""

    @property
    def warmup_s(self) -> float:
        """Leaks are measured from here (caches, pools and allocators fill before)."""
        return min(120.0, self.duration_s / 6)

    def __post_init__(self) -> None:
        if self.num_edges < 2 or not 1 <= self.num_linked_edges < self.num_edges:
            raise ValueError("a chaos run needs >= 2 edges, 1 or more of them linked through proxies and 1 or more not")
        if self.duration_s <= 0 or self.fault_interval_s <= 0:
            raise ValueError("duration and fault interval must be positive")


@dataclass(frozen=True)
class FaultPlan:
    """One fault: what, when (seconds from the load's start), for how long, aimed at what."""

    kind: FaultKind
    start_s: float
    duration_s: float
    target: int = 0
    """The edge (edge_term, link faults, rate_burst) or the replica (replica_kill) hit."""
    scheduled: bool = True
    """False: drawn at random between the scheduled ones."""


FAULT_DURATIONS_S: dict[FaultKind, float] = {
    "replica_kill": 8.0,
    "verifier_kill": 8.0,
    "nginx_restart": 1.0,
    "edge_term": 0.0,
    "link_delay": 10.0,
    "link_drop": 5.0,
    "link_rewrite": 10.0,
    "rate_burst": 3.0,
    "kv_exhaustion": 10.0,
    "wire_mismatch_edge": 0.0,
    "unwritable_cache": 0.0,
}
"""How long each kind lasts: a killed process stays down this long before it is restarted; a
link stays delayed, cut or rewriting this long. 0: the fault is an instant (the restart follows
the process's exit)."""


def fault_schedule(config: ChaosConfig) -> list[FaultPlan]:
    """Faults every ``fault_interval_s`` after warm-up, cycling through every kind first and then
    in a seeded order, each aimed at a seeded target; and between two scheduled faults, with
    probability 1/2, a random one. None starts in the last interval (the run ends quiet).

    The first cycle is always whole: a run too short to hold every kind (CI's 3-minute mode) plans
    the rest past its end, without random ones between, and the load runs on until they are over
    (``load_running``)."""
    rng = random.Random(config.seed)
    plans: list[FaultPlan] = []
    start = config.warmup_s
    order: list[FaultKind] = list(FAULT_KINDS)
    index = num_scheduled = 0
    cycle_fits = config.warmup_s + len(FAULT_KINDS) * config.fault_interval_s <= config.duration_s
    while start + config.fault_interval_s <= config.duration_s or num_scheduled < len(FAULT_KINDS):
        if index == len(order):
            order, index = rng.sample(FAULT_KINDS, len(FAULT_KINDS)), 0
        plans.append(_planned(order[index], start, config, rng, scheduled=True))
        index += 1
        num_scheduled += 1
        if cycle_fits and rng.random() < 0.5:
            offset = rng.uniform(0.3, 0.7) * config.fault_interval_s
            kind = rng.choice([kind for kind in FAULT_KINDS if kind not in ("verifier_kill", "wire_mismatch_edge", "unwritable_cache")])
            plans.append(_planned(kind, start + offset, config, rng, scheduled=False))
        start += config.fault_interval_s
    return plans


def load_running(now_s: float, config: ChaosConfig, faults_finished_at_s: float | None) -> bool:
    """Whether the load goes on at ``now_s`` (seconds from its start): for its duration, and past it
    until every planned fault is over and a quiet interval has followed the last one, so that a
    fault the ones before it delayed still runs, and is recovered from, under the load."""
    if faults_finished_at_s is None:
        return True
    return now_s < max(config.duration_s, faults_finished_at_s + config.fault_interval_s)


def _planned(kind: FaultKind, start_s: float, config: ChaosConfig, rng: random.Random, scheduled: bool) -> FaultPlan:
    if kind in LINK_FAULTS:
        target = rng.randrange(config.num_linked_edges)
    elif kind == "replica_kill":
        target = rng.randrange(2)
    elif kind in ("edge_term", "rate_burst"):
        target = rng.randrange(config.num_edges)
    else:
        target = 0
    return FaultPlan(kind, round(start_s, 3), FAULT_DURATIONS_S[kind], target, scheduled)


@dataclass(frozen=True)
class RequestPlan:
    """One client request, decided before it is sent."""

    index: int
    edge: int
    endpoint: Endpoint
    stream: bool
    temperature: float
    seed: int
    max_tokens: int
    prompt_id: int
    shared_system: bool
    """Starts with the system prompt that many requests share (its prefix is cached once)."""
    long_prompt: bool
    """A prompt near the context limit (the KV budget, eviction and admission paths)."""
    logprobs: bool
    n: int
    """2 asks for what the API refuses (n > 1): a clear 400 is the right answer."""
    behaviour: ClientBehaviour
    burst: bool = False
    """Sent by a rate burst (past the edge's concurrency limit: 429 is a right answer)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def expects_refusal(self) -> bool:
        return self.n > 1

    def reference_key(self) -> tuple:
        """Requests with the same key have the same target-only greedy text."""
        return (self.endpoint, self.prompt_id, self.shared_system, self.long_prompt, self.max_tokens)


@dataclass(frozen=True)
class MixShares:
    """The share of requests with each property (independent draws)."""

    sampled: float = 0.4
    stream: float = 0.6
    completions: float = 0.2
    shared_system: float = 0.5
    long_answer: float = 0.3
    logprobs: float = 0.15
    refused_n: float = 0.03
    disconnect: float = 0.06
    slow_reader: float = 0.06
    long_prompt: float = 0.02
    num_prompts: int = 12


@dataclass
class RequestMix:
    """Seeded request plans for one client (an edge's worker): ``next(edge)``."""

    config: ChaosConfig
    seed: int
    shares: MixShares = field(default_factory=MixShares)
    _count: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def next(self, edge: int, *, long_prompt: bool | None = None, burst: bool = False) -> RequestPlan:
        rng, shares = self._rng, self.shares
        self._count += 1
        sampled = rng.random() < shares.sampled
        behaviour: ClientBehaviour = "normal"
        draw = rng.random()
        if draw < shares.disconnect:
            behaviour = "disconnect"
        elif draw < shares.disconnect + shares.slow_reader:
            behaviour = "slow"
        stream = behaviour != "normal" or rng.random() < shares.stream
        is_long = rng.random() < shares.long_prompt if long_prompt is None else long_prompt
        return RequestPlan(
            index=self.seed * 1_000_000 + self._count,
            edge=edge,
            endpoint="completions" if rng.random() < shares.completions else "chat",
            stream=stream,
            temperature=0.8 if sampled else 0.0,
            seed=rng.randrange(2**31),
            max_tokens=self.config.max_tokens_long if rng.random() < shares.long_answer else self.config.max_tokens_short,
            prompt_id=rng.randrange(shares.num_prompts),
            shared_system=rng.random() < shares.shared_system,
            long_prompt=is_long,
            logprobs=rng.random() < shares.logprobs,
            n=2 if rng.random() < shares.refused_n else 1,
            behaviour=behaviour,
            burst=burst,
        )


SYSTEM_PROMPT = "You are a careful assistant. Answer briefly and plainly, and never invent facts you do not know."
WORDS = (
    "river stone window garden copper lantern orbit meadow signal harbor violet engine puzzle summit "
    "thunder marble compass pepper canyon ribbon glacier falcon velvet anchor"
).split()


def prompt_text(prompt_id: int, long_prompt: bool, long_words: int) -> str:
    """The user text of a prompt: a short question, or one padded near the context limit."""
    rng = random.Random(prompt_id)
    question = f"Question {prompt_id}: describe the {rng.choice(WORDS)} and the {rng.choice(WORDS)} in a few words."
    if not long_prompt:
        return question
    padding = " ".join(rng.choice(WORDS) for _ in range(long_words))
    return f"Notes: {padding}\n{question}"
