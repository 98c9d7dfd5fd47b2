"""``hutch cp``: files and directories into and out of a sandbox, over the SDK.

Either side may be ``SANDBOX:PATH``; the other is a path on this machine. As
with ``cp -r``, a source copied onto an existing directory (or a path ending
in ``/``) lands inside it under its own name; otherwise the destination is
the copy. Files already there are replaced, both ways, as ``cp`` replaces
them. File modes go with the files into a sandbox (one ``chmod`` per
mode, where the sandbox runs processes). Out of one, they come without
privilege: the caller's own files, never setuid, setgid or sticky, and never
a device node or a FIFO (see :func:`download`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import stat
import sys
import tempfile
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
    """Copy ``source`` (a file or directory in the sandbox) to ``destination`` here.

    What comes out never carries privilege: the files are the caller's, with
    no setuid, setgid or sticky bit and no write bit for others (the rules of
    :func:`tarfile.data_filter`, the standard library's for an archive from
    someone not trusted). A device node, FIFO or socket is refused, naming
    it, before anything is written here.
    """
    info = sandbox.stat(source)
    name = posixpath.basename(posixpath.normpath(sandbox.path(source)))
    if destination.endswith(os.sep) or os.path.isdir(destination):
        destination = os.path.join(destination, name)
    if info.type != FileType.DIRECTORY:
        _refuse_special(info)  # a link is read through, as cp reads it
        _fetch(sandbox, info.path, _safe_mode(info, name), destination)
        return 1
    # The whole tree is listed first: a special file anywhere in it is
    # refused before a byte is written here.
    files: list[tuple[str, str, int]] = []
    directories = [destination]
    pending = [(info.path, destination, ".")]
    while pending:
        remote_dir, local_dir, relative = pending.pop()
        for entry in sandbox.list_dir(remote_dir):
            inside = posixpath.join(relative, _entry_name(entry, remote_dir))
            local = os.path.join(local_dir, entry.name)
            if entry.type == FileType.DIRECTORY:
                _safe_mode(entry, inside)  # a name that leaves the tree is refused
                directories.append(local)
                pending.append((entry.path, local, inside))
            elif entry.type == FileType.FILE:
                files.append((entry.path, local, _safe_mode(entry, inside)))
            elif entry.type == FileType.SYMLINK:
                print(f"hutch cp: skipped {entry.path} (a symbolic link)", file=sys.stderr)
            else:
                _refuse_special(entry)
    for local_dir in directories:
        os.makedirs(local_dir, exist_ok=True)
    for remote, local, mode in files:
        _fetch(sandbox, remote, mode, local)
    return len(files)


def _entry_name(entry: Any, remote_dir: str) -> str:
    """A listed entry's own name: one path component, never one that climbs."""
    name = entry.name
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise InvalidArgument(f"{remote_dir} lists an entry named {name!r}: not a file name")
    return str(name)


def _refuse_special(info: Any) -> None:
    """A typed error naming ``info`` when it is a device node, FIFO or socket
    (a read of one may never end, and it is no file to hand out)."""
    if info.type == FileType.OTHER:
        raise InvalidArgument(
            f"{info.path} in the sandbox is a device node, FIFO or socket, "
            "not a regular file: not copied out"
        )


def _safe_mode(info: Any, relative: str) -> int:
    """The mode a copy of ``info`` (at ``relative`` inside the copy) gets
    here, by the standard library's rules for untrusted archives."""
    import tarfile

    from .._tar import copied_out_mode

    try:
        return copied_out_mode(relative, info.type == FileType.DIRECTORY, info.mode)
    except tarfile.FilterError as exc:
        raise InvalidArgument(f"{info.path} in the sandbox cannot be copied out: {exc}") from None


def _fetch(sandbox: Any, remote: str, mode: int, local: str) -> None:
    """``remote`` into a new file of the caller's, then moved to ``local``
    (replacing what was there, a link included, never writing through it)."""
    # The first piece before the local file is made: a read that fails
    # (missing, over the limit) leaves nothing behind here.
    pieces = iter(sandbox.read_pieces(remote))
    first = next(pieces, b"")
    parent = os.path.dirname(local) or "."
    os.makedirs(parent, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".hutch-cp-", dir=parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(first)
            for piece in pieces:  # as they arrive, never the whole file in memory
                fh.write(piece)
            os.fchmod(fh.fileno(), mode)
        os.replace(partial, local)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


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
