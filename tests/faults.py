"""The fault harness's parts (tests/test_faults.py): the fault points the
source names, which provider each is killed on this run, what a provider's
runtime really is (asked of the runtime, not of hutch), and the table of
kills survived that the run prints at its end.

A fault point is a literal name at a call of :func:`hutch._faults.fault_point`
(or a ``fault="..."`` argument that reaches one): ``<step>.<where>``, or
``<step>.<provider>.<where>`` for a point inside one provider. Every point
the source names is killed at least once a run; a step on no one provider is
killed on one of the providers it applies to, chosen afresh each run (the
same in every xdist worker), or on all of them with ``HUTCH_FAULTS_ALL=1``.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src" / "hutch"
#: A point's name where the source gives it.
_POINT = re.compile(r'(?:\bfault_point\(|\bfault=|\bfault: str = )"([a-z0-9-]+(?:\.[a-z0-9-]+)+)"')
PROVIDERS = ("docker", "bubblewrap", "gvisor", "local", "kubernetes")
#: The providers each step applies to (the steps the harness knows how to drive).
STEPS: dict[str, tuple[str, ...]] = {
    "pause": ("docker", "bubblewrap", "gvisor"),
    "suspend": ("docker", "bubblewrap", "gvisor", "kubernetes"),
    "resume": ("docker", "bubblewrap", "gvisor", "kubernetes"),
    "snapshot": ("docker", "bubblewrap", "gvisor", "local", "kubernetes"),
    "fork": ("docker", "bubblewrap", "local", "kubernetes"),
    "workspace-suspend": ("docker", "bubblewrap", "local", "kubernetes"),
    "workspace-resume": ("docker", "bubblewrap", "local", "kubernetes"),
    "definition-ensure": ("docker", "bubblewrap", "local", "kubernetes"),
    "delete": ("docker", "bubblewrap", "local", "kubernetes"),
    # Runs in the program that builds (the CLI), on the host and its Engine.
    "image-build": ("host",),
}
#: Points of a step that only some of its providers reach (a resume from a pause).
POINTS: dict[str, tuple[str, ...]] = {"resume.unpaused": STEPS["pause"]}


@dataclass(frozen=True)
class FaultCase:
    point: str
    provider: str

    @property
    def step(self) -> str:
        return self.point.split(".")[0]

    @property
    def id(self) -> str:
        return f"{self.point}@{self.provider}"


def fault_points() -> list[str]:
    """Every fault point the source names, sorted."""
    found: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        found.update(_POINT.findall(path.read_text(encoding="utf-8")))
    return sorted(found)


def run_seed() -> str:
    """This run's seed: the same in every xdist worker of one run (their
    collections must agree), another the next run."""
    return (os.environ.get("HUTCH_FAULT_SEED") or os.environ.get("PYTEST_XDIST_TESTRUNUID")
            or str(int(time.time()) // 600))


def plan() -> list[FaultCase]:
    """The kills of this run: each point once, on its own provider or on
    one chosen of those its step applies to (all of them with HUTCH_FAULTS_ALL)."""
    rng = random.Random(run_seed())
    every = os.environ.get("HUTCH_FAULTS_ALL") == "1"
    cases = []
    for point in fault_points():
        parts = point.split(".")
        step = parts[0]
        if step not in STEPS:
            raise AssertionError(f"fault point {point}: the harness does not drive step {step!r}; "
                                 "teach tests/test_faults.py how to (and add it to STEPS)")
        if len(parts) > 2 and parts[1] in PROVIDERS:
            providers: tuple[str, ...] = (parts[1],)
        else:
            providers = POINTS.get(point, STEPS[step])
        chosen = providers if every else (rng.choice(providers),)
        cases.extend(FaultCase(point, p) for p in chosen)
    return cases


# -- what the runtime really is ----------------------------------------------------------


def docker_state(sandbox_id: str) -> str:
    """``running``, ``paused``, ``suspended`` (no container, its suspend image
    kept) or ``gone``, as the Docker Engine has it."""
    import docker

    api = docker.APIClient()
    containers = api.containers(all=True, filters={"label": f"hutch.sandbox_id={sandbox_id}"})
    if containers:
        state = containers[0]["State"]
        return {"running": "running", "paused": "paused"}.get(state, "gone")
    images = api.images(name="hutch-suspended", filters={"label": f"hutch.sandbox_id={sandbox_id}"})
    return "suspended" if images else "gone"


def bubblewrap_state(sandbox_id: str, data_dir: str) -> str:
    """The same for a bubblewrap sandbox: its cgroup frozen, holding
    processes, or empty with its upper layer saved on disk."""
    from hutch.providers.bubblewrap.cgroups import SandboxCgroup

    cgroup = SandboxCgroup(sandbox_id)
    if cgroup.pids():
        return "paused" if cgroup.frozen() else "running"
    upper = Path(data_dir) / "bubblewrap" / "sandboxes" / sandbox_id / "upper"
    return "suspended" if upper.is_dir() else "gone"


def gvisor_state(sandbox_id: str, data_dir: str) -> str:
    """The same for a gvisor sandbox, as runsc has it (under the daemon's
    state root): running or paused, else suspended where its checkpoint
    (the image runsc wrote) is in its place."""
    import json
    import subprocess

    from hutch.providers.gvisor.runsc import runsc_binary

    home = Path(data_dir) / "gvisor"
    # Each restore runs under a new container id, recorded in the sandbox's directory.
    record = home / "sandboxes" / sandbox_id / "container"
    container = record.read_text().strip() if record.is_file() else sandbox_id
    found = subprocess.run([runsc_binary(), "--root", str(home / "state"), "state", container],
                           capture_output=True, text=True, timeout=30, check=False)
    status = json.loads(found.stdout).get("status") if found.returncode == 0 else None
    if status in ("running", "paused"):
        return str(status)
    image = home / "sandboxes" / sandbox_id / "checkpoint" / "checkpoint.img"
    return "suspended" if image.is_file() else "gone"


def kubernetes_state(sandbox_id: str) -> str:
    """The same for a kubernetes sandbox, as the API stand-in has it: its
    pod running, else suspended where its claim is kept."""
    from tests.kube_standin import shared

    def of_sandbox(kind: str) -> list[dict[str, Any]]:
        return [o for o in list(shared().objects[kind].values())
                if o["metadata"].get("labels", {}).get("hutch.dev/sandbox") == sandbox_id.lower()]

    pods = of_sandbox("pods")
    if pods:
        return "running" if pods[0].get("status", {}).get("phase") == "Running" else "gone"
    return "suspended" if of_sandbox("persistentvolumeclaims") else "gone"


def real_state(provider: str, sandbox_id: str, data_dir: str) -> str | None:
    """What the runtime is, or None where the provider has no such states."""
    if provider == "kubernetes":
        return kubernetes_state(sandbox_id)
    if provider == "docker":
        return docker_state(sandbox_id)
    if provider == "bubblewrap":
        return bubblewrap_state(sandbox_id, data_dir)
    if provider == "gvisor":
        return gvisor_state(sandbox_id, data_dir)
    return None


# -- the table ---------------------------------------------------------------------------

#: The user property a fault test records its outcome under.
PROPERTY = "fault_kill"


def record(request: pytest.FixtureRequest, case: FaultCase, survived: bool) -> None:
    request.node.user_properties.append((PROPERTY, (case.point, case.provider, survived)))


def outcomes(reports: Iterator[Any]) -> dict[tuple[str, str], list[int]]:
    """(point, provider) -> [kills, survived], from the run's test reports."""
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for report in reports:
        if getattr(report, "when", None) != "call":
            continue
        for key, value in getattr(report, "user_properties", ()):
            if key == PROPERTY:
                point, provider, survived = value
                row = table[(point, provider)]
                row[0] += 1
                # A kill counts as survived only if every check after it passed.
                row[1] += int(bool(survived) and report.passed)
    return table


def summary(terminalreporter: Any) -> None:
    """Print the kills each step survived, per provider (pytest's terminal summary)."""
    reports = (r for rs in terminalreporter.stats.values() for r in rs)
    table = outcomes(iter(reports))
    if not table:
        return
    terminalreporter.section("faults: daemon kills survived, per step and provider")
    width = max(len(p) for p, _ in table) + 2
    terminalreporter.write_line(f"{'step (fault point)':<{width}}{'provider':<12}survived/kills")
    for (point, provider), (kills, survived) in sorted(table.items()):
        mark = "" if survived == kills else "   <-- lost or stuck"
        terminalreporter.write_line(f"{point:<{width}}{provider:<12}{survived}/{kills}{mark}")
    terminalreporter.write_line(f"(seed {run_seed()}; HUTCH_FAULTS_ALL=1 kills every "
                                "step on every provider it applies to)")
