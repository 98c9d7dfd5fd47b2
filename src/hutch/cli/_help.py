"""hutch's ``--help``: usage, the command's own text as written, then its
arguments, options and commands in framed panels (the layout typer draws with
rich), in colour on a terminal.

Drawn with the standard library rather than rich: importing rich's console,
tables and markdown parser and laying a table out cost more than everything
else ``hutch --help`` does (about 60 % of its time, measured in
``bench/bench_startup.py``). The text of a command is printed line for line
as its docstring has it (an exit-code table stays a table); only lines wider
than the terminal are wrapped.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import textwrap

import click

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


def short_help(command: click.Command) -> str:
    """A command's line in its group's help: its short help, else the first
    paragraph of its help, on one line."""
    if command.short_help:
        return " ".join(command.short_help.split())
    text = inspect.cleandoc(command.help or "").partition("\f")[0]
    return " ".join(text.split("\n\n", 1)[0].split())


def render(command: click.Command, ctx: click.Context) -> str:
    width = min(shutil.get_terminal_size((80, 24)).columns, MAX_WIDTH)
    style = _styled()
    pieces = " ".join(command.collect_usage_pieces(ctx))
    lines = ["", f" {style('Usage:', '33')} {style(ctx.command_path, '1')} {pieces}", ""]
    text = inspect.cleandoc(command.help or "").partition("\f")[0]
    if text:
        for line in text.splitlines():
            wrapped = textwrap.wrap(line, width - 2, subsequent_indent=_indent(line),
                                    break_on_hyphens=False) if line.strip() else [""]
            lines += [f" {piece}" for piece in wrapped]
        lines.append("")
    arguments: list[tuple[str, str]] = []
    options: list[tuple[str, str]] = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            (options if isinstance(param, click.Option) else arguments).append(record)
    lines += _panel("Arguments", arguments, width, style)
    lines += _panel("Options", options, width, style)
    if isinstance(command, click.Group):
        rows = []
        for name in command.list_commands(ctx):
            entry: str | None
            if hasattr(command, "short_help_of"):
                entry = command.short_help_of(ctx, name)
            else:
                found = command.get_command(ctx, name)
                entry = None if found is None or found.hidden else short_help(found)
            if entry is not None:
                rows.append((name, entry))
        lines += _panel("Commands", rows, width, style)
    return "\n".join(line.rstrip() for line in lines) + "\n"


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
