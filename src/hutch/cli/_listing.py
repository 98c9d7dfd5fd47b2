"""How the hutch command lists things: one line an entry, plain text.

In a pipe (a script, ``grep``, a log) every cell is whole, however wide the
line. On a terminal each entry still takes one line: free-text cells are cut
(with ``…``) and the least useful columns left out until the line fits the
terminal's width; ids are cut only when nothing else is left to give. ``--json``
prints the entries as data, whatever the output is.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

ELLIPSIS = "…"
GAP = "  "


class Column(NamedTuple):  # not a data class: a third of the cost to make, at each start
    header: str
    #: Free text that may be shortened on a terminal (a path, a reason).
    cut: bool = False
    #: Left out on a terminal that is too narrow: higher goes first; None stays.
    drop: int | None = None


def terminal_width() -> int | None:
    """The terminal's width when standard output is one, else None (a pipe, a file)."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def print_json(data: Any) -> None:
    """The entries as JSON, as they are, on one line: the C encoder (an indent
    takes Python's, several times slower on a thousand entries); ``jq`` lays
    it out for reading."""
    sys.stdout.write(json.dumps(data) + "\n")


def shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + ELLIPSIS if width > 0 else ""


def table_lines(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None
) -> list[str]:
    """Columns padded to their widest cell, a line a row; fitted to ``width``
    (see the module's doc) when it is a terminal's."""
    keep = list(range(len(columns)))
    natural = [max([len(c.header), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    widths = list(natural)

    def total() -> int:
        return sum(widths[i] for i in keep) + len(GAP) * (len(keep) - 1)

    if width is not None and total() > width:
        # Free text down to its header's width (at least 8) ...
        for i in keep:
            if columns[i].cut:
                widths[i] = min(natural[i], max(len(columns[i].header), 8))
        # ... then the least useful columns, as long as they are in the way ...
        for i in sorted((i for i in keep if columns[i].drop is not None),
                        key=lambda i: -(columns[i].drop or 0)):
            if total() <= width:
                break
            keep.remove(i)
        # ... and the room that leaves goes back to the free text, left first.
        for i in keep:
            if columns[i].cut and total() < width:
                widths[i] = min(natural[i], widths[i] + width - total())
    lines = []
    for cells in [[c.header for c in columns], *rows]:
        shown = [shorten(cells[i], widths[i]) for i in keep]
        padded = [c.ljust(widths[i]) for c, i in zip(shown[:-1], keep[:-1], strict=True)]
        line = GAP.join([*padded, shown[-1]]).rstrip()
        lines.append(line if width is None else shorten(line, width))
    return lines


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """The table on standard output; nothing but its header when there are no rows."""
    out = "\n".join(table_lines(columns, rows, terminal_width()))
    sys.stdout.write(out + "\n")


def print_lines(lines: Sequence[str]) -> None:
    """Lines as they are in a pipe; on a terminal each cut to its width."""
    width = terminal_width()
    if width is not None:
        lines = [shorten(line, width) for line in lines]
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
