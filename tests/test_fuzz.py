"""Schema-driven fuzzing of the gateway from its own /openapi.json: no 5xx, no undocumented answer."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.core.result import Ok

from tests.conftest import Fleet

EXAMPLES_PER_OPERATION = 200

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # some 6,000 requests: minutes on a busy 2-core machine
def test_the_api_answers_generated_requests_within_its_schema(
    fleet: Fleet, subtests: pytest.Subtests
) -> None:
    fleet.start_worker("fuzzed")
    schema = schemathesis.openapi.from_url(f"{fleet.gateway_url}/openapi.json")
    sent = 0
    operations = [result.ok() for result in schema.get_all_operations() if isinstance(result, Ok)]
    assert len(operations) >= 10, "the spec lists the gateway's operations"

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def answers_within_schema(case: schemathesis.Case) -> None:
            nonlocal sent
            case.call_and_validate(checks=CHECKS, timeout=10)
            sent += 1

        with subtests.test(operation=operation.label):
            answers_within_schema()

    assert sent >= 1000, f"only {sent} generated requests were sent"
