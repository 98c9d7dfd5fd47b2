"""Bench: the daemon beside in-process hutch and the raw floor.

Exec round trip of ``true`` on the local provider, four ways measured in turn
within one loop (so a machine whose speed drifts moves them all alike): a bare
``subprocess.run`` (the floor), in-process hutch, through the daemon with the
sync SDK, and through the daemon with a bare keep-alive HTTP/1.1 client (what
the daemon itself adds, without the SDK's HTTP client).

Status GETs per second: wrk (2 threads, 32 connections) against one
sandbox's status, beside the same daemon's /healthz (a FastAPI route) and a
bare ASGI app on the same uvicorn settings (the server's floor). wrk shares
the machine's cores with the server it loads.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess, free_port

import hutch
from _common import header, median_ms, row, run, scratch_dir, turn

RUNS = 300
WARMUP = 20
LOAD_SECONDS = 4
LOAD_ROUNDS = 2

#: A trivial ASGI app on the daemon's own uvicorn settings: the server's floor.
BARE_SERVER = """
import sys, uvicorn
BODY = b'{"status":"ok"}'
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"15")]})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", loop="asyncio",
            lifespan="off", log_level="warning", access_log=False)
"""


def raw_exec(port: int, token: str, sandbox_id: str) -> Callable[[], object]:
    """An exec over one kept connection with the standard library's HTTP client."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"cmd": ["true"]})
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def call() -> object:
        try:
            connection.request("POST", f"/v1/sandboxes/{sandbox_id}/exec", body, headers)
            answer = connection.getresponse()
        except ConnectionError:
            # The daemon closed the kept connection, idle past its keep-alive
            # (uvicorn's 5 s; a lockstep twin's turn can last that long): again,
            # on a new one.
            connection.close()
            connection.request("POST", f"/v1/sandboxes/{sandbox_id}/exec", body, headers)
            answer = connection.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(data)
        return data

    return call


def requests_per_second(url: str, token: str) -> float:
    """wrk (a separate C process, 2 threads, 32 connections) against one URL."""
    out = subprocess.run(
        ["wrk", "-t2", "-c32", f"-d{LOAD_SECONDS}s", "-H", f"Authorization: Bearer {token}", url],
        capture_output=True, text=True, check=True,
    ).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None:
        raise RuntimeError(f"no figure in wrk's output:\n{out}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non_2xx:
        raise RuntimeError(f"{non_2xx.group(1)} requests failed:\n{out}")
    return float(match.group(1))


def wait_for(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing answered on port {port}")


async def exec_round_trips(daemon: DaemonProcess, workdir: str) -> str:
    header("exec round trip, local provider (floor: subprocess.run)")
    with hutch.Client(daemon.url, token=daemon.token) as client:
        remote = client.create_sandbox("local", workdir=workdir)
        raw = raw_exec(daemon.port, daemon.token, remote.id)
        async with await hutch.create_sandbox("local", workdir=workdir) as sb:
            samples: dict[str, list[float]] = {"floor": [], "in": [], "sdk": [], "raw": []}
            for i in range(RUNS + WARMUP):
                turn()
                t0 = time.perf_counter()
                subprocess.run(["true"], check=True)
                t1 = time.perf_counter()
                await sb.exec(["true"])
                t2 = time.perf_counter()
                remote.exec(["true"])
                t3 = time.perf_counter()
                raw()
                t4 = time.perf_counter()
                if i >= WARMUP:
                    for key, took in (("floor", t1 - t0), ("in", t2 - t1), ("sdk", t3 - t2),
                                      ("raw", t4 - t3)):
                        samples[key].append(took)
        floor, in_process, sdk, bare = (
            median_ms(samples[k]) for k in ("floor", "in", "sdk", "raw")
        )
        row("in-process exec", in_process, floor)
        row("exec through the daemon (bare HTTP client)", bare, floor)
        row("exec through the daemon (sync SDK)", sdk, floor)
        row("  daemon's own cost (bare client vs in-proc)", bare, in_process,
            "goal: +3 ms at most")
        row("  with the SDK (vs in-process)", sdk, in_process, "goal: +3 ms at most")
        return remote.id


def throughput(daemon: DaemonProcess, sandbox_id: str) -> None:
    print("\n== requests per second (wrk, 2 threads, 32 connections, 2 cores shared)")
    port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(port)])
    try:
        bare_url = f"http://127.0.0.1:{port}/"
        wait_for(port)
        targets = {
            "GET /v1/sandboxes/{id}": f"{daemon.url}/v1/sandboxes/{sandbox_id}",
            "GET /healthz (a FastAPI route)": f"{daemon.url}/healthz",
            "bare ASGI app, same uvicorn": bare_url,
        }
        best = dict.fromkeys(targets, 0.0)
        for _ in range(LOAD_ROUNDS):  # in turn, keeping each one's best round
            for name, url in targets.items():
                best[name] = max(best[name], requests_per_second(url, daemon.token))
    finally:
        bare.terminate()
        bare.wait(10)
    floor = best["bare ASGI app, same uvicorn"]
    print(f"{'measure':<44} {'req/s':>11} {'floor':>11} {'ratio':>7}")
    for name, rate in best.items():
        goal = "goal >= 3000/s" if name.startswith("GET /v1") else ""
        print(f"{name:<44} {rate:>9.0f}/s {floor:>9.0f}/s {rate / floor:>6.2f}x  {goal}")


async def main() -> None:
    workdir = scratch_dir("hutch-bench-", "/dev/shm")
    daemon = DaemonProcess().start()
    try:
        sandbox_id = await exec_round_trips(daemon, workdir)
        throughput(daemon, sandbox_id)
    finally:
        daemon.close()


if __name__ == "__main__":
    run(main)
