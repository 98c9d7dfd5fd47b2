"""Commands run in a sandbox: ``hutch exec``, ``attach`` (through a ref) and ``shell``."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ._common import client, command, exit_with, reports_errors

COMMAND_HELP = "The command (after --)."
TIMEOUT_HELP = "Kill the command's whole process tree after this many seconds."
CWD_HELP = "Directory to run in (relative to the sandbox's working directory)."
INTERACTIVE_HELP = ("Give the command this standard input (read to its end first), as "
                    "`docker exec -i`; without it the command's standard input is empty.")


@command("exec", context_settings={"allow_extra_args": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, help=COMMAND_HELP)
@click.option("--timeout", type=float, help=TIMEOUT_HELP)
@click.option("--cwd", help=CWD_HELP)
@click.option("--output-limit", type=int,
              help="Kill the command once its output passes this many bytes "
              "(default: the sandbox's, 16 MiB unless set).")
@click.option("--interactive", "-i", is_flag=True, help=INTERACTIVE_HELP)
@reports_errors
def exec_(
    sandbox_id: str, command: tuple[str, ...], timeout: float | None, cwd: str | None,
    output_limit: int | None, interactive: bool,
) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit code.

    Standard input is left alone unless -i says to give it to the command:
    a pipe that stays open (as under an agent's harness) never holds it up.
    """
    with client() as c:
        code = stream_command(c.get_sandbox(sandbox_id), list(command), timeout=timeout,
                              cwd=cwd, output_limit=output_limit, forward_stdin=interactive)
    raise exit_with(code)


def stream_command(
    sb: Any, command: list[str], *, timeout: float | None, cwd: str | None,
    output_limit: int | None, forward_stdin: bool,
) -> int:
    """Run ``command`` in ``sb``, its output streamed to ours; its exit code."""
    from .._types import ExitStatus

    cmd: str | list[str] = command[0] if len(command) == 1 else command
    stdin = None
    if forward_stdin and sys.stdin is not None:
        stdin = sys.stdin.buffer.read()
    code = 1
    for event in sb.exec_stream(cmd, timeout=timeout, cwd=cwd, stdin=stdin,
                                output_limit=output_limit):
        if isinstance(event, ExitStatus):
            code = event.exit_code
        else:
            out = sys.stdout if event.stream == "stdout" else sys.stderr
            out.buffer.write(event.data)
            out.flush()
    return code


@command("attach", context_settings={"allow_extra_args": True})
@click.argument("ref", help="A ref from `hutch ref` (or Sandbox.ref()).")
@click.argument("command", nargs=-1, required=True, help=COMMAND_HELP)
@click.option("--timeout", type=float, help=TIMEOUT_HELP)
@click.option("--cwd", help=CWD_HELP)
@click.option("--output-limit", type=int,
              help="Kill the command once its output passes this many bytes.")
@click.option("--interactive", "-i", is_flag=True, help=INTERACTIVE_HELP)
@reports_errors
def attach(
    ref: str, command: tuple[str, ...], timeout: float | None, cwd: str | None,
    output_limit: int | None, interactive: bool,
) -> None:
    """Run a command in the sandbox a ref names, as an attached session.

    The ref says where the daemon is and is the credential: no HUTCH_URL or
    HUTCH_TOKEN is needed. Exits with the command's exit code.
    """
    import hutch

    sb = hutch.attach_sync(ref)
    try:
        code = stream_command(sb, list(command), timeout=timeout, cwd=cwd,
                              output_limit=output_limit, forward_stdin=interactive)
    finally:
        sb.close()
    raise exit_with(code)


@command("shell")
@click.argument("sandbox_id")
@reports_errors
def shell(sandbox_id: str) -> None:
    """An interactive shell in a sandbox (bash, else sh), on a pseudo-terminal
    inside it; exit with the shell's exit code."""
    import termios
    import tty

    from ..client._shell import attach_shell

    fd = sys.stdin.fileno()
    interactive = os.isatty(fd)
    size = (24, 80)
    saved = None
    if interactive:
        columns, lines = os.get_terminal_size(fd)
        size = (lines, columns)
        saved = termios.tcgetattr(fd)
        tty.setraw(fd)  # every key goes to the sandbox's terminal, which echoes
    try:
        code = attach_shell(sandbox_id, stdin_fd=fd, stdout_fd=sys.stdout.fileno(), size=size,
                            watch_window=interactive)
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    raise exit_with(code)
