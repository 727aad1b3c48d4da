"""The deployment's configs (docker/nginx, docker/prometheus, docker/grafana) agree with the
compose file and with the services: the proxy pins on the header the edge sends and passes
nginx's own syntax check; Prometheus scrapes every service compose defines, with the key from a
compose secret; every dashboard query parses and names the jobs Prometheus has.

Whether the dashboard's metric names exist on the live services: tests/test_deploy_metrics.py.
Whether the pinning works: tests/test_deploy_pool.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from deploy_support import (
    DASHBOARDS,
    GRAFANA,
    NGINX_POOL_CONF,
    PROMETHEUS_CONF,
    ROOT,
    dashboard_queries,
    load_compose,
    load_prometheus,
    names_in,
    nginx_check,
    render_pool_config,
    selectors,
)
from edge_agent.verifier_client import ROUTE_HEADER, SESSION_HEADER

REQUIRED_PANELS = {
    "Tokens per verify call",
    "Acceptance rate",
    "Verify latency",
    "Target passes saved vs target-only",
    "Live sessions",
    "Verifier CPU (cores)",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def services_running(compose: dict, script: str) -> dict[str, str]:
    """name -> port of the compose services started by ``script``."""
    found = {}
    for name, spec in compose["services"].items():
        command = spec.get("command", [])
        if command and command[0] == script:
            found[name] = command[command.index("--port") + 1]
    return found


def mount_source(spec: dict, target: str) -> str:
    return next(volume.split(":")[0] for volume in spec["volumes"] if volume.split(":")[1] == target)


# --- nginx: the verifier pool -------------------------------------------------------------------


def test_the_pool_proxies_to_the_pool_replicas(compose):
    text = NGINX_POOL_CONF.read_text()
    servers = set(re.findall(r"^\s*server\s+([\w.-]+:\d+)", text, flags=re.MULTILINE))
    replicas = {
        name: port
        for name, port in services_running(compose, "spade-verifier").items()
        if compose["services"][name].get("profiles") == ["pool"]
    }
    assert servers == {f"{name}:{port}" for name, port in replicas.items()} == {"verifier-a:8001", "verifier-b:8001"}
    listen = re.search(r"^\s*listen\s+(\d+);", text, flags=re.MULTILINE).group(1)
    pool = compose["services"]["verifier-pool"]
    assert pool["ports"][0].rsplit(":", 1)[1] == listen
    assert mount_source(pool, "/etc/nginx/conf.d/default.conf") == "./docker/nginx/verifier-pool.conf"
    assert set(pool["depends_on"]) == set(replicas)


def test_the_pool_hashes_the_route_header_else_the_session_header_on_a_consistent_ring():
    text = NGINX_POOL_CONF.read_text()
    assert re.search(r"^\s*hash \$spade_replica_key consistent;", text, flags=re.MULTILINE)
    session_variable = "$http_" + SESSION_HEADER.lower().replace("-", "_")
    route_variable = "$http_" + ROUTE_HEADER.lower().replace("-", "_")
    assert f"map {session_variable} $spade_session" in text
    assert re.search(rf"map \{route_variable} \$spade_replica_key \{{\s*\"\" \$spade_session;", text)


@pytest.mark.parametrize(
    ("route", "path"),
    [
        ("/v1/sessions/{session_id}", "/v1/sessions/edge-0123abcd"),
        ("/v1/pipeline/sessions/{session_id}", "/v1/pipeline/sessions/edge-0123abcd"),
        ("/v1/pipeline/sessions/{session_id}/proposals", "/v1/pipeline/sessions/edge-0123abcd/proposals"),
        ("/v1/pipeline/sessions/{session_id}/decided", "/v1/pipeline/sessions/edge-0123abcd/decided"),
    ],
)
def test_a_call_without_the_header_is_pinned_by_the_id_in_its_path(route, path):
    """The fallback map turns the verifier's session routes (the DELETE of either wire, and the
    pipelined wire's proposals and decided stream) into the session id."""
    from verifier_service.app import create_app
    from verifier_service.settings import VerifierSettings

    routes = {getattr(route, "path", None) for route in create_app(VerifierSettings(pipelined_sessions=True)).routes}
    assert route in routes
    pattern = re.search(r'"~(\^/v1/.*?)"\s+\$session_id;', NGINX_POOL_CONF.read_text()).group(1)
    match = re.fullmatch(pattern.replace("(?<", "(?P<"), path)
    assert match and match.group("session_id") == "edge-0123abcd"
    assert re.fullmatch(pattern.replace("(?<", "(?P<"), "/v1/chat/completions") is None


def test_nginx_accepts_the_pool_config(tmp_path):
    config = render_pool_config(tmp_path, 18001, {"verifier-a": 18002, "verifier-b": 18003})
    result = nginx_check(config)
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


# --- Prometheus --------------------------------------------------------------------------------


def test_prometheus_scrapes_every_service_compose_defines(compose):
    jobs = {job["job_name"]: job for job in load_prometheus()["scrape_configs"]}
    assert set(jobs) == {"spade-verifier", "spade-edge"}
    for job, script in (("spade-verifier", "spade-verifier"), ("spade-edge", "spade-edge")):
        targets = {target for group in jobs[job]["static_configs"] for target in group["targets"]}
        assert targets == {f"{name}:{port}" for name, port in services_running(compose, script).items()}
    prometheus = compose["services"]["prometheus"]
    assert mount_source(prometheus, "/etc/prometheus/prometheus.yml") == "./docker/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_prometheus_sends_the_operators_metrics_key_from_a_compose_secret(compose):
    jobs = {job["job_name"]: job for job in load_prometheus()["scrape_configs"]}
    authorization = jobs["spade-verifier"]["authorization"]
    assert set(authorization) == {"type", "credentials_file"} and authorization["type"] == "Bearer"
    secret = authorization["credentials_file"].removeprefix("/run/secrets/")
    assert secret in compose["services"]["prometheus"]["secrets"]
    assert compose["secrets"][secret] == {"environment": "SPADE_VERIFIER_METRICS_API_KEY"}
    assert "credentials:" not in PROMETHEUS_CONF.read_text()


def test_edges_leave_metrics_open_to_the_unauthenticated_edge_job(compose):
    assert "authorization" not in {job["job_name"]: job for job in load_prometheus()["scrape_configs"]}["spade-edge"]
    for name in services_running(compose, "spade-edge"):
        assert compose["services"][name]["environment"]["SPADE_EDGE_METRICS_REQUIRE_KEY"] == "false"


# --- Grafana --------------------------------------------------------------------------------------


def test_grafana_reads_the_compose_prometheus(compose):
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(d["uid"], d["type"], d["url"]) for d in datasources] == [("spade-prometheus", "prometheus", "http://prometheus:9090")]
    assert compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1] == "9090"
    grafana = compose["services"]["grafana"]
    assert mount_source(grafana, "/etc/grafana/provisioning") == "./docker/grafana/provisioning"


def test_grafana_loads_the_dashboards_from_their_mount(compose):
    grafana = compose["services"]["grafana"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "spade.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    assert mount_source(grafana, path) == "./docker/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "docker" / "grafana" / "dashboards" / home.removeprefix(path + "/")).is_file()
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"


def test_the_dashboard_has_the_panels_the_deployment_is_watched_by():
    panels = [panel for path in DASHBOARDS for panel in json.loads(path.read_text())["panels"]]
    assert REQUIRED_PANELS <= {panel["title"] for panel in panels}
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "spade-prometheus"}
        assert panel["targets"], panel["title"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda query: f"{query.panel}: {query.expr[:40]}")
def test_every_dashboard_query_parses_and_names_a_scraped_job(query):
    jobs = {job["job_name"] for job in load_prometheus()["scrape_configs"]}
    found = selectors(query.expr)  # raises on a syntax error
    assert {selector.metric for selector in found} == names_in(query.expr)
    for selector in found:
        operator, value = selector.labels["job"]
        matched = {job for job in jobs if (job == value if operator == "Equal" else re.fullmatch(value, job))}
        assert matched, f"{query.panel}: job {value!r} is not scraped"
