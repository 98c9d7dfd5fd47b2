"""The hostile suite, kernel part: root inside every isolating provider's
sandbox (docker and bubblewrap, on each runtime, gvisor, kubernetes) goes at
the host's kernel and is refused each time, and the host is as it was.

What is tried (``tests/hostile_probe.py`` and ``.pl``, run inside as root): every file
under /proc/sys and /sys with a write bit, written with its own current value
(so a failure changes nothing), the six settings issue 19 names among them;
the SysRq trigger (opened only, never written); mknod of a character and a
block device; mount (tmpfs, proc, a bind of /, the new mount API); ptrace of
a host process; module loading and unloading, kexec; keyctl, add_key,
request_key; bpf; perf_event_open; userfaultfd; new user and mount
namespaces. The host's kernel settings are read before and after and must be
the same; the host process must not be traced.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

import hutch
from tests import isolating
from tests.isolating import kube_standin  # noqa: F401  (a fixture)

pytestmark = pytest.mark.docker

HERE = os.path.dirname(__file__)
#: Host settings that change on their own (the kernel lowers the perf sample
#: rate under load; the last PID moves with every process the host starts).
_VOLATILE = {"kernel/ns_last_pid", "kernel/perf_event_max_sample_rate"}


def host_settings() -> dict[str, bytes]:
    """The host's writable kernel settings but the network's (each sandbox
    tried has a network namespace of its own; other work on this host adds
    and removes interfaces meanwhile)."""
    values: dict[str, bytes] = {}
    for dirpath, dirs, files in os.walk("/proc/sys"):
        if dirpath == "/proc/sys":
            dirs[:] = [d for d in dirs if d != "net"]
        for name in files:
            path = os.path.join(dirpath, name)
            key = path[len("/proc/sys/"):]
            if key in _VOLATILE:
                continue
            try:
                if not os.stat(path).st_mode & 0o200 or not os.stat(path).st_mode & 0o400:
                    continue
                with open(path, "rb") as fh:
                    values[key] = fh.read()
            except OSError:
                continue
    return values


def _restore(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    """Put back what a sandbox let through changed (the test fails anyway):
    a write of a setting's own value can still change another one."""
    for key in before.keys() & after.keys():
        if before[key] != after[key]:
            with open(f"/proc/sys/{key}", "wb") as fh:
                fh.write(before[key])


async def _probe(settings: dict[str, Any], host_pid: int) -> dict[str, Any]:
    async with await hutch.create_sandbox(**settings, read_before_write=False) as sb:
        for name in ("hostile_probe.py", "hostile_probe.pl"):
            with open(os.path.join(HERE, name), "rb") as fh:
                await sb.write_bytes(f"/tmp/{name}", fh.read())
        files = await sb.exec(["python3", "/tmp/hostile_probe.py"], timeout=300)
        calls = await sb.exec(["perl", "/tmp/hostile_probe.pl", str(host_pid)], timeout=60)
    assert (files.exit_code, calls.exit_code) == (0, 0), (files, calls)
    return _parse(files.stdout + calls.stdout)


def _parse(said: str) -> dict[str, Any]:
    """The probes' lines, by kind: a dict of answers, or a list of paths."""
    answers: dict[str, Any] = {"knob-accepted": [], "named": {}, "mknod": {}, "mount": {},
                               "call": {}}
    for line in said.splitlines():
        kind, *rest = line.split("\t")
        if kind == "knob-accepted":
            answers[kind].append(rest[0])
        elif len(rest) == 2:
            answers[kind][rest[0]] = rest[1]
        else:
            answers[kind] = rest[0]
    return answers


@pytest.fixture(scope="module", params=isolating.params())
def attempt(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """One sandbox of a kind, probed once: what it answered, and the host's
    state around it."""
    kind = request.param
    standin = request.getfixturevalue("kube_standin") if kind == "kubernetes" else None
    settings = isolating.settings(kind, standin)
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        before = host_settings()
        try:
            answers = asyncio.run(_probe(settings, bystander.pid))
        finally:
            after = host_settings()
            _restore(before, after)
        with open(f"/proc/{bystander.pid}/status") as fh:
            tracer = next(line for line in fh if line.startswith("TracerPid:"))
        yield {"answers": answers, "before": before, "after": after,
               "tracer": tracer.split()[1], "bystander_alive": bystander.poll() is None}
    finally:
        bystander.kill()
        bystander.wait()


#: The kinds whose sandboxes run on the host's kernel. A gvisor sandbox's
#: kernel is gVisor's own (the Sentry, in user space): its /proc/sys, its
#: namespaces are that kernel's, and a write or an unshare there reaches the
#: sandbox's kernel only, never the host's. What gvisor lets through is
#: judged by the host's state around it (its settings, devices, processes).
HOST_KERNEL = [k for k in isolating.KINDS if k != "gvisor"]
#: Calls whose refusal is a rule of the host's kernel surface only.
HOST_KERNEL_CALLS = {"unshare user namespace", "unshare mount namespace"}
CALLS = [
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "unshare user namespace", "unshare mount namespace",
]


@pytest.mark.parametrize("attempt", isolating.params(*HOST_KERNEL), indirect=True)
def test_no_kernel_setting_takes_a_write(attempt: dict[str, Any]) -> None:
    answers = attempt["answers"]
    assert int(answers["knobs-tried"]) > 100, answers  # /proc/sys was walked
    assert answers["knob-accepted"] == []
    assert set(answers["named"].values()) == {"refused"}, answers["named"]
    assert answers["sysrq"] != "accepted"


def test_the_hosts_kernel_settings_are_unchanged(attempt: dict[str, Any]) -> None:
    before, after = attempt["before"], attempt["after"]
    changed = {k: (before[k], after[k]) for k in before.keys() & after.keys()
               if before[k] != after[k]}
    assert changed == {}
    assert len(before) > 100


#: A node made in a gvisor sandbox names a device of gVisor's own kernel,
#: which backs only its own (null, zero, random...): a host device's numbers
#: open nothing (ENXIO), so making one gives nothing of the host's. The host
#: kernel's rule (no CAP_MKNOD, as docker) is the other kinds'.
@pytest.mark.parametrize("attempt", isolating.params(*HOST_KERNEL), indirect=True)
def test_no_device_node_is_made(attempt: dict[str, Any]) -> None:
    assert "accepted" not in attempt["answers"]["mknod"].values(), attempt["answers"]["mknod"]


def test_nothing_is_mounted(attempt: dict[str, Any]) -> None:
    assert "accepted" not in attempt["answers"]["mount"].values(), attempt["answers"]["mount"]


def test_no_host_process_is_traced(attempt: dict[str, Any]) -> None:
    calls = attempt["answers"]["call"]
    assert calls["ptrace attach (host pid)"] != "accepted"
    assert calls["ptrace seize (host pid)"] != "accepted"
    assert attempt["tracer"] == "0"
    assert attempt["bystander_alive"]


@pytest.mark.parametrize("attempt, call", [
    pytest.param(kind.values[0], call, id=f"{kind.id}-{call}", marks=kind.marks)
    for kind in isolating.params() for call in CALLS
    if call not in HOST_KERNEL_CALLS or kind.values[0] in HOST_KERNEL
], indirect=["attempt"])
def test_kernel_surfaces_are_refused(attempt: dict[str, Any], call: str) -> None:
    assert attempt["answers"]["call"][call] != "accepted", attempt["answers"]["call"]
