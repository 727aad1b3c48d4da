"""The services under test, run as pinned subprocesses: start, wait for /health, scrape, stop.

Each service gets its own cores (``taskset``, or ``sched_setaffinity`` right after the spawn
where taskset is missing) and one torch thread, so an edge box and a cloud box are emulated on
one machine without competing for a core. The affinity each process really got is read back
and recorded with the results.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

logger = logging.getLogger(__name__)

CPU_METRIC = "process_cpu_seconds_total"
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one service."""

    name: str
    """``verifier-target``, ``edge-k4``, ``verifier-draft``: also the log file's name."""
    command: tuple[str, ...]
    """The console script (or python -c) and its arguments, without host/port."""
    cores: tuple[int, ...]
    threads: int
    log_dir: Path
    port: int = field(default_factory=lambda: free_port())
    extra_env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for this service alone (name, value)."""

    @property
    def argv(self) -> list[str]:
        return [*self.command, "--host", "127.0.0.1", "--port", str(self.port)]

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def console_command(script: str, module: str) -> tuple[str, ...]:
    """The installed console script next to this interpreter, else ``python -c`` its main."""
    installed = Path(sys.executable).parent / script
    if installed.exists():
        return (str(installed),)
    return (sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())")


def verifier_command(model: str, gguf_file: str | None, dtype: str, threads: int) -> tuple[str, ...]:
    command = console_command("spade-verifier", "verifier_service.cli")
    command += ("--model", model, "--device", "cpu", "--dtype", dtype, "--threads", str(threads))
    return command + (("--gguf-file", gguf_file) if gguf_file else ())


def edge_command(draft: str, gguf_file: str | None, dtype: str, threads: int, verifier_url: str, draft_length: str) -> tuple[str, ...]:
    command = console_command("spade-edge", "edge_agent.cli")
    command += (
        "--draft-model",
        draft,
        "--verifier-url",
        verifier_url,
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--threads",
        str(threads),
        "--draft-length",
        draft_length,
    )
    return command + (("--gguf-file", gguf_file) if gguf_file else ())


def pinned_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Service:
    """A running service process. Use as a context manager: it is stopped on exit."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self._process: subprocess.Popen | None = None
        self._log: IO[str] | None = None

    @property
    def pid(self) -> int:
        return self._started_process().pid

    def _started_process(self) -> subprocess.Popen:
        if self._process is None:
            raise ValueError(f"{self.spec.name} not started")
        return self._process

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status once the process ends; None if it still runs after ``timeout_s``."""
        try:
            return self._started_process().wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def start(self) -> Service:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.spec.log_path.open("w")
        cores = ",".join(str(core) for core in self.spec.cores)
        taskset = shutil.which("taskset")
        argv = [taskset, "-c", cores, *self.spec.argv] if taskset else self.spec.argv
        logger.info("starting %s: %s", self.spec.name, " ".join(argv))
        self._process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=pinned_env(self.spec.threads) | dict(self.spec.extra_env),
            start_new_session=True,
        )
        if not taskset:
            os.sched_setaffinity(self._process.pid, set(self.spec.cores))
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until it answers 200 with status ok; fail early if the process dies."""
        process = self._started_process()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {process.returncode}:\n{self.log_tail()}")
            if self._is_healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _is_healthy(self) -> bool:
        try:
            response = httpx.get(f"{self.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json().get("status") == "ok"

    def affinity(self) -> list[int]:
        """The cores the process may run on, as the kernel reports them."""
        return sorted(os.sched_getaffinity(self.pid))

    def metrics(self) -> dict[str, float]:
        """The service's /metrics, each metric summed over its label sets."""
        response = httpx.get(f"{self.url}/metrics", timeout=30.0)
        response.raise_for_status()
        return parse_prometheus(response.text)

    def cpu_seconds(self, metrics: dict[str, float]) -> float:
        """The process's CPU seconds: its own ``process_cpu_seconds_total``, else the kernel's."""
        if CPU_METRIC in metrics:
            return metrics[CPU_METRIC]
        return _proc_cpu_times(self.pid)

    def tree_cpu_seconds(self) -> float:
        """CPU seconds of the process and every live descendant (vLLM runs its engine and workers
        in child processes, which the service's own process_cpu_seconds_total leaves out)."""
        return process_tree_cpu_seconds(self.pid)

    def log_tail(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return self.spec.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_service(spec: ServiceSpec, timeout_s: float) -> Service:
    """Start ``spec`` and wait until healthy; stops it again if it never gets there."""
    service = Service(spec).start()
    try:
        service.wait_healthy(timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


def _proc_cpu_times(pid: int) -> float:
    """utime + stime of ``pid`` in seconds, from /proc (the kernel's process accounting)."""
    fields_after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields_after_name[11]) + int(fields_after_name[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants, from /proc; processes that exit while
    being read are skipped."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += _proc_cpu_times(current)
        except (OSError, IndexError, ValueError):
            continue
        pending.extend(children.get(current, ()))
    return total


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over label sets}.

    ``x_total{route="a"} 2`` and ``x_total{route="b"} 3`` give ``{"x_total": 5.0}``; comments
    and unparsable lines are skipped.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if "{" in line:
            rest = rest.rpartition("}")[2]
        tokens = rest.split()  # value, then an optional timestamp
        try:
            value = float(tokens[0])
        except (IndexError, ValueError):
            continue
        values[name.strip()] = values.get(name.strip(), 0.0) + value
    return values
