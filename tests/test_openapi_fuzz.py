"""Both services against their own OpenAPI documents, fuzzed by schemathesis (hypothesis
underneath) with a valid key, through real servers on loopback: no server error, every status
documented, every body and content type as documented, and no request the document allows
refused (schemathesis' ST202). Examples are bounded and the budgets
small (max_tokens capped at 4), so it runs in well under a minute."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from edge_support import edge_app, verifier_app
from servers import serve

KEY = "fuzz-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
POSITIVE_EXEMPT = {"POST /v1/verify"}
"""Operations whose schema cannot say all they refuse: a draft_probs row's token_ids and probs
must have the same length, which JSON Schema cannot express. Everywhere else a request the
document allows must not be refused (schemathesis' ST202, positive_data_acceptance)."""
EXAMPLES_PER_OPERATION = 25
LIMITS = {"api_key": KEY, "max_tokens_cap": 4, "default_max_tokens": 4, "max_context_length": 64}


@pytest.fixture(scope="module")
def urls(tiny_pair):
    with serve(verifier_app(tiny_pair, **LIMITS)) as verifier_url:
        edge_limits = {name: value for name, value in LIMITS.items() if name != "max_context_length"}
        with serve(edge_app(tiny_pair, verifier_url, verifier_api_key=KEY, **edge_limits)) as edge_url:
            yield {"verifier": verifier_url, "edge": edge_url}


def test_the_documents_declare_400_and_never_422(urls):
    documents = [httpx.get(url + "/openapi.json", headers=AUTH, timeout=30).json() for url in urls.values()]
    statuses = {
        status
        for document in documents
        for item in document["paths"].values()
        for operation in item.values()
        for status in operation["responses"]
    }
    assert ("422" in statuses, "400" in statuses) == (False, True)


def fuzz_operation(operation, url: str, statuses: list[int], failures: list[str]) -> None:
    """Call one operation with schemathesis' generated cases, collecting statuses and failures."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    def call(case) -> None:
        try:
            checks = CHECKS if operation.label in POSITIVE_EXEMPT else [*CHECKS, positive_data_acceptance]
            statuses.append(case.call_and_validate(base_url=url, headers=AUTH, checks=checks, timeout=60).status_code)
        except Exception as error:  # collect all, report together
            failures.append(f"{operation.label}: {type(error).__name__}: {str(error)[:400]}")

    call()


@pytest.mark.parametrize("service", ["verifier", "edge"])
def test_fuzzing_the_openapi_document_finds_no_server_error_or_schema_violation(urls, service):
    url = urls[service]
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json", headers=AUTH, timeout=30).json())
    failures: list[str] = []
    statuses: list[int] = []
    for result in schema.get_all_operations():
        fuzz_operation(result.ok(), url, statuses, failures)
    # The fuzzing reached the model (not only refusals). Refusals (400) are now rare: the documents
    # declare the bounds the services enforce, so most generated requests are ones they take.
    assert (failures, 200 in statuses) == ([], True)
