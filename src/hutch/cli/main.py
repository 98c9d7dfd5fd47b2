"""hutch: sandboxes for AI agents. Talks to `hutch serve` at HUTCH_URL
(default http://127.0.0.1:8787) with the token in HUTCH_TOKEN.

Exit codes scripts can rely on:

    0  done
    1  any other error
    2  bad usage or invalid argument (invalid_argument, timeout_too_large, invalid_state)
    3  not found (no such sandbox, workspace or file)
    4  sandbox unavailable or expired (sandbox_unavailable, idle_timeout, ...)
    5  unauthorized (missing or wrong token)

`hutch exec` exits with the command's own exit code.
"""

from __future__ import annotations

import importlib

import click

from ._common import EXIT_CODES, HutchGroup, client, exit_code_for, reports_errors

HELP = __doc__

#: Every command of ``hutch``, in the order its help lists them: where it is
#: (``module:name`` under ``hutch.cli``) and its line in ``hutch --help`` (the
#: first paragraph of its own help; a test keeps them the same). A command's
#: module is imported only when that command runs or shows its own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve:serve", "Run the daemon: the HTTP API, the state store, the timers."),
    "demo": ("serve:demo",
             "Show hutch working in-process, with no daemon: a local sandbox in a temp dir."),
    "ls": ("sandboxes:list_sandboxes",
           "List sandboxes, one line each: state, age, idle time and time to the deadline."),
    "events": ("sandboxes:events",
               "What happened to a sandbox or workspace, and why (reaped, failed, adopted...)."),
    "create": ("sandboxes:create",
               "Create a sandbox. Flags beat hutch.toml, which beats the daemon's defaults."),
    "exec": ("run:exec_",
             "Run a command in a sandbox, streaming its output; exit with its exit code."),
    "ref": ("refs:ref", "Hand out a ref to a sandbox you own: a credential for it alone."),
    "refs": ("refs:refs", "The refs of a sandbox that still work, one line each."),
    "attach": ("run:attach",
               "Run a command in the sandbox a ref names, as an attached session."),
    "shell": ("run:shell", "An interactive shell in a sandbox (bash, else sh), on a "
              "pseudo-terminal inside it; exit with the shell's exit code."),
    "start": ("processes:start", "Start a command in the background in a sandbox; print its id."),
    "stdin": ("processes:stdin", "Send our standard input, as it comes, to a background command "
              "started with --keep-stdin; at its end, close the command's (unless --keep-open)."),
    "wait": ("processes:wait", "Wait for a background command to end; print its output and "
             "exit with its exit code."),
    "cp": ("files:cp", "Copy a file or a directory into or out of a sandbox."),
    "mkdir": ("fileops:mkdir",
              "Make a directory in a sandbox (relative to its working directory)."),
    "mv": ("fileops:mv", "Move (rename) a file or a directory inside a sandbox."),
    "watch": ("fileops:watch", "Print what changes below a directory of a sandbox, a line an "
              "event: created, written, removed or renamed, then the path (and the new path)."),
    "pause": ("sandboxes:pause",
              "Hold a sandbox as it is (processes and memory stay, no CPU)."),
    "suspend": ("sandboxes:suspend", "Free a sandbox's memory, keeping its state on disk."),
    "resume": ("sandboxes:resume", "Bring a paused or suspended sandbox back."),
    "kill": ("sandboxes:kill", "End a sandbox and release everything it holds."),
    "set-timeout": ("sandboxes:set_timeout",
                    "Make a sandbox's deadline now + SECONDS; prints it as Unix time."),
    "fork": ("snapshots:fork", "Snapshot a sandbox and start N independent branches from it."),
    "ensure": ("definitions:ensure", "The sandbox of a thread for a definition: resumed, "
               "restored from its setup snapshot, or created with setup run. Prints its id "
               "and each step."),
    "definitions": ("definitions:definitions",
                    "The daemon's sandbox definitions, one line each."),
    "complete": ("definitions:complete",
                 "A thread's run ended: its sandbox is destroyed if the definition says so."),
    "mcp": ("mcp_server:mcp", "Serve a hutch sandbox as MCP tools to a coding assistant "
            "(stdio, or --http)."),
    "token": ("tokens:token",
              "Print the daemon's token (or a ref), e.g. as E2B_API_KEY for the E2B SDKs."),
    "workspace": ("workspaces:workspace", "Named workspaces that outlive the daemon."),
    "pool": ("pools:pool", "Warm pools: sandboxes made ahead, which a create takes ready."),
    "image": ("images:image",
              "Images: environments built once, used by name by docker and bubblewrap."),
    "snapshot": ("snapshots:snapshot", "Snapshots of sandboxes, as a lineage tree."),
}


class LazyGroup(HutchGroup):
    """``hutch``: its commands found in :data:`COMMANDS`, each module
    imported when one of its commands is used, so that ``hutch --help``
    builds no command and imports no command module."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS, *(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, _, attr = COMMANDS[cmd_name][0].partition(":")
            found = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
            assert isinstance(found, click.Command), COMMANDS[cmd_name]
            self.commands[cmd_name] = found
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            import difflib

            close = difflib.get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if not close:
                raise
            # As typer said it: "No such command 'lss'. Did you mean 'ls'?"
            raise click.UsageError(
                exc.message.rstrip(".") + ". Did you mean "
                + ", ".join(repr(name) for name in close) + "?", ctx=exc.ctx) from None

    def short_help_of(self, ctx: click.Context, name: str) -> str | None:
        if name in COMMANDS and name not in self.commands:
            return COMMANDS[name][1]
        return super().short_help_of(ctx, name)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from .. import __version__

        print(f"hutch {__version__}")
        ctx.exit()


app = LazyGroup(
    "hutch", help=HELP, no_args_is_help=True,
    params=[click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                         callback=_print_version, help="Print hutch's version and exit.")],
)

__all__ = ["COMMANDS", "EXIT_CODES", "app", "client", "exit_code_for", "reports_errors"]


if __name__ == "__main__":
    app()
