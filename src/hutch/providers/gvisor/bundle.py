"""The OCI bundle of a gvisor sandbox: its ``config.json`` over a hutch
image's root file system (shared, read-only on the host: the sandbox writes
to an overlay in its own memory), the agent's binary and the directory its
socket is made in."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..._atomic import write_json

#: Inside: the agent's binary and the directory of its socket.
AGENT_BINARY_PATH = "/.hutch/bin/hutch-agent"
AGENT_RUN_DIR = "/.hutch/run"
AGENT_SOCKET = "agent.sock"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Docker's defaults less what the docker provider drops too (raw sockets,
#: mknod, audit writes, chroot, file capabilities): agents have no use for them.
_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
]


def spec(
    *, rootfs: str, agent: str, run_dir: str, env: Mapping[str, str], hostname: str,
    sandbox_id: str, memory: int | None, pids: int | None, cpus: float | None,
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if memory is not None:
        resources["memory"] = {"limit": memory}
    if pids is not None:
        resources["pids"] = {"limit": pids}
    if cpus is not None:
        resources["cpu"] = {"quota": int(cpus * 100_000), "period": 100_000}
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            # hutch's agent is pid 1: it reaps orphans as an init does, and
            # lets go of its host socket (which a checkpoint refuses) when
            # asked, keeping every process it started (see the agent's
            # shared.go).
            "args": agent_argv(),
            "env": [f"{k}={v}" for k, v in {"PATH": DEFAULT_PATH, "HOME": "/root",
                                            "LANG": "C.UTF-8", **env}.items()],
            "cwd": "/",
            "capabilities": {k: list(_CAPS) for k in ("bounding", "effective", "permitted")},
            # A setuid program run by another user does not raise it (docker's
            # no-new-privileges); root's own setuid() still switches users.
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
            {"destination": AGENT_BINARY_PATH, "type": "bind", "source": agent,
             "options": ["rbind", "ro"]},
            {"destination": AGENT_RUN_DIR, "type": "bind", "source": run_dir,
             "options": ["rbind", "rw"]},
        ],
        "linux": {
            "cgroupsPath": cgroup_path(sandbox_id),
            "resources": resources,
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
        },
    }


def write(bundle_dir: str, config: Mapping[str, Any]) -> None:
    os.makedirs(bundle_dir, exist_ok=True)
    write_json(os.path.join(bundle_dir, "config.json"), config, durable=False)


def agent_argv() -> list[str]:
    return [AGENT_BINARY_PATH, "serve-shared", f"{AGENT_RUN_DIR}/{AGENT_SOCKET}"]


def for_branch(config: Mapping[str, Any], *, run_dir: str, sandbox_id: str) -> dict[str, Any]:
    """A snapshot's bundle for a sandbox restored from it: the same root,
    mounts and flags (a checkpoint restores under nothing else), its own
    agent directory and cgroup."""
    branch: dict[str, Any] = json.loads(json.dumps(config))
    for mount in branch["mounts"]:
        if mount.get("destination") == AGENT_RUN_DIR:
            mount["source"] = run_dir
    branch["linux"]["cgroupsPath"] = cgroup_path(sandbox_id)
    return branch


def pids_limit(bundle_dir: str) -> int | None:
    """The process limit the bundle in ``bundle_dir`` sets, or None (none, or
    no bundle to read)."""
    try:
        with open(os.path.join(bundle_dir, "config.json")) as found:
            limit = json.load(found)["linux"]["resources"]["pids"]["limit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return limit if isinstance(limit, int) and limit > 0 else None


def cgroup_path(container: str) -> str:
    return f"/hutch-gvisor/{container}"


def for_container(bundle_dir: str, container: str) -> None:
    """The bundle's cgroup that of ``container`` (a restore under a new
    container id, beside the previous one still giving its memory back)."""
    path = os.path.join(bundle_dir, "config.json")
    with open(path) as found:
        config: dict[str, Any] = json.load(found)
    if config["linux"].get("cgroupsPath") != cgroup_path(container):
        config["linux"]["cgroupsPath"] = cgroup_path(container)
        write(bundle_dir, config)
