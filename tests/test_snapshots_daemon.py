"""Snapshots, forks and workspaces through a real daemon, on local and docker:
lineage, dependencies, the two data-loss bugs, and SIGKILL mid-snapshot and
mid-fork (after a restart the store and the provider agree)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx
import pytest

import hutch
from hutch.providers import layers
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, cleaned_daemon, client, end_everything  # noqa: F401 - cleaned_daemon is the daemon fixture

PROVIDERS = [
    pytest.param({"provider": "local", "read_before_write": False}, id="local"),
    pytest.param({"provider": "docker", "image": TEST_IMAGE, "read_before_write": False},
                 id="docker",
                 marks=pytest.mark.docker),
]



def held(d: DaemonProcess, provider: str) -> set[str]:
    """What the provider holds for this daemon's data directory."""
    import anyio

    old = os.environ.get("HUTCH_HOME")
    os.environ["HUTCH_HOME"] = d.data_dir
    try:
        return set(anyio.run(hutch.providers.get_provider(provider).held_snapshots))
    finally:
        if old is None:
            os.environ.pop("HUTCH_HOME", None)
        else:
            os.environ["HUTCH_HOME"] = old


def assert_store_and_provider_agree(c: hutch.Client, d: DaemonProcess, provider: str) -> None:
    recorded = {s.id for s in c.snapshots() if s.provider == provider}
    assert held(d, provider) == recorded


def cleanup(c: hutch.Client) -> None:
    end_everything(c, force=False)  # unforced: each removal is refused if anything needs it


@pytest.mark.parametrize("settings", PROVIDERS)
def test_fork_three_branches_through_the_daemon(daemon: DaemonProcess, settings: Any) -> None:
    with client(daemon) as c:
        origin = c.create_sandbox(**settings)
        origin.write_text("a.txt", "A")
        fork = origin.fork("three", count=3)
        assert len(fork.branches) == 3
        assert fork.snapshot.sandbox_id == origin.id
        for i, branch in enumerate(fork.branches):
            branch.write_text(f"b{i}.txt", str(i))
            branch.write_text("a.txt", f"A{i}")
        for i, branch in enumerate(fork.branches):
            assert branch.read_text("a.txt") == f"A{i}"
            assert [branch.exists(f"b{j}.txt") for j in range(3)] == [j == i for j in range(3)]
        assert origin.read_text("a.txt") == "A"
        assert not any(origin.exists(f"b{j}.txt") for j in range(3))
        later = fork.attach()
        assert later.read_text("a.txt") == "A"
        # A fork of a fork: the tree shows both parents.
        second = fork.branches[0].snapshot("second")
        assert second.parent_id == fork.snapshot.id
        tree = {s.id: s.parent_id for s in c.snapshots()}
        assert tree[second.id] == fork.snapshot.id and tree[fork.snapshot.id] is None
        # The parent is needed (a child, live branches): refused.
        with pytest.raises(hutch.InvalidState, match="still needed"):
            c.delete_snapshot(fork.snapshot.id)
        # Forced, the answer names what it broke: a branch still on it.
        third = later.snapshot("third")
        on_third = c.create_sandbox(from_snapshot=third.id)
        assert c.delete_snapshot(third.id, force=True) == [
            hutch.SnapshotDependent("sandbox", on_third.id)]
        assert on_third.read_text("a.txt") == "A"  # it goes on running
        on_third.close()
        assert_store_and_provider_agree(c, daemon, settings["provider"])
        cleanup(c)
        assert c.snapshots() == []
        assert held(daemon, settings["provider"]) == set()


@pytest.mark.parametrize("settings", PROVIDERS)
def test_a_sandbox_from_a_snapshot_has_its_workspace(
    daemon: DaemonProcess, settings: Any
) -> None:
    """Bug: a sandbox or workspace started from a snapshot started empty."""
    with client(daemon) as c:
        origin = c.create_sandbox(**settings)
        origin.write_text("src/main.py", "print('hi')\n")
        snap = origin.snapshot("setup")
        origin.close()
        sb = c.create_sandbox(from_snapshot=snap.id, idle_timeout=600)
        assert sb.read_text("src/main.py") == "print('hi')\n"
        ws = c.create_workspace("fromsnap", snapshot_tag=snap.id)
        assert c.get_sandbox(ws["live_sandbox_id"]).read_text("src/main.py") == "print('hi')\n"
        cleanup(c)


@pytest.mark.parametrize("settings", PROVIDERS)
def test_a_workspace_made_from_another_keeps_its_source(
    daemon: DaemonProcess, settings: Any
) -> None:
    """Bug: deleting ws1, or suspending it again, removed or changed ws5's source."""
    with client(daemon) as c:
        ws1 = c.create_workspace("ws1", **settings)
        c.get_sandbox(ws1["live_sandbox_id"]).write_text("f.txt", "first")
        source = c.suspend_workspace("ws1")["state_snapshot_id"]
        c.create_workspace("ws5", snapshot_tag=source)
        # ws1 goes on: a new suspend replaces ws1's state, not ws5's source.
        ws1 = c.resume_workspace("ws1")
        c.get_sandbox(ws1["live_sandbox_id"]).write_text("f.txt", "second")
        assert c.suspend_workspace("ws1")["state_snapshot_id"] != source
        c.delete_workspace("ws1")
        assert c.get_snapshot(source).id == source
        assert c.get_workspace("ws5")["source_snapshot_id"] == source
        ws6 = c.create_workspace("ws6", snapshot_tag=source)
        assert c.get_sandbox(ws6["live_sandbox_id"]).read_text("f.txt") == "first"
        assert_store_and_provider_agree(c, daemon, settings["provider"])
        cleanup(c)


@pytest.mark.parametrize("settings", PROVIDERS)
def test_local_and_docker_workspaces_survive_sigkill(
    daemon: DaemonProcess, settings: Any
) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("kept", **settings)
        c.get_sandbox(ws["live_sandbox_id"]).write_text("w.txt", "alive")
        c.create_workspace("sleeping", **settings)
        c.suspend_workspace("sleeping")
    daemon.restart()
    with client(daemon) as c:
        alive = c.get_workspace("kept")
        assert alive["status"] == "running"
        assert c.get_sandbox(alive["live_sandbox_id"]).read_text("w.txt") == "alive"
        assert c.get_workspace("sleeping")["status"] == "suspended"
        c.resume_workspace("sleeping")
        assert_store_and_provider_agree(c, daemon, settings["provider"])
        cleanup(c)


def _kill_during(daemon: DaemonProcess, request: Any, delay: float) -> None:
    def run() -> None:
        try:
            request()
        except Exception:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(delay)
    daemon.kill()
    thread.join(30)


@pytest.mark.parametrize("settings", PROVIDERS)
@pytest.mark.parametrize("what", ["snapshot", "fork"])
def test_sigkill_during_a_snapshot_or_a_fork(
    daemon: DaemonProcess, settings: Any, what: str
) -> None:
    with client(daemon) as c:
        origin = c.create_sandbox(**settings)
        # Enough to copy that the kill lands in the middle.
        origin.exec("mkdir -p big && for i in $(seq 1 3000); do echo $i > big/f$i; done")
        origin.exec("head -c 30000000 /dev/urandom > blob.bin")
        sid = origin.id
        if what == "snapshot":
            _kill_during(daemon, lambda: origin.snapshot("cut"), 0.3)
        else:
            _kill_during(daemon, lambda: origin.fork("cut", count=3), 0.6)
    daemon.start()
    with client(daemon) as c:
        # No half snapshot listed, none held without a record.
        assert_store_and_provider_agree(c, daemon, settings["provider"])
        live = {s["id"] for s in c.list_sandboxes()}
        assert sid in live
        for snap in c.snapshots():
            branch = c.create_sandbox(from_snapshot=snap.id)
            assert branch.read_text("big/f3000") == "3000\n"
        # No orphan branch directory: each is a live sandbox's.
        old = os.environ.get("HUTCH_HOME")
        os.environ["HUTCH_HOME"] = daemon.data_dir
        try:
            assert set(layers.branches()) <= {s["id"] for s in c.list_sandboxes()}
        finally:
            if old is None:
                os.environ.pop("HUTCH_HOME", None)
            else:
                os.environ["HUTCH_HOME"] = old
        cleanup(c)


def test_snapshot_wire_shapes(daemon: DaemonProcess) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as http:
        sid = http.post("/v1/sandboxes", json={"provider": "virtual"}).json()["id"]
        made = http.post(f"/v1/sandboxes/{sid}/snapshots", json={"label": "x"})
        assert made.status_code == 201
        snap = made.json()
        assert set(snap) >= {"id", "label", "sandbox_id", "parent_id", "size_bytes",
                             "created_at_unix"}
        fork = http.post(f"/v1/sandboxes/{sid}/fork", json={"label": "f", "count": 2})
        assert fork.status_code == 201
        assert len(fork.json()["sandboxes"]) == 2
        assert fork.json()["snapshot"]["parent_id"] == snap["id"]
        assert http.get(f"/v1/snapshots/{snap['id']}").json() == snap
        assert http.delete(f"/v1/snapshots/{snap['id']}").status_code == 409
        # Forced from under its child: the answer says what it broke.
        child = fork.json()["snapshot"]["id"]
        forced = http.delete(f"/v1/snapshots/{snap['id']}?force=true")
        assert forced.status_code == 200
        assert forced.json() == {"id": snap["id"],
                                 "broken": [{"kind": "snapshot", "id": child}]}
        assert http.get(f"/v1/snapshots/{snap['id']}").status_code == 404
        # Nothing needs it: 204, no body, as ever.
        lone = http.post(f"/v1/sandboxes/{sid}/snapshots", json={}).json()["id"]
        plain = http.delete(f"/v1/snapshots/{lone}?force=true")
        assert plain.status_code == 204 and plain.content == b""
        bad = http.post(f"/v1/sandboxes/{sid}/fork", json={"count": 10_000})
        assert bad.status_code == 400
        attached = http.post("/v1/sandboxes", json={"from_snapshot": "snap-nothing"})
        assert attached.status_code == 404
        wrong = http.post("/v1/sandboxes", json={
            "from_snapshot": fork.json()["snapshot"]["id"], "image": "x"})
        assert wrong.status_code == 400
        local = http.post("/v1/sandboxes", json={"provider": "local"}).json()["id"]
        assert http.post(f"/v1/sandboxes/{local}/fork", json={}).status_code == 201


@pytest.mark.parametrize("remote_cls", [hutch.client.AsyncRemoteFork, hutch.client.RemoteFork])
def test_remote_fork_offers_what_a_fork_offers(remote_cls: type) -> None:
    import inspect

    local = {n for n in dir(hutch.Fork) if not n.startswith("_")}
    remote = {n for n in dir(remote_cls) if not n.startswith("_")}
    assert local == remote == {"attach", "close"}
    for name in ("attach", "close"):
        assert (inspect.signature(getattr(hutch.Fork, name)).parameters.keys()
                == inspect.signature(getattr(remote_cls, name)).parameters.keys())


@pytest.mark.anyio
async def test_attach_and_close_of_a_remote_fork_keep_its_branches_as_in_process(
    daemon: DaemonProcess,
) -> None:
    """fork.attach() adds to fork.branches and fork.close() ends them and
    removes the snapshot, in-process and through the daemon, sync and async."""
    import anyio

    async def in_process() -> tuple[int, ...]:
        async with await hutch.create_sandbox("virtual", read_before_write=False) as sb:
            fork = await sb.fork("f", count=1)
            seen = [len(fork.branches)]
            await fork.attach()
            await fork.attach()
            seen.append(len(fork.branches))
            await fork.close()
            seen.append(len(fork.branches))
            return tuple(seen)

    async def through_async() -> tuple[int, ...]:
        async with hutch.AsyncClient(daemon.url, token=daemon.token) as c:
            sb = await c.create_sandbox("virtual", read_before_write=False)
            fork = await sb.fork("f", count=1)
            seen = [len(fork.branches)]
            branches = [*fork.branches, await fork.attach(), await fork.attach()]
            assert [b.id for b in fork.branches] == [b.id for b in branches]
            seen.append(len(fork.branches))
            await fork.close()
            seen.append(len(fork.branches))
            assert all(b.closed for b in branches)
            live = {s["id"] for s in await c.list_sandboxes()}
            assert live == {sb.id}
            assert fork.snapshot.id not in {s.id for s in await c.snapshots()}
            await sb.close()
            return tuple(seen)

    def through_sync() -> tuple[int, ...]:
        with client(daemon) as c:
            sb = c.create_sandbox("virtual", read_before_write=False)
            fork = sb.fork("f", count=1)
            seen = [len(fork.branches)]
            branches = [*fork.branches, fork.attach(), fork.attach()]
            assert [b.id for b in fork.branches] == [b.id for b in branches]
            seen.append(len(fork.branches))
            fork.close()
            seen.append(len(fork.branches))
            assert all(b.closed for b in branches)
            assert {s["id"] for s in c.list_sandboxes()} == {sb.id}
            assert fork.snapshot.id not in {s.id for s in c.snapshots()}
            sb.close()
            return tuple(seen)

    expected = (1, 3, 0)
    assert await in_process() == expected
    assert await through_async() == expected
    assert await anyio.to_thread.run_sync(through_sync) == expected
