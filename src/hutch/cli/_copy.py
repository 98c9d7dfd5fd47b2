"""``hutch cp``: files and directories into and out of a sandbox, over the SDK.

Either side may be ``SANDBOX:PATH``; the other is a path on this machine. As
with ``cp -r``, a source copied onto an existing directory (or a path ending
in ``/``) lands inside it under its own name; otherwise the destination is
the copy. Files already there are replaced, both ways, as ``cp`` replaces
them. File modes go
with the files (into a sandbox through one ``chmod`` per mode, where the
sandbox runs processes).
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import sys
from collections import defaultdict
from typing import Any

from .._errors import InvalidArgument, SandboxFileNotFound
from .._types import FileType

#: ``sb-123:path``: a sandbox id, a colon, a path. A local path with a colon
#: before its first slash is written ``./a:b``.
REMOTE = re.compile(r"^(?P<sandbox>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>.*)$")


def split_remote(spec: str) -> tuple[str, str] | None:
    """(sandbox id, path) when ``spec`` names a place in a sandbox."""
    match = REMOTE.match(spec)
    if match is None:
        return None
    return match["sandbox"], match["path"] or "."


def _remote_is_dir(sandbox: Any, path: str) -> bool:
    try:
        return bool(sandbox.stat(path).type == FileType.DIRECTORY)
    except FileNotFoundError:
        return False


def upload(sandbox: Any, source: str, destination: str) -> int:
    """Copy ``source`` (a file or directory here) to ``destination`` in the sandbox."""
    if not os.path.lexists(source):
        raise SandboxFileNotFound(f"no such file or directory here: {source}")
    name = os.path.basename(os.path.normpath(source))
    # A trailing slash says "into this directory", made if missing (as rsync reads it).
    if destination.endswith("/") or _remote_is_dir(sandbox, destination):
        destination = posixpath.join(destination, name)
    modes: dict[int, list[str]] = defaultdict(list)
    empty_dirs: list[str] = []
    copied = 0

    def put(local: str, remote: str) -> None:
        nonlocal copied
        with open(local, "rb") as fh:
            # A person's copy replaces what is there, as cp does: the
            # read-before-write guard is for agents' sessions, and each CLI
            # call is a new session that has read nothing.
            sandbox.write_from(remote, fh, overwrite=True)  # a piece at a time, never whole
        modes[stat.S_IMODE(os.stat(local).st_mode)].append(sandbox.path(remote))
        copied += 1

    if os.path.isdir(source):
        for here, dirs, files in os.walk(source):
            rel = os.path.relpath(here, source)
            remote_dir = destination if rel == "." else posixpath.join(destination, rel)
            if not dirs and not files:
                empty_dirs.append(sandbox.path(remote_dir))
            for file_name in files:
                local = os.path.join(here, file_name)
                if os.path.islink(local) or not os.path.isfile(local):
                    print(f"hutch cp: skipped {local} (not a regular file)", file=sys.stderr)
                    continue
                put(local, posixpath.join(remote_dir, file_name))
    else:
        put(source, destination)
    _set_modes(sandbox, modes, empty_dirs)
    return copied


def _set_modes(sandbox: Any, modes: dict[int, list[str]], empty_dirs: list[str]) -> None:
    """Give the copies their modes, and make empty directories, where commands run."""
    if not sandbox.capabilities.supports("processes"):
        return
    batches: list[list[str]] = []
    if empty_dirs:
        batches.append(["mkdir", "-p", "--", *empty_dirs])
    for mode, paths in modes.items():
        batches.append(["chmod", f"{mode:o}", "--", *paths])
    for argv in batches:
        result = sandbox.exec(argv)
        if result.exit_code != 0:
            print(f"hutch cp: {argv[0]} in the sandbox: {result.stderr.strip()}", file=sys.stderr)


def download(sandbox: Any, source: str, destination: str) -> int:
    """Copy ``source`` (a file or directory in the sandbox) to ``destination`` here."""
    info = sandbox.stat(source)
    name = posixpath.basename(posixpath.normpath(sandbox.path(source)))
    if destination.endswith(os.sep) or os.path.isdir(destination):
        destination = os.path.join(destination, name)
    if info.type != FileType.DIRECTORY:
        _fetch(sandbox, info.path, info.mode, destination)
        return 1
    copied = 0
    pending = [(info.path, destination)]
    while pending:
        remote_dir, local_dir = pending.pop()
        os.makedirs(local_dir, exist_ok=True)
        for entry in sandbox.list_dir(remote_dir):
            local = os.path.join(local_dir, entry.name)
            if entry.type == FileType.DIRECTORY:
                pending.append((entry.path, local))
            elif entry.type == FileType.FILE:
                _fetch(sandbox, entry.path, entry.mode, local)
                copied += 1
            else:
                print(f"hutch cp: skipped {entry.path} ({entry.type.value})", file=sys.stderr)
    return copied


def _fetch(sandbox: Any, remote: str, mode: int, local: str) -> None:
    # The first piece before the local file is made: a read that fails
    # (missing, over the limit) leaves nothing behind here.
    pieces = iter(sandbox.read_pieces(remote))
    first = next(pieces, b"")
    parent = os.path.dirname(local)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(local, "wb") as fh:
        fh.write(first)
        for piece in pieces:  # as they arrive, never the whole file in memory
            fh.write(piece)
    os.chmod(local, stat.S_IMODE(mode) or 0o644)


def plan(source: str, destination: str) -> tuple[str, str, str, str]:
    """(direction, sandbox id, path there, path here) for ``hutch cp SRC DST``."""
    src, dst = split_remote(source), split_remote(destination)
    if (src is None) == (dst is None):
        raise InvalidArgument(
            "hutch cp copies between this machine and a sandbox: exactly one of "
            f"{source!r} and {destination!r} must be SANDBOX:PATH"
        )
    if src is not None:
        return "out", src[0], src[1], destination
    assert dst is not None
    return "in", dst[0], dst[1], source
