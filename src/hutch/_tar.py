"""Every tar archive hutch makes or opens in Python, and the rules an
extraction follows, in one place (a leaf: it imports nothing of hutch but
errors).

- :func:`pack_tree`: a directory's entries into an archive (a definition's
  source on its way into a sandbox, unpacked there by the sandbox's tar).
- :func:`one_file_archive`: one file as a PAX archive (the Docker Engine's
  way to write a file into a container).
- :func:`first_member`: the first file of an archive read as a stream (the
  Engine's way to read one).
- :func:`unpack_rootfs`: a root file system exported by the Engine, unpacked
  as ``tar -x --numeric-owner`` as root did (owners, setuid bits, device
  nodes and absolute symbolic links kept: it is a system's root), through
  :class:`RootfsFilter`, which refuses what would land outside the
  directory: an absolute or climbing name, a hard link to a file outside,
  or a name reached through a symbolic link that leads out.
- :func:`copied_out_mode`: the mode a file copied out of a sandbox gets here
  (``hutch cp``): the standard library's ``data`` filter's rules (no setuid,
  setgid or sticky bit, no write for group or others, a name that stays in
  the copy).

GNU tar stays where :mod:`tarfile` cannot do the job or costs far more:
layers kept as archives (``providers.layers.archive``: overlay whiteouts are
character devices with ``trusted.overlay.*`` extended attributes, ACLs and
sparse files, none of which :mod:`tarfile` carries), packing a root file
system for ``docker import`` (ten times less CPU than :mod:`tarfile`), the
Debian minbase unpacked before an image build, and a source unpacked inside
its sandbox (the sandbox's own tar).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import time
from typing import IO

__all__ = [
    "copied_out_mode",
    "first_member",
    "one_file_archive",
    "pack_tree",
    "RootfsFilter",
    "unpack_rootfs",
]


def pack_tree(tree: str, archive: str) -> None:
    """The entries of the directory ``tree`` (not ``tree`` itself), sorted,
    into a new archive at ``archive``."""
    with tarfile.open(archive, "w") as tar:
        for name in sorted(os.listdir(tree)):
            tar.add(os.path.join(tree, name), arcname=name)


def one_file_archive(into: IO[bytes], name: str, source: IO[bytes], size: int,
                     mode: int) -> None:
    """``size`` bytes of ``source`` as the file ``name`` (relative: missing
    parents are created where the archive is unpacked) of mode ``mode``, as a
    PAX archive written to ``into``: PAX headers carry any name (spaces,
    quotes, newlines, non-ASCII) byte for byte."""
    with tarfile.open(fileobj=into, mode="w", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo(name.lstrip("/"))
        member.size = size
        member.mode = mode
        member.mtime = int(time.time())
        tar.addfile(member, source)


def first_member(
    stream: IO[bytes] | io.RawIOBase, bufsize: int
) -> tuple[tarfile.TarFile, IO[bytes] | None]:
    """The archive read from ``stream`` as it comes (never seeking), and its
    first member's content (None when that member is no regular file).
    Raises ``LookupError`` on an empty archive. Closing ``stream`` ends both."""
    tar = tarfile.open(fileobj=stream, mode="r|", bufsize=bufsize)  # noqa: SIM115
    member = tar.next()
    if member is None:
        raise LookupError("an empty archive")
    return tar, tar.extractfile(member)


class RootfsFilter:
    """An extraction filter for a root file system: each member as it is
    (owner, mode with its setuid bits, device numbers, a symbolic link's
    target, absolute or not: all are read inside the sandbox's root), unless
    it would be written outside the destination. Raises
    ``tarfile.FilterError``.

    Where a member lands is the file system's answer, through the links that
    earlier members made (a link to / must not carry later members there);
    the directories' answers are kept until a member makes or replaces a
    link, which is what could change them (a resolution per member cost
    four times the unpacking's own CPU)."""

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {}
        self._dest: tuple[str, str] = ("", "")

    def _resolved(self, dest: str, name: str) -> str:
        parent, base = os.path.split(name)
        if ".." in name.split("/"):
            return os.path.realpath(os.path.join(dest, name))
        real_parent = self._dirs.get(parent)
        if real_parent is None:
            real_parent = self._dirs[parent] = os.path.realpath(os.path.join(dest, parent))
        target = os.path.join(real_parent, base)
        if os.path.islink(target):  # a file is written through a link already there
            self._dirs.clear()
            target = os.path.realpath(target)
        return target

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        if self._dest[0] != dest:
            self._dest = (dest, os.path.realpath(dest))
        dest = self._dest[1]
        name = member.name.lstrip("/")
        target = self._resolved(dest, name)
        if os.path.commonpath([target, dest]) != dest:
            raise tarfile.OutsideDestinationError(member, target)
        if member.issym():
            self._dirs.clear()
        if member.islnk():
            linked = self._resolved(dest, member.linkname.lstrip("/"))
            if os.path.commonpath([linked, dest]) != dest:
                raise tarfile.LinkOutsideDestinationError(member, linked)
            if member.linkname.startswith("/"):
                return member.replace(name=name, linkname=member.linkname.lstrip("/"),
                                      deep=False)
        return member if name == member.name else member.replace(name=name, deep=False)


def unpack_rootfs(stream: IO[bytes], into: str) -> None:
    """Unpack the root file system streamed in ``stream`` (read as it
    comes) into the directory ``into``, through a :class:`RootfsFilter`."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(into, numeric_owner=True, filter=RootfsFilter())


def copied_out_mode(relative: str, is_dir: bool, mode: int) -> int:
    """The mode a file or directory copied out of a sandbox (at ``relative``
    inside the copy) gets here, by :func:`tarfile.data_filter`'s rules.
    Raises ``tarfile.FilterError`` for a name that would leave the copy."""
    member = tarfile.TarInfo(relative)
    member.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    member.mode = stat.S_IMODE(mode) or 0o644
    # A destination that is never written: only the member's own name and
    # mode are judged.
    safe = tarfile.data_filter(member, "/nonexistent-hutch-cp")
    return 0o755 if safe.mode is None else safe.mode
