"""Run every bench in one go: ``.venv/bin/python bench/run.py [name ...]``.

Each bench prints hutch's figure beside the raw floor and their ratio. The
docker, lifecycle and daemon benches need a Docker Engine
(``scripts/ensure-docker.sh``). ``bench/compare.py [--ref REF] [name ...]``
runs each bench on this code and on another commit's at once, in lockstep.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
ORDER = [
    "local", "docker", "agent", "bwrap", "lifecycle", "daemon", "ssh", "fork", "ensure",
    "memory", "cli", "startup", "e2b", "tssdk", "sync", "fleet", "pools", "kubernetes", "gvisor",
]


def main(argv: list[str]) -> int:
    wanted = argv or ORDER
    failed = 0
    for name in wanted:
        script = HERE / f"bench_{name}.py"
        if not script.exists():
            print(f"\n== {name}: no bench_{name}.py")
            continue
        print(f"\n######## bench_{name}", flush=True)
        failed |= subprocess.run([sys.executable, str(script)], check=False).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
