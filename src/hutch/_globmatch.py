"""Glob patterns with ``**``, matched the same way on every provider.

``*`` and ``?`` stay inside one path segment, ``**`` spans any number of
segments (zero included), ``[...]`` is a character class. Patterns are
relative to the directory being searched. One matcher for every provider
keeps ``glob`` and ``grep --glob`` answers identical across backends.

``Sandbox.glob`` matches as ``pathlib.Path.glob`` does (``*.py`` is the top
level only); ``grep``'s ``glob`` filter picks files by name as ``grep
--include`` does (``*.py`` at any depth): see ``name_anywhere``.
"""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=256)
def compile_glob(pattern: str, *, name_anywhere: bool = True) -> re.Pattern[str]:
    """The matcher of relative paths for ``pattern``. With ``name_anywhere``
    a pattern with no slash matches the file name at any depth, as grep's
    --include does; without, the whole relative path, as pathlib does."""
    pattern = pattern.lstrip("/")
    if name_anywhere and "/" not in pattern and pattern != "**":
        pattern = "**/" + pattern
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1:i + 2] in ("!", "]") else i + 1)
            if end < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1:end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)
