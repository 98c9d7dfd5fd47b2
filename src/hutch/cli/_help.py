"""hutch's ``--help``: usage, the command's own text as written, then its
arguments, options and commands in framed panels (the layout typer draws with
rich), in colour on a terminal.

Drawn with the standard library rather than rich: importing rich's console,
tables and markdown parser and laying a table out cost more than everything
else ``hutch --help`` does (about 60 % of its time, measured in
``bench/bench_startup.py``). The text of a command is printed line for line
as its docstring has it (an exit-code table stays a table); only lines wider
than the terminal are wrapped. A page is laid out from plain rows, with no
CLI library: ``hutch --help`` is printed from the command table without
importing click, and click's help passes the rows it knows
(:func:`hutch.cli._common.render_help`).
"""

from __future__ import annotations

import os
import sys
import textwrap

#: Set from a terminal's width; a pipe gets 80 columns (``COLUMNS`` overrides both).
MAX_WIDTH = 160


class _Style:
    """ANSI styles on a terminal (none when ``NO_COLOR`` is set or in a pipe)."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.on and text else text


def _styled() -> _Style:
    return _Style(sys.stdout.isatty() and "NO_COLOR" not in os.environ)


def page(
    path: str,
    usage: str,
    text: str,
    arguments: list[tuple[str, str]],
    options: list[tuple[str, str]],
    commands: list[tuple[str, str]],
) -> str:
    """The help of the command ``path``: its usage line, ``text`` (cleaned, as
    :func:`inspect.cleandoc` leaves it), then its arguments, options and
    commands (each a name and its line) in panels."""
    width = min(_columns(), MAX_WIDTH)
    style = _styled()
    lines = ["", f" {style('Usage:', '33')} {style(path, '1')} {usage}", ""]
    if text:
        for line in text.splitlines():
            wrapped = textwrap.wrap(line, width - 2, subsequent_indent=_indent(line),
                                    break_on_hyphens=False) if line.strip() else [""]
            lines += [f" {piece}" for piece in wrapped]
        lines.append("")
    lines += _panel("Arguments", arguments, width, style)
    lines += _panel("Options", options, width, style)
    lines += _panel("Commands", commands, width, style)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _columns() -> int:
    """The terminal's width as :func:`shutil.get_terminal_size` finds it
    (``COLUMNS``, else standard output's terminal, else 80), without
    importing shutil (its archive modules are a tenth of ``hutch --help``)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _panel(title: str, rows: list[tuple[str, str]], width: int, style: _Style) -> list[str]:
    """``rows`` (a name, its help) in a frame ``width`` wide, names in a column."""
    if not rows:
        return []
    inner = width - 4  # the frame and a space on each side
    names = min(max(len(name) for name, _ in rows), max(12, inner // 3))
    text_width = max(20, inner - names - 2)
    top = f"╭─ {title} " + "─" * max(0, width - len(title) - 5) + "╮"
    out = [style(top, "2")]
    side = style("│", "2")
    for name, help_text in rows:
        wrapped = textwrap.wrap(help_text, text_width, break_on_hyphens=False) or [""]
        if len(name) > names:  # a name wider than its column has a line of its own
            out.append(f"{side} {style(name.ljust(inner), '1;36')} {side}")
        else:
            line, *wrapped = wrapped
            out.append(f"{side} {style(name.ljust(names), '1;36')}  "
                       f"{line.ljust(text_width)} {side}")
        for more in wrapped:
            out.append(f"{side} {' ' * names}  {more.ljust(text_width)} {side}")
    out.append(style("╰" + "─" * (width - 2) + "╯", "2"))
    return out
