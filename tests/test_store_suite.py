"""One store suite, run on every store: the embedded SQLite file and PostgreSQL.

Each case is written once against :class:`hutch.store.Store` and opens its
stores through the ``open_store`` fixture, which makes them share one
database (two programs on one SQLite file, two daemons on one PostgreSQL
database). What only one store has (SQLite's WAL, PostgreSQL's migrations)
is tested in that store's own module.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hutch.store import (
    DefinitionRow,
    InstanceRow,
    OwnershipLost,
    RefRow,
    SandboxRow,
    SnapshotRow,
    SQLiteStore,
    Store,
    WorkspaceRow,
    WriteConflict,
)

OpenStore = Callable[[], Store]


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens another store on the same database each call; all closed after."""
    opened: list[Store] = []
    if request.param == "sqlite":
        def make() -> Store:
            return SQLiteStore(str(tmp_path / "hutch.db"))
    else:
        from hutch.store.postgres import PostgresStore

        conninfo = request.getfixturevalue("postgres_cluster").new_database()

        def make() -> Store:
            return PostgresStore(conninfo, local_root=str(tmp_path / "local"))

    def opening() -> Store:
        store = make()
        opened.append(store)
        return store

    yield opening
    for store in opened:
        store.close()


def sandbox_row(sandbox_id: str = "sb-1", state: str = "running",
                created: float = 1.0) -> SandboxRow:
    return SandboxRow(
        id=sandbox_id, provider="docker", state=state, spec={"provider": {"type": "docker"}},
        description={"container_id": "abc", "nested": [1, {"a": None}]}, workspace="ws",
        created_at_unix=created, deadline_unix=123.5, last_active_unix=99.0,
        meter={"running_s": 4.0},
    )


def test_sandbox_rows_round_trip(open_store: OpenStore) -> None:
    store = open_store()
    store.put_sandbox(sandbox_row(), ("transition", "created"))
    store.put_sandbox(sandbox_row("sb-2", state="terminated", created=2.0))
    got = store.get_sandbox("sb-1")
    assert got is not None
    assert (got.description, got.deadline_unix, got.meter, got.spec) == (
        {"container_id": "abc", "nested": [1, {"a": None}]}, 123.5, {"running_s": 4.0},
        {"provider": {"type": "docker"}},
    )
    assert got.updated_at_unix > 0
    assert store.get_sandbox("sb-nope") is None
    assert [r.id for r in store.list_sandboxes()] == ["sb-1"]
    assert [r.id for r in store.list_sandboxes(include_final=True)] == ["sb-1", "sb-2"]
    assert [e["message"] for e in store.events("sb-1")] == ["created"]

    # Several events with one write: all kept, in order.
    store.put_sandbox(got, ("transition", "creating -> running"), ("created", "made"))
    assert [e["message"] for e in store.events("sb-1")] == [
        "created", "creating -> running", "made"]
    got = store.get_sandbox("sb-1")
    assert got is not None

    before = got.updated_at_unix
    store.set_sandbox_deadline("sb-1", 456.0)
    again = store.get_sandbox("sb-1")
    assert again is not None and again.deadline_unix == 456.0
    assert again.updated_at_unix == before, "a deadline is not a snapshot of the meter"
    store.set_sandbox_deadline("sb-1", None)
    cleared = store.get_sandbox("sb-1")
    assert cleared is not None and cleared.deadline_unix is None

    store.put_sandboxes([sandbox_row(f"sb-batch-{i}", created=3.0 + i) for i in range(50)])
    assert len(store.list_sandboxes()) == 51
    store.delete_sandbox("sb-batch-0")
    assert store.get_sandbox("sb-batch-0") is None
    # Written by one program, read by another.
    assert open_store().get_sandbox("sb-1") == store.get_sandbox("sb-1")


def test_pruning_removes_ended_sandboxes_their_events_and_refs(open_store: OpenStore) -> None:
    store = open_store()
    store.put_sandbox(sandbox_row("sb-old", state="terminated"))
    store.put_sandbox(sandbox_row("sb-live", state="running"))
    store.log_event("sb-old", "transition", "ended")
    store.log_event("sb-live", "transition", "started")
    store.put_workspace(WorkspaceRow(name="kept", status="running", provider="docker", spec={}))
    store.put_ref(RefRow(id="ref-plain", sandbox_id="sb-old", secret_sha256="x",
                         created_at_unix=1.0))
    store.put_ref(RefRow(id="ref-ws", sandbox_id="sb-old", secret_sha256="y",
                         created_at_unix=2.0, workspace="kept"))
    assert store.prune_ended(time.time() - 3600) == []
    assert store.prune_ended(time.time() + 1) == ["sb-old"]
    assert store.get_sandbox("sb-old") is None
    assert store.get_sandbox("sb-live") is not None
    assert store.events("sb-old") == []
    assert [e["message"] for e in store.events("sb-live")] == ["started"]
    assert store.get_ref("ref-plain") is None
    assert store.get_ref("ref-ws") is not None, "a workspace's ref outlives the sandbox"


def test_workspaces_snapshots_events_and_meta(open_store: OpenStore) -> None:
    store = open_store()
    ws = WorkspaceRow(name="ws", status="running", provider="docker", spec={"a": 1},
                      live_sandbox_id="sb-1", state_snapshot_id="snap-2",
                      source_snapshot_id="snap-1", created_at_unix=1.5, last_active_unix=2.5)
    store.put_workspace(ws)
    store.put_workspace(WorkspaceRow(name="a-first", status="suspended", provider="local",
                                     spec={}))
    assert store.get_workspace("ws") == ws
    assert [w.name for w in store.list_workspaces()] == ["a-first", "ws"]
    ws.status = "suspended"
    store.put_workspace(ws)
    assert store.get_workspace("ws") == ws
    store.delete_workspace("ws")
    assert store.get_workspace("ws") is None

    root = SnapshotRow(id="snap-a", provider="local", status="ready", label="setup",
                       sandbox_id="sb-1", size_bytes=5 << 30, created_at_unix=1.0,
                       handle={"data": {"layers": ["x"]}}, spec={"provider": {"type": "local"}})
    child = SnapshotRow(id="snap-b", provider="local", status="capturing", parent_id="snap-a",
                        created_at_unix=2.0)
    store.put_snapshot(child)
    store.put_snapshot(root)
    assert store.get_snapshot("snap-a") == root
    assert [r.id for r in store.list_snapshots()] == ["snap-a", "snap-b"]
    child.status = "ready"
    store.put_snapshot(child)
    got = store.get_snapshot("snap-b")
    assert got is not None and (got.status, got.parent_id) == ("ready", "snap-a")
    store.delete_snapshot("snap-a")
    assert [r.id for r in open_store().list_snapshots()] == ["snap-b"]

    for i in range(5):
        store.log_event("sb-1", "transition", f"step {i}")
    store.log_event("other", "orphan", "removed")
    assert [e["message"] for e in store.events("sb-1", limit=2)] == ["step 3", "step 4"]
    assert store.events(limit=1)[0]["subject"] == "other"
    assert set(store.events(limit=1)[0]) >= {"seq", "at_unix", "subject", "kind", "message"}

    store.set_meta("k", "v")
    store.set_meta("k", "w")
    assert store.get_meta("k") == "w"
    store.set_meta("k", None)
    assert store.get_meta("k") is None


def test_refs_and_definitions(open_store: OpenStore) -> None:
    store = open_store()
    ref = RefRow(id="ref-1", sandbox_id="sb-1", secret_sha256="abc", created_at_unix=1.0,
                 expires_at_unix=100.0)
    store.put_ref(ref)
    store.put_ref(RefRow(id="ref-2", sandbox_id="sb-2", secret_sha256="def",
                         created_at_unix=2.0, workspace="ws"))
    assert store.get_ref("ref-1") == ref
    assert [r.id for r in store.list_refs("sb-1")] == ["ref-1"]
    assert [r.id for r in store.list_refs("sb-1", workspace="ws")] == ["ref-1", "ref-2"]
    ref.revoked_at_unix = 50.0
    store.put_ref(ref)
    got = store.get_ref("ref-1")
    assert got is not None and got.revoked_at_unix == 50.0

    store.put_definition(DefinitionRow("b", {"provider": "docker", "image": "x"}, 1.0))
    store.put_definition(DefinitionRow("a", {"provider": "local"}, 2.0))
    store.put_definition(DefinitionRow("b", {"provider": "docker", "image": "y"}, 3.0))
    assert [(d.id, d.body, d.updated_at_unix) for d in store.list_definitions()] == [
        ("a", {"provider": "local"}, 2.0),
        ("b", {"provider": "docker", "image": "y"}, 3.0),
    ]


def instance(key: str = "def/thread", sandbox_id: str | None = "sb-1") -> InstanceRow:
    return InstanceRow(key=key, definition_id="def", thread_id="thread", tenant=None,
                       provider="docker", sandbox_id=sandbox_id,
                       description={"container_id": "c1"}, spec={"image": "x"},
                       updated_at_unix=1.0, created_at_unix=1.0)


def test_instances_activity_deadlines_and_compare_and_set(open_store: OpenStore) -> None:
    store, other = open_store(), open_store()
    row = instance()
    store.put_instance(row)
    store.put_instance(instance("def/unbound", sandbox_id=None))
    assert store.get_instance("def/thread") == row
    assert other.instance_of_sandbox("sb-1") == row
    assert store.instance_sandbox_ids() == {"sb-1"}

    store.note_instance_activity("sb-1", 50.0)
    other.note_instance_activity("sb-1", 40.0)  # an older time never moves it back
    got = store.get_instance("def/thread")
    assert got is not None and got.last_active_unix == 50.0
    other.set_instance_deadline("sb-1", 900.0)
    got = store.get_instance("def/thread")
    assert got is not None and got.deadline_unix == 900.0

    # Compare and set: only a writer that knew the current state writes.
    assert store.record_instance_sandbox(
        "sb-1", "suspended", {"container_id": "c2"}, was=("running", {"container_id": "c1"}),
        reason="idle")
    assert not other.record_instance_sandbox(
        "sb-1", "failed", {"container_id": "c1"}, was=("running", {"container_id": "c1"}))
    got = other.get_instance("def/thread")
    assert got is not None and (got.state, got.description, got.reason) == (
        "suspended", {"container_id": "c2"}, "idle")
    assert other.record_instance_sandbox("sb-1", "running", {"container_id": "c3"})

    store.delete_instance("def/thread")
    assert store.get_instance("def/thread") is None
    assert store.instance_sandbox_ids() == set()


def test_holders_and_claims(open_store: OpenStore) -> None:
    store, other = open_store(), open_store()
    store.put_instance(instance())
    store.hold_instance("def/thread", "host:1:a")
    other.hold_instance("def/thread", "host:2:b")
    store.hold_instance("def/thread", "host:1:a")  # again: still one hold
    assert sorted(store.instance_holders("def/thread")) == ["host:1:a", "host:2:b"]
    was = {"container_id": "c1"}
    # Another holder lives: no claim.
    assert not store.claim_instance("def/thread", "sb-1", "host:1:a", was=was,
                                    alive=lambda h: True)
    # The record moved: no claim.
    assert not store.claim_instance("def/thread", "sb-1", "host:1:a",
                                    was={"container_id": "other"}, alive=lambda h: False)
    assert not store.claim_instance("def/thread", "sb-9", "host:1:a", was=was,
                                    alive=lambda h: False)
    # The others are dead: the claim drops their holds.
    assert store.claim_instance("def/thread", "sb-1", "host:3:c", was=was,
                                alive=lambda h: False)
    assert other.instance_holders("def/thread") == ["host:3:c"]
    other.release_instance("def/thread", "host:3:c")
    assert store.instance_holders("def/thread") == []


def test_one_claim_wins_when_programs_race(open_store: OpenStore) -> None:
    stores = [open_store() for _ in range(4)]
    stores[0].put_instance(instance())
    stores[0].hold_instance("def/thread", "dead:1:x")
    won: list[str] = []
    go = threading.Barrier(len(stores) * 3)

    def claim(store: Store, holder: str) -> None:
        go.wait()
        if store.claim_instance("def/thread", "sb-1", holder, was={"container_id": "c1"},
                                alive=lambda h: h != "dead:1:x"):
            won.append(holder)

    threads = [threading.Thread(target=claim, args=(store, f"live:{i}:{j}"))
               for i, store in enumerate(stores) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1, won
    assert stores[1].instance_holders("def/thread") == won


def test_leases_one_holder_at_a_time_until_expiry_or_release(open_store: OpenStore) -> None:
    store, other = open_store(), open_store()
    me, them = "elsewhere:1:me", "elsewhere:2:them"  # another host's: only expiry frees them
    assert store.lease_holder("prune") is None
    assert store.take_lease("prune", me, 30)
    assert store.take_lease("prune", me, 30), "the holder renews"
    assert not other.take_lease("prune", them, 30)
    assert other.lease_holder("prune") == me
    store.release_lease("prune", them)  # not theirs to give back
    assert other.lease_holder("prune") == me
    store.release_lease("prune", me)
    assert other.take_lease("prune", them, 0.2)
    time.sleep(0.5)
    assert store.take_lease("prune", me, 30), "an expired lease is free"
    # A holder of this host whose process is gone held nothing.
    assert store.take_lease("killed", f"{os.uname().nodename}:999999999:0:x", 30)
    assert other.take_lease("killed", them, 30)


def test_leases_race(open_store: OpenStore) -> None:
    stores = [open_store() for _ in range(3)]
    won: list[str] = []
    go = threading.Barrier(9)

    def take(store: Store, holder: str) -> None:
        go.wait()
        if store.take_lease("race", holder, 30):
            won.append(holder)

    threads = [threading.Thread(target=take, args=(s, f"elsewhere:{i}:{j}"))
               for i, s in enumerate(stores) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1, won


def test_another_programs_change_is_seen_and_ones_own_is_not(open_store: OpenStore) -> None:
    store, other = open_store(), open_store()
    store.put_instance(instance())
    time.sleep(0.2)  # one's own writes' notices come and go
    seen = store.changes_by_others()
    store.note_instance_activity("sb-1", 5.0)
    time.sleep(0.5)
    assert store.changes_by_others() == seen
    other.set_instance_deadline("sb-1", 77.0)
    deadline = time.monotonic() + 5
    while store.changes_by_others() == seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.changes_by_others() != seen


# -- a fleet: owners, leases and fencing -------------------------------------------------
def test_daemons_register_and_their_heartbeat_lapses(open_store: OpenStore) -> None:
    store = open_store()
    store.register_daemon("d-1", "http://a:1", 30)
    store.register_daemon("d-2", "http://b:2", 0.2)
    time.sleep(0.5)
    seen = {d.id: (d.url, d.alive) for d in open_store().daemons()}
    assert seen == {"d-1": ("http://a:1", True), "d-2": ("http://b:2", False)}


def test_owned_rows_are_written_by_their_owner_alone(open_store: OpenStore) -> None:
    mine, theirs = open_store(), open_store()
    mine.act_as("d-1", 30)
    theirs.act_as("d-2", 30)
    row = sandbox_row()
    mine.put_sandbox(row)
    assert (row.owner, row.epoch, row.version) == ("d-1", 1, 1)
    stored = theirs.get_sandbox("sb-1")
    assert stored is not None and stored.owner == "d-1" and stored.lease_expires_at_unix
    # Another daemon's write of it, its deadline or its delete: refused, nothing kept.
    stored.state = "paused"
    # The refusal names the row as the user knows it ("sandbox sb-1").
    with pytest.raises(OwnershipLost, match=r"^sandbox sb-1 is served by daemon d-1"):
        theirs.put_sandbox(stored, ("transition", "running -> paused"))
    with pytest.raises(OwnershipLost, match=r"^sandbox sb-1 is served"):
        theirs.set_sandbox_deadline("sb-1", 5.0)
    with pytest.raises(OwnershipLost, match=r"^sandbox sb-1 is served"):
        theirs.delete_sandbox("sb-1")
    after = mine.get_sandbox("sb-1")
    assert after is not None and (after.state, after.deadline_unix, after.version) == (
        "running", 123.5, 1)
    assert theirs.events("sb-1") == []
    # Its owner writes on, each write counted.
    after.state = "paused"
    mine.put_sandbox(after)
    assert after.version == 2
    # Workspaces and snapshots alike.
    ws = WorkspaceRow(name="w", status="running", provider="docker", spec={})
    mine.put_workspace(ws)
    with pytest.raises(OwnershipLost, match=r"^workspace w is served"):
        theirs.put_workspace(WorkspaceRow(name="w", status="stale", provider="docker", spec={}))
    snap = SnapshotRow(id="snap-1", provider="docker", status="ready")
    mine.put_snapshot(snap)
    with pytest.raises(OwnershipLost, match=r"^snapshot snap-1 is served"):
        theirs.delete_snapshot("snap-1")
    # An ownerless (legacy) row is anyone's: the first daemon to write it owns it.
    legacy = open_store()
    legacy.put_sandbox(sandbox_row("sb-old"))
    old = theirs.get_sandbox("sb-old")
    assert old is not None and old.owner is None
    theirs.put_sandbox(old)
    assert old.owner == "d-2"


def test_a_lapsed_owner_is_taken_over_and_its_late_writes_refused(
        open_store: OpenStore) -> None:
    dead, live = open_store(), open_store()
    dead.act_as("d-dead", 0.3)
    live.act_as("d-live", 30)
    dead.register_daemon("d-dead", "http://dead", 0.3)
    row = sandbox_row()
    dead.put_sandbox(row)
    assert not live.take_over("sandbox", "sb-1"), "its lease holds"
    assert live.lapsed_sandboxes() == []
    time.sleep(0.6)
    assert [r.id for r in live.lapsed_sandboxes()] == ["sb-1"]
    # A daemon whose lease lapsed cannot write, even before anyone took over.
    row.state = "paused"
    with pytest.raises(OwnershipLost, match="lapsed"):
        dead.put_sandbox(row)
    assert live.take_over("sandbox", "sb-1")
    taken = live.get_sandbox("sb-1")
    assert taken is not None and (taken.owner, taken.epoch, taken.state) == (
        "d-live", 2, "running")
    assert live.lapsed_sandboxes() == []
    # The dead daemon back (its heartbeat renewed): the row is not its own any more.
    dead.register_daemon("d-dead", "http://dead", 30)
    with pytest.raises(OwnershipLost, match="served by daemon d-live"):
        dead.put_sandbox(row)
    assert not dead.take_over("sandbox", "sb-1")
    # The new owner's own stale copy (from before an epoch it was not in) is refused too.
    stale = sandbox_row()
    stale.owner, stale.epoch = "d-live", 1
    with pytest.raises(OwnershipLost, match="changed hands"):
        live.put_sandbox(stale)
    live.put_sandbox(taken)
    assert taken.version == 3


def test_one_daemon_takes_a_lapsed_row_over_when_several_race(open_store: OpenStore) -> None:
    dead = open_store()
    dead.act_as("d-dead", 0.2)
    dead.put_sandbox(sandbox_row())
    time.sleep(0.4)
    stores = [open_store() for _ in range(3)]
    won: list[str] = []
    go = threading.Barrier(3)

    def take(store: Store, daemon_id: str) -> None:
        store.act_as(daemon_id, 30)
        go.wait()
        if store.take_over("sandbox", "sb-1"):
            won.append(daemon_id)

    threads = [threading.Thread(target=take, args=(s, f"d-{i}")) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1, won
    final = stores[0].get_sandbox("sb-1")
    assert final is not None and final.owner == won[0] and final.epoch == 2


def test_lapsed_workspaces_and_snapshots_are_taken_over_at_once(open_store: OpenStore) -> None:
    dead, live = open_store(), open_store()
    dead.act_as("d-dead", 0.2)
    live.act_as("d-live", 30)
    dead.put_workspace(WorkspaceRow(name="w", status="running", provider="docker", spec={}))
    dead.put_snapshot(SnapshotRow(id="snap-1", provider="docker", status="ready"))
    live.put_snapshot(SnapshotRow(id="snap-2", provider="docker", status="ready"))
    assert live.take_over_lapsed("snapshot") == []
    time.sleep(0.4)
    assert live.take_over_lapsed("snapshot") == ["snap-1"]
    assert live.take_over_lapsed("workspace") == ["w"]
    ws = live.get_workspace("w")
    assert ws is not None and (ws.owner, ws.epoch) == ("d-live", 2)
    live.delete_snapshot("snap-1")
    assert live.get_snapshot("snap-1") is None


def owned_rows() -> list[tuple[str, Callable[[], SandboxRow | WorkspaceRow | SnapshotRow]]]:
    return [
        ("sandbox", sandbox_row),
        ("workspace", lambda: WorkspaceRow(name="ws", status="running", provider="docker",
                                           spec={})),
        ("snapshot", lambda: SnapshotRow(id="snap-1", provider="docker", status="ready")),
    ]


def _put(store: Store, row: SandboxRow | WorkspaceRow | SnapshotRow) -> None:
    if isinstance(row, SandboxRow):
        store.put_sandbox(row)
    elif isinstance(row, WorkspaceRow):
        store.put_workspace(row)
    else:
        store.put_snapshot(row)


def _get(store: Store, row: SandboxRow | WorkspaceRow | SnapshotRow) -> Any:
    if isinstance(row, SandboxRow):
        return store.get_sandbox(row.id)
    if isinstance(row, WorkspaceRow):
        return store.get_workspace(row.name)
    return store.get_snapshot(row.id)


@pytest.mark.parametrize("fenced", [False, True], ids=["unfenced", "one-daemon"])
@pytest.mark.parametrize("kind", ["sandbox", "workspace", "snapshot"])
def test_a_write_from_a_stale_read_is_refused_not_lost(
    open_store: OpenStore, kind: str, fenced: bool,
) -> None:
    """Two writers read one row, each changes it: the second write is a
    compare and set on the version it read, refused (typed) for the first
    one's change, which stays; read again, its own change goes on top."""
    one, two = open_store(), open_store()
    if fenced:  # two tasks of one daemon: the same owner, the same epoch
        one.act_as("d-1", 30)
        two.act_as("d-1", 30)
    made = dict(owned_rows())[kind]()
    _put(one, made)
    first, second = _get(one, made), _get(two, made)
    assert first.version == second.version == 1
    first.spec = {"by": "first"}
    _put(one, first)
    assert first.version == 2
    second.spec = {"by": "second"}
    with pytest.raises(WriteConflict, match="changed since"):
        _put(two, second)
    kept = _get(one, made)
    assert (kept.spec, kept.version) == ({"by": "first"}, 2), "the first write stays whole"
    again = _get(two, made)
    again.spec = {**again.spec, "and": "second"}
    _put(two, again)
    final = _get(one, made)
    assert (final.spec, final.version) == ({"by": "first", "and": "second"}, 3)
    # A row made again from nothing over a stored one replaces nothing.
    with pytest.raises(WriteConflict, match="exists"):
        _put(two, dict(owned_rows())[kind]())
    # A write of a row removed since it was read does not bring it back.
    if isinstance(made, SandboxRow):
        one.delete_sandbox(made.id)
    elif isinstance(made, WorkspaceRow):
        one.delete_workspace(made.name)
    else:
        one.delete_snapshot(made.id)
    with pytest.raises(WriteConflict, match="removed"):
        _put(two, final)
    assert _get(one, made) is None


def test_writers_racing_on_one_row_lose_no_update(open_store: OpenStore) -> None:
    """Writers on several threads and stores each count their own key up in
    one sandbox row's meter, read-modify-write, again on a conflict: every
    count is there at the end (a whole-row replacement would lose some)."""
    first = open_store()
    first.put_sandbox(sandbox_row())
    writers, rounds = 4, 15
    stores = [open_store() for _ in range(writers)]
    go = threading.Barrier(writers)
    conflicts: list[int] = []

    def count(store: Store, name: str) -> None:
        go.wait()
        for _ in range(rounds):
            while True:
                row = store.get_sandbox("sb-1")
                assert row is not None
                row.meter[name] = row.meter.get(name, 0) + 1
                try:
                    store.put_sandbox(row)
                    break
                except WriteConflict:
                    conflicts.append(1)

    threads = [threading.Thread(target=count, args=(s, f"w{i}"))
               for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    final = first.get_sandbox("sb-1")
    assert final is not None
    assert {k: v for k, v in final.meter.items() if k.startswith("w")} == {
        f"w{i}": rounds for i in range(writers)}
    assert final.version == 1 + writers * rounds


def test_a_daemons_listing_of_what_it_does_not_hold_leaves_out_its_own_made_rows(
    open_store: OpenStore,
) -> None:
    # The daemon's listing reads only what it holds no live object for: every
    # row of its own read and dropped cost 40 ms per 1000 sandboxes.
    mine, theirs, nobodys = open_store(), open_store(), open_store()
    mine.act_as("d-mine")
    theirs.act_as("d-theirs")
    mine.put_sandbox(sandbox_row("sb-mine", created=1.0))
    mine.put_sandbox(sandbox_row("sb-mine-making", state="creating", created=2.0))
    mine.put_sandbox(sandbox_row("sb-mine-ended", state="terminated", created=3.0))
    theirs.put_sandbox(sandbox_row("sb-theirs", created=4.0))
    theirs.put_sandbox(sandbox_row("sb-theirs-ended", state="failed", created=5.0))
    nobodys.put_sandbox(sandbox_row("sb-nobodys", created=6.0))  # a program in-process
    assert [r.id for r in mine.list_sandboxes(not_held_by="d-mine")] == [
        "sb-mine-making", "sb-theirs", "sb-nobodys"]
    assert [r.id for r in mine.list_sandboxes(include_final=True, not_held_by="d-mine")] == [
        "sb-mine-making", "sb-theirs", "sb-theirs-ended", "sb-nobodys"]
    assert [r.id for r in theirs.list_sandboxes(not_held_by="d-theirs")] == [
        "sb-mine", "sb-mine-making", "sb-nobodys"]
    assert [r.id for r in mine.list_sandboxes()] == [
        "sb-mine", "sb-mine-making", "sb-theirs", "sb-nobodys"]
