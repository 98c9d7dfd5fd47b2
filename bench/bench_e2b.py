"""Bench: the E2B wire beside hutch's own SDK, on one daemon and provider.

Through one ``hutch serve`` (docker), measured in turn within one loop (so a
machine whose speed drifts moves them alike): ``commands.run("true")`` of the
unmodified ``e2b`` Python SDK beside ``exec(["true"])`` of hutch's sync SDK,
and a 1 MiB write and read back through each. hutch's own SDK is the floor;
the goal is 1.5x at most. ``commands.run`` starts ``/bin/bash -l -c CMD`` (a
login shell, its profile read): a second row puts it beside the same process
tree through hutch's exec.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run
from hutch._e2bkey import e2b_key

RUNS = 60
WARMUP = 5
PAYLOAD = os.urandom(1024 * 1024)


def alternate(pairs: dict[str, tuple[object, object]], runs: int) -> dict[str, tuple[float, float]]:
    """Median ms of each (ours, floor) pair, the two measured in turn."""
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
    for i in range(WARMUP + runs):
        for name, (ours, floor) in pairs.items():
            for index, fn in ((1, floor), (0, ours)):
                t = time.perf_counter()
                fn()  # type: ignore[operator]
                if i >= WARMUP:
                    samples[name][index].append(time.perf_counter() - t)
    return {k: (median_ms(a), median_ms(b)) for k, (a, b) in samples.items()}


async def main() -> None:
    daemon = DaemonProcess(provider="docker").start()
    try:
        os.environ.update(E2B_API_URL=daemon.url, E2B_SANDBOX_URL=daemon.url,
                          E2B_API_KEY=e2b_key(daemon.token))
        from e2b import Sandbox

        e2b_sandbox = Sandbox.create()
        with hutch.Client(daemon.url, token=daemon.token) as client:
            sb = client.create_sandbox("docker", read_before_write=False)

            def e2b_write_read() -> None:
                e2b_sandbox.files.write("/tmp/bench-e2b.bin", PAYLOAD)
                assert len(e2b_sandbox.files.read("/tmp/bench-e2b.bin", format="bytes")) \
                    == len(PAYLOAD)

            def hutch_write_read() -> None:
                sb.write_bytes("/tmp/bench-hutch.bin", PAYLOAD, overwrite=True)
                assert len(sb.read_bytes("/tmp/bench-hutch.bin")) == len(PAYLOAD)

            results = alternate({
                "run": (lambda: e2b_sandbox.commands.run("true"), lambda: sb.exec(["true"])),
                # What commands.run starts: a login shell (its profile read) running the command.
                "login": (lambda: e2b_sandbox.commands.run("true"),
                          lambda: sb.exec(["/bin/bash", "-l", "-c", "true"])),
                "files": (e2b_write_read, hutch_write_read),
            }, RUNS)
            header("the E2B wire (e2b Python SDK) vs hutch's own SDK, docker, one daemon")
            row('commands.run("true") vs exec(["true"])', *results["run"], "goal: 1.5x at most")
            row('  the same, vs exec(["bash", "-l", "-c", "true"])', *results["login"])
            row("1 MiB write + read back", *results["files"], "goal: 1.5x at most")
            sb.close()
        e2b_sandbox.kill()
    finally:
        daemon.close()


if __name__ == "__main__":
    run(main)
