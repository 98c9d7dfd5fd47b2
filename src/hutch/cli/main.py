"""The ``hutch`` command's entry point.

``hutch --help``, and ``hutch`` alone, print the help from the command table
(:mod:`._commands`) with no CLI library loaded: importing click was most of
what ``hutch --help`` cost (about 55 of its 90 ms; ``bench/bench_startup.py``).
Everything else, a command's own ``--help`` included, runs through the click
group (:data:`app`, built on first use in :mod:`._app`), which lays out the same
page from the same table; a test compares the two.
"""

from __future__ import annotations

import sys

from ._commands import COMMANDS

#: As typing.TYPE_CHECKING (type checkers take the name as true), without
#: importing typing, which costs ``hutch --help`` a tenth of its time.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from ._app import LazyGroup, app

PROGRAM = "hutch"


def main(args: list[str] | None = None) -> None:
    """Run ``hutch`` with ``args`` (the process's own by default); exits."""
    argv = sys.argv[1:] if args is None else args
    if argv in ([], ["--help"]):
        from ._commands import HELP, OPTIONS, USAGE
        from ._help import page

        commands = [(name, line) for name, (_, line) in COMMANDS.items()]
        sys.stdout.write(page(PROGRAM, USAGE, HELP, [], OPTIONS, commands))
        sys.stdout.flush()
        # As click does it: help asked for exits 0; no command at all is a
        # usage error, exit 2 (the help on standard output all the same).
        raise SystemExit(0 if argv else 2)
    from ._app import app

    app(argv, prog_name=PROGRAM)


def __getattr__(name: str) -> LazyGroup:
    """``app``: the click group, imported on first use."""
    if name == "app":
        from ._app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "app", "main"]


if __name__ == "__main__":
    main()
