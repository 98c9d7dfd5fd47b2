"""``hutch serve`` (the daemon) and ``hutch demo`` (hutch in-process, no daemon)."""

from __future__ import annotations

import tempfile

import click

from .._errors import HutchError
from ._common import command, console, err_console, exit_code_for, exit_with, reports_errors


@command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (loopback unless a token is set).")
@click.option("--port", default=8787, type=int, show_default=True,
              help="TCP port to listen on.")
@click.option("--token-file", help="File holding the bearer token (mode 0600). Without it the "
              "token comes from HUTCH_TOKEN; never from the command line, where every user "
              "could read it.")
@click.option("--data-dir", envvar="HUTCH_HOME", show_envvar=True,
              help="Directory for the state store and working directories "
              "(default ~/.local/share/hutch).")
@click.option("--retention", type=float,
              help="Seconds an ended sandbox stays readable, with its events (default 86400).")
@click.option("--allow", multiple=True, metavar="SETTING",
              help="Let API clients set this host-reaching setting (mounts, host_workdir, "
              "network_mode, cap_drop, ...); repeatable. Also `allow = [...]` under [server] "
              "in hutch.toml.")
@click.option("--allow-provider", multiple=True, metavar="PROVIDER",
              help="Let API clients use this provider that runs on the host itself (local, "
              "ssh: commands run as a host user, not in a sandbox); repeatable. Also "
              "`providers = [...]` under [server] in hutch.toml.")
@click.option("--provider", metavar="PROVIDER",
              help="The provider of requests that name none (over hutch.toml's [sandbox] "
              "provider); unset: docker where its Engine answers, else bubblewrap. Naming one "
              "that runs on the host (local) allows it.")
@click.option("--config", help="hutch.toml with [server] allow, providers, limits and "
              "ceilings (default: ./hutch.toml).")
@click.option("--max-connections", type=int,
              help="How many client connections at once, at most (default 4096, or half the "
              "open-files limit); past it the longest-idle one is closed.")
@click.option("--advertise-url", metavar="URL",
              help="Where the other daemons sharing the store reach this one (also "
              "HUTCH_ADVERTISE_URL, or [server] advertise_url in hutch.toml); default: the "
              "address it listens on.")
def serve(
    host: str, port: int, token_file: str | None, data_dir: str | None,
    retention: float | None, allow: tuple[str, ...], allow_provider: tuple[str, ...],
    provider: str | None, config: str | None, max_connections: int | None,
    advertise_url: str | None,
) -> None:
    """Run the daemon: the HTTP API, the state store, the timers.

    The token clients must send is read from HUTCH_TOKEN or --token-file; with
    neither, the daemon makes one at its first start, in the file api-token of
    its data directory (mode 0600), where this user's CLI and SDK find it.
    """
    from ..server import serve as run

    def announce(url: str, where: str) -> None:
        # Said only once the port is ours and the daemon has started.
        console.print(f"hutch serving on {url} (state in {where}); dashboard at {url}/ui/")

    try:
        run(host, port, data_dir=data_dir, token_file=token_file, retention_seconds=retention,
            allow=list(allow), config_file=config, max_connections=max_connections,
            allow_providers=list(allow_provider), provider=provider, on_ready=announce,
            advertise_url=advertise_url)
    except HutchError as exc:
        err_console.print(f"[red]error[/red] ({exc.code}): {exc}")
        raise exit_with(exit_code_for(exc)) from None


@command("demo")
@reports_errors
def demo() -> None:
    """Show hutch working in-process, with no daemon: a local sandbox in a temp dir."""
    import hutch

    workdir = tempfile.mkdtemp(prefix="hutch-demo-")
    with hutch.create_sandbox_sync("local", workdir=workdir) as sb:
        console.print(f"[bold]sandbox[/bold] {sb.id} (provider local) in {workdir}")
        result = sb.exec("echo hello from $(basename $PWD); uname -s")
        console.print(f"$ echo ...  -> exit {result.exit_code}: {result.stdout.strip()!r}")
        failing = sb.exec("ls /no/such/dir")
        console.print(f"$ ls /no/such/dir -> exit {failing.exit_code} (a result, not an error)")
        name = "notes ü 'quoted'.txt"
        sb.write_text(name, "hutch keeps your agent's work\n")
        console.print(f"wrote {name!r}; read back: {sb.read_text(name).strip()!r}")
        console.print(f"grep 'work': {[m.line for m in sb.grep('work')]}")
        try:
            sb.exec("sleep 10", timeout=0.5)
        except hutch.ExecTimeout as exc:
            console.print(f"timeout: {exc}")
        status = sb.status()
        console.print(f"state {status.state.value}, meter {status.meter}")
    console.print("[green]done[/green]")
