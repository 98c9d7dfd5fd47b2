"""Watching, below the conformance suite: the polling watch's comparison,
inotify's events as hutch's, and the bounds (watches per sandbox)."""

from __future__ import annotations

import tempfile

import pytest

from hutch._types import FileEvent, FileInfo, FileType
from hutch.providers.watching import (
    IN_CREATE,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    InotifyEvents,
    WatchedEntry,
    compare,
)

pytestmark = pytest.mark.anyio


def _file(path: str, size: int = 1, mtime: float = 1.0) -> FileInfo:
    return FileInfo(path, FileType.FILE, size, 0o644, mtime)


def _dir(path: str, mtime: float = 1.0) -> FileInfo:
    return FileInfo(path, FileType.DIRECTORY, 0, 0o755, mtime)


def test_polling_tells_changes_and_guesses_renames() -> None:
    before = {p.path: p for p in (_file("/w/a", 3, 5.0), _file("/w/b"), _dir("/w/d"),
                                  _file("/w/d/x"), _file("/w/gone", 9, 9.0))}
    after = {p.path: p for p in (_file("/w/a2", 3, 5.0), _file("/w/b", 2, 2.0), _dir("/w/e"),
                                 _file("/w/e/x"), _file("/w/new", 7, 7.0))}
    events = compare(before, after)
    assert FileEvent("renamed", "/w/a", "/w/a2") in events
    assert FileEvent("renamed", "/w/d", "/w/e") in events
    assert FileEvent("written", "/w/b") in events
    assert FileEvent("removed", "/w/gone") in events
    assert FileEvent("created", "/w/new") in events
    # It came with bytes in it: written too, right after (as inotify tells it).
    made = events.index(FileEvent("created", "/w/new"))
    assert events[made + 1] == FileEvent("written", "/w/new")
    assert FileEvent("written", "/w/a2") not in events  # renamed, not written
    # What moved with its directory is not told again.
    assert not [e for e in events if e.path.startswith("/w/d/") or e.path.startswith("/w/e/")]
    # A directory whose time changed (something made in it) is not "written".
    assert compare({"/w/d": _dir("/w/d", 1.0)}, {"/w/d": _dir("/w/d", 2.0)}) == []


def test_inotify_events_pair_renames_and_follow_new_directories() -> None:
    watched: dict[int, str] = {}

    def add(path: str) -> int:
        watched[len(watched) + 1] = path
        return len(watched)

    events = InotifyEvents("/w", True, add, lambda wd: None,
                           lambda path: [WatchedEntry("inside", False, False),
                                         WatchedEntry("filled", False, True)]
                           if path == "/w/sub" else [])
    events.watch_tree("/w")
    # Held: "out"'s other half may come in the next read.
    assert events.translate([
        (1, IN_CREATE, 0, "f"), (1, IN_MODIFY, 0, "f"), (1, IN_MODIFY, 0, "f"),
        (1, IN_MOVED_FROM, 7, "f"), (1, IN_MOVED_TO, 7, "g"),
        (1, IN_MOVED_FROM, 8, "out"),  # moved out of the tree: a removal
        (1, IN_MOVED_TO, 9, "in"),     # moved in: a creation
        (1, IN_CREATE | IN_ISDIR, 0, "sub"),
    ]) == []
    assert events.awaiting_rename_half
    told = events.flush()
    assert not events.awaiting_rename_half
    assert told == [
        FileEvent("created", "/w/f"), FileEvent("written", "/w/f"),
        FileEvent("renamed", "/w/f", "/w/g"), FileEvent("removed", "/w/out"),
        FileEvent("created", "/w/in"), FileEvent("created", "/w/sub"),
        FileEvent("created", "/w/sub/inside"),  # made before its watch was
        FileEvent("created", "/w/sub/filled"),  # and written before it, too
        FileEvent("written", "/w/sub/filled"),
    ]
    assert "/w/sub" in watched.values()


def test_a_rename_read_in_two_halves_is_one_rename() -> None:
    """The kernel queues a rename's IN_MOVED_FROM and IN_MOVED_TO one after
    the other; a read between them gets the first alone. Seen in CI (the
    agent's watch, on a loaded machine): told as removed and created."""
    watched: dict[int, str] = {}

    def add(path: str) -> int:
        watched[len(watched) + 1] = path
        return len(watched)

    events = InotifyEvents("/w", True, add, lambda wd: None, lambda path: [])
    events.watch_tree("/w")
    assert events.translate([(1, IN_CREATE, 0, "a"), (1, IN_MOVED_FROM, 5, "before")]) == []
    assert events.translate([(1, IN_MOVED_TO, 5, "after"), (1, IN_MODIFY, 0, "after")]) == [
        FileEvent("created", "/w/a"), FileEvent("renamed", "/w/before", "/w/after"),
        FileEvent("written", "/w/after"),
    ]
    assert not events.awaiting_rename_half and events.flush() == []
    # A directory's rename, so split, moves its watches with it.
    events.watch_tree("/w/d")
    assert events.translate([(1, IN_MOVED_FROM | IN_ISDIR, 6, "d")]) == []
    assert events.translate([(1, IN_MOVED_TO | IN_ISDIR, 6, "e")]) == [
        FileEvent("renamed", "/w/d", "/w/e")]
    assert "/w/e" in events.dirs.values() and "/w/d" not in events.dirs.values()


async def test_a_sandbox_holds_so_many_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    import hutch._sandbox

    monkeypatch.setattr(hutch._sandbox, "MAX_WATCHES", 2)
    with tempfile.TemporaryDirectory() as workdir:
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            first, second = await sb.watch("."), await sb.watch(".")
            with pytest.raises(hutch.ResourceExhausted):
                await sb.watch(".")
            await first.close()
            third = await sb.watch(".")
            assert sb.watcher(third.id) is third
            with pytest.raises(hutch.NotFound):
                sb.watcher(first.id)
        # The sandbox's close ended the rest.
        assert not second.active and not third.active


async def test_a_polling_watch_outlasts_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Looks made while the sandbox is paused fail (sandbox_unavailable):
    skipped, and the watch tells what changed once it runs again."""
    import asyncio

    import hutch.providers.watching

    monkeypatch.setattr(hutch.providers.watching, "POLL_INTERVAL", 0.01)
    async with await hutch.create_sandbox("virtual") as sb:
        assert sb.capabilities.watch == "poll"
        watcher = await sb.watch(".")
        await sb.pause()
        await asyncio.sleep(0.2)  # looks at the paused sandbox come and go
        assert watcher.active
        await sb.resume()
        await sb.write_text("after.txt", "x")
        events = await watcher.events(wait=30)
        assert hutch.FileEvent("created", sb.path("after.txt")) in events
        await watcher.close()
