"""A fleet's forwarding, route family by route family (issue 24): a call
for a sandbox (or snapshot) that daemon A serves, made through daemon B, is
answered by A, whatever names the sandbox: the path, the JSON body (the
seed-named lifecycle calls, the snapshot a sandbox or workspace is made
from), or on the E2B wire the ``E2b-Sandbox-Id`` header, the control
plane's path, and the ``{port}-{id}.{domain}`` host, driven by the
unmodified e2b SDK. Real daemons on a real PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from hutch.server.e2b.keys import e2b_key
from tests import postgres_fixture
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.hazards import sleepers
from tests.test_e2b_sdk import PORT_SERVER, WEBSOCKET_SERVER
from tests.test_fleet import LEASE_SECONDS, client, fleet  # noqa: F401 (fixtures)


def test_calls_naming_their_sandbox_in_the_body_are_served_by_its_owner(
    fleet: list[DaemonProcess],  # noqa: F811
) -> None:
    owner, other = fleet[0], fleet[1]
    with client(owner) as c:
        made = c.create_sandbox("virtual", files={"seed.txt": "seeded"})
    with client(other) as c:
        # POST /v1/pause, /v1/resume, /v1/set_timeout: {"sandbox": ID}.
        assert c.pause(made.id)["state"] == "paused"
        assert c.get_sandbox(made.id).state.value == "paused"
        assert c.resume(made.id)["state"] == "running"
        deadline = c.set_timeout(made.id, 300)
        # A path's call too: its owner's samples (another daemon has none, and no such sandbox).
        assert c.meter_history(made.id) == []
    with client(owner) as c:
        sb = c.get_sandbox(made.id)
        assert sb.state.value == "running"
        assert sb.info()["deadline_unix"] == pytest.approx(deadline, abs=1)


def test_sandboxes_and_workspaces_from_another_daemon_s_snapshot(
    fleet: list[DaemonProcess],  # noqa: F811
) -> None:
    """A virtual sandbox's snapshot lives in its daemon's memory alone: a
    sandbox (or workspace) made from it through another daemon is made by
    the snapshot's owner."""
    owner, other = fleet[0], fleet[1]
    with client(owner) as c:
        origin = c.create_sandbox("virtual", files={"state.txt": "captured"})
        snap = origin.snapshot("for-the-fleet")
    with client(other) as c:
        branch = c.create_sandbox(from_snapshot=snap.id)
        assert branch.read_text("state.txt") == "captured"
        ws = c.create_workspace("from-a-snapshot", snapshot_tag=snap.id)
        assert ws["status"] == "running"
        served = c.get_sandbox(ws["live_sandbox_id"])
        assert served.read_text("state.txt") == "captured"
        c.delete_workspace("from-a-snapshot")
    with client(fleet[2]) as c:
        assert c.get_sandbox(branch.id).read_text("state.txt") == "captured"


# -- the E2B wire ---------------------------------------------------------------------------------


@pytest.fixture
def docker_fleet(
    postgres_cluster: postgres_fixture.PostgresCluster,
) -> Iterator[list[DaemonProcess]]:
    store = postgres_cluster.url(postgres_cluster.new_database())
    daemons = [DaemonProcess(provider="docker", extra_env={
        "HUTCH_STORE": store, "HUTCH_FLEET_LEASE_SECONDS": str(LEASE_SECONDS)})
        for _ in range(2)]
    try:
        for d in daemons:
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()


def run_e2b(d: DaemonProcess, script: str, **extra: str) -> str:
    """A script of the unmodified e2b SDK, pointed at daemon ``d`` alone."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("E2B_", "HUTCH_")) and k != "PYTHONPATH"}
    env.update(E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url, E2B_API_KEY=e2b_key(d.token),
               E2B_DOMAIN=f"e2b.local:{d.port}", HUTCH_URL=d.url, **extra)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"script failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.docker
def test_the_e2b_sdk_through_a_daemon_that_does_not_own_the_sandbox(
    docker_fleet: list[DaemonProcess],
) -> None:
    owner, other = docker_fleet
    made = run_e2b(owner, f"""
        from e2b import Sandbox
        sbx = Sandbox.create(metadata={{"case": "fleet"}})
        sbx.files.write("/tmp/port_server.py", {PORT_SERVER!r})
        sbx.files.write("/tmp/ws_server.py", {WEBSOCKET_SERVER!r})
        print(sbx.sandbox_id)
    """).split()[-1]
    run_e2b(other, """
        import os, socket, time, httpx
        from e2b import Sandbox, SandboxQuery, SandboxState
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect
        sid = os.environ["SANDBOX"]
        # Listed by the daemon that does not serve it, once, with its metadata.
        listed = Sandbox.list(query=SandboxQuery(metadata={"case": "fleet"})).next_items()
        assert [s.sandbox_id for s in listed] == [sid], listed
        # The control plane (/sandboxes/{id}/connect, GET /sandboxes/{id}, timeout).
        sbx = Sandbox.connect(sid)
        info = sbx.get_info()
        assert info.metadata == {"case": "fleet"}, info
        sbx.set_timeout(900)
        # envd (E2b-Sandbox-Id): commands, the filesystem service, GET/POST /files.
        assert sbx.commands.run("echo in $((40 + 2))").stdout == "in 42\\n"
        sbx.files.write("/tmp/through.txt", "via the other daemon")
        assert sbx.files.read("/tmp/through.txt") == "via the other daemon"
        assert "through.txt" in [e.name for e in sbx.files.list("/tmp")]
        assert sbx.files.read("/tmp/port_server.py").startswith("import socket")
        # A port of the sandbox, by its {port}-{id}.{domain} host.
        server = sbx.commands.run("python3 /tmp/port_server.py", background=True)
        hutch = os.environ["HUTCH_URL"]
        for _ in range(100):
            answer = httpx.get(f"{hutch}/page?x=1", headers={"Host": sbx.get_host(8000)})
            if answer.status_code == 200:
                break
            time.sleep(0.1)
        assert answer.text == "hello from /page?x=1", answer.text
        server.kill()
        ws_server = sbx.commands.run("python3 /tmp/ws_server.py", background=True)
        port = int(hutch.rsplit(":", 1)[1])
        for _ in range(100):
            try:
                with connect(f"ws://{sbx.get_host(8001)}/chat",
                             sock=socket.create_connection(("127.0.0.1", port))) as ws:
                    ws.send("hi")
                    assert ws.recv() == "echo: hi"
                break
            except (OSError, InvalidStatus):
                time.sleep(0.1)
        else:
            raise AssertionError("no websocket reached the sandbox")
        ws_server.kill()
        # Pause, then connect (resume), files intact.
        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        again = Sandbox.connect(sid)
        assert again.files.read("/tmp/through.txt") == "via the other daemon"
        # A snapshot, a sandbox made from it (its templateID), its template deleted.
        snap = again.create_snapshot(name="fleet-snap")
        branch = Sandbox.create(template=snap.snapshot_id)
        assert branch.files.read("/tmp/through.txt") == "via the other daemon"
        branch.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    """, SANDBOX=made)
    # What the other daemon did was done by the owner.
    with client(owner) as c:
        sb = c.get_sandbox(made)
        assert sb.read_text("/tmp/through.txt") == "via the other daemon"
        assert c.snapshots() == []
    run_e2b(other, """
        import os
        from e2b import Sandbox
        assert Sandbox.kill(os.environ["SANDBOX"]) is True
    """, SANDBOX=made)
    with client(owner) as c:
        assert [s["id"] for s in c.list_sandboxes()] == []
    assert httpx.get(f"{other.url}/sandboxes/{made}",
                     headers={"X-API-KEY": e2b_key(other.token)}).status_code == 404


# -- a caller gone ---------------------------------------------------------------------------------


def _wait_for(what: str, check: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("route", ["exec", "exec/stream"])
def test_a_caller_gone_through_another_daemon_cancels_what_its_call_started(
    fleet: list[DaemonProcess], route: str,  # noqa: F811
) -> None:
    """As through the owner itself (tests/test_bounded.py): the daemon in the
    middle hangs up on the owner when its caller hangs up on it, whether
    the answer had begun (a stream) or not."""
    owner, other = fleet[0], fleet[1]
    with client(owner) as c:
        sid = c.create_sandbox("docker", image=TEST_IMAGE).id
    marker = f"{time.time_ns() % 10**6 + 1000}.25"  # a sleep no one else runs
    headers = {"Authorization": f"Bearer {other.token}"}
    url = f"{other.url}/v1/sandboxes/{sid}/{route}"
    body = {"cmd": f"echo started; sleep {marker}"}
    with httpx.Client(headers=headers, timeout=5) as http:
        if route == "exec":
            def call() -> None:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and goes
                    http.post(url, json=body, timeout=3)

            caller = threading.Thread(target=call)
            caller.start()
            _wait_for("the command did not start", lambda: bool(sleepers(marker)), 10)
            caller.join()
        else:
            with http.stream("POST", url, json=body) as answer:
                assert answer.status_code == 200
                # Kept: a line iterator let go closes the answer (a hang-up).
                lines = answer.iter_lines()
                first = next(lines)
                assert "started" in first, first
                _wait_for("the command did not start", lambda: bool(sleepers(marker)), 10)
    # The caller is gone: so is its command, within a few seconds.
    _wait_for("the command outlived its caller", lambda: not sleepers(marker), 10)
