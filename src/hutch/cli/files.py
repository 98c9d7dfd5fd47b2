"""Files: ``hutch cp`` into and out of a sandbox (the copying is :mod:`._copy`'s)."""

from __future__ import annotations

import click

from ._common import client, command, err_console, reports_errors


@command("cp")
@click.argument("source", help="PATH here, or SANDBOX:PATH.")
@click.argument("destination", help="SANDBOX:PATH, or PATH here.")
@reports_errors
def cp(source: str, destination: str) -> None:
    """Copy a file or a directory into or out of a sandbox.

    hutch cp ./src sb-1234:project    (into the sandbox)
    hutch cp sb-1234:project/out .    (out of it)
    """
    from . import _copy

    direction, sandbox_id, there, here = _copy.plan(source, destination)
    with client() as c:
        sb = c.get_sandbox(sandbox_id)
        if direction == "in":
            copied = _copy.upload(sb, here, there)
        else:
            copied = _copy.download(sb, there, here)
    err_console.print(f"{copied} file{'s' if copied != 1 else ''} copied")
