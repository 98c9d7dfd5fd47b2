"""``hutch mcp``: serve a sandbox as MCP tools (see :mod:`hutch.mcp`). The
MCP SDK is loaded when the command runs, never for ``hutch --help``."""

from __future__ import annotations

import json

import click

from ._common import command, err_console, exit_with


@command("mcp")
@click.option("--provider",
              help="The provider of the sandboxes this server makes (default: the daemon's).")
@click.option("--image",
              help="The image of the sandboxes this server makes (docker, bubblewrap).")
@click.option("--set", "setting", multiple=True, metavar="KEY=VALUE",
              help="A setting of the sandboxes this server makes, as hutch.toml names it "
              "(memory=1g, idle_timeout=600, ...); the value is JSON where it parses as JSON; "
              "repeatable.")
@click.option("--sandbox",
              help="Start on this existing sandbox (default: one is made on first use).")
@click.option("--keep/--no-keep",
              help="Keep the sandboxes this server made when it stops (default: killed).")
@click.option("--read-before-write/--no-read-before-write", default=True, show_default=True,
              help="Refuse to replace a file the assistant has not read in this session "
              "(hutch's guardrail).")
@click.option("--output-cap", type=click.IntRange(min=64), default=30_000, show_default=True,
              help="Bytes of each output stream a command's answer keeps (the first and last "
              "halves; the middle is cut with a note).")
@click.option("--http", is_flag=True,
              help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (every "
              "request needs 'Authorization: Bearer $HUTCH_MCP_TOKEN').")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="With --http: the address to bind.")
@click.option("--port", type=int, default=8790, show_default=True,
              help="With --http: the TCP port.")
def mcp(
    provider: str | None, image: str | None, setting: tuple[str, ...], sandbox: str | None,
    keep: bool, read_before_write: bool, output_cap: int, http: bool, host: str, port: int,
) -> None:
    """Serve a hutch sandbox as MCP tools to a coding assistant (stdio, or --http).

    Talks to the daemon at HUTCH_URL with HUTCH_TOKEN, as every command does.
    Tools: sandbox_create, sandbox_use, sandbox_list, exec, read_file,
    write_file, edit_file, grep, glob, list_dir, pause, suspend, resume,
    snapshot, fork, kill.
    """
    try:
        from ..mcp import ServerDefaults, serve
    except ImportError as exc:
        err_console.print(f"[red]error[/red]: hutch mcp needs the MCP SDK: pip install "
                          f"'hutch[mcp]' ({exc})")
        raise exit_with(1) from None
    settings = {}
    for item in setting:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            err_console.print(f"[red]error[/red] (invalid_argument): --set {item!r} is not "
                              "KEY=VALUE")
            raise exit_with(2)
        try:
            settings[key] = json.loads(raw)
        except ValueError:
            settings[key] = raw
    defaults = ServerDefaults(provider=provider, image=image, settings=settings,
                              sandbox=sandbox, keep=keep, read_before_write=read_before_write,
                              output_cap=output_cap)
    serve(defaults, http=http, host=host, port=port)
