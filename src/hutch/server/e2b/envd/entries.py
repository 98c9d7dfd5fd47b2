"""EntryInfo, envd's description of a file, from hutch's FileInfo (proto3 JSON)."""

from __future__ import annotations

import stat as stat_mod
from typing import Any

from ...._types import FileInfo, FileType
from .connect import int64, timestamp

#: envd's FileType by hutch's.
FILE_TYPES = {
    FileType.FILE: "FILE_TYPE_FILE", FileType.DIRECTORY: "FILE_TYPE_DIRECTORY",
    FileType.SYMLINK: "FILE_TYPE_SYMLINK", FileType.OTHER: "FILE_TYPE_UNSPECIFIED",
}

#: What ``ls -l`` writes first for each type.
_TYPE_LETTER = {FileType.DIRECTORY: "d", FileType.SYMLINK: "L", FileType.OTHER: "?"}


def permissions(info: FileInfo) -> str:
    """The mode as Go's ``FileMode.String`` writes it (``-rw-r--r--``, ``drwxr-xr-x``)."""
    bits = "".join(
        letter if info.mode & mask else "-"
        for letter, mask in zip("rwxrwxrwx", (
            stat_mod.S_IRUSR, stat_mod.S_IWUSR, stat_mod.S_IXUSR,
            stat_mod.S_IRGRP, stat_mod.S_IWGRP, stat_mod.S_IXGRP,
            stat_mod.S_IROTH, stat_mod.S_IWOTH, stat_mod.S_IXOTH,
        ), strict=True)
    )
    return _TYPE_LETTER.get(info.type, "-") + bits


def entry_info(info: FileInfo, owner: tuple[str, str] | None = None) -> dict[str, Any]:
    """An EntryInfo, proto3 JSON: zero values left out, as protojson does.
    ``owner``: its owner and group, when known."""
    entry: dict[str, Any] = {
        "name": info.name, "type": FILE_TYPES[info.type], "path": info.path,
    }
    if info.size:
        entry["size"] = int64(info.size)
    if info.mode:
        entry["mode"] = info.mode & 0o7777
    entry["permissions"] = permissions(info)
    if owner is not None:
        entry["owner"], entry["group"] = owner
    entry["modifiedTime"] = timestamp(info.mtime)
    if info.type == FileType.SYMLINK:
        entry["isSymlink"] = True
    return entry
