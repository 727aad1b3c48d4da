"""Helpers shared by the deployment tests: the compose file, the Grafana dashboard's queries
parsed into their metric selectors, and the nginx pool config rendered for loopback ports and
run by a real nginx (spade_bench.nginx_pool, which the pool bench shares; here, skipped where
nginx is missing)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from spade_bench import nginx_pool
from spade_bench.nginx_pool import NGINX_POOL_CONF, find_nginx, render_pool_config

__all__ = ["NGINX_POOL_CONF", "render_pool_config"]  # the deployment tests import both from here

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
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
    found = find_nginx()
    if found is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it): the proxy config cannot run here")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def nginx_check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([nginx_binary(), "-t", "-c", str(config), "-p", str(config.parent)], capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def running_nginx(config: Path, listen_port: int, timeout_s: float = 30.0) -> Iterator[str]:
    """Run nginx in the foreground on ``config`` (skipped where nginx is missing); yield its base URL."""
    with nginx_pool.running_nginx(config, listen_port, nginx_binary(), timeout_s) as url:
        yield url
