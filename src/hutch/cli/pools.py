"""``hutch pool ls | set | rm``: warm pools, sandboxes made ahead that a
create with the same provider settings takes ready."""

from __future__ import annotations

from typing import Any

import click

from ._common import client, console, group, reports_errors
from ._listing import Column, print_json, print_table

pool = group("pool", help="Warm pools: sandboxes made ahead, which a create takes ready.")

POOL_COLUMNS = (Column("NAME"), Column("PROVIDER"), Column("READY"), Column("SIZE"),
                Column("HITS", drop=2), Column("SETTINGS", cut=True, drop=1))


@pool.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON as it is.")
@reports_errors
def pool_ls(as_json: bool) -> None:
    """List the warm pools, one line each."""
    with client() as c:
        found = c.list_pools()
    if as_json:
        print_json(found)
        return
    print_table(POOL_COLUMNS, [
        [p["name"], p["provider"], str(p["ready"]), str(p["size"]), str(p["hits"]),
         " ".join(f"{k}={v}" for k, v in sorted(p["settings"].items()) if k != "provider")
         or "-"]
        for p in found
    ])


@pool.command("set")
@click.argument("name")
@click.argument("size", type=click.IntRange(0, 1000))
@click.option("--provider", help="local, docker, bubblewrap, ... (default: the daemon's).")
@click.option("--image", help="Image: a Docker image or a hutch image (docker, bubblewrap).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Another setting of the provider (a string), e.g. --set network=none.")
@click.option("--definition", help="A sandbox definition whose settings the pool's are "
              "(an ensure that makes its thread's sandbox takes one).")
@reports_errors
def pool_set(name: str, size: int, provider: str | None, image: str | None,
             settings: tuple[str, ...], definition: str | None) -> None:
    """Make or resize a pool of SIZE sandboxes; new settings replace those it
    kept (with none given, a pool that exists keeps its own)."""
    body: dict[str, Any] = {}
    if definition is not None:
        body["definition"] = definition
    if provider is not None:
        body["provider"] = provider
    if image is not None:
        body["image"] = image
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint="--set")
        body[key] = value
    with client() as c:
        if not body:  # a resize
            body = next((dict(p["settings"]) for p in c.list_pools() if p["name"] == name), {})
        made = c.set_pool(name, size, body)
    console.print(f"pool {made['name']}: {made['provider']}, {made['size']} kept ready")


@pool.command("rm")
@click.argument("name")
@reports_errors
def pool_rm(name: str) -> None:
    """Remove a pool and free the sandboxes it kept ready."""
    with client() as c:
        c.remove_pool(name)
    console.print(f"pool {name} removed")
