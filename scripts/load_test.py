#!/usr/bin/env python
"""Load test: N concurrent greedy streams through two edges and one verifier (real processes,
API keys on), each output compared with its single-client output; then the same with the
verifier killed (SIGKILL) and restarted mid-run, where every stream must either complete
exactly or end with an error event and [DONE], its text a prefix of the right one (nothing
duplicated). Not a timed test: it reports p50/p99 latency and the counts.

    .venv/bin/python scripts/load_test.py                      # tiny random pair, built here
    .venv/bin/python scripts/load_test.py --target DIR --draft DIR --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "load-test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class StreamResult:
    text: str
    finished: bool
    """A finish chunk then [DONE]."""
    errored: bool
    """An error event then [DONE]."""
    seconds: float


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(module: str, *arguments: str) -> subprocess.Popen:
    environment = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "SPADE_VERIFIER_API_KEY": KEY}
    return subprocess.Popen([sys.executable, "-m", module, *arguments, "--log-level", "warning"], cwd=ROOT, env=environment)


def wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy")


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> StreamResult:
    body = {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, text, payloads = time.perf_counter(), "", []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=300) as response:
            if response.status_code != 200:
                return StreamResult("", False, False, time.perf_counter() - started)
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    payloads.append(line.removeprefix("data:").strip())
    except httpx.HTTPError:
        return StreamResult(text, False, False, time.perf_counter() - started)
    chunks = [json.loads(payload) for payload in payloads if payload != "[DONE]"]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))
    done = bool(payloads) and payloads[-1] == "[DONE]"
    finished = done and any(chunk.get("choices") and chunk["choices"][0]["finish_reason"] for chunk in chunks)
    errored = done and "error" in chunks[-1] if chunks else False
    return StreamResult(text, finished and not errored, errored, time.perf_counter() - started)


async def run_all(edge_urls: list[str], prompts: list[str], max_tokens: int) -> list[StreamResult]:
    limits = httpx.Limits(max_connections=len(prompts) * 2)
    async with httpx.AsyncClient(limits=limits) as client:
        jobs = [stream(client, edge_urls[index % len(edge_urls)], prompt, max_tokens) for index, prompt in enumerate(prompts)]
        return await asyncio.gather(*jobs)


async def single_client(edge_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient() as client:
        return [(await stream(client, edge_url, prompt, max_tokens)).text for prompt in prompts]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def report(name: str, results: list[StreamResult], expected: list[str]) -> dict:
    exact = sum(result.finished and result.text == want for result, want in zip(results, expected, strict=True))
    cut_cleanly = sum(result.errored and want.startswith(result.text) for result, want in zip(results, expected, strict=True))
    summary = {
        "scenario": name,
        "streams": len(results),
        "exact": exact,
        "ended_with_error_then_done": cut_cleanly,
        "violations": len(results) - exact - cut_cleanly,
        "errors": sum(not result.finished for result in results),
        "p50_s": round(statistics.median(r.seconds for r in results), 3),
        "p99_s": round(percentile([r.seconds for r in results], 0.99), 3),
    }
    print(json.dumps(summary), flush=True)
    return summary


def tiny_pair() -> tuple[Path, Path]:
    from spade_models.tiny import build_tiny_pair

    return build_tiny_pair(Path(tempfile.mkdtemp(prefix="spade-load-")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="Target model (default: a tiny random pair built here).")
    parser.add_argument("--draft", help="Draft model (with --target).")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--kill-after-s", type=float, default=1.0, help="Kill the verifier this long into the second run.")
    arguments = parser.parse_args()
    target, draft = (Path(arguments.target), Path(arguments.draft)) if arguments.target else tiny_pair()
    verifier_port, edge_ports = free_port(), [free_port(), free_port()]
    verifier_url, edge_urls = f"http://127.0.0.1:{verifier_port}", [f"http://127.0.0.1:{port}" for port in edge_ports]
    verifier_arguments = ["--model", str(target), "--port", str(verifier_port), "--served-model-name", "target", "--threads", "1"]
    processes = [start("verifier_service.cli", *verifier_arguments)]
    try:
        wait_healthy(verifier_url)
        for port in edge_ports:
            processes.append(
                start(
                    "edge_agent.cli",
                    "--draft-model",
                    str(draft),
                    "--verifier-url",
                    verifier_url,
                    "--port",
                    str(port),
                    "--verifier-api-key",
                    KEY,
                    "--api-key",
                    KEY,
                    "--draft-length",
                    "4",
                    "--circuit-open-s",
                    "1",
                    "--threads",
                    "1",
                )
            )
        for url in edge_urls:
            wait_healthy(url)
        prompts = [f"Request {index}: the edge drafts" for index in range(arguments.streams)]
        expected = asyncio.run(single_client(edge_urls[0], prompts, arguments.max_tokens))
        steady = report("concurrent", asyncio.run(run_all(edge_urls, prompts, arguments.max_tokens)), expected)

        async def with_outage() -> list[StreamResult]:
            running = asyncio.ensure_future(run_all(edge_urls, prompts, arguments.max_tokens))
            await asyncio.sleep(arguments.kill_after_s)
            processes[0].send_signal(signal.SIGKILL)
            processes[0].wait()
            processes[0] = start("verifier_service.cli", *verifier_arguments)
            return await running

        outage = report("verifier_killed_and_restarted", asyncio.run(with_outage()), expected)
        return 0 if steady["exact"] == len(prompts) and outage["violations"] == 0 else 1
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
