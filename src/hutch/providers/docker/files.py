"""A docker sandbox's files through the Engine's archive API (stat headers
decoded from Go's file modes, reads and writes as tar streams) and its grep."""

from __future__ import annotations

import base64
import io
import json
import re
import tempfile
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping
from datetime import datetime
from typing import IO, Any

import anyio
import anyio.to_thread

from ..._errors import (
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxPermissionDenied,
)
from ..._globmatch import compile_glob
from ..._tar import first_member, one_file_archive
from ..._types import KILL_GRACE_SECONDS, FileInfo, FileType, GrepMatch
from .._docker_engine import call as _call
from .._docker_engine import engine
from .._grep import GREP_OUTPUT_LIMIT
from .._grepfilter import LINE_BREAKS as _LINE_BREAKS
from .._grepfilter import required_literals as _required_literals
from .._grepstream import GrepStream
from ..base import ProcessRequest, bounded_pieces
from .process import DockerProcesses

#: Candidate lines a container's grep may send back for one search, bytes.
GREP_CANDIDATE_LIMIT = 16 * GREP_OUTPUT_LIMIT
#: An archive for put_archive kept in memory up to this size; on disk past it.
_ARCHIVE_IN_MEMORY = 1024 * 1024
#: Symlinks followed by one read or write before it gives up (as the kernel's 40).
_MAX_LINK_HOPS = 40
#: What one piece of a file read out of a container (an archive stream) holds.
_READ_PIECE = 1024 * 1024


#: Go's os.ModeDir and os.ModeSymlink bits, as the archive stat header uses them.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
#: Go's device, named pipe, socket, character device and irregular bits.
_GO_MODE_SPECIAL = (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
#: Go's setuid, setgid and sticky bits, and POSIX's.
_GO_MODE_PERMISSION_BITS = ((1 << 23, 0o4000), (1 << 22, 0o2000), (1 << 20, 0o1000))


class _ChunkReader(io.RawIOBase):
    """A binary file over an iterator of byte chunks (an HTTP body as it
    arrives), read without copying what is held."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._held = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._held:
            try:
                self._held = memoryview(next(self._chunks))
            except StopIteration:
                return 0
        count = min(len(buffer), len(self._held))
        buffer[:count] = self._held[:count]
        self._held = self._held[count:]
        return count


def _parse_mtime(value: object) -> float:
    """The archive stat header's RFC 3339 time (nanoseconds) as a Unix time."""
    if not isinstance(value, str):
        return 0.0
    try:
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", value)).timestamp()
    except ValueError:
        return 0.0


# grep over the regular files below $1 (links to them included, links to
# directories not entered), their names matching $2: never a FIFO or a device,
# whose read may never end.
_GREP_TREE = (
    'r=$1; n=$2; shift 2; '
    'find "$r" -mindepth 1 -xtype f -name "$n" -print0 | xargs -0 -r grep "$@" --'
)
#: What grep, find, xargs or sh say when they are not the GNU tools this needs.
_TOOL_FAILURES = (
    b"unknown predicate", b"invalid predicate", b"nvalid option", b"nrecognized option",
    b"not found", b"sage:",
)
#: grep's word (C locale) for a binary file with a matching line it did not print.
_BINARY_MATCHES = re.compile(rb"^grep: (.*?): binary file matches$", re.MULTILINE)
# Prints (NUL-terminated) each argument file with no NUL in its first 8 KiB.
_NO_NUL_HEAD = (
    'for f; do n=$(head -c 8192 -- "$f" | tr -d "\\000" | wc -c); '
    'm=$(head -c 8192 -- "$f" | wc -c); [ "$n" = "$m" ] && printf "%s\\0" "$f"; done; true'
)


class DockerFiles(DockerProcesses):
    """A docker sandbox's files."""

    # -- files -----------------------------------------------------------------------
    async def _stat_header(self, path: str) -> dict[str, Any]:
        api = engine()
        container = self._container()

        def head() -> dict[str, Any]:
            response = api.head(
                api._url("/containers/{0}/archive", container), params={"path": path}
            )
            if response.status_code == 404:
                raise SandboxFileNotFound(f"no such file or directory: {path}")
            if response.status_code >= 400:
                # A HEAD answer has no body to say why (a parent that is a
                # file, a loop of links): ask again with GET, on this error
                # path only, for the engine's message.
                api.get_archive(container, path)
            api._raise_for_status(response)
            header = response.headers.get("X-Docker-Container-Path-Stat", "")
            result: dict[str, Any] = json.loads(base64.b64decode(header))
            return result

        result: dict[str, Any] = await _call(head, path=path)
        return result

    @staticmethod
    def _info(path: str, header: Mapping[str, Any]) -> FileInfo:
        mode = int(header.get("mode", 0))
        if mode & _GO_MODE_DIR:
            kind = FileType.DIRECTORY
        elif mode & _GO_MODE_SYMLINK:
            kind = FileType.SYMLINK
        elif mode & _GO_MODE_SPECIAL:
            kind = FileType.OTHER
        else:
            kind = FileType.FILE  # setuid, setgid and sticky are bits of their own in Go
        permissions = mode & 0o777
        for go_bit, posix_bit in _GO_MODE_PERMISSION_BITS:
            if mode & go_bit:
                permissions |= posix_bit
        return FileInfo(path, kind, int(header.get("size", 0)), permissions,
                        _parse_mtime(header.get("mtime")))

    async def stat(self, path: str) -> FileInfo:
        return self._info(path, await self._stat_header(path))

    def _open_content(
        self, path: str, limit: int
    ) -> tuple[Generator[bytes, None, None], IO[bytes] | None]:
        """In a thread: the engine's archive stream of ``path`` (symlinks
        followed) and the file's content read from it as it arrives (None for
        what has no content, a FIFO); the caller closes the stream. Errors
        (missing, a directory, over ``limit``) come before a byte moves."""
        api = engine()
        container = self._container()
        target = path
        for _ in range(_MAX_LINK_HOPS):
            stream, header = api.get_archive(container, target, chunk_size=_READ_PIECE)
            try:
                mode = int(header.get("mode", 0))
                if mode & _GO_MODE_SYMLINK:
                    link = str(header.get("linkTarget") or "")  # resolved by the engine
                    if not link:
                        raise ProviderError(f"docker did not resolve the symlink {target}")
                    target = link
                    stream.close()
                    continue
                if mode & _GO_MODE_DIR:
                    raise SandboxIsADirectory(f"{path} is a directory")
                # The stat header tells the size before a byte of content moves.
                size = int(header.get("size", 0))
                if size > limit:
                    raise OutputLimitExceeded(
                        f"{path} is {size} bytes, over the read limit of {limit} bytes"
                    )
                # Read on after this returns; closing the stream under it ends it.
                try:
                    _, content = first_member(_ChunkReader(stream), _READ_PIECE)
                except LookupError:
                    raise ProviderError(f"docker returned an empty archive for {path}") from None
                return stream, content
            except BaseException:
                stream.close()
                raise
        raise ProviderError(f"{path}: too many levels of symbolic links")

    async def read_file(self, path: str, limit: int) -> bytes:
        def read() -> bytes:
            stream, content = self._open_content(path, limit)
            try:
                data = content.read(limit + 1) if content is not None else b""
            finally:
                stream.close()
            if len(data) > limit:
                raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
            return data

        data: bytes = await _call(read, path=path)
        return data

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """The file in pieces as the engine's archive stream brings them: a
        large file is never whole in the daemon's memory."""
        stream, content = await _call(self._open_content, path, limit, path=path)
        async def read() -> bytes:
            if content is None:
                return b""
            piece: bytes = await _call(content.read, _READ_PIECE, path=path)
            return piece

        try:
            async for piece in bounded_pieces(read, path, limit):
                yield piece
        finally:
            stream.close()

    async def write_file(self, path: str, data: bytes) -> None:
        await self.write_file_from(path, io.BytesIO(data))

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        api = engine()
        container = self._container()
        mode = 0o644
        target = path
        for _ in range(_MAX_LINK_HOPS):
            try:
                header = await self._stat_header(target)
            except FileNotFoundError:
                break
            info = self._info(target, header)
            if info.type == FileType.SYMLINK and header.get("linkTarget"):
                # Writing through a link writes its target, as open() does;
                # an archive would replace the link with a file.
                target = str(header["linkTarget"])
                continue
            # Untarring a file over a directory would replace the whole tree.
            if info.type == FileType.DIRECTORY:
                raise SandboxIsADirectory(f"{path} is a directory")
            mode = info.mode  # an overwrite keeps the file's mode, as open() does
            break
        else:
            raise ProviderError(f"{path}: too many levels of symbolic links")

        def put() -> None:
            # The archive goes to a spool (disk past its first MiB) and the
            # engine reads it from there: a large file is never whole in memory.
            with tempfile.SpooledTemporaryFile(max_size=_ARCHIVE_IN_MEMORY) as archive:
                start = source.tell()
                size = source.seek(0, io.SEEK_END) - start
                source.seek(start)
                # Relative to / so missing parents are created.
                one_file_archive(archive, target, source, size, mode)
                archive.seek(0)
                if not api.put_archive(container, "/", archive):
                    raise ProviderError(f"docker refused to write {path}")

        await _call(put, path=path)

    async def list_dir(self, path: str) -> list[FileInfo]:
        info = await self.stat(path)
        if info.type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        # Paths travel as argv items and come back NUL-separated: no quoting.
        code, out, err = await self.run_quiet(
            ["find", path, "-mindepth", "1", "-maxdepth", "1",
             "-printf", "%y\\t%s\\t%m\\t%T@\\t%f\\0"]
        )
        if code != 0 and not out:
            raise ProviderError(f"listing {path} failed: {err.decode('utf-8', 'replace')}")
        kinds = {"f": FileType.FILE, "d": FileType.DIRECTORY, "l": FileType.SYMLINK}
        entries = []
        for record in out.split(b"\0"):
            if not record:
                continue
            kind, size, mode, mtime, name = record.decode("utf-8", "surrogateescape").split(
                "\t", 4
            )
            entries.append(
                FileInfo(
                    path.rstrip("/") + "/" + name, kinds.get(kind, FileType.OTHER),
                    int(size), int(mode, 8), float(mtime),
                )
            )
        return sorted(entries, key=lambda e: e.path)

    async def remove(self, path: str, recursive: bool) -> None:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            argv = ["rm", "-rf", "--", path] if recursive else ["rmdir", "--", path]
        else:
            argv = ["rm", "-f", "--", path]
        code, _, err = await self.run_quiet(argv)
        if code != 0:
            message = err.decode("utf-8", "replace")
            if "not empty" in message:
                raise SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
            if "ermission denied" in message or "not permitted" in message:
                raise SandboxPermissionDenied(f"permission denied: {path}")
            if "ead-only" in message:
                raise SandboxPermissionDenied(f"read-only file system: {path}")
            raise ProviderError(f"removing {path} failed: {message.strip()}")

    async def walk_files(self, root: str) -> list[str]:
        # Regular files and links to them (-xtype f), as the base rule asks;
        # the root followed if it is a link (-H).
        code, out, _ = await self.run_quiet(
            ["find", "-H", root, "-mindepth", "1", "-xtype", "f", "-print0"]
        )
        if code != 0 and not out:
            await self.stat(root)  # the typed error for a missing root, off the happy path
        return [p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p]

    async def grep(
        self, pattern: re.Pattern[str], root: str, glob: str | None, limit: int
    ) -> list[GrepMatch]:
        """grep in the container over lines that may match, re-checked here.

        The container's ``grep -F`` (C locale, bytes) sends back only lines
        holding a literal that every match must contain, so file content
        never crosses the API in bulk. Each line is then matched with
        Python's ``re`` exactly as the base class would on local (in a worker
        process, never on the event loop); a file whose
        lines Python would split differently than grep does (a lone CR, form
        feed, U+2028...) or that grep stops reading as binary part way is
        read whole and searched by the base rule. Where the tools are not GNU
        ones (busybox), the base class's walk-and-read answers instead.
        """
        info = await self.stat(root)
        literals = _required_literals(pattern)
        grep_args = ["-H", "-n", "-Z", "-F", "-D", "skip"]
        if pattern.flags & re.IGNORECASE:
            grep_args.append("-i")
        if literals is None:
            grep_args += ["-e", ""]
        else:
            for literal in [*literals, *_LINE_BREAKS]:
                grep_args += ["-e", literal]
        if info.type == FileType.DIRECTORY:
            name = "*"
            if glob and "/" not in glob and "[" not in glob and "\\" not in glob:
                name = glob  # the same files find -name picks, checked again below
            argv = ["sh", "-c", _GREP_TREE, "hutch-grep", root, name, *grep_args]
        else:
            argv = ["grep", *grep_args, "--", root]
        matcher = compile_glob(glob) if glob and info.type == FileType.DIRECTORY else None
        found = GrepStream(pattern, root.rstrip("/") + "/",
                           None if matcher is None else matcher.match)
        err = await self._grep_into(found, argv)
        if not found.answered and any(marker in err for marker in _TOOL_FAILURES):
            return await super().grep(pattern, root, glob, limit)
        # grep calls a file binary at a NUL anywhere in what it has read; the
        # base rule, only at a NUL in the first 8 KiB. Those it named are
        # checked by that rule, and the ones it holds to be text read whole.
        binary = {
            m.decode("utf-8", "surrogateescape") for m in _BINARY_MATCHES.findall(err)
        }
        matches = await found.end(binary)
        reread = found.reread | (await self._text_by_base_rule(sorted(binary)) if binary
                                 else set())
        whole = [
            path for path in sorted(reread)
            if matcher is None or matcher.match(path[len(found.prefix):])
        ]
        matches.extend(await self.grep_files(pattern, whole, limit))
        return sorted(matches, key=lambda m: (m.path, m.line_number))

    async def _grep_into(self, found: GrepStream, argv: list[str]) -> bytes:
        """Run hutch's grep, its answer fed to ``found`` as it comes (never
        whole in memory); its stderr. Past :data:`GREP_CANDIDATE_LIMIT`
        bytes it is stopped (OutputLimitExceeded)."""
        proc = await self.start_process(
            ProcessRequest(argv, cwd="/", env={"LC_ALL": "C"}, user="0")
        )
        err = bytearray()
        total = 0
        try:
            while (chunk := await proc.read()) is not None:
                total += len(chunk.data)
                if total > GREP_CANDIDATE_LIMIT:
                    raise OutputLimitExceeded(
                        f"grep answered more than {GREP_CANDIDATE_LIMIT} bytes; "
                        "narrow the path, the glob or the pattern"
                    )
                if chunk.stream == "stdout":
                    await found.feed(chunk.data)
                elif len(err) < GREP_OUTPUT_LIMIT:  # its words on binary files, errors
                    err += chunk.data
            await proc.wait()
        except BaseException:
            # Cancelled (a grep's timeout, its caller gone) or over its cap:
            # what it started inside the sandbox is killed, not left to run.
            with anyio.CancelScope(shield=True):
                await proc.kill(KILL_GRACE_SECONDS)
            raise
        return bytes(err)

    async def _text_by_base_rule(self, paths: list[str]) -> set[str]:
        """Those of ``paths`` with no NUL in their first 8 KiB."""
        _, out, _ = await self.run_quiet(["sh", "-c", _NO_NUL_HEAD, "hutch-grep", *paths])
        return {p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p}
