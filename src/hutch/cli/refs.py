"""Refs: ``hutch ref`` hands one out (or revokes it), ``hutch refs`` lists them."""

from __future__ import annotations

import time

import click

from ._common import ago, client, command, duration, err_console, reports_errors
from ._listing import Column, print_json, print_table


@command("ref")
@click.argument("sandbox_id", required=False,
                help="The sandbox (not needed to revoke a whole ref: it names its sandbox).")
@click.option("--expires-in", type=float,
              help="Seconds the ref can be used for; unset: until revoked or the sandbox ends.")
@click.option("--revoke", metavar="REF", help="Revoke this ref (or, with the sandbox's id, "
              "this ref id) instead of making one.")
@reports_errors
def ref(sandbox_id: str | None, expires_in: float | None, revoke: str | None) -> None:
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


@command("refs")
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON as it is.")
@reports_errors
def refs(sandbox_id: str, as_json: bool) -> None:
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
