"""Files through commands in the pod (``stat``, ``find``, ``cat``, ``rm``):
the API server has no file calls, and hutch's agent is not in the pod yet."""

from __future__ import annotations

import abc
import stat as st

from ..._errors import (
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileNotFound,
    SandboxIsADirectory,
)
from ..._types import FileInfo, FileType
from ..base import tree_command_error

_TYPES = {"f": FileType.FILE, "d": FileType.DIRECTORY, "l": FileType.SYMLINK}
#: One entry per line of find's -printf: type, size, mode, mtime, path (NUL-ended).
_FORMAT = r"%y %s %m %T@ %p\0"


def _entries(out: bytes) -> list[FileInfo]:
    infos = []
    for record in out.split(b"\0"):
        if not record:
            continue
        kind, size, mode, mtime, path = record.decode("utf-8", "surrogateescape").split(" ", 4)
        file_type = _TYPES.get(kind, FileType.OTHER)
        type_bits = {FileType.FILE: st.S_IFREG, FileType.DIRECTORY: st.S_IFDIR,
                     FileType.SYMLINK: st.S_IFLNK}.get(file_type, 0)
        infos.append(FileInfo(path, file_type, int(size), type_bits | int(mode, 8),
                              float(mtime)))
    return infos


class CommandFiles(abc.ABC):
    """SandboxFiles on :meth:`run` (a command's exit code, stdout and stderr)."""

    @abc.abstractmethod
    async def run(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        ...

    async def _checked(self, argv: list[str], what: str, stdin: bytes | None = None) -> bytes:
        code, out, err = await self.run(argv, stdin)
        if code != 0:
            raise tree_command_error(err.decode("utf-8", "replace"), what)
        return out

    async def stat(self, path: str) -> FileInfo:
        out = await self._checked(
            ["find", path, "-maxdepth", "0", "-printf", _FORMAT], f"stat {path}")
        entries = _entries(out)
        if not entries:
            raise SandboxFileNotFound(f"{path}: no such file or directory")
        return entries[0]

    async def list_dir(self, path: str) -> list[FileInfo]:
        if (await self.stat(path)).type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        out = await self._checked(["find", path, "-mindepth", "1", "-maxdepth", "1",
                                   "-printf", _FORMAT], f"list {path}")
        return sorted(_entries(out), key=lambda i: i.path)

    async def read_file(self, path: str, limit: int) -> bytes:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            raise SandboxIsADirectory(f"{path} is a directory")
        if info.size > limit:
            raise OutputLimitExceeded(
                f"{path} is {info.size} bytes, over the read limit of {limit} bytes")
        # head -c stops at one past the limit: a file that grew says so.
        data = await self._checked(["head", "-c", str(limit + 1), "--", path], f"read {path}")
        if len(data) > limit:
            raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
        return data

    async def write_file(self, path: str, data: bytes) -> None:
        # Sized, not read to the end of stdin: the v4 channel protocol
        # cannot close a command's stdin.
        code, _, err = await self.run(
            ["sh", "-c", 'if [ -d "$1" ]; then echo "$1: Is a directory" >&2; exit 1; fi; '
             'mkdir -p -- "$(dirname -- "$1")" && head -c "$2" > "$1"', "hutch-write", path,
             str(len(data))], data)
        if code != 0:
            said = err.decode("utf-8", "replace")
            if "Is a directory" in said:
                raise SandboxIsADirectory(f"{path} is a directory")
            raise tree_command_error(said, f"write {path}")

    async def remove(self, path: str, recursive: bool) -> None:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            if not recursive:
                if await self.list_dir(path):
                    raise SandboxIsADirectory(
                        f"{path} is a non-empty directory; pass recursive=True")
                await self._checked(["rmdir", "--", path], f"remove {path}")
                return
            await self._checked(["rm", "-rf", "--", path], f"remove {path}")
            return
        await self._checked(["rm", "-f", "--", path], f"remove {path}")

    async def walk_files(self, root: str) -> list[str]:
        info = await self.stat(root)
        if info.type != FileType.DIRECTORY:
            return [root]
        out = await self._checked(["find", root, "-type", "f", "-print0"], f"walk {root}")
        try:
            return sorted(p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p)
        except UnicodeDecodeError as exc:  # pragma: no cover - surrogateescape never fails
            raise ProviderError(str(exc)) from exc
