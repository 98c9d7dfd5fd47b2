"""Bench: the daemon's memory while callers print more than it could hold.

20 callers at once, each an exec printing 250 MB (``output_limit`` 256 MiB)
through a real daemon, on a bubblewrap and a docker sandbox (native
runtime). Every caller must be answered with its output, intact (the hash of
the whole answer, read as it comes), or ``output_limit_exceeded``. Reported:

* the daemon's peak resident memory above where it was (the kernel's
  high-water mark, reset first), beside the same 20 callers printing 1 KB
  each (the floor: what 20 calls at once cost anyway); goal <= 128 MiB;
* what it keeps once they are answered (resident memory a few seconds later
  above where it was): memory given back, or kept by the allocator;
* the time for all 20, beside the same 20 commands run on the host at once,
  their output read through pipes and hashed (the floor: moving 5 GB).

``HUTCH_BENCH_CALLERS`` and ``HUTCH_BENCH_OUTPUT_MB`` change the load (20, 250).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

from _common import run

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
CALLERS = int(os.environ.get("HUTCH_BENCH_CALLERS", "20"))
OUTPUT_BYTES = int(os.environ.get("HUTCH_BENCH_OUTPUT_MB", "250")) * 1_000_000
OUTPUT_LIMIT = 256 * 1024 * 1024
GOAL_MIB = 128
#: Where they run: provider, runtime.
PLACES = [("bubblewrap", "native"), ("docker", "native")]
#: Seconds the daemon is given after the burst before what it keeps is read.
SETTLE_SECONDS = 3


def printer(caller: int, size: int) -> str:
    """A command printing ``size`` bytes of text that JSON keeps as is (no
    escapes), different for each caller. Python rather than ``yes | head``:
    no writer killed by a closed pipe, no word on stderr."""
    return (
        "python3 -c 'import sys; w = sys.stdout.buffer.write; "
        f"b = b\"caller-{caller}-hutch \" * 65536; n = {size}\n"
        "while n > 0: w(b[:n]); n -= len(b)'"
    )


def expected_digest(caller: int, size: int) -> str:
    """The hash of the whole exec answer the daemon owes ``caller``."""
    block = f"caller-{caller}-hutch ".encode() * 65536
    h = hashlib.sha256(b'{"exit_code":0,"stdout":"')
    left = size
    while left > 0:
        h.update(block[:left])
        left -= len(block)
    h.update(b'","stderr":""}')
    return h.hexdigest()


def status_of(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class Burst:
    """``CALLERS`` execs at once through the daemon, each read as it comes."""

    def __init__(self, daemon: DaemonProcess, sandbox_id: str, size: int) -> None:
        self.daemon = daemon
        self.sandbox_id = sandbox_id
        self.size = size
        self.digests = [expected_digest(i, size) for i in range(CALLERS)]
        self.outcomes: dict[int, str] = {}

    def call(self, caller: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.daemon.port, timeout=900)
        try:
            body = json.dumps({"cmd": printer(caller, self.size), "output_limit": OUTPUT_LIMIT})
            connection.request(
                "POST", f"/v1/sandboxes/{self.sandbox_id}/exec", body,
                {"Authorization": f"Bearer {self.daemon.token}",
                 "Content-Type": "application/json"},
            )
            answer = connection.getresponse()
            h = hashlib.sha256()
            head = b""
            while piece := answer.read(1 << 20):
                h.update(piece)
                head = head or piece[:300]
            if answer.status == 200 and h.hexdigest() == self.digests[caller]:
                self.outcomes[caller] = "output"
            elif answer.status == 413 and b"output_limit_exceeded" in head:
                self.outcomes[caller] = "output_limit_exceeded"
            else:
                self.outcomes[caller] = f"WRONG: {answer.status} {head[:200]!r}"
        except Exception as exc:
            self.outcomes[caller] = f"FAILED: {type(exc).__name__}: {exc}"
        finally:
            connection.close()

    def run(self) -> float:
        threads = [threading.Thread(target=self.call, args=(i,)) for i in range(CALLERS)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started


def growth(daemon: DaemonProcess, burst: Callable[[], float]) -> tuple[int, int, float]:
    """(peak growth, kept growth, seconds) of the daemon's resident memory."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # the high-water mark starts again from here
    before = status_of(pid, "VmRSS")
    took = burst()
    peak = status_of(pid, "VmHWM") - before
    time.sleep(SETTLE_SECONDS)
    return peak, status_of(pid, "VmRSS") - before, took


def host_floor(size: int) -> float:
    """The same commands on the host at once, their output read and hashed."""

    def drain(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        h = hashlib.sha256()
        while piece := proc.stdout.read(1 << 20):
            h.update(piece)
        proc.wait()

    started = time.perf_counter()
    procs = [subprocess.Popen(["sh", "-c", printer(i, size)], stdout=subprocess.PIPE)
             for i in range(CALLERS)]
    threads = [threading.Thread(target=drain, args=(p,)) for p in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def create(daemon: DaemonProcess, provider: str, runtime: str) -> str:
    import hutch

    with hutch.Client(daemon.url, token=daemon.token) as client:
        settings: dict[str, object] = {"image": IMAGE, "runtime": runtime,
                                       "read_before_write": False}
        if provider == "bubblewrap":
            settings["ephemeral"] = True
        return str(client.create_sandbox(provider, **settings).id)


def delete(daemon: DaemonProcess, sandbox_id: str) -> None:
    import hutch

    with hutch.Client(daemon.url, token=daemon.token) as client:
        client.delete_sandbox(sandbox_id)


def report(place: str, daemon: DaemonProcess, sandbox_id: str, floor_seconds: float) -> bool:
    small = Burst(daemon, sandbox_id, 1000)
    small_peak, _, _ = growth(daemon, small.run)
    big = Burst(daemon, sandbox_id, OUTPUT_BYTES)
    peak, kept, took = growth(daemon, big.run)
    mib = 1 << 20
    answered = sorted(set(big.outcomes.values()) | set(small.outcomes.values()))
    ok = all(not a.startswith(("WRONG", "FAILED")) for a in answered)
    ok = ok and len(big.outcomes) == CALLERS and len(small.outcomes) == CALLERS
    print(f"\n== {place}: {CALLERS} callers at once, {OUTPUT_BYTES // 1_000_000} MB of "
          "output each")
    print(f"{'measure':<44} {'hutch':>11} {'floor':>11} {'ratio':>7}")
    print(f"{'daemon RSS growth, peak':<44} {peak / mib:>7.1f}MiB {small_peak / mib:>7.1f}MiB "
          f"{peak / max(small_peak, mib):>6.2f}x  goal <= {GOAL_MIB} MiB "
          f"({'met' if peak <= GOAL_MIB * mib else 'MISSED'})")
    print(f"{f'daemon RSS kept after {SETTLE_SECONDS} s':<44} {kept / mib:>7.1f}MiB")
    print(f"{'time for all (floor: host pipes, hashed)':<44} {took:>9.2f}s {floor_seconds:>9.2f}s "
          f"{took / floor_seconds:>6.2f}x  "
          f"{CALLERS * OUTPUT_BYTES / took / 1e6:.0f} MB/s through the daemon")
    counts = {a: list(big.outcomes.values()).count(a) for a in set(big.outcomes.values())}
    print(f"answers: {counts}" + ("" if ok else f"  FAILED: {big.outcomes}"))
    return ok


async def main() -> None:
    floor_seconds = host_floor(OUTPUT_BYTES)
    daemon = DaemonProcess(token=f"tok-{uuid.uuid4().hex}").start()
    failed = False
    try:
        for provider, runtime in PLACES:
            sandbox_id = create(daemon, provider, runtime)
            try:
                failed |= not report(f"{provider} ({runtime})", daemon, sandbox_id,
                                     floor_seconds)
            finally:
                delete(daemon, sandbox_id)
        alive = daemon.proc is not None and daemon.proc.poll() is None
        print(f"\ndaemon alive and serving after: {alive}")
        failed |= not alive
    finally:
        daemon.close()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    run(main)
