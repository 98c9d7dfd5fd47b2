"""Bench: the kubernetes provider against the API stand-in (tests/kube_standin.py).

One run, three measures, each beside its floor, measured in turn:

- ``exec(["true"])`` through hutch's agent, over the one kept ``pods/exec``
  (the relay), beside a fresh ``pods/exec`` of ``true`` per call: the bare
  channel protocol (a WebSocket, ``v5.channel.k8s.io``, no prologue), the
  least a command costs without a kept connection. Below 1x is the point.
- The same ``exec`` with ``runtime = "native"`` (a ``pods/exec`` per command,
  its prologue setting the directory and environment) beside that floor.
- Suspend + resume + first exec where the provider can suspend (the pod
  deleted, its volume kept; the next pod made on it): beside a pod made,
  ready and exec'd through the API by hand. Where it cannot yet, the row
  is a new sandbox to its first exec (pod, agent copied in, relay) beside
  that floor, and the bench says so.

The stand-in's pods are local docker containers and its exec is ``docker
exec``: the figures are the API's protocol and hutch's work on top of a
local engine, not a cluster's network or scheduler.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.kube_standin import KubeStandin

import hutch
from _common import header, median_ms, row, run
from hutch.providers.kubernetes.api import Cluster
from hutch.providers.kubernetes.config import KubernetesConfig
from hutch.providers.kubernetes.execws import ExecSession

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
RUNS = 40
BLOCKS = 4
LIFECYCLE_RUNS = 5


async def main() -> None:
    standin = KubeStandin().start()
    fd, kubeconfig = tempfile.mkstemp(prefix="hutch-bench-kubeconfig-")
    os.close(fd)
    standin.write_kubeconfig(kubeconfig)
    settings = {"kubeconfig": kubeconfig, "image": IMAGE, "read_before_write": False}
    try:
        agent_sb = await hutch.create_sandbox("kubernetes", runtime="agent", **settings)
        native_sb = await hutch.create_sandbox("kubernetes", runtime="native", **settings)
        cluster = Cluster(KubernetesConfig(kubeconfig=kubeconfig))
        pod = next(p["metadata"]["name"] for p in standin.objects["pods"].values()
                   if p["metadata"]["labels"]["hutch.dev/sandbox"] == agent_sb.id.lower())

        async def fresh_exec() -> None:
            session = await ExecSession.open(cluster.http, cluster.pod_path(pod), ["true"],
                                             stdin=None, keep_stdin=False, kill=None)
            while await session.read() is not None:
                pass
            assert await session.wait() == 0

        samples: dict[str, list[float]] = {"agent": [], "native": [], "fresh": []}
        # In blocks, taking turns: a fresh exec's teardown (a docker exec
        # ending) spills into the call after it, which a light call would
        # pay for if they alternated one by one.
        for _block in range(BLOCKS):
            for name, call in (("fresh", fresh_exec),
                               ("agent", lambda: agent_sb.exec(["true"])),
                               ("native", lambda: native_sb.exec(["true"]))):
                for i in range(2 + RUNS // BLOCKS):
                    t = time.perf_counter()
                    await call()
                    if i >= 2:
                        samples[name].append(time.perf_counter() - t)
        fresh = median_ms(samples["fresh"])
        header("kubernetes (API stand-in, pods as local docker containers)")
        row('exec(["true"]), agent over the kept exec', median_ms(samples["agent"]), fresh,
            "floor: a fresh pods/exec of true")
        row('exec(["true"]), runtime=native', median_ms(samples["native"]), fresh,
            "a pods/exec per command, its prologue")
        relays = sum(c[1:2] == ["relay"] for c in standin.execs)
        print(f"  (pods/exec relays opened for the agent sandbox: {relays}, "
              f"for {BLOCKS * (2 + RUNS // BLOCKS)} execs)")

        async def pod_by_hand() -> None:
            """The floor: a pod made through the API, ready, and one exec."""
            name = f"bench-floor-{os.urandom(4).hex()}"
            made = await cluster.http.post(
                f"/api/v1/namespaces/{standin.namespace}/pods",
                json={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                      "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                               "containers": [{"name": "sandbox", "image": IMAGE,
                                               "command": ["sleep", "infinity"]}]}})
            assert made.status_code == 201, made.text
            while True:
                got = (await cluster.http.get(cluster.pod_path(name))).json()
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in got["status"].get("conditions", [])):
                    break
                await asyncio.sleep(0.2)  # the provider's own poll
            session = await ExecSession.open(cluster.http, cluster.pod_path(name), ["true"],
                                             stdin=None, keep_stdin=False, kill=None)
            while await session.read() is not None:
                pass
            await session.wait()
            await cluster.delete_pod(name, None)

        if agent_sb.capabilities.suspend:
            async def cycle() -> None:
                await agent_sb.suspend()
                await agent_sb.resume()
                await agent_sb.exec(["true"])

            ours = await _timed(cycle, LIFECYCLE_RUNS)
            floor_ms = await _timed(pod_by_hand, LIFECYCLE_RUNS)
            row("suspend + resume + first exec", ours, floor_ms,
                "floor: a pod made, ready, one exec")
        else:
            async def create_first_exec() -> None:
                sb = await hutch.create_sandbox("kubernetes", runtime="agent", **settings)
                await sb.exec(["true"])
                await sb.close()

            ours = await _timed(create_first_exec, LIFECYCLE_RUNS)
            floor_ms = await _timed(pod_by_hand, LIFECYCLE_RUNS)
            row("create + first exec (agent)", ours, floor_ms,
                "floor: a pod made, ready, one exec")
            print("  suspend is not offered by the kubernetes provider yet: the row above "
                  "is a new sandbox to its first exec instead")
        await agent_sb.close()
        await native_sb.close()
        await cluster.close()
    finally:
        standin.stop()
        os.unlink(kubeconfig)


async def _timed(fn: Callable[[], Awaitable[object]], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    return median_ms(samples)


if __name__ == "__main__":
    run(main)
