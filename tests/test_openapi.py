"""The OpenAPI document against the daemon, by schemathesis: generated requests
(with the token, sandboxes on the ``virtual`` provider) never answer 500, and
every status the daemon answers with is one the document names, with a
body its schema describes."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.daemon_fixture import DaemonProcess

_config_dir = tempfile.mkdtemp(prefix="hutch-openapi-")
_config = os.path.join(_config_dir, "hutch.toml")
with open(_config, "w") as fh:
    fh.write('[sandbox]\nprovider = "virtual"\n')

# No Docker Engine for this daemon: a generated workspace request must not
# start (or pull) anything real; it answers provider_error instead.
_daemon = DaemonProcess(
    provider=None, extra_args=["--config", _config],
    extra_env={"DOCKER_HOST": f"unix://{_config_dir}/no-engine.sock"},
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    _daemon.start()
    try:
        yield _daemon
    finally:
        _daemon.close()
        shutil.rmtree(_config_dir, ignore_errors=True)


#: Streams that end only when their caller goes (each has a test of its own).
ENDLESS = {"/v1/events/follow"}  # tests/test_events_follow.py


def not_a_bug(ctx: Any, response: Any, case: Any) -> bool:
    """500 is what an unexpected exception answers: never a typed error."""
    assert response.status_code != 500, f"500 from {case.method} {case.path}: {response.text}"
    return True


def test_the_daemon_answers_as_its_document_says(daemon: DaemonProcess) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    document = httpx.get(f"{daemon.url}/openapi.json", headers=headers)
    assert document.status_code == 200, document.text
    schema = schemathesis.openapi.from_dict(document.json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 30  # every route is there

    for operation in operations:
        if operation.path in ENDLESS:
            continue

        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def answers_as_documented(case: Any) -> None:
            case.call_and_validate(
                base_url=daemon.url, headers=headers, timeout=30,
                checks=[status_code_conformance, content_type_conformance,
                        response_schema_conformance, not_a_bug],
            )

        answers_as_documented()


def test_every_route_and_status_has_a_response_schema() -> None:
    """The document describes every answer: each route's success status and
    every error status of hutch's table (500 is a bug, not an answer) have a
    body schema under the media type the route answers with; only 204 has
    no body."""
    from fastapi.routing import APIRoute

    from hutch._errors import ERRORS_BY_CODE
    from hutch.server import create_app

    app = create_app()
    document = app.openapi()
    error_statuses = {str(c.http_status) for c in ERRORS_BY_CODE.values() if c.http_status != 500}
    routes: list[APIRoute] = []

    def walk(entries: Any) -> None:
        for route in entries:
            included = getattr(route, "original_router", None)
            if included is not None:
                walk(included.routes)
            elif isinstance(route, APIRoute) and route.include_in_schema:
                routes.append(route)

    walk(app.router.routes)
    assert len(routes) > 40
    missing: list[str] = []
    for route in routes:
        for method in route.methods:
            operation = document["paths"][route.path_format][method.lower()]
            answers = operation["responses"]
            expected = {str(route.status_code or 200)}
            if route.path_format.startswith("/v1/"):
                expected |= error_statuses
            else:
                expected.add("401")  # /healthz: only the token is checked
            for status in sorted(expected - set(answers)):
                missing.append(f"{method} {route.path_format} {status}: not documented")
            for status, answer in answers.items():
                if status == "204":
                    continue
                content = answer.get("content") or {}
                schemas = [c.get("schema") for c in content.values()]
                if not schemas or not all(s and s != {} for s in schemas):
                    missing.append(f"{method} {route.path_format} {status}: no body schema")
                elif any(s.get("$ref") and s.get("type") for s in schemas if s):
                    missing.append(f"{method} {route.path_format} {status}: a ref and a type")
    assert missing == []
    # Error answers name their schema by reference (a model given to each
    # route's each status cost FastAPI a field apiece, most of the app's
    # making): every reference names a schema the document holds.
    text = json.dumps(document)
    named = set(re.findall(r'"#/components/schemas/([^"]+)"', text))
    assert "ErrorBody" in named
    assert named - set(document["components"]["schemas"]) == set()
