"""Memory and disk over time (hutch.daemon.meters): the daemon samples each
running sandbox's figures, keeps a bounded ring of them, asks nothing of a
paused or suspended sandbox, and drops a sandbox's samples when it ends;
GET /v1/sandboxes/{id}/meters answers them under the usual credentials."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from hutch._sandbox import Sandbox
from hutch.daemon.meters import MeterHistory
from hutch.states import SandboxState
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

#: The daemon's sampling interval in these tests (the default is 10 s).
INTERVAL = 0.3
#: How long a test waits for what it expects before it fails (a hang guard).
HANG_GUARD_SECONDS = 60.0


def wait_for_samples(c: hutch.Client, sandbox_id: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while True:
        samples = c.meter_history(sandbox_id)
        if len(samples) >= count or time.monotonic() > deadline:
            return samples
        time.sleep(INTERVAL)


# -- the sampler, on in-process sandboxes ---------------------------------------------------


@pytest.mark.anyio
async def test_the_ring_keeps_the_newest_samples_of_running_sandboxes_only() -> None:
    meters = MeterHistory(interval=1.0, keep_seconds=3.0)  # 3 samples a sandbox
    sandbox = await hutch.create_sandbox("bubblewrap", image=TEST_IMAGE)
    async with sandbox:
        assert isinstance(sandbox, Sandbox)
        await sandbox.exec("head -c 2000000 /dev/urandom > blob")
        idle_before = sandbox.status().idle_seconds
        for _ in range(5):
            await meters.sample([sandbox])
        samples = meters.history_json(sandbox.id)["samples"]
        assert len(samples) == 3  # bounded: the oldest two went
        times = [s["at_unix"] for s in samples]
        assert times == sorted(times) and len(set(times)) == 3
        assert all(isinstance(s["memory_bytes"], int) and s["memory_bytes"] > 0 for s in samples)
        assert all(isinstance(s["disk_bytes"], int) and s["disk_bytes"] >= 2_000_000
                   for s in samples)
        # Sampling is not activity: the sandbox's idle clock went on.
        assert sandbox.status().idle_seconds >= idle_before

        # Paused, then suspended: nothing is asked of it, and it stays asleep.
        await sandbox.pause()
        await meters.sample([sandbox])
        assert sandbox.state is SandboxState.PAUSED
        assert meters.history_json(sandbox.id)["samples"] == samples
        await sandbox.resume()
        await sandbox.suspend()
        await meters.sample([sandbox])
        assert sandbox.state is SandboxState.SUSPENDED
        assert meters.history_json(sandbox.id)["samples"] == samples

        # A sandbox no longer live has no samples kept.
        await meters.sample([])
        assert meters.history_json(sandbox.id)["samples"] == []


@pytest.mark.parametrize("interval", [0, -1, float("inf"), float("nan")])
def test_a_sampling_interval_must_be_a_positive_number_of_seconds(interval: float) -> None:
    with pytest.raises(hutch.InvalidArgument):
        MeterHistory(interval=interval)


# -- the route, on a daemon -------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with tempfile.TemporaryDirectory() as config_dir:
        config = os.path.join(config_dir, "hutch.toml")
        with open(config, "w") as fh:
            fh.write(f"[server]\nmeter_interval = {INTERVAL}\n")
        d = DaemonProcess(extra_args=["--config", config]).start()
        try:
            yield d
        finally:
            d.close()


def test_a_running_sandbox_has_its_history_sampled_and_loses_it_when_it_ends(
    daemon: DaemonProcess,
) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sandbox = c.create_sandbox("bubblewrap", image=TEST_IMAGE)
        try:
            sandbox.exec("head -c 3000000 /dev/urandom > blob")
            samples = wait_for_samples(c, sandbox.id, 3)
            assert len(samples) >= 3
            assert all(isinstance(s["memory_bytes"], int) for s in samples)
            assert all(isinstance(s["disk_bytes"], int) for s in samples)
            assert samples[-1]["disk_bytes"] >= 3_000_000
            times = [float(s["at_unix"]) for s in samples]
            assert times == sorted(times)
            answer = httpx.get(f"{daemon.url}/v1/sandboxes/{sandbox.id}/meters",
                               headers={"Authorization": f"Bearer {daemon.token}"}).json()
            assert answer["interval_seconds"] == INTERVAL and answer["id"] == sandbox.id

            # Suspended: no sample is taken (none would be worth waking it).
            sandbox.suspend()
            before = c.meter_history(sandbox.id)
            time.sleep(INTERVAL * 4)
            assert c.meter_history(sandbox.id) == before
            assert sandbox.info()["state"] == "suspended"
        finally:
            c.delete_sandbox(sandbox.id)
        # Ended: on record, with no history kept.
        assert c.meter_history(sandbox.id) == []


def test_the_history_route_answers_only_a_credential_for_a_known_sandbox(
    daemon: DaemonProcess,
) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sandbox = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        other = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        try:
            url = f"{daemon.url}/v1/sandboxes/{sandbox.id}/meters"
            assert httpx.get(url).status_code == 401
            assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
            unknown = httpx.get(f"{daemon.url}/v1/sandboxes/sb-nosuch/meters",
                                headers={"Authorization": f"Bearer {daemon.token}"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
            # A ref reads its own sandbox's figures (as it reads its description), no other's.
            ref = {"Authorization": f"Bearer {sandbox.ref()}"}
            assert httpx.get(url, headers=ref).status_code == 200
            assert httpx.get(f"{daemon.url}/v1/sandboxes/{other.id}/meters",
                             headers=ref).status_code in (403, 404)
        finally:
            c.delete_sandbox(sandbox.id)
            c.delete_sandbox(other.id)
