"""Bench: the hutch command's listings with a thousand sandboxes.

``hutch ls --json`` and ``hutch ls`` (in a pipe) as a person or a script runs
them, a new process each time, against a daemon holding 1000 ``virtual``
sandboxes. Floors: ``curl`` fetching the same ``GET /v1/sandboxes`` (a new
process doing the same request) and an interpreter that imports nothing of
hutch (``python -c pass``): what is left above them is the command's own cost
(its imports, its parsing, its rendering). Goal: ``ls --json`` under 500 ms.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run
from _common import timed_command as timed

SANDBOXES = 1000
RUNS = 9


def median_of(measure: Callable[[], float]) -> float:
    measure()  # warm: the page cache, the daemon's first answer
    return median_ms([measure() for _ in range(RUNS)])


async def main() -> None:
    daemon = DaemonProcess().start()
    try:
        with hutch.Client(daemon.url, token=daemon.token) as c:
            for _ in range(SANDBOXES):
                c.create_sandbox(provider="virtual")
        env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
        hutch_cmd = [sys.executable, "-m", "hutch.cli.main"]
        ls_json = median_of(timed([*hutch_cmd, "ls", "--json"], env))
        ls_table = median_of(timed([*hutch_cmd, "ls"], env))
        bare = median_of(timed([sys.executable, "-c", "pass"], env))
        header(f"hutch ls with {SANDBOXES} sandboxes (a new process each run)")
        curl = shutil.which("curl")
        if curl is not None:
            get = median_of(timed(
                [curl, "-sf", "-o", "/dev/null", "-H", f"Authorization: Bearer {daemon.token}",
                 f"{daemon.url}/v1/sandboxes"], env))
            row("ls --json vs curl GET /v1/sandboxes", ls_json, get, "goal: < 500 ms")
            row("ls (table, piped) vs curl GET", ls_table, get)
        row("ls --json vs python -c pass", ls_json, bare)
        row("ls (table, piped) vs python -c pass", ls_table, bare)
        ls_json_cpu = median_of(timed([*hutch_cmd, "ls", "--json"], env, cpu=True))
        bare_cpu = median_of(timed([sys.executable, "-c", "pass"], env, cpu=True))
        row("ls --json CPU time vs python -c pass's", ls_json_cpu, bare_cpu)
    finally:
        daemon.close()


if __name__ == "__main__":
    run(main)
