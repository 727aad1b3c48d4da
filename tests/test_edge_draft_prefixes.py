"""The edge's draft reuses prefixes across requests, end to end (tiny pair, transformers drafter):
a second request sharing the first one's prompt prefix reports the draft tokens it did not decode
(``spade.draft_cached_tokens``), the edge's /metrics count them against the prompt tokens, and
the greedy output is still the target's own."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_support import edge_app, verifier_app
from servers import serve

SHARED = "You are the assistant of a small shop. Answer in one short sentence. Question:"


@pytest.fixture(scope="module")
def runs(tiny_pair) -> dict:
    with serve(verifier_app(tiny_pair)) as verifier_url:
        target = openai.OpenAI(base_url=verifier_url + "/v1", api_key="unused", max_retries=0)
        with serve(edge_app(tiny_pair, verifier_url, "3")) as edge_url:
            edge = openai.OpenAI(base_url=edge_url + "/v1", api_key="unused", max_retries=0)
            prompts = [SHARED + " when do you open?", SHARED + " do you sell bread?"]
            answers = [edge.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=0) for prompt in prompts]
            expected = [target.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=0) for prompt in prompts]
            metrics = httpx.get(edge_url + "/metrics", timeout=10).text
    return {"answers": answers, "expected": expected, "metrics": metrics}


def test_the_second_request_reuses_the_first_ones_prefix_and_says_so(runs):
    first, second = (answer.model_extra["spade"]["draft_cached_tokens"] for answer in runs["answers"])
    prompt_tokens = runs["answers"][1].usage.prompt_tokens
    assert first == 0
    assert 0 < second < prompt_tokens


def test_reuse_leaves_the_greedy_output_the_targets(runs):
    assert [answer.choices[0].text for answer in runs["answers"]] == [answer.choices[0].text for answer in runs["expected"]]


def test_the_edge_metrics_count_prefix_hit_tokens_against_prompt_tokens(runs):
    samples = {sample.name: sample.value for family in text_string_to_metric_families(runs["metrics"]) for sample in family.samples}
    assert samples["spade_edge_draft_prompt_tokens_total"] == sum(answer.usage.prompt_tokens for answer in runs["answers"])
    assert samples["spade_edge_draft_prefix_hit_tokens_total"] == sum(
        answer.model_extra["spade"]["draft_cached_tokens"] for answer in runs["answers"]
    )
