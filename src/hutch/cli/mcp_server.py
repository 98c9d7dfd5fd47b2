"""``hutch mcp``: serve a sandbox as MCP tools (see :mod:`hutch.mcp`). The
MCP SDK is loaded when the command runs, never for ``hutch --help``."""

from __future__ import annotations

import json

import typer

from ._common import err_console


def mcp(
    provider: str | None = typer.Option(
        None, help="The provider of the sandboxes this server makes (default: the daemon's)."),
    image: str | None = typer.Option(
        None, help="The image of the sandboxes this server makes (docker, bubblewrap)."),
    setting: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE",
        help="A setting of the sandboxes this server makes, as hutch.toml names it "
        "(memory=1g, idle_timeout=600, ...); the value is JSON where it parses as JSON; "
        "repeatable."),
    sandbox: str | None = typer.Option(
        None, help="Start on this existing sandbox (default: one is made on first use)."),
    keep: bool = typer.Option(
        False, help="Keep the sandboxes this server made when it stops (default: killed)."),
    read_before_write: bool = typer.Option(
        True, help="Refuse to replace a file the assistant has not read in this session "
        "(hutch's guardrail)."),
    output_cap: int = typer.Option(
        30_000, min=64, help="Bytes of each output stream a command's answer keeps (the "
        "first and last halves; the middle is cut with a note)."),
    http: bool = typer.Option(
        False, "--http", help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio "
        "(every request needs 'Authorization: Bearer $HUTCH_MCP_TOKEN')."),
    host: str = typer.Option("127.0.0.1", help="With --http: the address to bind."),
    port: int = typer.Option(8790, help="With --http: the TCP port."),
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
        raise typer.Exit(1) from None
    settings = {}
    for item in setting:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            err_console.print(f"[red]error[/red] (invalid_argument): --set {item!r} is not "
                              "KEY=VALUE")
            raise typer.Exit(2)
        try:
            settings[key] = json.loads(raw)
        except ValueError:
            settings[key] = raw
    defaults = ServerDefaults(provider=provider, image=image, settings=settings,
                              sandbox=sandbox, keep=keep, read_before_write=read_before_write,
                              output_cap=output_cap)
    serve(defaults, http=http, host=host, port=port)
