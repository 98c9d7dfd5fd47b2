"""Bench: the TypeScript SDK beside the Python SDK, in one run.

One daemon, one ``local`` sandbox; the Python sync client and the TypeScript
SDK (one node process, bench/tssdk_driver.mjs) take turns, batch by batch,
the first of each round changing (ABBA), so a machine whose speed drifts, or
a load that favours whichever goes second, moves both alike: ``exec(["true"])``, and a
1 MiB ``write_bytes`` + ``read_bytes``. The ratio is TypeScript over Python
(goal: 1.2x at most); the client's own CPU time per call (its process's,
not the daemon's) is printed beside, a figure a loaded machine moves less.
The SDK is built first (scripts/build-ts-sdk.sh).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SDK_ENTRY = os.path.join(ROOT, "clients", "typescript", "dist", "index.js")
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tssdk_driver.mjs")
ROUNDS = 40
#: Per round and SDK: (batch, how many in it).
BATCHES = {"exec": 10, "file": 3}
WARMUP_ROUNDS = 4
MIB = 1024 * 1024


class NodeSide:
    """The driver: asked for a batch on stdin, it answers its samples (ms)."""

    def __init__(self, daemon: DaemonProcess, sandbox_id: str) -> None:
        env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
        self.proc = subprocess.Popen(["node", DRIVER, SDK_ENTRY, sandbox_id], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def batch(self, name: str, count: int) -> tuple[list[float], float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{name} {count}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the node driver ended (exit {self.proc.wait(10)})")
        answer = json.loads(line)
        return [ms / 1000 for ms in answer["samples"]], answer["cpu"] / 1000

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def python_batch(operation: Callable[[], object], count: int) -> tuple[list[float], float]:
    samples = []
    cpu = cpu_seconds()
    for _ in range(count):
        start = time.perf_counter()
        operation()
        samples.append(time.perf_counter() - start)
    return samples, cpu_seconds() - cpu


async def main() -> None:
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "build-ts-sdk.sh")], check=True)
    daemon = DaemonProcess().start()
    data = bytes(i * 7919 % 251 for i in range(MIB))
    try:
        with hutch.Client(daemon.url, token=daemon.token) as client:
            sandbox = client.create_sandbox("local")

            def file_round_trip() -> None:
                sandbox.write_bytes("bench-py.bin", data, overwrite=True)
                if len(sandbox.read_bytes("bench-py.bin")) != MIB:
                    raise RuntimeError("the file came back short")

            python_ops: dict[str, Callable[[], object]] = {
                "exec": lambda: sandbox.exec(["true"]), "file": file_round_trip,
            }
            node = NodeSide(daemon, sandbox.id)
            samples: dict[str, dict[str, list[float]]] = {
                name: {"py": [], "ts": []} for name in BATCHES
            }
            cpu: dict[str, dict[str, float]] = {name: {"py": 0.0, "ts": 0.0} for name in BATCHES}
            try:
                for round_ in range(WARMUP_ROUNDS + ROUNDS):
                    for name, count in BATCHES.items():
                        if round_ % 2:
                            py = python_batch(python_ops[name], count)
                            ts = node.batch(name, count)
                        else:
                            ts = node.batch(name, count)
                            py = python_batch(python_ops[name], count)
                        if round_ >= WARMUP_ROUNDS:
                            for side, (taken, spent) in (("ts", ts), ("py", py)):
                                samples[name][side] += taken
                                cpu[name][side] += spent
            finally:
                node.close()
            sandbox.close()
    finally:
        daemon.close()
    header("TypeScript SDK (node) beside the Python SDK (sync), one daemon, local")
    for name, title in (("exec", 'exec(["true"])'), ("file", "1 MiB writeBytes + readBytes")):
        row(f"{title} (floor: Python SDK)", median_ms(samples[name]["ts"]),
            median_ms(samples[name]["py"]), "goal: 1.20x at most")
    for name, title in (("exec", 'exec(["true"])'), ("file", "1 MiB write + read")):
        calls = len(samples[name]["ts"])
        row(f"  client CPU per {title}", cpu[name]["ts"] / calls * 1000,
            cpu[name]["py"] / calls * 1000)


if __name__ == "__main__":
    run(main)
