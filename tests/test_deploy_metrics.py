"""The Grafana dashboard watches metrics the services really export.

A verifier and an edge on the tiny pair, configured as docker-compose.yml configures them (the
verifier's /metrics behind its key, the edge's left open), serve one request; both /metrics are
scraped the way docker/prometheus/prometheus.yml scrapes them, and every metric each dashboard
query selects must be among the scraped names of the job it selects."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy_support import dashboard_queries, names_in, selectors
from edge_support import edge_app, verifier_app
from servers import serve

VERIFIER_KEY = "verifier-key-for-tests"
EDGE_KEY = "edge-key-for-tests"
PROMETHEUS_SYNTHETIC = {"up"}
"""Series Prometheus writes itself for every target."""


def sample_names(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.fixture(scope="module")
def scrapes(tiny_pair) -> dict:
    """One request through the edge, then each job's scrape and the request's spade stats."""
    verifier = verifier_app(tiny_pair, api_key=VERIFIER_KEY)
    with serve(verifier) as verifier_url:
        edge = edge_app(tiny_pair, verifier_url, "3", verifier_api_key=VERIFIER_KEY, api_key=EDGE_KEY, metrics_require_key=False)
        with serve(edge) as edge_url:
            client = openai.OpenAI(base_url=edge_url + "/v1", api_key=EDGE_KEY, max_retries=0)
            completion = client.completions.create(model="target", prompt="The edge drafts", max_tokens=24, temperature=0)
            return {
                "spade": completion.model_extra["spade"],
                "verifier_without_key": httpx.get(verifier_url + "/metrics", timeout=10),
                "spade-verifier": httpx.get(verifier_url + "/metrics", headers={"Authorization": f"Bearer {VERIFIER_KEY}"}, timeout=10),
                "spade-edge": httpx.get(edge_url + "/metrics", timeout=10),
            }


def test_the_verifier_metrics_need_the_key_prometheus_sends(scrapes):
    assert scrapes["verifier_without_key"].status_code == 401
    assert scrapes["spade-verifier"].status_code == 200


def test_the_edge_metrics_are_open_to_the_unauthenticated_job(scrapes):
    assert scrapes["spade-edge"].status_code == 200


def test_the_dashboards_inputs_count_what_the_request_did(scrapes):
    families = text_string_to_metric_families(scrapes["spade-verifier"].text)
    samples = {sample.name: sample.value for family in families for sample in family.samples}
    spade = scrapes["spade"]
    assert spade["verify_calls"] > 0
    assert samples["spade_verifier_verify_calls_total"] == spade["verify_calls"]
    assert samples["spade_verifier_accepted_tokens_total"] == spade["accepted_tokens"]
    assert samples["spade_verifier_drafted_tokens_total"] == spade["drafted_tokens"]


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda query: f"{query.panel}: {query.expr[:40]}")
def test_every_metric_a_dashboard_query_selects_is_exported_by_its_job(scrapes, query):
    exported = {job: sample_names(scrapes[job].text) for job in ("spade-verifier", "spade-edge")}
    for selector in selectors(query.expr):
        if selector.metric in PROMETHEUS_SYNTHETIC:
            continue
        operator, job = selector.labels["job"]
        assert operator == "Equal", f"{query.panel}: {selector.metric} selected across jobs"
        assert selector.metric in exported[job], f"{query.panel}: {selector.metric} is not exported by {job}"
    assert names_in(query.expr) <= exported["spade-verifier"] | exported["spade-edge"] | PROMETHEUS_SYNTHETIC
