"""Warm pools on a real daemon (bubblewrap, docker): kept full from hutch.toml
and the API, a matching create takes one and the pool refills, the sandbox
taken is as fresh as a cold one (its own working directory and options, no
earlier process, its clocks and events from the take), a runtime that dies
in the pool is never handed out, pools of definitions, pools kept across a
restart, under the operator's max_sandboxes, managed from the CLI, and
drained on stop with nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hutch
from hutch.client import RemoteSandbox
from hutch.store import SQLiteStore
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, containers_of, mounts_under, sandbox_processes
from tests.diskfill import fill

HUTCH = [sys.executable, "-m", "hutch.cli.main"]
#: A hang guard for a pool to fill (not a timing check).
FILL_GUARD_SECONDS = 120
#: What lists a sandbox's processes from inside it (the listing's own shell among them).
PROCESSES = "for p in /proc/[0-9]*; do cat $p/comm 2>/dev/null; done"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    config = tmp_path_factory.mktemp("pools") / "hutch.toml"
    config.write_text('[pools.warm]\nsize = 2\nprovider = "bubblewrap"\n')
    d = DaemonProcess(extra_args=["--config", str(config)]).start()
    try:
        yield d
    finally:
        d.close()


def until(what: str, check: Callable[[], bool]) -> None:
    give_up = time.monotonic() + FILL_GUARD_SECONDS
    while not check():
        assert time.monotonic() < give_up, f"never: {what}"
        time.sleep(0.05)


def pool(c: hutch.Client, name: str) -> dict[str, object]:
    return next(p for p in c.list_pools() if p["name"] == name)


def scrape(d: DaemonProcess, metric: str, name: str) -> float:
    answer = httpx.get(f"{d.url}/metrics", headers={"Authorization": f"Bearer {d.token}"})
    return sum(s.value for f in text_string_to_metric_families(answer.text)
               for s in f.samples
               if s.name == metric and s.labels == {"pool": name})


def scrape_pool_hits(d: DaemonProcess, name: str) -> float:
    return scrape(d, "hutch_pool_hits_total", name)


def stored_spec(d: DaemonProcess, sandbox_id: str) -> dict[str, object]:
    store = SQLiteStore(os.path.join(d.data_dir, "hutch.db"))
    try:
        row = store.get_sandbox(sandbox_id)
        assert row is not None
        return row.spec
    finally:
        store.close()


def test_a_create_takes_a_ready_sandbox_and_the_pool_refills(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        until("the pool is full", lambda: pool(c, "warm")["ready"] == 2)
        assert c.list_sandboxes() == []  # kept ready: not sandboxes yet
        hits = pool(c, "warm")["hits"]
        assert isinstance(hits, int)
        before = time.time()
        warm = c.create_sandbox("bubblewrap", max_lifetime=300)
        cold = c.create_sandbox("bubblewrap", max_lifetime=300, memory="512m")  # no pool's
        try:
            assert pool(c, "warm")["hits"] == hits + 1
            assert scrape_pool_hits(daemon, "warm") == hits + 1
            info = warm.info()
            # Fresh: made now as far as anyone sees, its deadline from now, nothing run in it.
            assert info["created_at_unix"] >= before
            assert info["deadline_unix"] >= before + 300
            assert warm.processes() == []
            assert warm.exec("ls -A .").stdout == cold.exec("ls -A .").stdout
            assert sorted(s["id"] for s in c.list_sandboxes()) == sorted([warm.id, cold.id])
            until("the pool refills", lambda: pool(c, "warm")["ready"] == 2)
        finally:
            c.delete_sandbox(warm.id)
            c.delete_sandbox(cold.id)


def test_pools_from_the_cli(daemon: DaemonProcess) -> None:
    env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token, COLUMNS="200")

    def hutch_cli(*args: str) -> str:
        ran = subprocess.run([*HUTCH, "pool", *args], env=env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    hutch_cli("set", "small", "1", "--provider", "bubblewrap", "--set", "memory=256m")
    with hutch.Client(daemon.url, token=daemon.token) as c:
        until("the new pool fills", lambda: pool(c, "small")["ready"] == 1)
        listed = hutch_cli("ls")
        assert "small" in listed and "memory=256m" in listed and "warm" in listed
        hutch_cli("set", "small", "0")  # a resize: its settings stay
        assert pool(c, "small")["ready"] == 0
        assert pool(c, "small")["settings"] == {"provider": "bubblewrap", "memory": "256m"}
        hutch_cli("rm", "small")
        assert [p["name"] for p in c.list_pools()] == ["warm"]
        with pytest.raises(hutch.NotFound):
            c.remove_pool("small")
        with pytest.raises(hutch.InvalidArgument):
            c.set_pool("bad name", 1, {"provider": "bubblewrap"})


def test_a_pooled_sandbox_is_as_fresh_as_a_made_one(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        until("the pool is full", lambda: pool(c, "warm")["ready"] == 2)
        time.sleep(1)  # its runtimes wait a while: what the take shows starts at the take
        hits = pool(c, "warm")["hits"]
        before = time.time()
        warm = c.create_sandbox("bubblewrap", idle_timeout=600, max_lifetime=300,
                                metadata={"asked": "warm"})
        other = c.create_sandbox("bubblewrap")  # the pool's other runtime
        cold = c.create_sandbox("bubblewrap", memory="512m", metadata={"asked": "cold"})
        try:
            assert pool(c, "warm")["hits"] == hits + 2  # warm and other were the pool's
            info, now = warm.info(), time.time()
            # Its clocks from the take: made now, idle since, its deadline from now.
            assert before <= info["created_at_unix"] <= now
            assert info["idle_seconds"] <= now - before
            assert info["meter"]["running_s"] <= now - before
            assert before + 300 <= info["deadline_unix"] <= now + 300
            # The create's options, not the pool's (which set none).
            options = stored_spec(daemon, warm.id)["options"]
            assert isinstance(options, dict)
            assert options["metadata"] == {"asked": "warm"} and options["idle_timeout"] == 600
            assert stored_spec(daemon, other.id)["options"] == stored_spec(daemon, cold.id)[
                "options"] | {"metadata": {}}
            # No earlier process: what runs in it is what runs in a made one.
            assert warm.processes() == []
            assert sorted(warm.exec(PROCESSES).stdout.split()) == sorted(
                cold.exec(PROCESSES).stdout.split())
            # Its own working directory: nothing in it, and nothing of another's.
            assert warm.exec("ls -A .").stdout == cold.exec("ls -A .").stdout
            warm.write_text("mine.txt", "warm's")
            assert "mine.txt" not in other.exec("ls -A .").stdout
            # Its events: those of a made sandbox, from the take, saying where it came from.
            events = c.events(warm.id)
            assert [e["kind"] for e in events] == [e["kind"] for e in c.events(cold.id)]
            assert all(e["at_unix"] >= before for e in events)
            made = next(e["message"] for e in events if e["kind"] == "created")
            assert "warm pool warm" in made
        finally:
            for sb in (warm, other, cold):
                c.delete_sandbox(sb.id)


@pytest.mark.docker
def test_a_runtime_that_dies_in_the_pool_is_never_handed_out(daemon: DaemonProcess) -> None:
    def sandbox_ids() -> dict[str, str]:
        """The pool's containers (the only docker ones of this daemon): sandbox id -> container."""
        held = containers_of(daemon.data_dir)
        if not held:
            return {}
        labels = subprocess.run(
            ["docker", "inspect", "-f", '{{index .Config.Labels "hutch.sandbox_id"}}', *held],
            capture_output=True, text=True, check=False, timeout=120).stdout.split()
        return dict(zip(labels, held, strict=False))

    settings = {"provider": "docker", "image": TEST_IMAGE}
    taken: list[RemoteSandbox] = []
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.set_pool("dying", 2, settings)
        try:
            until("the pool is full", lambda: pool(c, "dying")["ready"] == 2)
            killed, container = next(iter(sandbox_ids().items()))
            subprocess.run(["docker", "rm", "-f", container], check=True, capture_output=True,
                           timeout=120)
            # Its watcher told the pool, which made another in its place.
            until("the dead one is replaced", lambda: len(sandbox_ids()) == 2
                  and killed not in sandbox_ids() and pool(c, "dying")["ready"] == 2)
            for _ in range(2):
                taken.append(c.create_sandbox("docker", image=TEST_IMAGE))
            assert killed not in [sb.id for sb in taken]
            assert [sb.exec("echo ok").stdout for sb in taken] == ["ok\n", "ok\n"]
        finally:
            c.remove_pool("dying")
            for sb in taken:
                c.delete_sandbox(sb.id)
        assert containers_of(daemon.data_dir) == []  # the pool's are gone with it


def test_a_pool_of_a_definition(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.put_definition({
            # Settings of its own (a pool of a create's same settings would serve it too).
            "id": "pooled", "provider": {"type": "bubblewrap", "memory": "384m"},
            "workspace": {"setup": ["echo set up > made-by-setup"]},
            "lifecycle": {"snapshot": "none"},
        })
        with pytest.raises(hutch.InvalidArgument):  # the definition's settings, not others
            c.set_pool("of-definition", 1, {"definition": "pooled", "memory": "1g"})
        with pytest.raises(hutch.NotFound):
            c.set_pool("of-definition", 1, {"definition": "no-such-definition"})
        c.set_pool("of-definition", 1, {"definition": "pooled"})
        try:
            until("the pool is full", lambda: pool(c, "of-definition")["ready"] == 1)
            ensured = c.ensure("pooled", "thread-1")
            try:
                assert ensured.path == "created"
                assert pool(c, "of-definition")["hits"] == 1
                assert ensured.sandbox.exec("cat made-by-setup").stdout == "set up\n"
                assert any("warm pool of-definition" in e["message"]
                           for e in c.events(ensured.sandbox.id))
            finally:
                c.delete_sandbox(ensured.sandbox.id)
        finally:
            c.remove_pool("of-definition")


def left_behind(d: DaemonProcess) -> list[str]:
    """What a stopped daemon's pools left: records, containers, mounts, processes."""
    store = SQLiteStore(os.path.join(d.data_dir, "hutch.db"))
    try:
        left = [f"record {r.id} ({r.state})" for r in store.list_sandboxes()]
    finally:
        store.close()
    left += [f"container {cid}" for cid in containers_of(d.data_dir)]
    left += [f"mount {point}" for point in mounts_under(d.data_dir)]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if d.data_dir in cmdline and "hutch.server" not in cmdline:
                left.append(f"process {pid}: {cmdline[:200]}")
    return left


@pytest.mark.docker
def test_pools_set_through_the_api_outlive_a_restart_and_drain_on_stop(tmp_path: Path) -> None:
    config = tmp_path / "hutch.toml"
    config.write_text('[pools.warm]\nsize = 1\nprovider = "bubblewrap"\n')
    d = DaemonProcess(extra_args=["--config", str(config)]).start()
    kept = {"provider": "bubblewrap", "memory": "256m"}
    docker = {"provider": "docker", "image": TEST_IMAGE}
    try:
        with hutch.Client(d.url, token=d.token) as c:
            c.set_pool("kept", 1, kept)
            c.set_pool("dock", 1, docker)
            c.set_pool("warm", 0, {"provider": "bubblewrap"})  # over the operator's, kept too
            until("the pools fill", lambda: [p["ready"] for p in c.list_pools()] == [1, 1, 0])
        d.stop()
        assert left_behind(d) == []
        d.start()
        with hutch.Client(d.url, token=d.token) as c:
            assert [(p["name"], p["size"], p["settings"]) for p in c.list_pools()] == [
                ("dock", 1, docker), ("kept", 1, kept), ("warm", 0, {"provider": "bubblewrap"})]
            until("the pools fill again", lambda: [p["ready"] for p in c.list_pools()] == [1, 1, 0])
            c.remove_pool("kept")
            c.remove_pool("dock")
        d.stop()
        assert left_behind(d) == []
        d.start()
        with hutch.Client(d.url, token=d.token) as c:
            assert [(p["name"], p["size"]) for p in c.list_pools()] == [("warm", 0)]
    finally:
        d.close()


def test_pools_count_toward_the_operators_max_sandboxes(tmp_path: Path) -> None:
    config = tmp_path / "hutch.toml"
    config.write_text('[server]\nmax_sandboxes = 3\n\n'
                      '[pools.warm]\nsize = 2\nprovider = "bubblewrap"\n')
    d = DaemonProcess(extra_args=["--config", str(config)]).start()
    made: list[RemoteSandbox] = []
    try:
        with hutch.Client(d.url, token=d.token) as c:
            with pytest.raises(hutch.InvalidArgument, match="max_sandboxes"):
                c.set_pool("more", 2, {"provider": "bubblewrap"})  # 4 kept ready: over 3
            until("the pool is full", lambda: pool(c, "warm")["ready"] == 2)
            made.append(c.create_sandbox("bubblewrap"))  # the pool's: it refills into the room
            until("the pool refills", lambda: pool(c, "warm")["ready"] == 2)
            # Creates of other settings take the room of what the pool keeps ready...
            made.append(c.create_sandbox("bubblewrap", memory="256m"))
            assert pool(c, "warm")["ready"] == 1
            made.append(c.create_sandbox("bubblewrap", memory="256m"))
            assert pool(c, "warm")["ready"] == 0
            # ...and past the limit none is made.
            with pytest.raises(hutch.ResourceExhausted, match="max_sandboxes"):
                c.create_sandbox("bubblewrap", memory="256m")
            assert len(c.list_sandboxes()) == 3 and pool(c, "warm")["ready"] == 0
            assert scrape(d, "hutch_pool_size", "warm") == 2
            assert scrape(d, "hutch_pool_ready", "warm") == 0
            assert scrape(d, "hutch_pool_misses_total", "warm") == 0  # other settings
            # A sandbox that ends gives the pool its room back.
            c.delete_sandbox(made.pop().id)
            until("the pool fills the room", lambda: pool(c, "warm")["ready"] == 1)
            assert scrape(d, "hutch_pool_ready", "warm") == 1
            # A create of the pool's settings takes what it holds, and then
            # finds it empty (a miss), with no room to make one cold.
            made.append(c.create_sandbox("bubblewrap"))
            assert pool(c, "warm")["ready"] == 0
            with pytest.raises(hutch.ResourceExhausted):
                c.create_sandbox("bubblewrap")
            assert scrape(d, "hutch_pool_misses_total", "warm") == 1
            assert len(c.list_sandboxes()) == 3
            for sb in made:
                c.delete_sandbox(sb.id)
            made.clear()
            until("the pool fills again", lambda: pool(c, "warm")["ready"] == 2)
    finally:
        d.close()


def test_a_pool_killed_with_its_daemon_is_freed_at_the_next_start(tmp_path: Path) -> None:
    config = tmp_path / "hutch.toml"
    config.write_text('[pools.warm]\nsize = 2\nprovider = "bubblewrap"\n')
    d = DaemonProcess(extra_args=["--config", str(config)]).start()
    try:
        with hutch.Client(d.url, token=d.token) as c:
            until("the pool is full", lambda: pool(c, "warm")["ready"] == 2)
        d.kill()  # no drain: its runtimes and their records stay
        assert len(left_behind(d)) >= 2
        d.start()
        with hutch.Client(d.url, token=d.token) as c:
            until("the pool is full again", lambda: pool(c, "warm")["ready"] == 2)
            assert c.list_sandboxes() == []
        d.stop()
        # What the killed daemon's pool made was freed at the start; the new one's on stop.
        assert left_behind(d) == []
    finally:
        d.close()


def test_a_take_the_store_cannot_record_hands_nothing_out(tmp_path: Path) -> None:
    """A take's one store write is started ahead of its bookkeeping: when the
    store cannot keep it (a full disk), the create is refused as any
    transition is, no sandbox is left that the store does not know, and once
    the store has room again a create works."""
    mount = str(tmp_path / "full")
    os.mkdir(mount)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", mount],
                   check=True)
    config = tmp_path / "hutch.toml"
    config.write_text('[pools.warm]\nsize = 1\nprovider = "virtual"\n')
    d = DaemonProcess(data_dir=mount, log_path=str(tmp_path / "daemon.log"),
                      extra_args=["--config", str(config)])
    try:
        d.start()
        with hutch.Client(d.url, token=d.token) as c:
            until("the pool is full", lambda: pool(c, "warm")["ready"] == 1)
            filler = fill(mount)
            with pytest.raises(hutch.StoreUnavailable) as refused:
                c.create_sandbox("virtual")
            assert "hutch.db" in str(refused.value)
            # Nothing handed out (its half-made record, which the full disk
            # kept too, is freed at the next start as any create's).
            assert [s for s in c.list_sandboxes() if s["state"] != "creating"] == []
            os.remove(filler)
            sb = c.create_sandbox("virtual")
            assert sb.info()["state"] == "running"
            assert [s["id"] for s in c.list_sandboxes() if s["state"] == "running"] == [sb.id]
            c.delete_sandbox(sb.id)
    finally:
        d.close()
        subprocess.run(["umount", mount], check=False)




@pytest.mark.anyio
async def test_a_pool_removed_while_it_warms_a_sandbox_ends_that_sandbox(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool removed (its filler cancelled) once its provider has made a
    sandbox, before the sandbox is ready: that sandbox goes too, runtime and
    record, not left running where nothing lists it."""
    from hutch.daemon import Daemon, OperatorPolicy
    from hutch.providers.agent.runtime import AgentRuntime

    warming = asyncio.Event()

    async def warm_for_ever(self: AgentRuntime) -> None:
        warming.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(AgentRuntime, "warm", warm_for_ever)
    data = str(tmp_path / "data")
    monkeypatch.setenv("HUTCH_HOME", data)  # as the server sets it for its providers
    daemon = Daemon(data, policy=OperatorPolicy(providers=["bubblewrap"]))
    await daemon.start()
    try:
        await daemon.set_pool("warming", {"provider": "bubblewrap"}, 1, persist=False)
        await asyncio.wait_for(warming.wait(), 120)
        made = [row.id for row in await daemon.astore.list_sandboxes(include_final=True)]
        assert len(made) == 1 and sandbox_processes(made[0])
        await daemon.remove_pool("warming")
        assert sandbox_processes(made[0]) == []
        assert await daemon.astore.list_sandboxes(include_final=True) == []
    finally:
        await daemon.stop()
