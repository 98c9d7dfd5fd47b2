"""Whose files are: the owner and group envd's entries name, and files made
for a user (``user=`` on an SDK's call) handed to that user.

hutch's file operations neither report an owner nor write as a chosen user,
so both go through the sandbox's own tools, one command for many paths:
``stat`` to read the owners, ``chown`` (as root) to give. A sandbox that runs
no processes has entries without owners and files as hutch writes them.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable

from ...._errors import HutchError, InvalidArgument
from ...._sandbox import Sandbox

log = logging.getLogger("hutch.server.e2b")

#: Paths given to one command (well under the kernel's limit on arguments).
BATCH = 256
#: Directories a write may make above its file that are looked for.
MAX_MADE_PARENTS = 64


def _batches(paths: list[str]) -> Iterable[list[str]]:
    for start in range(0, len(paths), BATCH):
        yield paths[start:start + BATCH]


async def owners(sandbox: Sandbox, paths: list[str]) -> dict[str, tuple[str, str]]:
    """The owner and group (names, or ids where the sandbox has no name for
    them) of each path found; none where they cannot be told."""
    found: dict[str, tuple[str, str]] = {}
    if not paths or not sandbox.capabilities.processes:
        return found
    for batch in _batches(paths):
        try:
            result = await sandbox.exec(["stat", "-c", "%U:%G", "--", *batch], timeout=30)
        except HutchError as exc:
            log.debug("no owners for %s: %s", batch[0], exc)
            return found
        lines = result.stdout.splitlines()
        if result.exit_code or len(lines) != len(batch):
            continue  # one vanished meanwhile: its line is missing, so none is sure
        for path, line in zip(batch, lines, strict=True):
            owner, _, group = line.partition(":")
            found[path] = (owner, group)
    return found


async def missing_parents(sandbox: Sandbox, path: str) -> list[str]:
    """The directories above ``path`` that are not there yet, top first
    (those a write or a mkdir with its parents will make)."""
    missing: list[str] = []
    parent = posixpath.dirname(path)
    while parent not in ("/", "") and len(missing) < MAX_MADE_PARENTS:
        if await sandbox.exists(parent):
            break
        missing.append(parent)
        parent = posixpath.dirname(parent)
    return missing[::-1]


async def hand_over(sandbox: Sandbox, user: str | None, paths: list[str]) -> None:
    """Make ``user`` (and their group) the owner of ``paths``, as envd's
    writes made as that user are."""
    if user is None or not paths:
        return
    for batch in _batches(paths):
        result = await sandbox.exec(["chown", "-h", "--", f"{user}:", *batch], user="root",
                                    timeout=60)
        if result.exit_code:
            why = result.stderr.strip() or f"chown exited {result.exit_code}"
            raise InvalidArgument(f"could not give {batch[0]} to user {user!r}: {why}")
