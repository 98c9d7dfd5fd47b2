"""What the hutch command's modules share: the command classes (click, with
hutch's help), the consoles, the typed-error-to-exit-code rule, the client and
the small formatters. Command modules import this and never each other, and it
imports nothing heavy: ``hutch --help`` loads no HTTP client, provider, server
or rich, and a command loads what it uses when it runs.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from .._errors import HutchError

if TYPE_CHECKING:
    from rich.console import Console

    from ..client import Client

F = TypeVar("F", bound=Callable[..., Any])


def help_text(command: click.Command) -> str:
    """A command's help as its page prints it: cleaned, up to a ``\\f``."""
    return inspect.cleandoc(command.help or "").partition("\f")[0]


def short_help(command: click.Command) -> str:
    """A command's line in its group's help: its short help, else the first
    paragraph of its help, on one line."""
    if command.short_help:
        return " ".join(command.short_help.split())
    return " ".join(help_text(command).split("\n\n", 1)[0].split())


def render_help(command: click.Command, ctx: click.Context) -> str:
    """``command``'s help page (:func:`hutch.cli._help.page`), from what click
    knows of it: its usage, text, parameters and, for a group, its commands."""
    from ._help import page

    arguments: list[tuple[str, str]] = []
    options: list[tuple[str, str]] = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            (options if isinstance(param, click.Option) else arguments).append(record)
    rows = []
    if isinstance(command, HutchGroup):
        for name in command.list_commands(ctx):
            entry = command.short_help_of(ctx, name)
            if entry is not None:
                rows.append((name, entry))
    return page(ctx.command_path, " ".join(command.collect_usage_pieces(ctx)),
                help_text(command), arguments, options, rows)


class HutchCommand(click.Command):
    """A command whose ``--help`` is laid out by :mod:`hutch.cli._help`."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write(render_help(self, ctx))


class HutchGroup(click.Group):
    """A group of commands (``hutch workspace``...), its help as its commands'."""

    command_class = HutchCommand

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # in the order they are written, not sorted

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # The help on standard output, where it was asked for by name
            # (click's usage error would put it on standard error); exit 2.
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(2)
        return super().parse_args(ctx, args)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write(render_help(self, ctx))

    def short_help_of(self, ctx: click.Context, name: str) -> str | None:
        """A command's line in this group's help (None: hidden or unknown)."""
        found = self.get_command(ctx, name)
        return None if found is None or found.hidden else short_help(found)


#: ``@command("ls")``: a top-level command, hung on ``hutch`` by the table in ``_commands``.
command = cast("Callable[..., Callable[[Callable[..., Any]], HutchCommand]]",
               functools.partial(click.command, cls=HutchCommand))


def group(name: str, help: str) -> HutchGroup:
    """A group of commands (``hutch NAME ...``), hung on ``hutch`` by the table in ``_commands``."""
    return HutchGroup(name, help=help, no_args_is_help=True)


class _LazyConsole:
    """A rich console made on first use: most commands print plain lines and
    need no rich (a third of ``hutch --help``'s imports otherwise)."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr)
        return getattr(self._console, name)


console = cast("Console", _LazyConsole(stderr=False))
err_console = cast("Console", _LazyConsole(stderr=True))

EXIT_CODES = {
    "invalid_argument": 2, "timeout_too_large": 2, "invalid_state": 2,
    "not_found": 3, "file_not_found": 3,
    "sandbox_unavailable": 4, "idle_timeout": 4, "max_lifetime_exceeded": 4,
    "timeout_expired": 4,
    "unauthorized": 5,
}


def exit_code_for(exc: HutchError) -> int:
    return EXIT_CODES.get(exc.code, 1)


def exit_with(code: int) -> click.exceptions.Exit:
    """The exception that ends the command with ``code`` (raise it)."""
    return click.exceptions.Exit(code)


def reports_errors(fn: F) -> F:
    """Turn a typed error into a one-line message and its documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HutchError as exc:
            err_console.print(f"[red]error[/red] ({exc.code}): {exc}")
            raise exit_with(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


def client() -> Client:
    _import_httpcore_without_http2()
    from ..client import Client

    return Client()


def _import_httpcore_without_http2() -> None:
    """Import httpcore (the client's connections) with its HTTP/2 half left
    for later: httpcore imports the ``h2`` package whenever it is installed
    (the e2b extra brings it), a third of a command's imports, and the
    command never speaks HTTP/2 (its client does not ask for it). httpcore
    takes the package's absence as it was written to (a stand-in class that
    says h2 is missing); a connection that does negotiate HTTP/2 imports its
    real module when it needs it, h2 being importable again by then. Done
    here, for the hutch command's own process, not in the SDK: another
    library in a program may use httpcore's HTTP/2 class by its name."""
    if "httpcore" in sys.modules or "h2" in sys.modules:
        return
    sys.modules["h2"] = None  # type: ignore[assignment]  # "import h2" raises ImportError
    try:
        import httpcore  # noqa: F401
    finally:
        del sys.modules["h2"]


def ago(unix: float | None) -> str:
    if unix is None:
        return "-"
    return duration(time.time() - unix)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f}{unit}"
        n = int(n / 1024)
    return f"{n}TiB"
