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

import os
import sys
import tempfile
import time
from typing import Any

import typer

from .._errors import HutchError
from ._common import (
    EXIT_CODES,
    ago,
    app,
    client,
    console,
    duration,
    err_console,
    exit_code_for,
    reports_errors,
    size,
    snapshot_app,
    workspace_app,
)
from ._listing import Column, print_json, print_lines, print_table
from .images import image_app
from .mcp_server import mcp
from .tokens import token_

HELP = __doc__
app.add_typer(workspace_app, name="workspace")
app.add_typer(image_app, name="image")
app.add_typer(snapshot_app, name="snapshot")
app.command("mcp")(mcp)
app.command("token")(token_)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"hutch {__version__}")
        raise typer.Exit()


@app.callback(help=HELP)
def main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True,
        help="Print hutch's version and exit.",
    ),
) -> None:
    pass


__all__ = ["EXIT_CODES", "app", "client", "exit_code_for", "reports_errors"]


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless a token is set)."),
    port: int = typer.Option(8787, help="TCP port to listen on."),
    token_file: str | None = typer.Option(
        None, help="File holding the bearer token (mode 0600). Without it the token comes "
        "from HUTCH_TOKEN; never from the command line, where every user could read it.",
    ),
    data_dir: str | None = typer.Option(
        None, envvar="HUTCH_HOME",
        help="Directory for the state store and working directories "
        "(default ~/.local/share/hutch).",
    ),
    retention: float | None = typer.Option(
        None, help="Seconds an ended sandbox stays readable, with its events (default 86400)."
    ),
    allow: list[str] = typer.Option(
        [], "--allow", metavar="SETTING",
        help="Let API clients set this host-reaching setting (mounts, host_workdir, "
        "network_mode, cap_drop, ...); repeatable. Also `allow = \\[...]` under \\[server] in "
        "hutch.toml.",
    ),
    allow_provider: list[str] = typer.Option(
        [], "--allow-provider", metavar="PROVIDER",
        help="Let API clients use this provider that runs on the host itself (local, ssh: "
        "commands run as a host user, not in a sandbox); repeatable. Also `providers = "
        "\\[...]` under \\[server] in hutch.toml.",
    ),
    provider: str | None = typer.Option(
        None, "--provider", metavar="PROVIDER",
        help="The provider of requests that name none (over hutch.toml's \\[sandbox] "
        "provider); unset: docker where its Engine answers, else bubblewrap. Naming one "
        "that runs on the host (local) allows it.",
    ),
    config: str | None = typer.Option(
        None, help="hutch.toml with \\[server] allow, providers, limits and ceilings "
        "(default: ./hutch.toml)."
    ),
    max_connections: int | None = typer.Option(
        None, help="How many client connections at once, at most (default 4096, or half "
        "the open-files limit); past it the longest-idle one is closed.",
    ),
) -> None:
    """Run the daemon: the HTTP API, the state store, the timers.

    The token clients must send is read from HUTCH_TOKEN or --token-file; with
    neither, the daemon makes one at its first start, in the file api-token of
    its data directory (mode 0600), where this user's CLI and SDK find it.
    """
    from ..server import serve as run

    def announce(url: str, where: str) -> None:
        # Said only once the port is ours and the daemon has started.
        console.print(f"hutch serving on {url} (state in {where})")

    try:
        run(host, port, data_dir=data_dir, token_file=token_file, retention_seconds=retention,
            allow=allow, config_file=config, max_connections=max_connections,
            allow_providers=allow_provider, provider=provider, on_ready=announce)
    except HutchError as exc:
        err_console.print(f"[red]error[/red] ({exc.code}): {exc}")
        raise typer.Exit(exit_code_for(exc)) from None


@app.command()
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


#: ``hutch ls``: on a narrow terminal the free text is cut first, then the
#: columns with a ``drop`` rank are left out, highest first.
LS_COLUMNS = (
    Column("ID"), Column("PROVIDER"), Column("STATE"), Column("AGE", drop=2),
    Column("IDLE", drop=3), Column("DEADLINE", drop=1),
)
LS_WIDE_COLUMNS = (
    Column("MEMORY", drop=5), Column("RUNNING", drop=7), Column("PAUSED", drop=9),
    Column("SUSPENDED", drop=8), Column("ATTACHED", drop=10),
    Column("WORKSPACE", cut=True, drop=6), Column("WORKDIR", cut=True, drop=4),
    Column("REASON", cut=True),
)


def sandbox_row(s: dict[str, Any], wide: bool) -> list[str]:
    deadline = s.get("deadline_unix")
    row = [
        s["id"], s["provider"], s["state"], ago(s.get("created_at_unix")),
        duration(s.get("idle_seconds")),
        f"in {duration(deadline - time.time())}" if deadline else "-",
    ]
    if wide:
        meter = s.get("meter") or {}
        row += [size(s.get("memory_bytes"))]
        row += [duration(meter.get(k)) for k in ("running_s", "paused_s", "suspended_s")]
        row += [str(len(s.get("attachments") or []))]  # sessions attached with refs
        row += [s.get("workspace") or "-", s.get("workdir") or "-", s.get("reason") or "-"]
    return row


@app.command("ls")
@reports_errors
def list_sandboxes(
    as_json: bool = typer.Option(False, "--json", help="Print the daemon's JSON as it is."),
    wide: bool = typer.Option(
        False, "--wide", "-w",
        help="Also show memory, time spent running / paused / suspended, sessions "
        "attached with refs, workspace, working directory and the reason a sandbox ended.",
    ),
    include_ended: bool = typer.Option(
        False, "--all", "-a",
        help="Also show sandboxes that ended (terminated or failed) within the daemon's "
        "retention period, with the reason.",
    ),
) -> None:
    """List sandboxes, one line each: state, age, idle time and time to the deadline.

    Ids are whole in a pipe; on a terminal each line fits its width."""
    with client() as c:
        sandboxes = c.list_sandboxes(include_ended=include_ended)
    if as_json:
        print_json(sandboxes)
        return
    columns = LS_COLUMNS + (LS_WIDE_COLUMNS if wide else ())
    print_table(columns, [sandbox_row(s, wide) for s in sandboxes])


@app.command()
@reports_errors
def events(
    subject: str | None = typer.Argument(
        None, help="A sandbox id or workspace name; all subjects when omitted."
    ),
    limit: int = typer.Option(100, help="How many of the newest events to show."),
    as_json: bool = typer.Option(False, "--json", help="Print the daemon's JSON as it is."),
) -> None:
    """What happened to a sandbox or workspace, and why (reaped, failed, adopted...)."""
    with client() as c:
        found = c.events(subject, limit=limit)
    if as_json:
        print_json(found)
        return
    if not found:
        err_console.print(f"no events{f' for {subject}' if subject else ''}")
        return
    lines = []
    for event in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(event["at_unix"])))
        who = "" if subject else f"{event['subject']}  "
        # Plain text: an event's message is data, not rich markup.
        lines.append(f"{when}  {who}{event['kind']}: {event['message']}")
    print_lines(lines)


@app.command()
@reports_errors
def create(
    provider: str | None = typer.Option(None, help="local, docker, virtual, ssh, ..."),
    image: str | None = typer.Option(
        None, help="Image: a Docker image or a hutch image (docker, bubblewrap)."
    ),
    rootfs: str | None = typer.Option(
        None, help="A host directory as the read-only root file system (bubblewrap)."
    ),
    workdir: str | None = typer.Option(None, help="Working directory (local)."),
    destination: str | None = typer.Option(
        None, help="user@host, a host, or an ssh config alias (ssh)."
    ),
    working_directory: str | None = typer.Option(
        None, help="Absolute working directory on the host (ssh)."
    ),
    ssh_config: str | None = typer.Option(None, help="An ssh client config file (ssh)."),
    preview_url_base: str | None = typer.Option(
        None, help="Where the host's ports are reachable, e.g. http://devbox (ssh)."
    ),
    clone_current: bool = typer.Option(
        False, "--clone-current",
        help="Clone this directory's git origin (as https) at its current branch (ssh).",
    ),
    idle_suspend_after: float | None = typer.Option(
        None, help="Suspend after this many seconds idle (work-aware); unset: never."
    ),
    idle_timeout: float | None = typer.Option(
        None, help="Terminate after this many seconds idle (work-aware); unset: never."
    ),
    max_lifetime: float | None = typer.Option(
        None, help="Terminate this many seconds after creation, busy or not; unset: never."
    ),
    config: str | None = typer.Option(None, help="Run config file (default ./hutch.toml)."),
) -> None:
    """Create a sandbox. Flags beat hutch.toml, which beats the daemon's defaults."""
    # Here, not at the top: the other commands do without the providers' settings.
    from ..config import load_config_file
    from ..providers.ssh.gitsource import current_source

    layer = load_config_file(config)
    flags: dict[str, Any] = {
        "provider": provider, "image": image, "workdir": workdir,
        "rootfs": os.path.abspath(rootfs) if rootfs else None,
        "destination": destination, "working_directory": working_directory,
        "config_file": os.path.abspath(ssh_config) if ssh_config else None,
        "preview_url_base": preview_url_base,
        "idle_suspend_after": idle_suspend_after, "idle_timeout": idle_timeout,
        "max_lifetime": max_lifetime,
    }
    if clone_current:
        source = current_source(os.getcwd())
        if source is None:
            err_console.print(
                "no git repository with an origin here: the working directory is used as it is"
            )
        else:
            flags.update(clone=True, repository=source.repository, branch=source.branch)
    body = merge_layers(layer, {k: v for k, v in flags.items() if v is not None})
    with client() as c, console.status("creating sandbox..."):
        sb = c.create_sandbox(**body)
    console.print(sb.id)


def merge_layers(config_file: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """One request body: the config file with the flags on top."""
    body = dict(config_file)
    provider = flags.get("provider") or body.get("provider")
    providers = body.pop("providers", {}) or {}
    if provider:
        body.update(providers.get(provider, {}))
        body["provider"] = provider
    body.update(flags)
    return body


@app.command("exec", context_settings={"allow_extra_args": True})
@reports_errors
def exec_(
    sandbox_id: str,
    command: list[str] = typer.Argument(..., help="The command (after --)."),
    timeout: float | None = typer.Option(
        None, help="Kill the command's whole process tree after this many seconds."
    ),
    cwd: str | None = typer.Option(
        None, help="Directory to run in (relative to the sandbox's working directory)."
    ),
    output_limit: int | None = typer.Option(
        None, help="Kill the command once its output passes this many bytes "
        "(default: the sandbox's, 16 MiB unless set)."
    ),
    interactive: bool = typer.Option(
        False, "--interactive", "-i",
        help="Give the command this standard input (read to its end first), as "
        "`docker exec -i`; without it the command's standard input is empty.",
    ),
) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit code.

    Standard input is left alone unless -i says to give it to the command:
    a pipe that stays open (as under an agent's harness) never holds it up.
    """
    with client() as c:
        code = stream_command(c.get_sandbox(sandbox_id), command, timeout=timeout, cwd=cwd,
                              output_limit=output_limit, forward_stdin=interactive)
    raise typer.Exit(code)


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


@app.command("ref")
@reports_errors
def ref_(
    sandbox_id: str | None = typer.Argument(
        None, help="The sandbox (not needed to revoke a whole ref: it names its sandbox)."
    ),
    expires_in: float | None = typer.Option(
        None, help="Seconds the ref can be used for; unset: until revoked or the sandbox ends."
    ),
    revoke: str | None = typer.Option(
        None, metavar="REF", help="Revoke this ref (or, with the sandbox's id, this ref id) "
        "instead of making one."
    ),
) -> None:
    """Hand out a ref to a sandbox you own: a credential for it alone.

    Whoever holds it can `hutch attach REF -- CMD` (or hutch.attach(ref) in
    Python) with no other configuration; their closing only detaches them.
    `hutch ref --revoke REF` ends one.
    """
    from .._errors import InvalidArgument
    from .._refwire import decode_ref

    if revoke is not None:
        decoded = decode_ref(revoke)
        named = decoded.sandbox_id if decoded is not None else None
        if sandbox_id is not None and named is not None and named != sandbox_id:
            raise InvalidArgument(f"that ref is for sandbox {named}, not {sandbox_id}")
        sandbox_id = sandbox_id or named
        if sandbox_id is None:
            raise InvalidArgument(
                f"{revoke!r} is a ref id: say its sandbox too (hutch ref SANDBOX --revoke "
                "REF_ID), or give the whole ref"
            )
    elif sandbox_id is None:
        raise InvalidArgument("which sandbox? hutch ref SANDBOX (or hutch ref --revoke REF)")
    with client() as c:
        sb = c.get_sandbox(sandbox_id)
        if revoke is not None:
            sb.revoke_ref(revoke)
            err_console.print(f"revoked; it no longer reaches {sandbox_id}")
            return
        print(sb.ref(expires_in=expires_in))


REF_COLUMNS = (
    Column("REF"), Column("CREATED", drop=3), Column("EXPIRES", drop=1),
    Column("LAST USED", drop=2), Column("WORKSPACE", cut=True, drop=4),
)


@app.command("refs")
@reports_errors
def refs_(
    sandbox_id: str,
    as_json: bool = typer.Option(False, "--json", help="Print the daemon's JSON as it is."),
) -> None:
    """The refs of a sandbox that still work, one line each."""
    with client() as c:
        found = c.get_sandbox(sandbox_id).info().get("refs") or []
    if as_json:
        print_json(found)
        return
    print_table(REF_COLUMNS, [
        [r["ref_id"], ago(r.get("created_at_unix")),
         f"in {duration(r['expires_at_unix'] - time.time())}" if r.get("expires_at_unix")
         else "-",
         ago(r.get("last_used_unix")), r.get("workspace") or "-"]
        for r in found
    ])


@app.command("attach", context_settings={"allow_extra_args": True})
@reports_errors
def attach_(
    ref: str = typer.Argument(..., help="A ref from `hutch ref` (or Sandbox.ref())."),
    command: list[str] = typer.Argument(..., help="The command (after --)."),
    timeout: float | None = typer.Option(
        None, help="Kill the command's whole process tree after this many seconds."
    ),
    cwd: str | None = typer.Option(
        None, help="Directory to run in (relative to the sandbox's working directory)."
    ),
    output_limit: int | None = typer.Option(
        None, help="Kill the command once its output passes this many bytes."
    ),
    interactive: bool = typer.Option(
        False, "--interactive", "-i",
        help="Give the command this standard input (read to its end first), as "
        "`docker exec -i`; without it the command's standard input is empty.",
    ),
) -> None:
    """Run a command in the sandbox a ref names, as an attached session.

    The ref says where the daemon is and is the credential: no HUTCH_URL or
    HUTCH_TOKEN is needed. Exits with the command's exit code.
    """
    import hutch

    sb = hutch.attach_sync(ref)
    try:
        code = stream_command(sb, command, timeout=timeout, cwd=cwd,
                              output_limit=output_limit, forward_stdin=interactive)
    finally:
        sb.close()
    raise typer.Exit(code)


@app.command()
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
    raise typer.Exit(code)


@app.command()
@reports_errors
def cp(
    source: str = typer.Argument(..., help="PATH here, or SANDBOX:PATH."),
    destination: str = typer.Argument(..., help="SANDBOX:PATH, or PATH here."),
) -> None:
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


def _lifecycle(action: str, sandbox_id: str) -> None:
    with client() as c, console.status(f"{action} {sandbox_id}..."):
        if action == "kill":
            c.delete_sandbox(sandbox_id)
            console.print(f"{sandbox_id} killed")
            return
        info = getattr(c, action)(sandbox_id)
    console.print(f"{sandbox_id} {info['state']}")


@app.command()
@reports_errors
def pause(sandbox_id: str) -> None:
    """Hold a sandbox as it is (processes and memory stay, no CPU)."""
    _lifecycle("pause", sandbox_id)


@app.command()
@reports_errors
def suspend(sandbox_id: str) -> None:
    """Free a sandbox's memory, keeping its state on disk."""
    _lifecycle("suspend", sandbox_id)


@app.command()
@reports_errors
def resume(sandbox_id: str) -> None:
    """Bring a paused or suspended sandbox back."""
    _lifecycle("resume", sandbox_id)


@app.command()
@reports_errors
def kill(sandbox_id: str) -> None:
    """End a sandbox and release everything it holds."""
    _lifecycle("kill", sandbox_id)


@app.command("set-timeout")
@reports_errors
def set_timeout(sandbox_id: str, seconds: float) -> None:
    """Make a sandbox's deadline now + SECONDS; prints it as Unix time."""
    with client() as c:
        console.print(f"{c.set_timeout(sandbox_id, seconds):.3f}")


@workspace_app.command("create")
@reports_errors
def workspace_create(
    name: str,
    snapshot: str | None = typer.Option(None, help="A snapshot tag to start from."),
    image: str | None = typer.Option(None, help="An image to start from."),
    provider: str | None = typer.Option(
        None, help="local, docker, bubblewrap, ... (default: the daemon's default provider)."
    ),
    idle_suspend_after: float | None = typer.Option(
        None, help="Suspend after this many seconds idle (work-aware); unset: never."
    ),
) -> None:
    """Create a workspace from a snapshot tag or an image."""
    extra: dict[str, Any] = {"idle_suspend_after": idle_suspend_after} if idle_suspend_after else {}
    if provider is not None:
        extra["provider"] = provider
    with client() as c, console.status(f"creating workspace {name}..."):
        ws = c.create_workspace(name, image=image, snapshot_tag=snapshot, **extra)
    console.print(f"{ws['name']} {ws['status']} (sandbox {ws['live_sandbox_id']})")


@workspace_app.command("suspend")
@reports_errors
def workspace_suspend(
    name: str,
    diff: bool = typer.Option(
        False, "--diff", help="Capture only what changed since the last state snapshot."
    ),
) -> None:
    """Capture a workspace's state and free its sandbox."""
    with client() as c, console.status(f"suspending {name}..."):
        ws = c.suspend_workspace(name, diff=diff)
    console.print(f"{ws['name']} {ws['status']} (state {ws['state_snapshot_id']})")


@workspace_app.command("resume")
@reports_errors
def workspace_resume(name: str) -> None:
    """Bring a suspended or stale workspace back from its last state."""
    with client() as c, console.status(f"resuming {name}..."):
        ws = c.resume_workspace(name)
    console.print(f"{ws['name']} {ws['status']} (sandbox {ws['live_sandbox_id']})")


WORKSPACE_COLUMNS = (
    Column("NAME"), Column("STATUS"), Column("SANDBOX", drop=1),
    Column("STATE SNAPSHOT", drop=4), Column("FROM", cut=True, drop=5), Column("AGE", drop=3),
    Column("LAST ACTIVE", drop=2),
)


@workspace_app.command("list")
@reports_errors
def workspace_list(
    as_json: bool = typer.Option(False, "--json", help="Print the daemon's JSON as it is."),
) -> None:
    """List workspaces, one line each (ids whole in a pipe)."""
    with client() as c:
        found = c.list_workspaces()
    if as_json:
        print_json(found)
        return
    print_table(WORKSPACE_COLUMNS, [
        [w["name"], w["status"], w["live_sandbox_id"] or "-", w["state_snapshot_id"] or "-",
         w["source_snapshot_id"] or w["provider"], ago(w["created_at_unix"]),
         ago(w["last_active_unix"])]
        for w in found
    ])


@workspace_app.command("delete")
@reports_errors
def workspace_delete(name: str) -> None:
    """Delete a workspace: its sandbox and its own state snapshot (not its source)."""
    with client() as c, console.status(f"deleting {name}..."):
        c.delete_workspace(name)
    console.print(f"{name} deleted")


# -- snapshots and forks -------------------------------------------------------------


@snapshot_app.command("create")
@reports_errors
def snapshot_create(
    sandbox_id: str,
    label: str | None = typer.Option(None, "--label", "-l", help="A name to know it by."),
    full: bool = typer.Option(False, "--full", help="Write the whole state, not a diff."),
) -> None:
    """Capture a sandbox's state (it keeps running)."""
    with client() as c, console.status(f"snapshotting {sandbox_id}..."):
        snap = c.get_sandbox(sandbox_id).snapshot(label, diff=not full)
    console.print(f"{snap.id} {size(snap.size_bytes)}"
                  + (f" (parent {snap.parent_id})" if snap.parent_id else ""))


def lineage_lines(snapshots: list[Any]) -> list[str]:
    """The snapshots as a tree, children under their parent, oldest first.

    A last child that is its parent's only one stays at its parent's depth
    (two ``└─`` in a row are parent and child: a last child has no sibling
    after it), so a long lineage takes no more width than a short one.
    """
    known = {s.id for s in snapshots}
    children: dict[str | None, list[Any]] = {}
    for snap in sorted(snapshots, key=lambda s: (s.created_at_unix, s.id)):
        parent = snap.parent_id if snap.parent_id in known else None
        children.setdefault(parent, []).append(snap)
    lines: list[str] = []
    # (snapshot, prefix of its line, its branch mark, prefix of its children's lines)
    pending: list[tuple[Any, str, str, str]] = [
        (snap, "", "", "") for snap in reversed(children.get(None, []))
    ]
    while pending:  # depth first, without recursion: a lineage may be thousands deep
        snap, prefix, branch, below = pending.pop()
        label = f" {snap.label}" if snap.label else ""
        lines.append(f"{prefix}{branch}{snap.id}{label}  {size(snap.size_bytes)}  "
                     f"{snap.provider}  from {snap.sandbox_id or '-'}  "
                     f"{ago(snap.created_at_unix)} ago")
        kids = children.get(snap.id, [])
        if len(kids) == 1 and branch == "└─ ":
            pending.append((kids[0], prefix, "└─ ", below))
            continue
        for i, kid in reversed(list(enumerate(kids))):
            last = i == len(kids) - 1
            pending.append((kid, below, "└─ " if last else "├─ ",
                            below + ("   " if last else "│  ")))
    return lines


@snapshot_app.command("ls")
@reports_errors
def snapshot_ls(
    as_json: bool = typer.Option(False, "--json", help="Print them as JSON."),
) -> None:
    """List snapshots as their lineage tree, one line each (ids whole in a pipe)."""
    with client() as c:
        snapshots = c.snapshots()
    if as_json:
        print_json([s.as_dict() for s in snapshots])
        return
    print_lines(lineage_lines(snapshots))


@snapshot_app.command("rm")
@reports_errors
def snapshot_rm(
    snapshot_id: str,
    force: bool = typer.Option(False, "--force", help="Remove it even if something needs it."),
) -> None:
    """Remove a snapshot and free its storage."""
    with client() as c:
        broken = c.delete_snapshot(snapshot_id, force=force)
    console.print(f"{snapshot_id} removed")
    if broken:
        console.print("it was still needed by " + ", ".join(map(str, broken)),
                      style="yellow", highlight=False, markup=False)


@app.command()
@reports_errors
def fork(
    sandbox_id: str,
    count: int = typer.Option(1, "-n", "--count", help="How many branches to start now."),
    label: str | None = typer.Option(None, "--label", "-l", help="A name for the snapshot."),
) -> None:
    """Snapshot a sandbox and start N independent branches from it."""
    with client() as c, console.status(f"forking {sandbox_id} into {count}..."):
        made = c.get_sandbox(sandbox_id).fork(label, count=count)
    console.print(f"snapshot {made.snapshot.id}")
    for branch in made.branches:
        console.print(branch.id)


@app.command()
@reports_errors
def ensure(
    definition: str = typer.Argument(..., help="The definition's id (PUT, or in the daemon's "
                                     "hutch.toml)."),
    thread: str = typer.Option(..., "--thread", "-t", help="The thread id."),
    tenant: str | None = typer.Option(None, "--tenant", help="The tenant, if any."),
) -> None:
    """The sandbox of a thread for a definition: resumed, restored from its
    setup snapshot, or created with setup run. Prints its id and each step."""
    from ..client import EnsureProgress

    made = None
    with client() as c, console.status(f"ensuring {definition} for thread {thread}...") as shown:
        for event in c.ensure_stream(definition, thread, tenant=tenant):
            if isinstance(event, EnsureProgress) and event.kind == "step":
                shown.update(f"{definition} for thread {thread}: {event.text}...")
            elif isinstance(event, EnsureProgress):
                err_console.out(event.text, end="", highlight=False)  # setup's own output
            else:
                made = event
    if made is None:
        raise HutchError("the daemon ended the ensure stream without a result")
    console.print(f"{made.sandbox.id} ({made.path})")
    for step in made.steps:
        console.print(f"  {step['name']:<24} {float(step['seconds']):8.2f} s")


DEFINITION_COLUMNS = (
    Column("ID"), Column("PROVIDER"), Column("REUSE", drop=2), Column("KEEP ALIVE", drop=1),
    Column("SOURCE", cut=True, drop=3), Column("SETUP", cut=True),
)


@app.command()
@reports_errors
def definitions(
    as_json: bool = typer.Option(False, "--json", help="Print the daemon's JSON as it is."),
) -> None:
    """The daemon's sandbox definitions, one line each."""
    with client() as c:
        found = c.definitions()
    if as_json:
        print_json(found)
        return
    rows = []
    for d in found:
        workspace, lifecycle = d.get("workspace") or {}, d.get("lifecycle") or {}
        source = workspace.get("source") or {}
        rows.append([
            d["id"], (d.get("provider") or {}).get("type") or "-",
            str(lifecycle.get("reuse") or "-"), duration(lifecycle.get("keep_alive")),
            " ".join(f"{k}={v}" for k, v in source.items() if v is not None) or "-",
            "; ".join(workspace.get("setup") or []) or "-",
        ])
    print_table(DEFINITION_COLUMNS, rows)


@app.command()
@reports_errors
def complete(
    definition: str,
    thread: str = typer.Option(..., "--thread", "-t", help="The thread id."),
    tenant: str | None = typer.Option(None, "--tenant", help="The tenant, if any."),
) -> None:
    """A thread's run ended: its sandbox is destroyed if the definition says so."""
    with client() as c:
        destroyed = c.complete(definition, thread, tenant=tenant)
    console.print(f"{'destroyed' if destroyed else 'kept'}")


if __name__ == "__main__":
    app()
