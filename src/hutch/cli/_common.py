"""What the hutch command's modules share: the typer apps commands hang on,
the consoles, the typed-error-to-exit-code rule, the client and the small
formatters. Command modules (``main``, ``images``...) import this and never
each other, and it imports nothing heavy: ``hutch --help`` loads no HTTP
client, provider or server, and a command loads what it uses when it runs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import typer

from .._errors import HutchError

if TYPE_CHECKING:
    from rich.console import Console

    from ..client import Client

F = TypeVar("F", bound=Callable[..., Any])

#: The hutch command; its help is ``hutch.cli.main``'s docstring, given with its callback.
app = typer.Typer(no_args_is_help=True, add_completion=False)
workspace_app = typer.Typer(help="Named workspaces that outlive the daemon.", no_args_is_help=True)
snapshot_app = typer.Typer(help="Snapshots of sandboxes, as a lineage tree.",
                           no_args_is_help=True)


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


def reports_errors(fn: F) -> F:
    """Turn a typed error into a one-line message and its documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HutchError as exc:
            err_console.print(f"[red]error[/red] ({exc.code}): {exc}")
            raise typer.Exit(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


def client() -> Client:
    from ..client import Client

    return Client()


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
