"""Background commands: ``hutch start``, ``hutch stdin`` (what is typed or
piped, to a running command) and ``hutch wait``."""

from __future__ import annotations

import os
import sys

import click

from ._common import client, command, exit_with, reports_errors

#: What one write to a command's stdin carries at most.
STDIN_PIECE = 64 * 1024


@command("start", context_settings={"allow_extra_args": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, help="The command (after --).")
@click.option("--keep-stdin", is_flag=True,
              help="Keep its standard input open, for `hutch stdin` to write to.")
@click.option("--cwd", help="Directory to run in (relative to the sandbox's working directory).")
@reports_errors
def start(sandbox_id: str, command: tuple[str, ...], keep_stdin: bool, cwd: str | None) -> None:
    """Start a command in the background in a sandbox; print its id."""
    cmd: str | list[str] = command[0] if len(command) == 1 else list(command)
    with client() as c:
        process = c.get_sandbox(sandbox_id).start(cmd, cwd=cwd, keep_stdin=keep_stdin)
    print(process.id)


@command("stdin")
@click.argument("sandbox_id")
@click.argument("process_id")
@click.option("--keep-open", is_flag=True,
              help="Leave the command's standard input open at the end of ours.")
@reports_errors
def stdin(sandbox_id: str, process_id: str, keep_open: bool) -> None:
    """Send our standard input, as it comes, to a background command started
    with --keep-stdin; at its end, close the command's (unless --keep-open).

    echo hello | hutch stdin sb-1234 3f2a...
    """
    with client() as c:
        process = c.get_sandbox(sandbox_id).process(process_id)
        fd = sys.stdin.fileno()
        while piece := os.read(fd, STDIN_PIECE):
            process.write_stdin(piece)
        if not keep_open:
            process.close_stdin()


@command("wait")
@click.argument("sandbox_id")
@click.argument("process_id")
@click.option("--timeout", type=float, help="Give up (exit 1) after this many seconds.")
@reports_errors
def wait(sandbox_id: str, process_id: str, timeout: float | None) -> None:
    """Wait for a background command to end; print its output and exit with
    its exit code."""
    with client() as c:
        result = c.get_sandbox(sandbox_id).process(process_id).wait(timeout=timeout)
    sys.stdout.buffer.write(result.stdout_bytes)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr_bytes)
    sys.stderr.flush()
    raise exit_with(result.exit_code)
