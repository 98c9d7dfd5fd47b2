"""The grep rule, and the worker process that applies it off the daemon's loop.

A regular expression is the caller's: one that backtracks (``(a|a)+$``) runs
for minutes in Python's ``re``, holding the GIL, and a thread cannot be
stopped. So matching runs in a separate process that the caller kills when
its time is up; reading host files runs there too, so a read that blocks
(a FIFO swapped in, a procfs file that waits) is killed with it.

Standard library only: the process starts with ``python -I -S <this file>``
(tens of milliseconds), not by importing hutch (hundreds).

Protocol on stdin/stdout: each message is an 8-byte big-endian length and a
``marshal`` payload. Requests are tuples whose first item names the kind:

``("data", pattern, flags, budget, [(path, bytes), ...])``
    the matching lines of each file's content;
``("files", pattern, flags, budget, limit, [(path, host_path), ...])``
    the same for host files this process reads (regular files only, at most
    ``limit`` bytes each);
``("lines", pattern, flags, budget, [text, ...])``
    the indices of the lines the pattern matches.

``budget`` is the most characters of matching lines one answer may carry
(past it: the error ``too_much``), each match counted as its line and
:data:`MATCH_COST` more (its place in the answer: an empty line is not
free), so that a pattern matching everything in a large tree, or every line
of a file of empty lines, cannot fill the daemon's memory. Answers are
``("ok", result)`` or ``("error", kind, message)``, where a file answer is
``[(path, line_number, line), ...]``.
"""

from __future__ import annotations

import marshal
import os
import re
import stat
import struct
import sys
from typing import Any, BinaryIO

#: What precedes every request and answer: its length in bytes.
HEADER = struct.Struct(">Q")
#: A file with a NUL in its first this many bytes is binary and skipped.
BINARY_PROBE = 8192
#: What one match costs an answer beyond its line's characters: about what
#: it holds of the daemon's memory (an object, a number, a string's header;
#: its path is one string that all of a file's matches share).
MATCH_COST = 96


def match_cost(line: str) -> int:
    """What one match counts against a grep's budget."""
    return len(line) + MATCH_COST


def matching_lines(data: bytes, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """The rule every provider's grep answers by: (line number, line) of each
    line ``pattern`` matches in one file's ``data``; none in a binary file."""
    if b"\0" in data[:BINARY_PROBE]:
        return []  # binary: grep skips it, and so do we
    return [
        (number, line)
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1)
        if pattern.search(line)
    ]


class TooLarge(Exception):
    """A file over the read limit: the whole grep fails, as a read would."""


class TooMuch(Exception):
    """More matching lines than the answer's budget."""


class _Budget:
    def __init__(self, chars: int) -> None:
        self.left = chars

    def take(self, line: str) -> None:
        self.left -= match_cost(line)
        if self.left < 0:
            raise TooMuch("grep matched more lines than its output cap")


def read_regular(host_path: str, shown: str, limit: int) -> bytes | None:
    """A regular file's bytes; None for what is not one (a FIFO, a device, a
    socket, a directory) or cannot be read."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(host_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > limit:
            raise TooLarge(
                f"{shown} is {info.st_size} bytes, over the read limit of {limit} bytes"
            )
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError:
        return None  # unreadable (EIO, EAGAIN...), as grep -s skips it
    finally:
        os.close(fd)
    if len(data) > limit:
        # It said it was small and did not end (a procfs file such as
        # /proc/1/pagemap): not a text file to search.
        return None
    return data


def answer(request: tuple[Any, ...]) -> Any:
    kind, pattern_text, flags = request[0], request[1], request[2]
    pattern = re.compile(pattern_text, flags)
    budget = _Budget(request[3])
    if kind == "lines":
        indices = []
        for i, line in enumerate(request[4]):
            if pattern.search(line):
                budget.take(line)
                indices.append(i)
        return indices
    found: list[tuple[str, int, str]] = []
    if kind == "data":
        for path, data in request[4]:
            for number, line in matching_lines(data, pattern):
                budget.take(line)
                found.append((path, number, line))
        return found
    if kind == "files":
        limit = request[4]
        for path, host_path in request[5]:
            data = read_regular(host_path, path, limit)
            for number, line in matching_lines(data, pattern) if data is not None else []:
                budget.take(line)
                found.append((path, number, line))
        return found
    raise ValueError(f"unknown request {kind!r}")


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    while (header := _read_exact(requests, HEADER.size)) is not None:
        body = _read_exact(requests, HEADER.unpack(header)[0])
        if body is None:
            return
        try:
            reply: Any = ("ok", answer(marshal.loads(body)))
        except TooLarge as exc:
            reply = ("error", "too_large", str(exc))
        except TooMuch as exc:
            reply = ("error", "too_much", str(exc))
        except Exception as exc:
            reply = ("error", type(exc).__name__, str(exc))
        payload = marshal.dumps(reply)
        answers.write(HEADER.pack(len(payload)) + payload)
        answers.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
