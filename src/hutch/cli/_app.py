"""The ``hutch`` click group: its commands found in :data:`._commands.COMMANDS`,
each command's module imported when that command is used."""

from __future__ import annotations

import importlib

import click

from ._commands import COMMANDS, HELP, VERSION_HELP
from ._common import HutchGroup


class LazyGroup(HutchGroup):
    """``hutch``: its commands found in :data:`COMMANDS`, each module
    imported when one of its commands is used, so that its help builds no
    command and imports no command module."""

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
                         callback=_print_version, help=VERSION_HELP)],
)
