"""Sandboxes: ``hutch ls``, ``events``, ``create``, ``pause``, ``suspend``,
``resume``, ``kill`` and ``set-timeout``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from ._common import ago, client, command, console, duration, err_console, reports_errors, size
from ._listing import Column, print_json, print_lines, print_table

JSON_HELP = "Print the daemon's JSON as it is."

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


@command("ls")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--wide", "-w", is_flag=True,
              help="Also show memory, time spent running / paused / suspended, sessions "
              "attached with refs, workspace, working directory and the reason a sandbox ended.")
@click.option("--all", "-a", "include_ended", is_flag=True,
              help="Also show sandboxes that ended (terminated or failed) within the daemon's "
              "retention period, with the reason.")
@reports_errors
def list_sandboxes(as_json: bool, wide: bool, include_ended: bool) -> None:
    """List sandboxes, one line each: state, age, idle time and time to the deadline.

    Ids are whole in a pipe; on a terminal each line fits its width."""
    with client() as c:
        sandboxes = c.list_sandboxes(include_ended=include_ended)
    if as_json:
        print_json(sandboxes)
        return
    columns = LS_COLUMNS + (LS_WIDE_COLUMNS if wide else ())
    print_table(columns, [sandbox_row(s, wide) for s in sandboxes])


@command("events")
@click.argument("subject", required=False,
                help="A sandbox id or workspace name; all subjects when omitted.")
@click.option("--limit", default=None, type=int,
              help="How many of the newest events to show (default 100; 10 with -f).")
@click.option("-f", "--follow", is_flag=True,
              help="Keep going: print each event as it happens, until interrupted.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@reports_errors
def events(subject: str | None, limit: int | None, follow: bool, as_json: bool) -> None:
    """What happened to a sandbox or workspace, and why (reaped, failed, adopted...)."""
    if follow:
        with client() as c:
            for event in c.follow_events(subject, limit=10 if limit is None else limit):
                if as_json:
                    click.echo(json.dumps(event))
                else:
                    click.echo(_event_line(event, subject))
        return
    with client() as c:
        found = c.events(subject, limit=100 if limit is None else limit)
    if as_json:
        print_json(found)
        return
    if not found:
        err_console.print(f"no events{f' for {subject}' if subject else ''}")
        return
    # Plain text: an event's message is data, not rich markup.
    print_lines([_event_line(event, subject) for event in found])


def _event_line(event: dict[str, Any], subject: str | None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(event["at_unix"])))
    who = "" if subject else f"{event['subject']}  "
    return f"{when}  {who}{event['kind']}: {event['message']}"


@command("create")
@click.option("--provider", help="local, docker, virtual, ssh, ...")
@click.option("--image", help="Image: a Docker image or a hutch image (docker, bubblewrap).")
@click.option("--rootfs",
              help="A host directory as the read-only root file system (bubblewrap).")
@click.option("--workdir", help="Working directory (local).")
@click.option("--destination", help="user@host, a host, or an ssh config alias (ssh).")
@click.option("--working-directory", help="Absolute working directory on the host (ssh).")
@click.option("--ssh-config", help="An ssh client config file (ssh).")
@click.option("--preview-url-base",
              help="Where the host's ports are reachable, e.g. http://devbox (ssh).")
@click.option("--clone-current", is_flag=True,
              help="Clone this directory's git origin (as https) at its current branch (ssh).")
@click.option("--idle-suspend-after", type=float,
              help="Suspend after this many seconds idle (work-aware); unset: never.")
@click.option("--idle-timeout", type=float,
              help="Terminate after this many seconds idle (work-aware); unset: never.")
@click.option("--max-lifetime", type=float,
              help="Terminate this many seconds after creation, busy or not; unset: never.")
@click.option("--config", help="Run config file (default ./hutch.toml).")
@reports_errors
def create(
    provider: str | None, image: str | None, rootfs: str | None, workdir: str | None,
    destination: str | None, working_directory: str | None, ssh_config: str | None,
    preview_url_base: str | None, clone_current: bool, idle_suspend_after: float | None,
    idle_timeout: float | None, max_lifetime: float | None, config: str | None,
) -> None:
    """Create a sandbox. Flags beat hutch.toml, which beats the daemon's defaults."""
    # Here, not at the top: the other commands do without the providers' settings.
    from ..config import load_config_file
    from ..providers.ssh.gitsource import current_source

    layer = load_config_file(config)
    flags: dict[str, Any] = {
        "provider": provider, "image": image,
        "workdir": os.path.abspath(os.path.expanduser(workdir)) if workdir else None,
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


def _lifecycle(action: str, sandbox_id: str) -> None:
    with client() as c, console.status(f"{action} {sandbox_id}..."):
        if action == "kill":
            c.delete_sandbox(sandbox_id)
            console.print(f"{sandbox_id} killed")
            return
        info = getattr(c, action)(sandbox_id)
    console.print(f"{sandbox_id} {info['state']}")


@command("pause")
@click.argument("sandbox_id")
@reports_errors
def pause(sandbox_id: str) -> None:
    """Hold a sandbox as it is (processes and memory stay, no CPU)."""
    _lifecycle("pause", sandbox_id)


@command("suspend")
@click.argument("sandbox_id")
@reports_errors
def suspend(sandbox_id: str) -> None:
    """Free a sandbox's memory, keeping its state on disk."""
    _lifecycle("suspend", sandbox_id)


@command("resume")
@click.argument("sandbox_id")
@reports_errors
def resume(sandbox_id: str) -> None:
    """Bring a paused or suspended sandbox back."""
    _lifecycle("resume", sandbox_id)


@command("kill")
@click.argument("sandbox_id")
@reports_errors
def kill(sandbox_id: str) -> None:
    """End a sandbox and release everything it holds."""
    _lifecycle("kill", sandbox_id)


@command("set-timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=float)
@reports_errors
def set_timeout(sandbox_id: str, seconds: float) -> None:
    """Make a sandbox's deadline now + SECONDS; prints it as Unix time."""
    with client() as c:
        console.print(f"{c.set_timeout(sandbox_id, seconds):.3f}")
