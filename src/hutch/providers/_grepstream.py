"""GNU grep's ``-H -n -Z`` answer (``PATH\\0NUMBER:LINE\\n`` a line), read as
it comes and matched by the base rule a batch at a time, for a provider that
prefilters in place with ``grep -F`` (docker's native runtime).

A filter matching most of a large tree (a pattern with no literal, a file
of millions of short lines) sends back far more candidate lines than
matches: held whole, with an object for each, they took gigabytes of the
daemon. Here at most :data:`BATCH_CHARS` of candidates are held at once;
what matches is kept, within the grep's output budget (the worker refuses
past it), and the rest is dropped as soon as it is matched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .._types import GrepMatch
from ._grep import matching_indices
from ._grepfilter import LINE_BREAK_CHARS
from ._grepworker import match_cost

#: Characters of candidate lines matched in one batch.
BATCH_CHARS = 1024 * 1024


@dataclass
class GrepStream:
    """Feed it grep's stdout as it comes; :meth:`end` gives the matches.

    ``prefix`` is the searched root (with its slash) and ``accepts`` the
    glob's check of a path below it (None: every path). A file whose lines
    Python would split otherwise than grep does (a lone CR, U+2028...) is
    not matched here but named in :attr:`reread`, to be read whole.
    """

    pattern: re.Pattern[str]
    prefix: str
    accepts: Callable[[str], object] | None = None
    #: Files to search whole by the base rule instead.
    reread: set[str] = field(default_factory=set)
    #: Whether grep wrote anything to stdout at all.
    answered: bool = False
    _buffer: bytearray = field(default_factory=bytearray)
    _batch: list[GrepMatch] = field(default_factory=list)
    _batch_chars: int = 0
    _matches: list[GrepMatch] = field(default_factory=list)

    async def feed(self, data: bytes) -> None:
        self.answered = True
        self._buffer += data
        pos = self._parse(complete_only=True)
        del self._buffer[:pos]
        if self._batch_chars >= BATCH_CHARS:
            await self._match()

    def _parse(self, *, complete_only: bool) -> int:
        """Candidates from the records in the buffer; where it stopped."""
        out = self._buffer
        pos = 0
        while pos < len(out):
            nul = out.find(b"\0", pos)
            if nul < 0:
                break
            end = out.find(b"\n", nul)
            if end < 0:
                if complete_only:
                    break
                end = len(out)
            path = bytes(out[pos:nul]).decode("utf-8", "surrogateescape")
            number, _, raw = bytes(out[nul + 1:end]).partition(b":")
            pos = end + 1
            self._add(path, int(number), raw)
        return min(pos, len(out))

    def _add(self, path: str, number: int, raw: bytes) -> None:
        if self.accepts is not None and not self.accepts(path[len(self.prefix):]):
            return
        if path in self.reread:
            return
        text = raw.decode("utf-8", "replace")
        body = text[:-1] if text.endswith("\r") else text  # CRLF: as splitlines
        if LINE_BREAK_CHARS.search(body):
            self.reread.add(path)
            return
        self._batch.append(GrepMatch(path, number, body))
        self._batch_chars += match_cost(body)

    async def _match(self) -> None:
        batch, self._batch, self._batch_chars = self._batch, [], 0
        if not batch:
            return
        found = await matching_indices(self.pattern, [c.line for c in batch])
        self._matches.extend(batch[i] for i in found)

    async def end(self, skipped: set[str]) -> list[GrepMatch]:
        """The matches, but none in ``skipped`` or :attr:`reread` files."""
        self._parse(complete_only=False)
        self._buffer.clear()
        await self._match()
        gone = skipped | self.reread
        return [m for m in self._matches if m.path not in gone]
