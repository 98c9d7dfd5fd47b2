"""Checkpoints: a running sandbox's whole state (processes, memory, its
in-memory root overlay) written by ``runsc checkpoint`` and brought back by
``runsc restore``. Each records the runsc build that wrote it: another build
cannot read it, and says so before trying."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time

from ..._errors import InvalidState, ProviderError
from . import bundle, runsc

log = logging.getLogger("hutch.gvisor")
META = "hutch-checkpoint.json"
IMAGE = "checkpoint.img"
#: How long the agent has to let go of its host sockets.
RELEASE_TIMEOUT = 10.0


class CheckpointBuildMismatch(InvalidState):
    """A checkpoint written by another runsc build: its format is that
    build's own, and a restore would fail or misread it."""


def held(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, IMAGE)) and os.path.isfile(
        os.path.join(directory, META)
    )


def start_agent(container: str, env: list[str]) -> None:
    """hutch's agent, started beside the keeper (blocking)."""
    flags = [f"--env={item}" for item in env]
    try:
        runsc.run("exec", "--detach", "--cwd", "/", *flags, container, *bundle.agent_argv(),
                  what=f"starting {container}'s agent")
    except ProviderError as exc:
        # Debian's build (2022) passes its own --pid-file to the command
        # rather than to itself and then fails waiting for that file, with
        # the command started all the same: whether the agent came up is
        # told by its answer (the caller waits for it), this kept for then.
        log.debug("runsc exec --detach: %s", exc)


def release_agent(container: str, socket_path: str) -> None:
    """The agent ended (its socket is a host socket, which a checkpoint
    refuses); what it started lives on under the keeper. Blocking."""
    try:
        with open(socket_path + ".pid") as found:
            pid = int(found.read().strip())
    except (OSError, ValueError):
        return
    runsc.run("kill", "--pid", str(pid), container, "KILL", what=f"ending {container}'s agent")
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while pid in runsc.pids(container):
        if time.monotonic() >= deadline:
            raise ProviderError(f"gvisor: {container}'s agent did not end")
        time.sleep(0.005)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)


def checkpoint(container: str, directory: str, socket_path: str) -> None:
    """The container's state into ``directory``, the container gone (its
    memory freed). Blocking."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    build = runsc.runsc_build()
    release_agent(container, socket_path)
    runsc.run("checkpoint", "--image-path", directory, container,
              what=f"checkpointing {container}")
    runsc.remove(container)
    with open(os.path.join(directory, META), "w") as out:
        json.dump({"runsc_build": build, "at": time.time()}, out)


def restore(container: str, directory: str, bundle_dir: str) -> None:
    """The container running again from ``directory`` (with no agent: the
    caller starts one). Blocking."""
    with open(os.path.join(directory, META)) as meta:
        recorded = str(json.load(meta).get("runsc_build", ""))
    build = runsc.runsc_build()
    if recorded != build:
        raise CheckpointBuildMismatch(
            f"gvisor: {container}'s checkpoint was written by another runsc build "
            f"({recorded.splitlines()[0] if recorded else 'unknown'}; this is "
            f"{build.splitlines()[0] if build else 'unknown'}): a checkpoint restores only "
            "under the build that wrote it"
        )
    runsc.remove(container)  # a stopped leftover of the same name
    runsc.run("restore", "--detach", "--image-path", directory, "--bundle", bundle_dir,
              container, what=f"restoring {container}")
