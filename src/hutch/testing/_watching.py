"""Watching a directory: created, written, removed and renamed, seen the
same way on every provider (by inotify or by looking again; the sandbox's
``capabilities.watch`` says which)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import hutch

from ._support import Case, raises

#: How long a case waits for an event before it fails (a bound against a
#: hang, not a speed: a polling watch looks every half second).
EVENT_PATIENCE = 60.0

Match = Callable[[hutch.FileEvent], bool]


async def _until(
    watcher: Any, match: Match, seen: list[hutch.FileEvent], after: int = 0,
) -> hutch.FileEvent:
    """Read ``watcher`` (adding to ``seen``) until an event ``match``es, one
    of those from ``seen[after]`` on."""
    deadline = time.monotonic() + EVENT_PATIENCE
    while True:
        for event in seen[after:]:
            if match(event):
                return event
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the awaited event never came; the watch told {seen}")
        seen.extend(await watcher.events(wait=min(left, 5.0)))


def _is(kind: str, path: str, new_path: str | None = None) -> Match:
    return lambda e: e.type == kind and e.path == path and (
        new_path is None or e.new_path == new_path)


async def check_watch_sees_files_created_written_and_removed(sandbox: Any) -> None:
    assert sandbox.capabilities.watch in ("inotify", "poll")
    await sandbox.write_text("watched/was-there.txt", "old")
    watcher = await sandbox.watch("watched")
    try:
        assert watcher.active
        seen: list[hutch.FileEvent] = []
        await sandbox.write_text("watched/new file ü.txt", "new")
        await _until(watcher, _is("created", sandbox.path("watched/new file ü.txt")), seen)
        await sandbox.write_text("watched/was-there.txt", "written again, longer", overwrite=True)
        await _until(watcher, _is("written", sandbox.path("watched/was-there.txt")), seen)
        await sandbox.remove("watched/new file ü.txt")
        await _until(watcher, _is("removed", sandbox.path("watched/new file ü.txt")), seen)
        await sandbox.mkdir("watched/made")
        await _until(watcher, _is("created", sandbox.path("watched/made")), seen)
        assert all(e.path.startswith(sandbox.path("watched") + "/") for e in seen)
    finally:
        await watcher.close()


async def check_watch_pairs_a_rename(sandbox: Any) -> None:
    await sandbox.write_text("moves/before.txt", "contents")
    watcher = await sandbox.watch("moves")
    try:
        await sandbox.rename("moves/before.txt", "moves/after.txt")
        seen: list[hutch.FileEvent] = []
        await _until(watcher, _is("renamed", sandbox.path("moves/before.txt"),
                                  sandbox.path("moves/after.txt")), seen)
    finally:
        await watcher.close()


async def check_watch_tells_moves_out_and_in(sandbox: Any) -> None:
    """A rename out of the watched tree is a removal, one into it a
    creation (the other half of each is not watched), and the watch goes
    on after them."""
    await sandbox.write_text("leaving/here.txt", "x")
    await sandbox.write_text("elsewhere/coming.txt", "y")
    watcher = await sandbox.watch("leaving")
    try:
        seen: list[hutch.FileEvent] = []
        await sandbox.rename("leaving/here.txt", "elsewhere/here.txt")
        await _until(watcher, _is("removed", sandbox.path("leaving/here.txt")), seen)
        await sandbox.rename("elsewhere/coming.txt", "leaving/coming.txt")
        await _until(watcher, _is("created", sandbox.path("leaving/coming.txt")), seen)
        await sandbox.write_text("leaving/after.txt", "z")
        await _until(watcher, _is("created", sandbox.path("leaving/after.txt")), seen)
        assert not [e for e in seen if e.type == "renamed"], seen
    finally:
        await watcher.close()


async def check_watch_sees_what_commands_change(sandbox: Any) -> None:
    """Changes made by processes in the sandbox, not only through hutch."""
    if not sandbox.capabilities.processes:
        return
    await sandbox.mkdir("by-commands")
    watcher = await sandbox.watch("by-commands")
    try:
        seen: list[hutch.FileEvent] = []
        await sandbox.exec("echo one > by-commands/made.log")
        await _until(watcher, _is("created", sandbox.path("by-commands/made.log")), seen)
        told = len(seen)  # its first bytes may have been told written already
        await sandbox.exec("echo two more >> by-commands/made.log")
        await _until(watcher, _is("written", sandbox.path("by-commands/made.log")), seen, told)
        await sandbox.exec("mv by-commands/made.log by-commands/moved.log")
        await _until(watcher, _is("renamed", sandbox.path("by-commands/made.log"),
                                  sandbox.path("by-commands/moved.log")), seen)
        await sandbox.exec("rm by-commands/moved.log")
        await _until(watcher, _is("removed", sandbox.path("by-commands/moved.log")), seen)
    finally:
        await watcher.close()


async def check_recursive_watch_sees_every_level(sandbox: Any) -> None:
    await sandbox.write_text("tree/deep/er/file.txt", "x")
    watcher = await sandbox.watch("tree", recursive=True)
    try:
        assert watcher.recursive
        seen: list[hutch.FileEvent] = []
        await sandbox.write_text("tree/deep/er/other.txt", "y")
        await _until(watcher, _is("created", sandbox.path("tree/deep/er/other.txt")), seen)
        # A directory made after the watch began is watched too.
        await sandbox.mkdir("tree/later/on", parents=True)
        await _until(watcher, _is("created", sandbox.path("tree/later/on")), seen)
        await sandbox.write_text("tree/later/on/new.txt", "z")
        await _until(watcher, _is("created", sandbox.path("tree/later/on/new.txt")), seen)
    finally:
        await watcher.close()


async def check_recursive_watch_tells_files_that_came_filled(sandbox: Any) -> None:
    """A directory moved in from outside the tree: its files are told made,
    and one already holding bytes written too (nothing of the writing could
    be seen: it happened before its directory was watched; a polling watch
    finds them so at its next look)."""
    await sandbox.write_text("outside/sub/filled.txt", "bytes")
    await sandbox.write_text("outside/sub/empty.txt", "")
    await sandbox.mkdir("arrivals")
    watcher = await sandbox.watch("arrivals", recursive=True)
    try:
        seen: list[hutch.FileEvent] = []
        await sandbox.rename("outside/sub", "arrivals/sub")
        await _until(watcher, _is("created", sandbox.path("arrivals/sub/empty.txt")), seen)
        await _until(watcher, _is("written", sandbox.path("arrivals/sub/filled.txt")), seen)
        assert _is("created", sandbox.path("arrivals/sub/filled.txt"))(
            seen[seen.index(hutch.FileEvent("written", sandbox.path("arrivals/sub/filled.txt")))
                 - 1]), seen
        assert hutch.FileEvent("written", sandbox.path("arrivals/sub/empty.txt")) not in seen
    finally:
        await watcher.close()


async def check_a_write_that_makes_directories_tells_only_its_file(sandbox: Any) -> None:
    """A write into directories it makes: the directories and the file, and
    nothing of how the write is done (a runtime's temporary file, found in
    a new directory as its watch is added, is no file of the caller's)."""
    await sandbox.mkdir("made-by-write")
    watcher = await sandbox.watch("made-by-write", recursive=True)
    try:
        seen: list[hutch.FileEvent] = []
        for n in range(5):
            await sandbox.write_text(f"made-by-write/d{n}/e/f.txt", "x")
            await _until(watcher, _is("created", sandbox.path(f"made-by-write/d{n}/e/f.txt")),
                         seen)
        written = {sandbox.path(f"made-by-write/d{n}{tail}") for n in range(5)
                   for tail in ("", "/e", "/e/f.txt")}
        assert {e.path for e in seen} <= written, seen
    finally:
        await watcher.close()


async def check_watch_without_recursive_stays_at_its_level(sandbox: Any) -> None:
    await sandbox.write_text("level/below/old.txt", "x")
    watcher = await sandbox.watch("level")
    try:
        assert not watcher.recursive
        seen: list[hutch.FileEvent] = []
        await sandbox.write_text("level/below/new.txt", "not told")
        await sandbox.write_text("level/marker.txt", "told")
        await _until(watcher, _is("created", sandbox.path("level/marker.txt")), seen)
        below = sandbox.path("level/below") + "/"
        assert not [e for e in seen if e.path.startswith(below)], seen
    finally:
        await watcher.close()


async def check_watch_errors_and_close(sandbox: Any) -> None:
    with raises(FileNotFoundError, code="file_not_found"):
        await sandbox.watch("no-such-directory")
    await sandbox.write_text("a-file.txt", "x")
    with raises(NotADirectoryError, code="not_a_directory"):
        await sandbox.watch("a-file.txt")
    await sandbox.mkdir("closing")
    watcher = await sandbox.watch("closing")
    await watcher.close()
    assert not watcher.active
    await sandbox.write_text("closing/after.txt", "x")
    assert await watcher.events() == []
    assert [e async for e in watcher] == []
    await watcher.close()  # again: nothing to do


WATCH_CASES: list[Case] = [
    check_watch_sees_files_created_written_and_removed,
    check_watch_pairs_a_rename,
    check_watch_tells_moves_out_and_in,
    check_watch_sees_what_commands_change,
    check_recursive_watch_sees_every_level,
    check_recursive_watch_tells_files_that_came_filled,
    check_a_write_that_makes_directories_tells_only_its_file,
    check_watch_without_recursive_stays_at_its_level,
    check_watch_errors_and_close,
]
