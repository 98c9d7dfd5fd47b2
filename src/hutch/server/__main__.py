"""``python -m hutch.server --host H --port P [--token T] [--data-dir D]``."""

from __future__ import annotations

import argparse
import sys

from .._errors import HutchError
from . import DEFAULT_HOST, DEFAULT_PORT, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hutch-server")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--token", default=None)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--retention", type=float, default=None,
                        help="seconds an ended sandbox stays readable (default 86400)")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, args.token, args.data_dir, args.retention)
    except HutchError as exc:
        print(f"hutch serve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
