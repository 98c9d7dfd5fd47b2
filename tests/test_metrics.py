"""/metrics on a real daemon: Prometheus' own parser reads it, every family is
there, and each moves as sandboxes are made, used, held, resumed and ended."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import hutch
from tests.daemon_fixture import DaemonProcess

#: A provider that suspends (local does not).
PROVIDER = "bubblewrap"

FAMILIES = {
    "hutch_sandboxes": "gauge",
    "hutch_operation_duration_seconds": "histogram",
    "hutch_suspends": "counter",
    "hutch_resumes": "counter",
    "hutch_reaps": "counter",
    "hutch_store_call_duration_seconds": "histogram",
    "hutch_daemon_process_resident_memory_bytes": "gauge",
    "hutch_pool_size": "gauge",
    "hutch_pool_ready": "gauge",
    "hutch_pool_hits": "counter",
    "hutch_pool_misses": "counter",
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.close()


def scrape(d: DaemonProcess) -> dict[str, list[Sample]]:
    answer = httpx.get(f"{d.url}/metrics", headers={"Authorization": f"Bearer {d.token}"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    for name, kind in FAMILIES.items():
        assert name in families, sorted(families)
        assert families[name].type == kind, (name, families[name].type)
    return {name: f.samples for name, f in families.items()}


def value(samples: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    """The sum of a family's samples named ``sample`` whose labels include ``labels``."""
    return sum(s.value for s in samples[family]
               if s.name == sample and labels.items() <= s.labels.items())


def test_metrics_need_the_token(daemon: DaemonProcess) -> None:
    assert httpx.get(f"{daemon.url}/metrics").status_code == 401
    wrong = httpx.get(f"{daemon.url}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_metrics_move_with_the_sandboxes(daemon: DaemonProcess) -> None:
    before = scrape(daemon)
    assert value(before, "hutch_daemon_process_resident_memory_bytes",
                 "hutch_daemon_process_resident_memory_bytes") > 0
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox(PROVIDER)
        made = scrape(daemon)
        assert value(made, "hutch_sandboxes", "hutch_sandboxes",
                     provider=PROVIDER, state="running") == 1
        assert value(made, "hutch_store_call_duration_seconds",
                     "hutch_store_call_duration_seconds_count", call="put_sandbox") > value(
            before, "hutch_store_call_duration_seconds",
            "hutch_store_call_duration_seconds_count", call="put_sandbox")
        creates = value(made, "hutch_operation_duration_seconds",
                        "hutch_operation_duration_seconds_count",
                        method="POST", route="/v1/sandboxes", outcome="ok")
        assert creates >= 1

        route = "/v1/sandboxes/{sandbox_id}/exec"
        execs = value(made, "hutch_operation_duration_seconds",
                      "hutch_operation_duration_seconds_count", route=route, outcome="ok")
        assert sb.exec("true").exit_code == 0
        ran = scrape(daemon)
        assert value(ran, "hutch_operation_duration_seconds",
                     "hutch_operation_duration_seconds_count", route=route,
                     outcome="ok") == execs + 1
        # An error is filed under its status, on the route it took.
        with pytest.raises(hutch.HutchError):
            c.get_sandbox("sb-nosuch")
        missed = scrape(daemon)
        assert value(missed, "hutch_operation_duration_seconds",
                     "hutch_operation_duration_seconds_count",
                     route="/v1/sandboxes/{sandbox_id}", outcome="404") >= 1

        sb.suspend()
        held = scrape(daemon)
        assert value(held, "hutch_sandboxes", "hutch_sandboxes",
                     provider=PROVIDER, state="suspended") == 1
        assert value(held, "hutch_sandboxes", "hutch_sandboxes",
                     provider=PROVIDER, state="running") == 0
        assert value(held, "hutch_suspends", "hutch_suspends_total", provider=PROVIDER,
                     to="suspended", cause="requested") == value(
            before, "hutch_suspends", "hutch_suspends_total", to="suspended") + 1

        sb.resume()
        back = scrape(daemon)
        assert value(back, "hutch_resumes", "hutch_resumes_total", provider=PROVIDER,
                     cause="requested", **{"from": "suspended"}) == value(
            before, "hutch_resumes", "hutch_resumes_total") + 1
        assert value(back, "hutch_sandboxes", "hutch_sandboxes", state="running") == 1

        c.delete_sandbox(sb.id)
        gone = scrape(daemon)
        assert value(gone, "hutch_reaps", "hutch_reaps_total", provider=PROVIDER,
                     state="terminated", reason="closed") == value(
            before, "hutch_reaps", "hutch_reaps_total", reason="closed") + 1
        assert value(gone, "hutch_sandboxes", "hutch_sandboxes") == 0
