"""Schema-driven fuzzing of the gateway from its own /openapi.json: no 5xx, no undocumented answer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.schemas import BaseSchema

from tests.conftest import Fleet

EXAMPLES_PER_OPERATION = 200
REQUESTS_SENT: list[int] = []

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def served_api(redis_server: object, tiny_model: object) -> Iterator[BaseSchema]:
    from tests.conftest import RedisServer

    assert isinstance(redis_server, RedisServer)
    fleet = Fleet(redis_server.url, tiny_model)  # type: ignore[arg-type]
    try:
        fleet.start_gateway()
        fleet.start_worker("fuzzed")
        schema = schemathesis.openapi.from_url(f"{fleet.gateway_url}/openapi.json")
        yield schema
    finally:
        fleet.stop_all()


schema = schemathesis.pytest.from_fixture("served_api")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_the_api_answers_generated_requests_within_its_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=10)
    REQUESTS_SENT.append(1)


def test_the_fuzzing_sent_at_least_a_thousand_requests() -> None:
    assert len(REQUESTS_SENT) >= 1000
