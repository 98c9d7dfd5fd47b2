"""Output a model can take: a command's output kept to its first and last
bytes, with a note that says what was cut.

A model reads a tool's answer into its context, so a command that prints
10 MB must not answer 10 MB. The head (where the command said what it is
doing) and the tail (where it said how it ended) are kept; the middle is
dropped as it streams past, so holding it never costs more than the cap.
"""

from __future__ import annotations

from collections import deque

#: What a tool's answer keeps of one stream by default (bytes).
DEFAULT_OUTPUT_CAP = 30_000


class CappedStream:
    """One stream's bytes, keeping at most ``cap`` of them: the first half
    and the last half, and a count of all."""

    def __init__(self, cap: int) -> None:
        if cap < 2:
            raise ValueError(f"an output cap is at least 2 bytes, got {cap}")
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_size = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self._tail.append(data)
        self._tail_size += len(data)
        while self._tail_size - len(self._tail[0]) >= self.tail_cap:
            self._tail_size -= len(self._tail.popleft())

    @property
    def cut(self) -> int:
        """Bytes dropped from the middle."""
        return max(0, self.total - self.head_cap - self.tail_cap)

    def render(self, name: str) -> str:
        """The kept text; where bytes were cut, a line between head and tail
        says how many, out of how many, and how to see the rest."""
        tail = b"".join(self._tail)
        if self.cut == 0:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        tail = tail[len(tail) - self.tail_cap:]
        note = (
            f"\n[... output cut: {name} was {self.total} bytes; {self.cut} bytes in the middle "
            f"are not shown (the first {len(self.head)} and the last {len(tail)} are). "
            "To see it all, redirect it to a file and read or grep that file ...]\n"
        )
        return (bytes(self.head).decode("utf-8", errors="replace") + note
                + tail.decode("utf-8", errors="replace"))


def cap_text(text: str, cap: int, what: str) -> str:
    """``text`` cut to ``cap`` characters, with a note saying so when it was."""
    if len(text) <= cap:
        return text
    return (text[:cap] + f"\n[... {what} cut: {len(text)} characters, the first {cap} shown; "
            "narrow the request (a path, a glob, a line range) to see the rest ...]")
