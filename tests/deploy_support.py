"""Helpers shared by the deployment tests: the compose file, the Grafana dashboard's queries
parsed into their metric selectors, and the nginx pool config rendered for loopback ports and
run by a real nginx."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
NGINX_POOL_CONF = DOCKER / "nginx" / "verifier-pool.conf"
PROMETHEUS_CONF = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA = DOCKER / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
"""Grafana's built-in variables, as Grafana substitutes them before sending a query."""


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def load_prometheus() -> dict:
    return yaml.safe_load(PROMETHEUS_CONF.read_text())


# --- the dashboard's queries --------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str
    """With Grafana's variables substituted: plain PromQL."""


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: dict[str, tuple[str, str]]
    """label -> (operator, value), e.g. {"job": ("=", "spade-verifier")}."""


def dashboard_queries() -> list[Query]:
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                queries.append(Query(panel["title"], expr))
    return queries


def selectors(expr: str) -> list[Selector]:
    """Every metric selector in a PromQL expression (raises ValueError if it does not parse)."""
    import promql_parser

    found: list[Selector] = []

    def visit(node, *_):
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name: (str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers if m.name != "__name__"}
            found.append(Selector(node.name, labels))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def names_in(expr: str) -> set[str]:
    """The metric names an expression mentions, by a plain pattern (independent of the parser)."""
    return set(re.findall(r"\b((?:spade|process)_[a-z_]+|up)\b(?=\s*[{\[)]|\s*$)", expr))


# --- nginx on loopback --------------------------------------------------------------------------


def nginx_binary() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
    if found is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it): the proxy config cannot run here")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def render_pool_config(directory: Path, listen_port: int, replica_ports: dict[str, int]) -> Path:
    """The shipped pool config with its listen port and replica addresses moved to loopback,
    inside the process-level settings the nginx image supplies (pid, logs, temp paths)."""
    text = NGINX_POOL_CONF.read_text()
    replacements = {"listen 8001;": f"listen 127.0.0.1:{listen_port};"}
    replacements |= {f"server {name}:8001 ": f"server 127.0.0.1:{port} " for name, port in replica_ports.items()}
    for old, new in replacements.items():
        assert text.count(old) == 1, f"{NGINX_POOL_CONF.name} no longer has {old!r}"
        text = text.replace(old, new)
    (directory / "verifier-pool.conf").write_text(text)
    temp_paths = "\n".join(f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = directory / "nginx.conf"
    main.write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\nworker_processes 1;\npid {directory / 'nginx.pid'};\nerror_log {directory / 'error.log'} info;\n"
        + "events {}\nhttp {\n"
        + f"    access_log {directory / 'access.log'};\n{temp_paths}\n    include {directory / 'verifier-pool.conf'};\n}}\n"
    )
    return main


def nginx_check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([nginx_binary(), "-t", "-c", str(config), "-p", str(config.parent)], capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def running_nginx(config: Path, listen_port: int, timeout_s: float = 30.0) -> Iterator[str]:
    """Run nginx in the foreground on ``config``; yield its base URL once it accepts connections."""
    process = subprocess.Popen([nginx_binary(), "-c", str(config), "-p", str(config.parent)], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{listen_port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited: {process.stderr.read()}")
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url + "/health", timeout=5)
                break
            if time.monotonic() > deadline:
                raise TimeoutError("nginx did not start")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
