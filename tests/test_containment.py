"""Containment on docker, through the daemon, with the server's default limits.

Each hazard (fork bomb, memory hog, disk fill, output flood) runs in a sandbox
made with no limits of its own, while a watcher checks, twice a second, that
the host runs a process, the daemon answers and another sandbox works. After
each, the API has said what happened and the sandbox itself still works.
The daemon's default limits are the built-in ones but for disk, which its
hutch.toml sets small (256 MiB) so that filling it is quick.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

pytestmark = pytest.mark.docker

#: The most any probe may take while a hazard runs (generous: the machine is shared).
PROBE_CEILING = 10.0
#: The most the daemon's /healthz may take meanwhile: it runs nothing in a sandbox.
HEALTHZ_CEILING = 1.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    config = tmp_path_factory.mktemp("containment") / "hutch.toml"
    config.write_text('[server.limits]\ndisk = "256m"\n')
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}",
                      extra_args=["--config", str(config)]).start()
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[hutch.Client]:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        yield c


@pytest.fixture(scope="module")
def bystander(client: hutch.Client) -> Iterator[Any]:
    sb = client.create_sandbox("docker", image=TEST_IMAGE)
    yield sb
    sb.close()


@pytest.fixture
def hazard(client: hutch.Client, request: pytest.FixtureRequest) -> Iterator[Any]:
    runtime = getattr(request, "param", "auto")
    sb = client.create_sandbox("docker", image=TEST_IMAGE, runtime=runtime)
    yield sb
    with contextlib.suppress(hutch.HutchError):
        sb.close()


@contextlib.contextmanager
def watched(
    daemon: DaemonProcess, bystander: Any, hazard: Any = None
) -> Iterator[dict[str, float]]:
    """Probe the host, the daemon and the bystander (and the hazard's own
    sandbox's files, if given) until the block ends; fail if any probe fails
    or takes longer than PROBE_CEILING, or /healthz longer than HEALTHZ_CEILING."""
    worst = {"host": 0.0, "daemon": 0.0, "bystander": 0.0, "hazard": 0.0}
    failures: list[str] = []
    done = threading.Event()
    headers = {"Authorization": f"Bearer {daemon.token}"}

    def timed(name: str, probe: Any) -> None:
        started = time.monotonic()
        try:
            probe()
        except Exception as exc:  # recorded, asserted on below
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        worst[name] = max(worst[name], time.monotonic() - started)

    def host() -> None:
        subprocess.run(["true"], check=True, timeout=PROBE_CEILING)

    def daemon_answers() -> None:
        answer = httpx.get(f"{daemon.url}/healthz", headers=headers, timeout=PROBE_CEILING)
        assert answer.status_code == 200

    def bystander_works() -> None:
        assert bystander.exec("echo ok", timeout=PROBE_CEILING).stdout == "ok\n"

    def hazard_answers() -> None:
        assert "Debian" in hazard.read_text("/etc/os-release")

    def loop() -> None:
        while not done.is_set():
            timed("host", host)
            timed("daemon", daemon_answers)
            timed("bystander", bystander_works)
            if hazard is not None:
                timed("hazard", hazard_answers)
            done.wait(0.5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield worst
    finally:
        done.set()
        thread.join(60)
    assert not failures, failures
    assert all(seconds < PROBE_CEILING for seconds in worst.values()), worst
    assert worst["daemon"] < HEALTHZ_CEILING, worst


def events_of(client: hutch.Client, sandbox_id: str) -> str:
    return "\n".join(e["message"] for e in client.events(sandbox_id))


# On both runtimes: with the agent, what runs is held in the workload's
# cgroup while the agent keeps a reserve above it (it answers throughout).
@pytest.mark.parametrize("hazard", ["agent", "native"], indirect=True)
def test_a_fork_bomb_is_held_to_the_pids_limit(
    daemon: DaemonProcess, client: hutch.Client, bystander: Any, hazard: Any
) -> None:
    with watched(daemon, bystander, hazard), pytest.raises(hutch.ExecTimeout) as info:
        hazard.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=15)
    assert "killed" in str(info.value)
    # The tree is gone and the sandbox works again.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(hutch.HutchError):
            if hazard.exec("echo ok", timeout=10).stdout == "ok\n":
                break
        time.sleep(1)
    else:
        raise AssertionError("the sandbox did not recover from the fork bomb")
    left = hazard.exec("ls /proc | grep -c '^[0-9]'").stdout.strip()
    assert int(left) < 20, left


@pytest.mark.parametrize("hazard", ["agent", "native"], indirect=True)
def test_an_8_gib_allocation_is_oom_killed_at_the_default_limit_and_told(
    daemon: DaemonProcess, client: hutch.Client, bystander: Any, hazard: Any
) -> None:
    hog = ("import sys\nheld = []\nfor i in range(128):\n"
           "    held.append(bytearray(64 << 20)); print((i + 1) * 64, flush=True)\n")
    with watched(daemon, bystander):
        result = hazard.exec(["python3", "-c", hog], timeout=120)
    assert (result.exit_code, result.oom_killed) == (137, True), result
    assert int(result.stdout.split()[-1]) <= 2048  # MiB, at the 2 GiB default
    # Told in its events (a runtime's notices are noted once a burst of them
    # has gone quiet for a second).
    deadline = time.monotonic() + 15
    while "OOM" not in events_of(client, hazard.id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "OOM" in events_of(client, hazard.id)
    assert hazard.exec("echo ok").stdout == "ok\n"


def test_an_output_flood_is_cut_at_the_cap(
    daemon: DaemonProcess, client: hutch.Client, bystander: Any, hazard: Any
) -> None:
    with watched(daemon, bystander), pytest.raises(hutch.OutputLimitExceeded) as info:
        hazard.exec("yes flood", timeout=120)
    assert "bytes" in str(info.value)
    streamed = 0
    with watched(daemon, bystander), pytest.raises(hutch.OutputLimitExceeded):
        for event in hazard.exec_stream("yes flood", timeout=60):
            assert not isinstance(event, hutch.ExitStatus)
            streamed += len(event.data)
    assert 0 < streamed <= 16 << 20  # streamed up to the cap, then cut
    assert hazard.exec("echo ok").stdout == "ok\n"


def test_a_disk_fill_stops_at_the_limit(
    daemon: DaemonProcess, client: hutch.Client, bystander: Any, hazard: Any
) -> None:
    # Layered: the overlay as the host sees it; what it writes, in a store of the cap's size.
    host_workdir = f"{daemon.data_dir}/layers/mounts/{hazard.id}/merged"
    store = f"{daemon.data_dir}/layers/stores/{hazard.id}"
    before = shutil.disk_usage(daemon.data_dir).free
    with watched(daemon, bystander):
        result = hazard.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=1024", timeout=120)
    assert result.exit_code != 0
    assert "No space left on device" in result.stderr
    written = os.path.getsize(os.path.join(host_workdir, "fill"))
    assert 200 << 20 < written <= 256 << 20, written
    assert before - shutil.disk_usage(daemon.data_dir).free < 512 << 20
    # Freed again, the sandbox goes on.
    assert hazard.exec("rm /workspace/fill && echo ok > /workspace/after && cat /workspace/after"
                       ).stdout == "ok\n"
    hazard.close()
    assert not os.path.exists(os.path.dirname(host_workdir)) and not os.path.exists(store)
    with open("/proc/self/mounts") as fh:
        mounts = fh.read()
    assert host_workdir not in mounts and store not in mounts
