"""``hutch token``: the credential this user's clients send, as it is or in
E2B's API key format (for the E2B SDKs pointed at the daemon)."""

from __future__ import annotations

import os

import click

from ._common import command, reports_errors


@command("token")
@click.option("--e2b", is_flag=True,
              help="In E2B's API key format (e2b_ and hex), for E2B_API_KEY: the E2B SDKs up "
              "to 2.45 refuse keys of any other shape.")
@click.argument("credential", required=False,
                help="A credential to print (a ref from `hutch ref`); default: the daemon's "
                "token, from HUTCH_TOKEN or the file the local daemon made.")
@reports_errors
def token(e2b: bool, credential: str | None) -> None:
    """Print the daemon's token (or a ref), e.g. as E2B_API_KEY for the E2B SDKs."""
    from .._e2bkey import e2b_key
    from .._errors import Unauthorized
    from ..client._http import client_url, local_token

    given = credential or os.environ.get("HUTCH_TOKEN") or local_token(client_url(None))
    if not given:
        raise Unauthorized(
            "no token found: set HUTCH_TOKEN, or run this as the user of a local daemon "
            "(its token is in the file api-token of its data directory)")
    print(e2b_key(given) if e2b else given)
