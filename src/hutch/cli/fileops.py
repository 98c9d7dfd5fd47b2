"""Directories in a sandbox: ``hutch mkdir``, ``hutch mv`` and ``hutch watch``."""

from __future__ import annotations

import json
import sys

import click

from ._common import client, command, err_console, reports_errors


@command("mkdir")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("--parents", "-p", is_flag=True,
              help="Make missing parents too; a directory already there is no error.")
@reports_errors
def mkdir(sandbox_id: str, path: str, parents: bool) -> None:
    """Make a directory in a sandbox (relative to its working directory)."""
    with client() as c:
        c.get_sandbox(sandbox_id).mkdir(path, parents=parents, exist_ok=parents)


@command("mv")
@click.argument("sandbox_id")
@click.argument("source")
@click.argument("destination")
@click.option("--force", "-f", is_flag=True,
              help="Replace what is at DESTINATION (a file, or an empty directory).")
@reports_errors
def mv(sandbox_id: str, source: str, destination: str, force: bool) -> None:
    """Move (rename) a file or a directory inside a sandbox.

    DESTINATION is the new path itself, never a directory to move into; its
    directory must exist. Something already there is an error unless --force.
    """
    with client() as c:
        c.get_sandbox(sandbox_id).rename(source, destination, overwrite=force)


@command("watch")
@click.argument("sandbox_id")
@click.argument("path", default=".")
@click.option("--recursive", "-r", is_flag=True, help="Every directory below PATH too.")
@click.option("--count", "-n", type=click.IntRange(min=1),
              help="Stop after how many events (default: until interrupted).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@reports_errors
def watch(sandbox_id: str, path: str, recursive: bool, count: int | None,
          as_json: bool) -> None:
    """Print what changes below a directory of a sandbox, a line an event:
    created, written, removed or renamed, then the path (and the new path).

    Watches from when it starts until interrupted (or --count events).
    """
    told = 0
    with client() as c:
        watcher = c.get_sandbox(sandbox_id).watch(path, recursive=recursive)
        err_console.print(f"watching {watcher.path} ({watcher.kind})")
        try:
            for event in watcher:
                if as_json:
                    line = json.dumps({"type": event.type, "path": event.path,
                                       **({"new_path": event.new_path}
                                          if event.new_path is not None else {})})
                else:
                    line = "\t".join(p for p in (event.type, event.path, event.new_path) if p)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                told += 1
                if count is not None and told >= count:
                    break
        except KeyboardInterrupt:
            pass
        finally:
            watcher.close()
