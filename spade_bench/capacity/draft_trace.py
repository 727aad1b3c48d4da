"""The draft's one-step greedy proposals along the target's output: what lets an emulated edge
draft any length (``spade_bench.capacity.emulated_edge``).

At temperature 0 a verdict depends only on which drafted tokens equal the target's. After a
recorded session the target's output y is known (greedy SPADE output equals the target's), and a
block drafted at committed position i is the draft's greedy continuation of prompt + y_<i: its
first token is g_i, the draft's proposal given y_<i, and while g_i = y_i the draft, fed y_i,
proposes g_(i+1) next, and so on. So one teacher-forced pass of the draft along prompt + y,
keeping g_i at every position, decides the verdict of every block of every length:

    y       = [ 5, 9, 2, 7 ]          the target's output (the recorded committed tokens)
    g       = [ 5, 9, 4, 7 ]          g_i = the draft's argmax after prompt + y_<i
    block of 3 at i = 0:  [5, 9, 4]   2 accepted, next token 2 (the correction)
    block of 2 at i = 3:  [7, ...]    the first accepted, the rest decided by the next mismatch

The pass runs ``propose(context, 1)`` per position through the edge's own drafter (the same code
path and model file as the real edge: ``edge_agent.draft_backend``), whose KV prefix reuse feeds
one new token per call: one forward per position. Its seconds per call are the draft's time
per token; the first call's (the prompt's prefill) is kept apart.

    python -m spade_bench.capacity.draft_trace --sessions recording.jsonl --output traced.jsonl \\
        -- --draft-model qwen2.5-coder-0.5b-instruct --verifier-url http://127.0.0.1:8001 --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from edge_agent.drafter import DraftSession
from spade_bench.capacity.sessions import DraftTrace, read_sessions, write_sessions
from spade_core.params import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)


def recorded_prompt(calls: Sequence) -> list[int]:
    """The prompt's token ids: the first call of a session carries them all (prefix_length 0)."""
    first = calls[0].request
    if first["prefix_length"] != 0:
        raise ValueError("the session's first call does not carry the prompt (prefix_length != 0)")
    return list(first["new_tokens"])


def recorded_output(calls: Sequence, completion_tokens: int) -> list[int]:
    """The committed tokens of a recorded session: per call the accepted drafts and the next
    token, cut to the tokens the edge delivered (its last block may overshoot). A call that
    starts before the committed end repeats one already answered (the edge's client retries a
    call whose answer was slow or lost; the verifier answers it from memory) and adds nothing:

        call at 1052 (the prompt) -> next t0      committed [t0]
        call at 1052 again (a retry)              skipped
        call at 1053, block [d0] -> 1 accepted, t1   committed [t0, d0, t1]
    """
    prompt_length = len(recorded_prompt(calls))
    committed: list[int] = []
    for call in calls:
        if call.status != 200 or call.num_accepted is None or call.next_token is None:
            raise ValueError("a session with a refused call (a resync) has no single committed path")
        start = call.request["prefix_length"] + len(call.request["new_tokens"]) - prompt_length
        if start < len(committed):
            continue
        if start > len(committed):
            raise ValueError(f"a call starts at {start} with {len(committed)} tokens committed")
        committed += list(call.request["draft_tokens"][: call.num_accepted]) + [call.next_token] + call.continued_tokens
    return committed[:completion_tokens]


def trace_proposals(session: DraftSession, prompt: list[int], target: list[int]) -> DraftTrace:
    """The teacher-forced pass: one ``propose(prompt + target[:i], 1)`` per position i."""
    proposals, seconds = [], []
    for position in range(len(target)):
        started = time.perf_counter()
        block = session.propose(prompt + target[:position], 1, GREEDY)
        seconds.append(time.perf_counter() - started)
        proposals.append(block.token_ids[0])
    per_token = statistics.median(seconds[1:]) if len(seconds) > 1 else (seconds[0] if seconds else 0.0)
    return DraftTrace(list(prompt), list(target), proposals, per_token, seconds[0] if seconds else 0.0)


def trace_sessions(drafter, sessions: list) -> list[DraftTrace]:
    """Each recorded session's trace, one draft session each (as the edge opens one per request)."""
    traces = []
    for recorded in sessions:
        session = drafter.start_session()
        try:
            traces.append(
                trace_proposals(session, recorded_prompt(recorded.calls), recorded_output(recorded.calls, recorded.completion_tokens))
            )
        finally:
            session.close()
    return traces


# --- the pass in its own process, pinned to the edge's cores ---------------------------------


def edge_drafter(edge_flags: list[str]):
    """The drafter the real edge builds from these ``spade-edge`` flags, within the limits of the
    verifier its --verifier-url names (vocabulary, context)."""
    import httpx
    import torch

    from edge_agent.draft_backend import build_drafter, load_draft_model
    from edge_agent.settings import EdgeSettings
    from gateway.cli import add_settings_arguments, settings_from_arguments
    from verifier_service.protocol import VerifierHealth

    parser = argparse.ArgumentParser(prog="spade-edge flags")
    add_settings_arguments(parser, EdgeSettings)
    settings = settings_from_arguments(parser, parser.parse_args(edge_flags), EdgeSettings)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    health = VerifierHealth.model_validate(httpx.get(f"{settings.verifier_url}/health", timeout=30).json())
    return build_drafter(load_draft_model(settings), settings, health)


def run_pinned_trace(sessions_path: Path, output_path: Path, edge_flags: Sequence[str], cores: Sequence[int], threads: int) -> None:
    """Run ``main`` on ``cores`` (the edge's), as the edge itself runs there."""
    from spade_bench.services import pinned_env

    argv = [
        sys.executable,
        "-m",
        "spade_bench.capacity.draft_trace",
        "--sessions",
        str(sessions_path),
        "--output",
        str(output_path),
        "--",
        *edge_flags,
    ]
    taskset = shutil.which("taskset")
    pinned = [taskset, "-c", ",".join(str(core) for core in cores), *argv] if taskset else argv
    env = pinned_env(threads) | {"PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(pinned, env=env)
    if not taskset:
        os.sched_setaffinity(process.pid, set(cores))
    if process.wait() != 0:
        raise RuntimeError(f"the draft's teacher-forced pass failed (exit {process.returncode})")


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m spade_bench.capacity.draft_trace", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=Path, required=True, help="recording.jsonl (from spade_bench.capacity)")
    parser.add_argument("--output", type=Path, required=True, help="the sessions again, each with its trace")
    parser.add_argument("edge_flags", nargs=argparse.REMAINDER, help="-- then the spade-edge flags of the recording edge")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # the draft backend chosen, and why
    flags = args.edge_flags[1:] if args.edge_flags[:1] == ["--"] else args.edge_flags
    sessions = read_sessions(args.sessions)
    drafter = edge_drafter(flags)
    try:
        traces = trace_sessions(drafter, sessions)
    finally:
        drafter.close()
    write_sessions([session.with_trace(trace) for session, trace in zip(sessions, traces, strict=True)], args.output)
    for trace in traces:
        print(json.dumps({"tokens": len(trace.target_token_ids), "draft_ms_per_token": round(trace.draft_s_per_token * 1e3, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
