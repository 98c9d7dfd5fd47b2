"""``python -m hutch.server --host H --port P [--token-file F] [--data-dir D]``.

The token comes from ``HUTCH_TOKEN`` or ``--token-file``, never from the
command line (which every user on the host can read in /proc).
"""

from __future__ import annotations

import argparse
import sys

from .._errors import HutchError
from . import DEFAULT_HOST, DEFAULT_PORT, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hutch-server",
        epilog="The bearer token is read from HUTCH_TOKEN or --token-file (mode 0600), "
        "never from the command line; with neither, the daemon makes one in the file "
        "api-token of its data directory.",
    )
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--token-file", default=None,
                        help="file holding the bearer token (no other user may read it)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--retention", type=float, default=None,
                        help="seconds an ended sandbox stays readable (default 86400)")
    parser.add_argument("--allow", action="append", default=[], metavar="SETTING",
                        help="let clients set this host-reaching setting (mounts, "
                        "host_workdir, network_mode, cap_drop); repeatable")
    parser.add_argument("--allow-provider", action="append", default=[], metavar="PROVIDER",
                        help="let clients use this provider that runs on the host itself "
                        "(local, ssh); repeatable")
    parser.add_argument("--provider", default=None, metavar="PROVIDER",
                        help="the provider of requests that name none (default: docker "
                        "where its Engine answers, else bubblewrap)")
    parser.add_argument("--config", default=None,
                        help="hutch.toml with a [server] table (default: ./hutch.toml)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="most client connections at once (default 4096, or half "
                        "the open-files limit)")
    parser.add_argument("--store", default=None, metavar="URL",
                        help="where the daemon keeps its state: a postgresql:// URL (also "
                        "HUTCH_STORE, or [server] store in hutch.toml); default: SQLite in "
                        "the data directory")
    parser.add_argument("--advertise-url", default=None, metavar="URL",
                        help="where the other daemons sharing the store reach this one "
                        "(also HUTCH_ADVERTISE_URL, or [server] advertise_url in hutch.toml); "
                        "default: the address it listens on")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, data_dir=args.data_dir, retention_seconds=args.retention,
              token_file=args.token_file, allow=args.allow, config_file=args.config,
              max_connections=args.max_connections, allow_providers=args.allow_provider,
              provider=args.provider, store=args.store, advertise_url=args.advertise_url)
    except HutchError as exc:
        print(f"hutch serve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
