"""Schemathesis against the coordinator's own OpenAPI document: generated requests (valid
and invalid) to every route of a real stack (real Redis, buffer, reward, rollout, trainer
on loopback; no engine, so runs fail early, as they may) get no server error and no status
the document does not list. Bounded: a few examples per route, no shrinking, no example
database."""

from __future__ import annotations

import itertools

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from rlmesh.common.auth import client_headers
from rlmesh.common.net import free_port
from tests.helpers.stack import start_local_stack

EXAMPLES_PER_ROUTE = 15  # per route and mode (valid input, invalid input)


def test_no_server_errors_and_only_documented_statuses(start_in_loop, redis_url, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"  # no engine: generation fails fast
    stack = start_local_stack(start_in_loop, redis_url, nowhere, tmp_path, remote_timeout_seconds=2.0)
    schema = schemathesis.openapi.from_url(
        f"http://{stack.addresses['coordinator']}/openapi.json", headers=client_headers()
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9

    for operation, mode in itertools.product(operations, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_ROUTE,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def call(case):
            case.call_and_validate(
                headers=client_headers(), timeout=30, checks=[not_a_server_error, status_code_conformance]
            )

        try:
            call()
        except Unsatisfiable:  # a route without parameters or body has no invalid input
            assert mode == GenerationMode.NEGATIVE
