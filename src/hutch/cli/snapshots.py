"""Snapshots and forks: ``hutch snapshot create | ls | rm`` and ``hutch fork``."""

from __future__ import annotations

from typing import Any

import click

from ._common import ago, client, command, console, group, reports_errors, size
from ._listing import print_json, print_lines

snapshot = group("snapshot", help="Snapshots of sandboxes, as a lineage tree.")


@snapshot.command("create")
@click.argument("sandbox_id")
@click.option("--label", "-l", help="A name to know it by.")
@click.option("--full", is_flag=True, help="Write the whole state, not a diff.")
@reports_errors
def snapshot_create(sandbox_id: str, label: str | None, full: bool) -> None:
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


@snapshot.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON.")
@reports_errors
def snapshot_ls(as_json: bool) -> None:
    """List snapshots as their lineage tree, one line each (ids whole in a pipe)."""
    with client() as c:
        snapshots = c.snapshots()
    if as_json:
        print_json([s.as_dict() for s in snapshots])
        return
    print_lines(lineage_lines(snapshots))


@snapshot.command("rm")
@click.argument("snapshot_id")
@click.option("--force", is_flag=True, help="Remove it even if something needs it.")
@reports_errors
def snapshot_rm(snapshot_id: str, force: bool) -> None:
    """Remove a snapshot and free its storage."""
    with client() as c:
        broken = c.delete_snapshot(snapshot_id, force=force)
    console.print(f"{snapshot_id} removed")
    if broken:
        console.print("it was still needed by " + ", ".join(map(str, broken)),
                      style="yellow", highlight=False, markup=False)


@command("fork")
@click.argument("sandbox_id")
@click.option("-n", "--count", default=1, type=int, show_default=True,
              help="How many branches to start now.")
@click.option("--label", "-l", help="A name for the snapshot.")
@reports_errors
def fork(sandbox_id: str, count: int, label: str | None) -> None:
    """Snapshot a sandbox and start N independent branches from it."""
    with client() as c, console.status(f"forking {sandbox_id} into {count}..."):
        made = c.get_sandbox(sandbox_id).fork(label, count=count)
    console.print(f"snapshot {made.snapshot.id}")
    for branch in made.branches:
        console.print(branch.id)
