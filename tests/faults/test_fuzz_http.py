"""Hostile HTTP: schemathesis drives a real api process from its own OpenAPI
schema. With no scheduler behind it and a 1 s deadline, every well-formed
request ends in a 408 and every malformed one in a 4xx: never a 5xx, but for
/health_generate's 503 (a probe's answer: no scheduler made its token)."""

from __future__ import annotations

import itertools
import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.harness import Tier


@pytest.fixture(scope="module")
def api_schema(redis_url, tmp_path_factory):
    tier = Tier(redis_url, f"fuzz-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("fuzz"),
                **{"request-timeout": "1"})
    url = tier.start_api()
    tier.wait_ready(schedulers=0, detokenizers=0)
    try:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")
    finally:
        tier.stop()


def test_no_input_the_schema_allows_or_forbids_gets_a_server_error(api_schema):
    checked = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(timeout=30)
            if case.path == "/health_generate":
                assert response.status_code == 503, response.text
                assert response.json()["status"] == "unavailable"
                return
            assert response.status_code < 500, (case.method, case.path, case.body,
                                                response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"]
            checked.append(response.status_code)

        try:
            check()
        except Unsatisfiable:  # no way to break an operation without inputs (GET /health)
            assert mode is GenerationMode.NEGATIVE
    print(f"\n[fuzz] {len(checked)} requests, statuses {sorted(set(checked))}")
    assert len(checked) > 50
