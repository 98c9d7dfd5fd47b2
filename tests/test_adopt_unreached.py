"""A sandbox whose runtime cannot be reached when a daemon adopts it (a
Docker Engine restarting as the host boots, an ssh host down) is not failed
on that guess: it is adopted as recorded, its calls say the runtime cannot
be reached, and once it can be, the sandbox is there with its files (SPEC:
hutch never loses an agent's work). Before, such a sandbox was recorded
failed for good, and its runtime released once it could be reached again.

Real parts: the Docker Engine is kept from one daemon alone by a mount
namespace of its own, where the Engine's socket is /dev/null; the ssh host
is an sshd of the test's own, stopped and started again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

import hutch
from hutch._e2bkey import e2b_key
from hutch.client import RemoteSandbox
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, client
from tests.ssh_server import ALIAS, SshServer

#: The Engine's socket, as the docker SDK dials it.
ENGINE_SOCKET = os.path.realpath("/var/run/docker.sock")


def without_the_engine() -> list[str]:
    """A command prefix: what runs under it has a mount namespace of its own
    in which the Engine's socket is /dev/null (a dial is refused), the rest
    of the host as it is."""
    mount = f'mount --bind /dev/null {ENGINE_SOCKET} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(provider=None, extra_args=[
        "--allow-provider", "ssh", "--allow", "destination", "--allow", "config_file"]).start()
    yield d
    d.launcher = []
    try:
        d.remove_everything()
    finally:
        d.close()


def _adopted_unreached(daemon: DaemonProcess, sandbox_id: str, *, refused: bool) -> None:
    """The daemon says the sandbox is as recorded (running) and that its
    runtime could not be reached; a call that needs what cannot be reached
    (``refused``) is refused as unavailable, one that does not is answered,
    and the sandbox stays running."""
    with client(daemon) as c:
        sb = c.get_sandbox(sandbox_id)
        assert sb.status().state is hutch.SandboxState.RUNNING
        said = [e["message"] for e in c.events(sandbox_id)]
        assert any("could not be reached" in m for m in said), said
        if refused:
            with pytest.raises(hutch.SandboxUnavailable):
                sb.exec("true")
        else:  # what answers without the unreachable part does
            assert sb.exec("cat work.txt").stdout == "the agent's work\n"
        assert sb.status().state is hutch.SandboxState.RUNNING


def _found_whole(daemon: DaemonProcess, sandbox_id: str) -> None:
    with client(daemon) as c:
        sb = c.get_sandbox(sandbox_id)
        assert sb.status().state is hutch.SandboxState.RUNNING
        assert sb.read_text("work.txt") == "the agent's work\n"
        assert sb.exec("cat work.txt").stdout == "the agent's work\n"


@pytest.mark.docker
@pytest.mark.parametrize("runtime", ["native", "agent"])
def test_a_docker_sandbox_adopted_while_its_engine_is_down_is_kept(
    daemon: DaemonProcess, runtime: str
) -> None:
    """A sandbox and a workspace's: neither fails, nor does the workspace go
    stale (back to its last saved state), while the Engine is down."""
    with client(daemon) as c:
        sb = c.create_sandbox(provider="docker", image=TEST_IMAGE, runtime=runtime,
                              read_before_write=False)
        sb.write_text("work.txt", "the agent's work\n")
        ws = c.create_workspace(f"unreached-{runtime}", provider="docker", image=TEST_IMAGE,
                                runtime=runtime, read_before_write=False)
        in_ws = ws["live_sandbox_id"]
        c.get_sandbox(in_ws).write_text("work.txt", "the agent's work\n")
    daemon.kill()
    daemon.launcher = without_the_engine()
    daemon.start()
    for sandbox_id in (sb.id, in_ws):
        # docker exec needs the Engine; the agent's commands do not.
        _adopted_unreached(daemon, sandbox_id, refused=runtime == "native")
    with client(daemon) as c:
        assert c.get_workspace(ws["name"])["status"] == "running"
    daemon.stop()
    daemon.launcher = []
    daemon.start()
    for sandbox_id in (sb.id, in_ws):
        _found_whole(daemon, sandbox_id)
    with client(daemon) as c:
        found = c.get_workspace(ws["name"])
        assert (found["status"], found["live_sandbox_id"]) == ("running", in_ws)


def _kept_through_an_outage(daemon: DaemonProcess, made: Callable[[hutch.Client], RemoteSandbox],
                            down: Callable[[], object], up: Callable[[], object]) -> None:
    """The sandbox ``made`` holds the agent's work; the daemon is killed,
    ``down`` takes its runtime's service away, and the daemon adopts it on
    its start; ``up`` brings the service back, and the same daemon's next
    call finds the sandbox whole."""
    with client(daemon) as c:
        sb = made(c)
        sb.write_text("work.txt", "the agent's work\n")
    daemon.kill()
    down()
    daemon.start()
    _adopted_unreached(daemon, sb.id, refused=True)
    up()
    _found_whole(daemon, sb.id)


def test_an_ssh_sandbox_adopted_while_its_host_is_down_is_kept(daemon: DaemonProcess) -> None:
    server = SshServer().start()
    workdir = tempfile.mkdtemp(prefix="hutch-ssh-")
    try:
        _kept_through_an_outage(
            daemon,
            lambda c: c.create_sandbox(provider="ssh", destination=ALIAS,
                                       config_file=server.config_file,
                                       working_directory=workdir, connect_timeout=3,
                                       read_before_write=False),
            server.kill_all, server.start)
    finally:
        server.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.docker
def test_an_e2b_sandbox_adopted_while_e2b_is_down_is_kept() -> None:
    """E2B's service (a second ``hutch serve`` stands in for it) down while
    the daemon adopts the sandbox, then back."""
    service = DaemonProcess(provider="docker").start()
    env = {"E2B_API_URL": service.url, "E2B_SANDBOX_URL": service.url,
           "E2B_API_KEY": e2b_key(service.token)}
    d = DaemonProcess(provider="e2b", extra_env=env).start()
    try:
        _kept_through_an_outage(
            d, lambda c: c.create_sandbox("e2b", template=TEST_IMAGE, read_before_write=False),
            service.stop, service.start)
    finally:
        d.close()
        service.close()
