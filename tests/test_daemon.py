"""The daemon as a real process: restarts, crashes, workspaces, auth, SDK parity."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

import hutch
from hutch.client import AsyncRemoteSandbox, RemoteSandbox
from hutch.providers import _diskcap
from hutch.store.sqlite import SQLiteStore
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, cleaned_daemon, client, mounts_under  # noqa: F401 - cleaned_daemon is the daemon fixture
from tests.hazards import loop_devices_left


def managed_containers(data_dir: str | None = None) -> dict[str, str]:
    """sandbox id -> container id of every container hutch made (for one daemon)."""
    api = docker.APIClient()
    wanted = f"hutch.home={data_dir}" if data_dir else "hutch.managed=1"
    return {
        c["Labels"]["hutch.sandbox_id"]: c["Id"]
        for c in api.containers(all=True, filters={"label": wanted})
    }


def snapshot_images(data_dir: str) -> set[str]:
    """The snapshot images one daemon's data directory holds on the engine."""
    repository = "hutch-snapshot-" + hashlib.sha256(data_dir.encode()).hexdigest()[:12]
    return {t for i in docker.APIClient().images(repository) for t in i["RepoTags"] or []}


def assert_store_and_engine_agree(c: hutch.Client, d: DaemonProcess) -> None:
    live = {s["id"] for s in c.list_sandboxes() if s["state"] in ("running", "paused")}
    containers = managed_containers(d.data_dir)
    assert set(containers) == live, f"store {live} vs engine {set(containers)}"
    for ws in c.list_workspaces():
        assert ws["status"] in ("running", "suspended", "stale"), ws
    # Every docker snapshot on record has its image, and no image lacks a record.
    recorded = {s.id for s in c.snapshots() if s.provider == "docker"}
    assert {t.partition(":")[2] for t in snapshot_images(d.data_dir)} == recorded


def cleanup_workspaces(c: hutch.Client) -> None:
    for ws in c.list_workspaces():
        c.delete_workspace(ws["name"])


# -- restarts --------------------------------------------------------------------------


@pytest.mark.docker
def test_workspace_survives_daemon_crash_with_container_alive(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("alive", image=TEST_IMAGE)
        sb = c.get_sandbox(ws["live_sandbox_id"])
        for i in range(5):
            sb.write_text(f"file-{i}.txt", f"content {i}")
        sb.write_text("/root/in-rootfs.txt", "rootfs")
        assert sb.info()["workspace"] == "alive"
    daemon.restart()  # SIGKILL, then start: no cleanup ran
    with client(daemon) as c:
        listed = c.list_workspaces()
        assert [w["name"] for w in listed] == ["alive"]
        assert listed[0]["status"] == "running"
        sb = c.get_sandbox(listed[0]["live_sandbox_id"])
        for i in range(5):
            assert sb.read_text(f"file-{i}.txt") == f"content {i}"
        assert sb.read_text("/root/in-rootfs.txt") == "rootfs"
        assert sb.info()["workspace"] == "alive"
        assert len([s for s in c.list_sandboxes() if s["id"] == sb.id]) == 1
        assert_store_and_engine_agree(c, daemon)
        cleanup_workspaces(c)
    assert managed_containers(daemon.data_dir) == {}


@pytest.mark.docker
def test_workspace_goes_stale_when_its_container_is_gone(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("reboot", image=TEST_IMAGE)
        sb = c.get_sandbox(ws["live_sandbox_id"])
        sb.write_text("kept.txt", "the working directory survives")
    daemon.kill()
    docker.APIClient().remove_container(f"hutch-{ws['live_sandbox_id']}", force=True)
    daemon.start()
    with client(daemon) as c:
        stale = c.get_workspace("reboot")
        assert stale["status"] == "stale"
        assert stale["live_sandbox_id"] is None
        resumed = c.resume_workspace("reboot")
        assert resumed["status"] == "running"
        sb = c.get_sandbox(resumed["live_sandbox_id"])
        assert sb.read_text("kept.txt") == "the working directory survives"
        assert len(c.list_workspaces()) == 1
        # A workspace whose sandbox ends under it (deleted, reaped) is stale too.
        sb.close()
        assert c.get_workspace("reboot")["status"] == "stale"
        again = c.get_sandbox(c.resume_workspace("reboot")["live_sandbox_id"])
        assert again.read_text("kept.txt") == "the working directory survives"
        assert_store_and_engine_agree(c, daemon)
        cleanup_workspaces(c)
    assert managed_containers(daemon.data_dir) == {}


@pytest.fixture
def image_with_config() -> Iterator[str]:
    """The test image plus an ENV and a WORKDIR, as a user's image would have."""
    api = docker.APIClient()
    container = api.create_container(TEST_IMAGE, ["true"])
    tag = f"probe-{uuid.uuid4().hex[:12]}"  # its own: runs on one Engine at once
    api.commit(container["Id"], repository="hutch-test-config", tag=tag, changes=[
        'ENV HUTCH_PROBE="kept \\$value"', "WORKDIR /srv",
    ])
    api.remove_container(container["Id"], force=True)
    yield f"hutch-test-config:{tag}"
    api.remove_image(f"hutch-test-config:{tag}", force=True)


@pytest.mark.docker
def test_suspended_workspace_stays_suspended_across_a_crash(
    daemon: DaemonProcess, image_with_config: str
) -> None:
    states = []  # every state snapshot the workspace makes; none may outlive it
    with client(daemon) as c:
        ws = c.create_workspace("sleeper", image=image_with_config)
        sb = c.get_sandbox(ws["live_sandbox_id"])
        sb.write_text("work.txt", "in the workspace dir")
        sb.write_text("/root/layer.txt", "in the container layer")
        suspended = c.suspend_workspace("sleeper", diff=True)
        assert suspended["status"] == "suspended"
        assert suspended["state_snapshot_id"]
        states.append(suspended["state_snapshot_id"])
        assert managed_containers(daemon.data_dir) == {}  # memory freed: no container
    daemon.restart()
    with client(daemon) as c:
        assert c.get_workspace("sleeper")["status"] == "suspended"
        resumed = c.resume_workspace("sleeper")
        sb = c.get_sandbox(resumed["live_sandbox_id"])
        assert sb.read_text("work.txt") == "in the workspace dir"
        assert sb.read_text("/root/layer.txt") == "in the container layer"
        # A full (flattened) snapshot, then a resume from it, keeps everything too.
        sb.write_text("/root/second.txt", "second")
        states.append(c.suspend_workspace("sleeper", diff=False)["state_snapshot_id"])
        # One state snapshot per workspace: the one it replaced is gone.
        assert [s.id for s in c.snapshots()] == [states[-1]]
        again = c.get_sandbox(c.resume_workspace("sleeper")["live_sandbox_id"])
        assert again.read_text("/root/layer.txt") == "in the container layer"
        assert again.read_text("/root/second.txt") == "second"
        # Flattening keeps the image's environment, not only its files.
        assert again.exec('echo "$HUTCH_PROBE"').stdout == "kept $value\n"
        assert_store_and_engine_agree(c, daemon)
        c.delete_workspace("sleeper")
        with pytest.raises(hutch.NotFound):
            c.get_workspace("sleeper")
        assert c.snapshots() == [], "delete must drop the workspace's own state snapshot"
    tags = {t for i in docker.APIClient().images() for t in (i["RepoTags"] or [])}
    assert image_with_config in tags, "delete must keep the image it was made from"
    assert not any(t.endswith(tuple(states)) for t in tags), "state snapshots left behind"
    assert managed_containers(daemon.data_dir) == {}


def _kill_during(daemon: DaemonProcess, request: Any, delay: float) -> None:
    thread = threading.Thread(target=lambda: _swallow(request), daemon=True)
    thread.start()
    time.sleep(delay)
    daemon.kill()
    thread.join(30)


def _swallow(request: Any) -> None:
    try:
        request()
    except Exception:
        pass


@pytest.mark.docker
@pytest.mark.parametrize("delay", [0.05, 0.2])
def test_crash_in_the_middle_of_a_create(daemon: DaemonProcess, delay: float) -> None:
    c = client(daemon)
    _kill_during(daemon, lambda: c.create_workspace("halfmade", image=TEST_IMAGE), delay)
    daemon.start()
    with client(daemon) as c2:
        assert_store_and_engine_agree(c2, daemon)
        names = [w["name"] for w in c2.list_workspaces()]
        assert names in ([], ["halfmade"])
        if names:  # the create had finished: it is whole and usable
            ws = c2.get_workspace("halfmade")
            assert ws["status"] == "running"
            assert c2.get_sandbox(ws["live_sandbox_id"]).exec("true").exit_code == 0
        cleanup_workspaces(c2)
    assert managed_containers(daemon.data_dir) == {}


@pytest.mark.docker
def test_crash_in_the_middle_of_a_suspend(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("midsuspend", image=TEST_IMAGE)
        c.get_sandbox(ws["live_sandbox_id"]).write_text("keep.txt", "kept")
        # Make the commit slow enough to be cut in the middle.
        c.get_sandbox(ws["live_sandbox_id"]).exec(
            "head -c 50000000 /dev/urandom > /root/big.bin"
        )
        _kill_during(daemon, lambda: c.suspend_workspace("midsuspend", diff=True), 0.3)
    daemon.start()
    with client(daemon) as c:
        assert_store_and_engine_agree(c, daemon)
        status = c.get_workspace("midsuspend")["status"]
        assert status in ("running", "suspended", "stale")
        if status != "running":
            c.resume_workspace("midsuspend")
        sb = c.get_sandbox(c.get_workspace("midsuspend")["live_sandbox_id"])
        assert sb.read_text("keep.txt") == "kept"
        cleanup_workspaces(c)
        assert c.snapshots() == []
    assert managed_containers(daemon.data_dir) == {}


@pytest.mark.docker
@pytest.mark.parametrize("sandbox_after", ["alive", "gone"])
def test_a_suspend_cut_after_its_state_was_recorded(
    daemon: DaemonProcess, sandbox_after: str
) -> None:
    """Killed between recording the new state snapshot and naming it in the
    workspace: with its sandbox alive the workspace runs on and the
    unnamed snapshot goes (the sandbox has everything); with the sandbox
    gone, that snapshot is the latest state and becomes the workspace's."""
    with client(daemon) as c:
        ws = c.create_workspace("cut", image=TEST_IMAGE)
        live = c.get_sandbox(ws["live_sandbox_id"])
        live.write_text("keep.txt", "kept")
        state = live.snapshot("workspace cut state")
        live.write_text("after.txt", "after the state")
    daemon.kill()
    store = SQLiteStore(os.path.join(daemon.data_dir, "hutch.db"))
    try:
        row = store.get_workspace("cut")
        assert row is not None
        row.status = "suspending"
        store.put_workspace(row)
    finally:
        store.close()
    if sandbox_after == "gone":
        docker.APIClient().remove_container(f"hutch-{ws['live_sandbox_id']}", force=True)
    daemon.start()
    with client(daemon) as c:
        found = c.get_workspace("cut")
        if sandbox_after == "alive":
            assert found["status"] == "running"
            assert state.id not in {s.id for s in c.snapshots()}
            sb = c.get_sandbox(found["live_sandbox_id"])
            assert sb.read_text("after.txt") == "after the state"
        else:
            assert found["status"] == "stale"
            assert found["state_snapshot_id"] == state.id
            sb = c.get_sandbox(c.resume_workspace("cut")["live_sandbox_id"])
        assert sb.read_text("keep.txt") == "kept"
        cleanup_workspaces(c)
        assert c.snapshots() == []
    assert managed_containers(daemon.data_dir) == {}


@pytest.mark.docker
def test_unknown_hutch_containers_are_removed_at_start(daemon: DaemonProcess) -> None:
    api = docker.APIClient()
    stray = api.create_container(
        TEST_IMAGE, ["sleep", "infinity"], labels={
            "hutch.managed": "1", "hutch.sandbox_id": "sb-stray",
            "hutch.home": daemon.data_dir,
        },
    )
    # An in-process sandbox (another program's) carries no daemon label: untouched.
    other = api.create_container(
        TEST_IMAGE, ["sleep", "infinity"],
        labels={"hutch.managed": "1", "hutch.sandbox_id": "sb-in-process"},
    )
    api.start(stray["Id"])
    api.start(other["Id"])
    try:
        daemon.restart()
        assert "sb-stray" not in managed_containers()
        assert "sb-in-process" in managed_containers()
    finally:
        api.remove_container(other["Id"], force=True)
    with client(daemon) as c:
        events = c.events("sb-stray")
        assert any("orphan" in e["kind"] for e in events)


@pytest.mark.docker
@pytest.mark.parametrize("store_says", ["creating", "nothing"])
def test_a_capped_working_directory_the_store_does_not_keep_is_released_at_start(
    daemon: DaemonProcess, store_says: str
) -> None:
    """A daemon killed while it made a sandbox (its row still ``creating``), or
    a store that no longer names a sandbox at all: the next start lets go of
    that sandbox's size-capped working directory (its loop mount, the loop
    device and the image), not only of its container."""
    with client(daemon) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, disk="64m")
        sb.write_text("kept.txt", "x")
    # Layered: the overlay's upper directory is in a store of the cap's size.
    workdir = os.path.join(daemon.data_dir, "layers", "stores", sb.id)
    image = workdir + ".img"
    merged = os.path.join(daemon.data_dir, "layers", "mounts", sb.id, "merged")
    assert os.path.ismount(workdir) and os.path.ismount(merged)
    assert _diskcap.loop_devices_backed_by(image)
    daemon.kill()
    store = SQLiteStore(os.path.join(daemon.data_dir, "hutch.db"))
    try:
        row = store.get_sandbox(sb.id)
        assert row is not None
        if store_says == "creating":
            row.state = "creating"
            store.put_sandbox(row)
        else:
            store.delete_sandbox(sb.id)
    finally:
        store.close()
    daemon.start()
    assert not os.path.ismount(workdir)
    assert loop_devices_left(image) == []
    assert not os.path.exists(workdir) and not os.path.exists(image)
    assert not os.path.exists(os.path.dirname(merged))
    assert sb.id not in managed_containers(daemon.data_dir)


def test_local_sandbox_is_adopted_after_a_crash(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    with client(daemon) as c:
        sb = c.create_sandbox("local", workdir=workdir, max_lifetime=3600)
        sb.write_text("note.txt", "before")
        # The set_timeout deadline (sooner than max_lifetime) outlives the crash.
        deadline = sb.set_timeout(1000)
        time.sleep(0.5)
        running_before = sb.info()["meter"]["running_s"]
    daemon.restart()
    with client(daemon) as c:
        again = c.get_sandbox(sb.id)
        assert again.read_text("note.txt") == "before"
        info = again.info()
        assert info["deadline_unix"] == pytest.approx(deadline, abs=2)
        assert info["meter"]["running_s"] >= running_before
        again.close()
        with pytest.raises(hutch.SandboxUnavailable):
            c.get_sandbox(sb.id).exec("true")
    shutil.rmtree(workdir, ignore_errors=True)


def test_wire_names_and_errors(daemon: DaemonProcess) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers) as http:
        made = http.post("/v1/sandboxes", json={"provider": "local", "workdir": daemon.data_dir})
        assert made.status_code == 201
        sid = made.json()["id"]
        assert made.json()["state"] == "running"
        answer = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"]})
        assert answer.json() == {"exit_code": 0, "stdout": "hi\n", "stderr": ""}
        before = time.time()
        deadline = http.post("/v1/set_timeout", json={"sandbox": sid, "timeout_seconds": 100})
        assert before + 100 <= deadline.json()["deadline_unix"] <= time.time() + 100
        too_big = http.post("/v1/set_timeout", json={"sandbox": sid, "timeout_seconds": 86401})
        assert too_big.status_code == 400
        assert too_big.json()["error"]["code"] == "timeout_too_large"
        assert "86400" in too_big.json()["error"]["message"]
        missing = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "nope.txt"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "file_not_found"
        assert "nope.txt" in missing.json()["error"]["message"]
        unsupported = http.post("/v1/pause", json={"sandbox": sid})
        assert unsupported.status_code == 501
        assert unsupported.json()["error"]["code"] == "capability_unsupported"
        bad = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "timeout": -1})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        gone = http.get("/v1/sandboxes/sb-nothing")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_status_reads_are_not_activity(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox("local", workdir=daemon.data_dir, idle_timeout=1)
        for _ in range(12):
            c.list_sandboxes()
            time.sleep(0.25)
        with pytest.raises(hutch.IdleTimeoutExpired):
            sb.exec("true")


def test_sessions_have_their_own_read_before_write(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    with client(daemon) as first, client(daemon) as second:
        sb = first.create_sandbox("local", workdir=workdir)
        sb.write_text("shared.txt", "by the first session")
        other = second.get_sandbox(sb.id)
        with pytest.raises(hutch.ReadBeforeWrite):
            other.write_text("shared.txt", "blind overwrite")
        assert other.read_text("shared.txt") == "by the first session"
        other.write_text("shared.txt", "after reading")
        sb.close()
    shutil.rmtree(workdir, ignore_errors=True)


# -- auth ---------------------------------------------------------------------------------


def test_every_route_needs_the_token(daemon: DaemonProcess) -> None:
    schema = httpx.get(f"{daemon.url}/openapi.json",
                       headers={"Authorization": f"Bearer {daemon.token}"}).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs")]
    assert len(routes) > 25
    # One client: a new one per request costs more than the request.
    with httpx.Client(base_url=daemon.url, timeout=60) as http:
        for method, path in routes:
            url = re.sub(r"\{[^}]+\}", "x", path)
            for headers in ({}, {"Authorization": "Bearer wrong-token"},
                            {"Authorization": daemon.token}):
                answer = http.request(method, url, headers=headers, json={})
                assert answer.status_code == 401, (method, path, headers, answer.status_code)
                if answer.headers.get("content-type") == "application/json":
                    assert answer.json()["error"]["code"] == "unauthorized"


def test_non_loopback_bind_without_token_is_refused() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "hutch.server", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "token" in result.stderr


# -- SDK parity ------------------------------------------------------------------------------


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


@pytest.mark.parametrize(
    ("sync_cls", "async_cls"),
    [(hutch.Client, hutch.AsyncClient), (RemoteSandbox, AsyncRemoteSandbox),
     (hutch.client.RemoteProcess, hutch.client.AsyncRemoteProcess)],
)
def test_sync_and_async_have_the_same_methods(sync_cls: type, async_cls: type) -> None:
    sync_methods, async_methods = _public(sync_cls), _public(async_cls)
    # Closing is close() in sync code and aclose() in async code, as in httpx.
    sync_methods.pop("close", None) if sync_cls is hutch.Client else None
    async_methods.pop("aclose", None)
    assert set(sync_methods) == set(async_methods)
    for name, signature in sync_methods.items():
        twin = async_methods[name]
        assert signature.parameters == twin.parameters, name
        # The same result, each face's own class of it (RemoteSandbox /
        # AsyncRemoteSandbox, an iterator / an async iterator, a context
        # manager / an async one).
        assert str(signature.return_annotation) == str(twin.return_annotation).replace(
            "AsyncRemote", "Remote").replace("AsyncIterator[", "Iterator[").replace(
            "AbstractAsyncContextManager[", "AbstractContextManager["), name
        # Asynchronous where it talks to the daemon; a check made on the spot
        # (path, require) is one plain function shared by both faces.
        shared = getattr(async_cls, name) is getattr(sync_cls, name)
        streams = str(twin.return_annotation).startswith(
            ("AsyncIterator[", "AbstractAsyncContextManager["))
        assert inspect.iscoroutinefunction(getattr(async_cls, name)) or shared or streams, name


def _parameters(cls: type, name: str) -> list[tuple[str, Any, Any]]:
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("remote_cls", [AsyncRemoteSandbox, RemoteSandbox])
def test_remote_sandbox_offers_what_a_sandbox_offers(remote_cls: type) -> None:
    """Every public method and property, both ways, with the same parameters."""
    local = {n for n in dir(hutch.Sandbox) if not n.startswith("_")}
    remote = {n for n in dir(remote_cls) if not n.startswith("_")}
    assert local == remote, (local - remote, remote - local)
    for name in local:
        local_attr, remote_attr = getattr(hutch.Sandbox, name), getattr(remote_cls, name)
        assert isinstance(local_attr, property) == isinstance(remote_attr, property), name
        if callable(local_attr):
            assert _parameters(hutch.Sandbox, name) == _parameters(remote_cls, name), name


@pytest.mark.parametrize("remote_cls", [hutch.client.AsyncRemoteProcess,
                                        hutch.client.RemoteProcess])
def test_remote_process_offers_what_a_process_offers(remote_cls: type) -> None:
    local = {n for n in dir(hutch.Process) if not n.startswith("_")}
    remote = {n for n in dir(remote_cls) if not n.startswith("_")}
    assert local == remote, (local - remote, remote - local)


def test_a_streamed_background_command_tells_its_handle_it_ended(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox("local", read_before_write=False)
        try:
            proc = sb.start("echo streamed; exit 3")
            events = list(proc.stream())
            assert isinstance(events[-1], hutch.ExitStatus) and events[-1].exit_code == 3
            # The stream's end told the handle: no wait was asked for.
            assert (proc.running, proc.exit_code) == (False, 3)
        finally:
            sb.close()


@pytest.mark.docker
def test_workspace_auto_suspends_on_idle_and_comes_back(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("napper", image=TEST_IMAGE, idle_suspend_after=1)
        sb = c.get_sandbox(ws["live_sandbox_id"])
        sb.write_text("/root/kept.txt", "kept")
        deadline = time.monotonic() + 10
        while c.get_workspace("napper")["status"] != "suspended":
            assert time.monotonic() < deadline, "workspace never suspended on idle"
            time.sleep(0.2)
        assert managed_containers(daemon.data_dir) == {}  # its memory is freed
    daemon.restart()  # a crash while it sleeps: it is adopted as it was
    with client(daemon) as c:
        assert c.get_workspace("napper")["status"] == "suspended"
        sb = c.get_sandbox(ws["live_sandbox_id"])
        # The next call resumes it transparently, with its files.
        assert sb.read_text("/root/kept.txt") == "kept"
        assert c.get_workspace("napper")["status"] == "running"
        assert_store_and_engine_agree(c, daemon)
        cleanup_workspaces(c)


@pytest.mark.docker
def test_crash_in_the_middle_of_a_delete(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("halfgone", image=TEST_IMAGE)
        c.get_sandbox(ws["live_sandbox_id"]).write_text("/root/x.txt", "x")
        c.suspend_workspace("halfgone", diff=True)
        c.resume_workspace("halfgone")
        _kill_during(daemon, lambda: c.delete_workspace("halfgone"), 0.1)
    daemon.start()
    with client(daemon) as c:
        # Either the delete had not begun (the workspace is whole) or it is finished.
        names = [w["name"] for w in c.list_workspaces()]
        assert_store_and_engine_agree(c, daemon)
        if names:
            ws = c.get_workspace("halfgone")
            assert ws["status"] in ("running", "stale")
            cleanup_workspaces(c)
        assert c.snapshots() == []
    assert snapshot_images(daemon.data_dir) == set(), "a state snapshot outlived its workspace"
    assert managed_containers(daemon.data_dir) == {}


def test_list_and_get_agree(daemon: DaemonProcess) -> None:
    """Every listed sandbox, live or ended, is found by id with the same description."""
    with client(daemon) as c:
        kept = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        ended = c.create_sandbox("local", workdir=tempfile.mkdtemp())
        ended.close()
        live = c.list_sandboxes()
        everything = c.list_sandboxes(include_ended=True)
        assert [s["id"] for s in live] == [kept.id]
        assert {s["id"] for s in everything} == {kept.id, ended.id}
        stable = ("id", "provider", "state", "reason", "workdir", "capabilities",
                  "created_at_unix", "workspace")
        for listed in everything:
            got = c.get_sandbox(listed["id"])
            info = got.info()
            assert set(info) == set(listed), listed["id"]
            assert {k: info[k] for k in stable} == {k: listed[k] for k in stable}
            assert got.state == listed["state"] and got.status().state == listed["state"]
        kept.close()


@pytest.mark.docker
def test_a_suspended_capped_workspace_holds_no_mounted_store(daemon: DaemonProcess) -> None:
    """Every daemon sandbox is capped (a store each): a suspended workspace's
    state chain stacks one store a suspend, none of them left mounted."""
    stores = os.path.join(daemon.data_dir, "layers", "stores")
    with client(daemon) as c:
        ws = c.create_workspace("resting", image=TEST_IMAGE)
        c.get_sandbox(ws["live_sandbox_id"]).write_text("a.txt", "A")
        c.suspend_workspace("resting", diff=True)
        sb = c.get_sandbox(c.resume_workspace("resting")["live_sandbox_id"])
        sb.write_text("b.txt", "B")
        c.suspend_workspace("resting", diff=True)
        images = [os.path.join(stores, n) for n in os.listdir(stores) if n.endswith(".img")]
        assert len(images) == 2
        assert mounts_under(stores) == []
        # Each loop device clears itself once the last copy of its mount goes
        # (a container's mount namespace lets go of its copy a little after
        # the container is removed): waited for, not expected at once.
        assert [loop_devices_left(image) for image in images] == [[], []]
        sb = c.get_sandbox(c.resume_workspace("resting")["live_sandbox_id"])
        assert (sb.read_text("a.txt"), sb.read_text("b.txt")) == ("A", "B")
        c.delete_workspace("resting")
