"""Which literal strings a regex's every match must contain: a filter that lets a
provider searching in place (grep -F in a container, the agent) send back only
candidate lines or files, which the host then matches by the base rule."""

from __future__ import annotations

import importlib
import re
from typing import Any

#: Characters str.splitlines() breaks a line at, besides \n (and \r\n).
LINE_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
LINE_BREAK_CHARS = re.compile("[" + "".join(LINE_BREAKS) + "]")
#: Under re.IGNORECASE these letters also match non-ASCII characters (K and
#: the Kelvin sign, s and the long s, i and the dotted and dotless I), which
#: grep -i in the C locale would not: no literal holding them filters lines.
_WIDE_FOLDING = frozenset("iksIKS")
_SRE: Any = None


def _literal_char_ok(code: int, ignore_case: bool) -> bool:
    char = chr(code)
    if code == 0 or 0xD800 <= code < 0xE000 or char == "\ufffd" or char == "\n":
        return False  # not in an argv, or matches what "replace" decoding made
    if LINE_BREAK_CHARS.match(char):
        return False
    return not ignore_case or (code < 0x80 and char not in _WIDE_FOLDING)


def required_literals(pattern: re.Pattern[str]) -> list[str] | None:
    """Strings one of which every line ``pattern`` matches must contain, or
    None when no such filter can be read off the pattern (then every line is
    a candidate). Conservative: any doubt gives None, never a wrong filter."""
    global _SRE
    if _SRE is None:
        _SRE = (importlib.import_module("re._parser"), importlib.import_module("re._constants"))
    parser, const = _SRE
    ignore_case = bool(pattern.flags & re.IGNORECASE)
    try:
        parsed = parser.parse(pattern.pattern, pattern.flags)
    except Exception:
        return None

    def of_sequence(items: Any) -> list[str] | None:
        runs: list[str] = []
        run: list[str] = []
        options: list[list[str]] = []

        def flush() -> None:
            if run:
                runs.append("".join(run))
                run.clear()

        def walk(items: Any) -> None:
            for op, arg in items:
                if op == const.LITERAL and _literal_char_ok(arg, ignore_case):
                    run.append(chr(arg))
                elif op == const.SUBPATTERN and not arg[1] and not arg[2]:
                    walk(arg[3])  # a group matches in place: its literals join the run
                elif op == const.BRANCH:
                    flush()
                    alternatives = [of_sequence(branch) for branch in arg[1]]
                    if all(alternatives):
                        options.append([s for alt in alternatives if alt for s in alt])
                else:
                    flush()

        walk(items)
        flush()
        best = max(runs, key=len) if runs else None
        for option in options:
            if best is None or min(map(len, option)) > len(best):
                return option
        return [best] if best else None

    return of_sequence(parsed)
