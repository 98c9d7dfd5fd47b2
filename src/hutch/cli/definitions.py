"""Sandbox definitions: ``hutch ensure``, ``definitions`` and ``complete``."""

from __future__ import annotations

import click

from .._errors import HutchError
from ._common import client, command, console, duration, err_console, reports_errors
from ._listing import Column, print_json, print_table


@command("ensure")
@click.argument("definition",
                help="The definition's id (PUT, or in the daemon's hutch.toml).")
@click.option("--thread", "-t", required=True, help="The thread id.")
@click.option("--tenant", help="The tenant, if any.")
@reports_errors
def ensure(definition: str, thread: str, tenant: str | None) -> None:
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


@command("definitions")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON as it is.")
@reports_errors
def definitions(as_json: bool) -> None:
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


@command("complete")
@click.argument("definition")
@click.option("--thread", "-t", required=True, help="The thread id.")
@click.option("--tenant", help="The tenant, if any.")
@reports_errors
def complete(definition: str, thread: str, tenant: str | None) -> None:
    """A thread's run ended: its sandbox is destroyed if the definition says so."""
    with client() as c:
        destroyed = c.complete(definition, thread, tenant=tenant)
    console.print(f"{'destroyed' if destroyed else 'kept'}")
