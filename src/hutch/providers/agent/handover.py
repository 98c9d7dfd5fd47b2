"""Files the agent opens and hands over as descriptors (SCM_RIGHTS): read
and written here, straight from the page cache, not through the socket."""

from __future__ import annotations

import os
import stat
from typing import IO

import anyio
import anyio.to_thread

from ..._errors import InvalidArgument, OutputLimitExceeded
from .wire import MAX_PAYLOAD, AgentFailure

#: Past this size, file I/O on a handed-over descriptor moves off the event loop.
THREAD_BYTES = 4 << 20


def regular_file(fd: int) -> os.stat_result:
    """The handed-over descriptor's stat, refused unless a regular file (a
    pipe or a socket could block this process)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise AgentFailure("the agent handed over a descriptor that is not a regular file")
    return info


async def read_handed_over(fd: int, path: str, limit: int) -> bytes:
    try:
        size = regular_file(fd).st_size
        if size > limit:
            raise OutputLimitExceeded(
                f"{path} is {size} bytes, over the read limit of {limit} bytes"
            )

        def read() -> bytes:
            # What fstat promised and a byte more, to notice a file still growing.
            data = os.pread(fd, size + 1, 0)
            if len(data) > size:
                # It grew (or is a /proc file, which says 0): the rest in
                # pieces, up to the limit and a byte, never the limit up front.
                parts = [data]
                total = len(data)
                while total <= limit:
                    piece = os.pread(fd, min(MAX_PAYLOAD, limit + 1 - total), total)
                    if not piece:
                        break
                    parts.append(piece)
                    total += len(piece)
                data = b"".join(parts)
            if len(data) > limit:
                raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
            return data

        try:
            if size > THREAD_BYTES:
                return await anyio.to_thread.run_sync(read)
            return read()
        except OSError as exc:
            # A procfs or sysfs file that cannot be read at an offset (EINVAL):
            # not a file the file API reads (grep skips it), as a FIFO is not.
            raise InvalidArgument(
                f"{path} cannot be read as a file ({exc.strerror or exc}); read it with exec"
            ) from None
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def copy_into(fd: int, source: IO[bytes]) -> None:
    while piece := source.read(MAX_PAYLOAD):
        write_all(fd, piece)
