"""Sandbox definitions (SPEC §6): the model, the instance key, and ensure's
order on real providers, with a real git repository served as file://."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from hutch import InvalidArgument
from hutch.definitions import (
    Definition,
    Definitions,
    LocalHost,
    SetupFailed,
    label_for,
    load_definitions,
)
from hutch.providers.registry import get_provider
from hutch.store import InstanceRow, SQLiteStore

from .conftest import TEST_IMAGE

pytestmark = pytest.mark.anyio

#: Takes a couple of seconds and leaves a marker line per run.
SETUP = ["sleep 2 && echo ran >> .setup-runs && echo setup-done"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "home"
    monkeypatch.setenv("HUTCH_HOME", str(home))
    yield home
    end_leftovers(home)


def end_leftovers(home: Path) -> None:
    """What a test's sandboxes left under its own hutch home (a sandbox a
    failed assertion or another program left, a snapshot kept for the next
    ensure): ended by each provider's own reaping (a branch's mount, a
    container, a keeper), then the Docker images, children before the images
    they build on."""
    docker = shutil.which("docker") is not None

    async def reap() -> None:
        for name in ("local", "bubblewrap", "docker") if docker else ("local",):
            await get_provider(name).reap_orphans(set())

    anyio.run(reap)
    if not docker:
        return
    label = f"label=hutch.home={home}"

    def ids(*args: str) -> list[str]:
        done = subprocess.run(["docker", *args, "-q", "--filter", label],
                              capture_output=True, text=True, check=False)
        return done.stdout.split()

    containers = ids("ps", "-a")
    if containers:
        subprocess.run(["docker", "rm", "-f", *containers], capture_output=True, check=False)
    for _ in range(5):
        images = ids("images")
        if not images:
            return
        subprocess.run(["docker", "rmi", "-f", *images], capture_output=True, check=False)


@pytest.fixture
def repo(tmp_path: Path) -> str:
    """A real git repository with two commits on main; its file:// URL."""
    path = tmp_path / "repo"
    path.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})

    git("init", "-q", "-b", "main")
    (path / "README.md").write_text("first\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    (path / "README.md").write_text("second\n")
    (path / "src").mkdir()
    (path / "src" / "app.py").write_text("print('hi')\n")
    git("add", ".")
    git("commit", "-q", "-m", "two")
    return f"file://{path}"


@pytest.fixture
def defs(home: Path) -> Iterator[Definitions]:
    store = SQLiteStore(str(home / "hutch.db"))
    yield Definitions(LocalHost(store))
    store.close()


def definition(repo: str, provider: dict[str, object], **lifecycle: object) -> Definition:
    return Definition.parse({
        "id": "repo-agent",
        "provider": provider,
        "workspace": {"source": {"git": repo, "ref": "main"}, "setup": SETUP},
        "lifecycle": {"snapshot_max_age": "24h", **lifecycle},
    })


def step_names(ensured: object) -> list[str]:
    return [s.name for s in ensured.steps]  # type: ignore[attr-defined]


# -- the model ---------------------------------------------------------------------------
def test_durations_and_field_errors() -> None:
    d = Definition.parse({"id": "a", "provider": "local",
                          "lifecycle": {"keep_alive": "30m", "snapshot_max_age": "24h"}})
    assert d.lifecycle.keep_alive == 1800 and d.lifecycle.snapshot_max_age == 86400
    bad = [
        ({"id": "a", "lifecycle": {"keep_alive": "30 minutes"}}, "lifecycle.keep_alive"),
        ({"id": "a", "lifecycle": {"reuse": "always"}}, "lifecycle.reuse"),
        ({"id": "a", "workspace": {"source": {"git": "x", "ref": "--upload-pack=evil"}}},
         "ref"),
        ({"id": "a", "workspace": {"source": {"dir": "relative/path"}}}, "dir"),
        ({"id": "no spaces"}, "id"),
        ({"id": "a", "provider": {"type": "docker", "imagee": "x"}}, "imagee"),
        ({"id": "a", "colour": "red"}, "colour"),
    ]
    for data, field in bad:
        with pytest.raises(InvalidArgument, match=field):
            Definition.parse(data)


def test_toml_definitions(tmp_path: Path) -> None:
    config = tmp_path / "hutch.toml"
    config.write_text(textwrap.dedent("""
        [definitions.repo-agent]
        provider = { type = "docker", image = "hutch-test:bookworm" }
        workspace = { source = { git = "file:///srv/repo", ref = "main" }, setup = ["make"] }
        lifecycle = { reuse = "thread", keep_alive = "30m", snapshot_max_age = "24h" }
    """))
    loaded = load_definitions(config)
    d = loaded["repo-agent"]
    assert d.provider.type == "docker" and d.workspace.setup == ["make"]
    assert d.lifecycle.keep_alive == 1800
    config.write_text('[definitions.x]\nlifecycle = { snapshot_max_age = "soon" }\n')
    with pytest.raises(InvalidArgument, match=r"'x'.*snapshot_max_age"):
        load_definitions(config)


def test_instance_key_changes_with_each_part(repo: str) -> None:
    d = definition(repo, {"type": "local"})
    base = d.instance_key("t1")
    assert d.instance_key("t1") == base  # stable
    others = {
        d.instance_key("t2"),
        d.instance_key("t1", tenant="acme"),
        d.model_copy(update={"id": "other"}).instance_key("t1"),
        definition(repo, {"type": "docker", "image": TEST_IMAGE}).instance_key("t1"),
        definition(repo, {"type": "docker", "image": "debian:12"}).instance_key("t1"),
        Definition.parse({**d.model_dump(), "workspace": {"source": {"git": repo},
                                                          "setup": ["true"]}}).instance_key("t1"),
        Definition.parse({**d.model_dump(), "workspace": {"source": {"git": repo, "ref": "v2"},
                                                          "setup": SETUP}}).instance_key("t1"),
    }
    assert base not in others and len(others) == 7
    # The lifecycle is how the environment lives, not what it is: same key.
    assert definition(repo, {"type": "local"}, keep_alive="5m").instance_key("t1") == base


# -- ensure's order ------------------------------------------------------------------------
async def _ensure_order(defs: Definitions, d: Definition, *, check_storage: bool) -> None:
    first = await defs.ensure(d, "thread-1")
    assert first.path == "created"
    assert step_names(first) == ["create", "fetch", "setup[0]", "snapshot"]
    sandbox = first.sandbox
    assert (await sandbox.read_text("README.md")) == "second\n"  # ref main, its last commit
    assert (await sandbox.read_text("src/app.py")) == "print('hi')\n"
    assert (await sandbox.read_text(".setup-runs")) == "ran\n"
    await sandbox.write_text("notes.txt", "live work")

    second = await defs.ensure(d, "thread-1")
    assert second.path == "resumed" and second.sandbox.id == sandbox.id
    assert (await second.sandbox.read_text("notes.txt")) == "live work"
    assert (await second.sandbox.read_text(".setup-runs")) == "ran\n"

    await sandbox.close()
    third = await defs.ensure(d, "thread-1")
    assert third.path == "restored" and third.sandbox.id != sandbox.id
    assert step_names(third) == ["restore"]
    # Setup did not run: the marker still has the one line the snapshot caught.
    assert (await third.sandbox.read_text(".setup-runs")) == "ran\n"
    assert (await third.sandbox.read_text("README.md")) == "second\n"
    assert not await third.sandbox.exists("notes.txt")  # after setup, before the work

    # The snapshot has aged past a (now shorter) max age: setup runs again.
    await third.sandbox.close()
    await anyio.sleep(1.5)
    aged = d.model_copy(update={"lifecycle": d.lifecycle.model_copy(
        update={"snapshot_max_age": 1.0})})
    assert aged.instance_key("thread-1") == d.instance_key("thread-1")
    fourth = await defs.ensure(aged, "thread-1")
    assert fourth.path == "created" and "setup[0]" in step_names(fourth)
    # The stale snapshot is freed (in the background), not kept beside the new one.
    if check_storage:
        await defs.settle()
        label = label_for(d.instance_key("thread-1"))
        kept = [s.id for s in defs.host.store.list_snapshots() if s.label == label]
        assert kept == [fourth.snapshot_id]
    assert (await fourth.sandbox.read_text(".setup-runs")) == "ran\n"

    # A changed setup step is another environment: a fresh bootstrap beside it.
    changed = Definition.parse({**d.model_dump(), "workspace": {
        "source": {"git": d.workspace.source.git, "ref": "main"},  # type: ignore[union-attr]
        "setup": [*SETUP, "echo two >> .setup-runs"]}})
    fifth = await defs.ensure(changed, "thread-1")
    assert fifth.path == "created" and fifth.sandbox.id != fourth.sandbox.id
    assert (await fifth.sandbox.read_text(".setup-runs")) == "ran\ntwo\n"
    again = await defs.ensure(d, "thread-1")
    assert again.path == "resumed" and again.sandbox.id == fourth.sandbox.id
    for ensured in (fourth, fifth):
        await ensured.sandbox.close()


async def test_ensure_order_local(defs: Definitions, repo: str) -> None:
    await _ensure_order(defs, definition(repo, {"type": "local"}), check_storage=True)


@pytest.mark.docker
async def test_ensure_order_docker(defs: Definitions, repo: str) -> None:
    # Docker's image removal is the seam's (tested there), and not waited for here.
    await _ensure_order(defs, definition(repo, {"type": "docker", "image": TEST_IMAGE,
                                                "runtime": "native"}), check_storage=False)


@pytest.mark.docker  # its root file system is the test image, exported once
async def test_ensure_order_bubblewrap(defs: Definitions, repo: str) -> None:
    await _ensure_order(defs, definition(repo, {"type": "bubblewrap", "image": TEST_IMAGE}),
                        check_storage=True)


@pytest.mark.docker
async def test_keep_alive_suspends_and_ensure_resumes_docker(defs: Definitions, repo: str) -> None:
    d = definition(repo, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"},
                   keep_alive="1s")
    first = await defs.ensure(d, "t")
    try:
        assert not await defs.complete(d, "t")  # kept for the next run
        deadline = time.monotonic() + 60
        while first.sandbox.state.value != "suspended":
            assert time.monotonic() < deadline, "keep_alive never suspended the sandbox"
            await anyio.sleep(0.2)
        second = await defs.ensure(d, "t")
        assert second.path == "resumed" and second.sandbox.id == first.sandbox.id
        assert second.sandbox.state.value == "running"
        assert (await second.sandbox.read_text(".setup-runs")) == "ran\n"
    finally:
        await first.sandbox.close()


async def test_keep_alive_reaps_where_nothing_suspends_local(
    defs: Definitions, repo: str
) -> None:
    d = definition(repo, {"type": "local"}, keep_alive="1s")
    first = await defs.ensure(d, "t")
    await defs.complete(d, "t")
    deadline = time.monotonic() + 60
    while not first.sandbox.closed:
        assert time.monotonic() < deadline, "keep_alive never reaped the idle sandbox"
        await anyio.sleep(0.2)
    second = await defs.ensure(d, "t")
    assert second.path == "restored"
    await second.sandbox.close()


async def test_destroy_on_complete_and_reuse_none(defs: Definitions, repo: str) -> None:
    d = definition(repo, {"type": "local"}, destroy_on_complete=True)
    first = await defs.ensure(d, "t")
    assert await defs.complete(d, "t")
    assert first.sandbox.closed
    second = await defs.ensure(d, "t")
    assert second.path == "restored"  # setup paid once, kept in the snapshot
    await second.sandbox.close()

    fresh = definition(repo, {"type": "local"}, reuse="none")
    one = await defs.ensure(fresh, "u")
    two = await defs.ensure(fresh, "u")
    assert one.path == "created" and two.path == "restored"  # never the live one
    assert one.sandbox.id != two.sandbox.id
    assert await defs.complete(fresh, "u")
    assert two.sandbox.closed
    await one.sandbox.close()


async def test_threads_tenants_and_concurrent_ensure(defs: Definitions, repo: str) -> None:
    d = Definition.parse({"id": "quick", "provider": "local",
                          "workspace": {"source": {"git": repo},
                                        "setup": ["sleep 1; echo x >> .setup-runs"]}})
    a = await defs.ensure(d, "thread-a")
    b = await defs.ensure(d, "thread-b")
    acme = await defs.ensure(d, "thread-a", tenant="acme")
    assert len({a.sandbox.id, b.sandbox.id, acme.sandbox.id}) == 3

    results = []

    async def one() -> None:
        results.append(await defs.ensure(d, "crowd"))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(one)
    assert len({r.sandbox.id for r in results}) == 1
    assert sorted(r.path for r in results) == ["created"] + ["resumed"] * 9
    assert (await results[0].sandbox.read_text(".setup-runs")) == "x\n"
    for sandbox in {id(r.sandbox): r.sandbox for r in [a, b, acme, *results]}.values():
        await sandbox.close()


async def test_a_lease_outlives_a_setup_longer_than_it(home: Path, repo: str) -> None:
    """Two programs (here: two stores on one file) ensure one key at once with
    a lease far shorter than setup: the holder renews it, so one sandbox."""
    stores = [SQLiteStore(str(home / "hutch.db")) for _ in range(2)]
    programs = [Definitions(LocalHost(store), lease_seconds=0.6) for store in stores]
    d = Definition.parse({"id": "slow", "provider": "local",
                          "workspace": {"setup": ["sleep 3; echo x >> .setup-runs"]}})
    results: list[Any] = []

    async def one(program: Definitions) -> None:
        results.append(await program.ensure(d, "t"))

    async with anyio.create_task_group() as tg:
        for program in programs:
            tg.start_soon(one, program)
    assert sorted(r.path for r in results) == ["created", "resumed"]
    assert results[0].sandbox.id == results[1].sandbox.id
    for r in results:
        await r.sandbox.close()
    for store in stores:
        store.close()


def test_leases_in_the_store(home: Path) -> None:
    store = SQLiteStore(str(home / "hutch.db"))
    me = f"{os.uname().nodename}:{os.getpid()}:a"
    assert store.take_lease("k", me, 60)
    assert store.take_lease("k", me, 60)  # its own again: renewed
    assert not store.take_lease("k", f"{os.uname().nodename}:{os.getpid()}:b", 60)
    store.release_lease("k", f"{os.uname().nodename}:{os.getpid()}:b")  # not its own: no-op
    assert not store.take_lease("k", f"{os.uname().nodename}:{os.getpid()}:b", 60)
    store.release_lease("k", me)
    assert store.take_lease("k", "otherhost:1:c", 0.2)
    assert not store.take_lease("k", me, 60)  # another host's, until it expires
    time.sleep(0.3)
    assert store.take_lease("k", me, 60)
    # A holder of this host whose process is gone left it: free at once.
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert store.take_lease("j", f"{os.uname().nodename}:{dead.pid}:d", 60)
    assert store.take_lease("j", me, 60)
    store.close()


async def test_failing_setup_is_typed_and_records_nothing(
    defs: Definitions, repo: str, home: Path
) -> None:
    d = Definition.parse({"id": "broken", "provider": "local",
                          "workspace": {"source": {"git": repo},
                                        "setup": ["echo building; echo oops >&2; exit 3"]}})
    with pytest.raises(SetupFailed) as caught:
        await defs.ensure(d, "t")
    assert caught.value.exit_code == 3 and caught.value.code == "setup_failed"
    assert "building" in caught.value.output_tail and "oops" in caught.value.output_tail
    key = d.instance_key("t")
    assert defs.host.store.get_instance(key) is None
    assert not [s for s in defs.host.store.list_snapshots() if s.label == label_for(key)]
    # The half-made sandbox is gone too.
    assert not list((home / "sandboxes").glob("*/workspace/.hutch-source.tar"))
    assert not [p for p in (home / "sandboxes").glob("*") if (p / "workspace").exists()]


async def test_dir_source_and_bad_git_source(defs: Definitions, tmp_path: Path) -> None:
    src = tmp_path / "src dir"
    src.mkdir()
    (src / "name with 'quotes'.txt").write_bytes(b"\x00\xffbinary")
    d = Definition.parse({"id": "d", "workspace": {"source": {"dir": str(src)}}})
    ensured = await defs.ensure(d, "t")
    assert await ensured.sandbox.read_bytes("name with 'quotes'.txt") == b"\x00\xffbinary"
    await ensured.sandbox.close()
    missing = Definition.parse({"id": "g", "workspace": {
        "source": {"git": f"file://{tmp_path}/nothing-here"}}})
    with pytest.raises(InvalidArgument, match="nothing-here"):
        await defs.ensure(missing, "t")
    # ext:: would have git run a command on the host: refused whatever git's config.
    marker = tmp_path / "pwned"
    ext = Definition.parse({"id": "e", "workspace": {
        "source": {"git": f"ext::sh -c touch% {marker}"}}})
    with pytest.raises(InvalidArgument, match="git clone failed"):
        await defs.ensure(ext, "t")
    assert not marker.exists()


# -- across processes, no daemon ---------------------------------------------------------
_ENSURE_SCRIPT = """
import json, sys, anyio
from hutch.definitions import Definition, open_definitions
provider, repo, then = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
d = Definition.parse({"id": "xproc", "provider": provider,
                      "workspace": {"source": {"git": repo},
                                    "setup": ["sleep 1; echo x >> .setup-runs"]}})
async def main():
    definitions = open_definitions()
    e = await definitions.ensure(d, "thread-x")
    sandbox = e.sandbox
    notes = await sandbox.read_text("notes.txt") if await sandbox.exists("notes.txt") else "-"
    runs = (await sandbox.read_text(".setup-runs")).count("x")
    print(e.path, sandbox.id, runs, notes)
    if then == "write":
        await sandbox.write_text("notes.txt", "written-by-an-earlier-program")
    elif then == "suspend":
        await sandbox.suspend()
    elif then == "close":
        await sandbox.close()
    await definitions.settle()
anyio.run(main)
"""


def _ensure_across_processes(provider: dict[str, object], repo: str) -> None:
    """Each step a program of its own, sharing only the store (no daemon):
    the sandbox the first made is the one every later one finds, left
    running or suspended by the program before."""
    def run(then: str = "-") -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _ENSURE_SCRIPT, json.dumps(provider), repo, then],
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def answer(proc: subprocess.Popen[str]) -> list[str]:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return out.split()

    # Two at once: the store's lease makes one sandbox between them.
    answers = [answer(p) for p in (run(), run())]
    assert sorted(a[0] for a in answers) == ["created", "resumed"]
    sandbox_id = answers[0][1]
    assert answers[1][1] == sandbox_id and {a[2] for a in answers} == {"1"}
    # Later programs, one after another: the same sandbox, setup not run again,
    # the work of the program before kept (a suspended one resumed as it was).
    assert answer(run("write")) == ["resumed", sandbox_id, "1", "-"]
    kept = ["resumed", sandbox_id, "1", "written-by-an-earlier-program"]
    suspends = provider["type"] != "local"
    assert answer(run("suspend" if suspends else "-")) == kept
    assert answer(run("close")) == kept


def test_ensure_across_processes_reuses_one_sandbox_local(home: Path, repo: str) -> None:
    _ensure_across_processes({"type": "local"}, repo)


@pytest.mark.docker
def test_ensure_across_processes_reuses_one_sandbox_docker(home: Path, repo: str) -> None:
    _ensure_across_processes({"type": "docker", "image": TEST_IMAGE}, repo)


async def test_nothing_durable_reruns_setup_and_progress_streams(
    defs: Definitions, repo: str
) -> None:
    """Without a snapshot (here: ``snapshot = "none"``, as on a provider that
    cannot), a lost sandbox is rebuilt under the same key, setup run again;
    setup's output reaches the progress callback as it is printed."""
    d = Definition.parse({"id": "plain", "provider": "local",
                          "workspace": {"source": {"git": repo},
                                        "setup": ["echo first-line; sleep 1; echo second-line"]},
                          "lifecycle": {"snapshot": "none"}})
    told: list[tuple[str, str, float]] = []
    first = await defs.ensure(d, "t", progress=lambda kind, text: told.append(
        (kind, text, time.monotonic())))
    assert step_names(first) == ["create", "fetch", "setup[0]"]
    assert first.snapshot_id is None
    output = [(text, at) for kind, text, at in told if kind == "output"]
    first_at = next(at for text, at in output if "first-line" in text)
    second_at = next(at for text, at in output if "second-line" in text)
    assert second_at - first_at > 0.5  # streamed as printed, not at the end
    assert [text for kind, text, _ in told if kind == "step"][:2] == ["create", "fetch"]
    await first.sandbox.close()
    second = await defs.ensure(d, "t")
    assert second.path == "created" and "setup[0]" in step_names(second)
    assert second.sandbox.id != first.sandbox.id
    await second.sandbox.close()


# -- a sandbox another program suspended -------------------------------------------------
async def _suspended_elsewhere_is_resumed(home: Path, d: Definition) -> None:
    """Work done after setup survives a pause or a suspend made by another
    program (here: other store handles on the same file, each with a host of
    its own): ensure resumes the sandbox's own state, never the after-setup
    snapshot, and a program whose handle is out of date goes by the store."""
    programs = [Definitions(LocalHost(SQLiteStore(str(home / "hutch.db")))) for _ in range(3)]
    first = await programs[0].ensure(d, "t")
    await first.sandbox.write_text("notes.txt", "work since setup")
    other = await programs[1].ensure(d, "t")
    assert other.path == "resumed" and other.sandbox.id == first.sandbox.id
    await other.sandbox.pause()
    third = await programs[2].ensure(d, "t")
    assert third.path == "resumed" and third.sandbox.id == first.sandbox.id
    assert third.sandbox.state.value == "running"
    assert await third.sandbox.read_text("notes.txt") == "work since setup"
    await third.sandbox.suspend()
    # Back in the program that made it: its own handle says running, the
    # store says suspended, and the store is right.
    again = await programs[0].ensure(d, "t")
    try:
        assert again.path == "resumed" and again.sandbox.id == first.sandbox.id
        assert again.sandbox.state.value == "running"
        assert await again.sandbox.read_text("notes.txt") == "work since setup"
        assert (await again.sandbox.read_text(".setup-runs")) == "ran\n"
    finally:
        await again.sandbox.close()
        for program in programs:
            await program.settle()
            program.host.store.close()


@pytest.mark.docker
async def test_a_sandbox_suspended_elsewhere_is_resumed_docker(home: Path, repo: str) -> None:
    await _suspended_elsewhere_is_resumed(
        home, definition(repo, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"}))


@pytest.mark.docker  # its root file system is the test image, exported once
async def test_a_sandbox_suspended_elsewhere_is_resumed_bubblewrap(home: Path, repo: str) -> None:
    await _suspended_elsewhere_is_resumed(
        home, definition(repo, {"type": "bubblewrap", "image": TEST_IMAGE}))


@pytest.mark.docker
async def test_a_suspend_the_record_missed_is_resumed_docker(home: Path, repo: str) -> None:
    """A program that died between its suspend and writing it down left a
    record of a running container that is gone: the sandbox is still found
    by its suspend image, and resumed with the work in it."""
    d = definition(repo, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"})
    programs = [Definitions(LocalHost(SQLiteStore(str(home / "hutch.db")))) for _ in range(2)]
    first = await programs[0].ensure(d, "t")
    await first.sandbox.write_text("notes.txt", "work since setup")
    store = programs[0].host.store
    before = store.get_instance(first.key)
    assert before is not None and before.state == "running"
    await first.sandbox.suspend()
    after = store.get_instance(first.key)
    assert after is not None and after.state == "suspended"
    store.put_instance(before)  # the record as it was before the suspend
    found = await programs[1].ensure(d, "t")
    try:
        assert found.path == "resumed" and found.sandbox.id == first.sandbox.id
        assert await found.sandbox.read_text("notes.txt") == "work since setup"
    finally:
        await found.sandbox.close()
        for program in programs:
            await program.settle()
            program.host.store.close()


def test_a_record_is_overwritten_only_by_who_wrote_it_last(home: Path) -> None:
    """A transition is written where the record still says what its writer
    last knew: a program whose handle is out of date never overwrites it."""
    store = SQLiteStore(str(home / "hutch.db"))
    store.put_instance(InstanceRow(key="k", definition_id="d", thread_id="t", tenant=None,
                                   provider="docker", sandbox_id="sb-1",
                                   description={"container_id": "c1"}, state="running"))
    # Another program suspended it: its write stands...
    assert store.record_instance_sandbox("sb-1", "suspended", {"container_id": None},
                                         was=("running", {"container_id": "c1"}))
    # ... against the one that made it, whose handle still says running on c1.
    assert not store.record_instance_sandbox("sb-1", "paused", {"container_id": "c1"},
                                             was=("running", {"container_id": "c1"}))
    row = store.get_instance("k")
    assert row is not None and (row.state, row.description) == ("suspended",
                                                                {"container_id": None})
    assert not store.record_instance_sandbox("sb-other", "running", {})
    store.close()
