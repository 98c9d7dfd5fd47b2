"""``hutch workspace create | suspend | resume | list | delete``: named
workspaces that outlive the daemon."""

from __future__ import annotations

from typing import Any

import click

from ._common import ago, client, console, group, reports_errors
from ._listing import Column, print_json, print_table

workspace = group("workspace", help="Named workspaces that outlive the daemon.")


@workspace.command("create")
@click.argument("name")
@click.option("--snapshot", help="A snapshot tag to start from.")
@click.option("--image", help="An image to start from.")
@click.option("--provider", help="local, docker, bubblewrap, ... (default: the daemon's "
              "default provider).")
@click.option("--idle-suspend-after", type=float,
              help="Suspend after this many seconds idle (work-aware); unset: never.")
@reports_errors
def workspace_create(
    name: str, snapshot: str | None, image: str | None, provider: str | None,
    idle_suspend_after: float | None,
) -> None:
    """Create a workspace from a snapshot tag or an image."""
    extra: dict[str, Any] = {"idle_suspend_after": idle_suspend_after} if idle_suspend_after else {}
    if provider is not None:
        extra["provider"] = provider
    with client() as c, console.status(f"creating workspace {name}..."):
        ws = c.create_workspace(name, image=image, snapshot_tag=snapshot, **extra)
    console.print(f"{ws['name']} {ws['status']} (sandbox {ws['live_sandbox_id']})")


@workspace.command("suspend")
@click.argument("name")
@click.option("--diff", is_flag=True,
              help="Capture only what changed since the last state snapshot.")
@reports_errors
def workspace_suspend(name: str, diff: bool) -> None:
    """Capture a workspace's state and free its sandbox."""
    with client() as c, console.status(f"suspending {name}..."):
        ws = c.suspend_workspace(name, diff=diff)
    console.print(f"{ws['name']} {ws['status']} (state {ws['state_snapshot_id']})")


@workspace.command("resume")
@click.argument("name")
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


@workspace.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON as it is.")
@reports_errors
def workspace_list(as_json: bool) -> None:
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


@workspace.command("delete")
@click.argument("name")
@reports_errors
def workspace_delete(name: str) -> None:
    """Delete a workspace: its sandbox and its own state snapshot (not its source)."""
    with client() as c, console.status(f"deleting {name}..."):
        c.delete_workspace(name)
    console.print(f"{name} deleted")
