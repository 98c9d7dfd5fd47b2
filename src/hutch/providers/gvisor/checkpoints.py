"""Checkpoints: a running sandbox's whole state (processes, memory, its
in-memory root overlay) written by ``runsc checkpoint`` and brought back by
``runsc restore``. Each records the runsc build that wrote it: another build
cannot read it, and says so before trying.

The sandbox's pid 1 is hutch's agent, whose socket is a host socket (made
through gVisor's gofer), which a checkpoint refuses: the agent lets go of it
before (SIGUSR1) and listens again after a restore (SIGUSR2), its processes
kept throughout."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid

from ..._atomic import write_json
from ..._errors import InvalidState, ProviderError
from ..._faults import fault_point
from . import bundle, cgroups, deaths, runsc

log = logging.getLogger("hutch.gvisor")
META = "hutch-checkpoint.json"
IMAGE = "checkpoint.img"
#: How long the agent has to let go of its host sockets.
RELEASE_TIMEOUT = 10.0
#: How long an agent that said it would let go has before it is signalled.
ASKED_TIMEOUT = 2.0
#: How long a checkpoint waits for the stopped sandbox's process to end.
EXIT_WAIT = 60.0
#: How long a restore retries where its container id is still in use.
RESTORE_WAIT = 30.0
#: What runsc says of a restore whose container, or sandbox, is not gone yet.
_NOT_YET_GONE = ("already exists", "address already in use")


class CheckpointBuildMismatch(InvalidState):
    """A checkpoint written by another runsc build: its format is that
    build's own, and a restore would fail or misread it."""


def held(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, IMAGE)) and os.path.isfile(
        os.path.join(directory, META)
    )


def size_of(directory: str) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def listen_again(container: str, socket_path: str) -> None:
    """The agent (pid 1) listening on its socket again (blocking; the caller
    waits for its answer). A socket file it left (not always removable from
    inside) is removed first: it would be in the way."""
    if not listening(socket_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    runsc.run("kill", container, "USR2", what=f"waking {container}'s agent")


def release_agent(container: str, socket_path: str, *, asked: bool = False) -> None:
    """The agent holding no host socket (it removes its pid file last); what
    it started lives on. ``asked``: the agent said it would (on its socket);
    otherwise, or where it takes too long, it is signalled. Blocking."""
    if not asked:
        runsc.run("kill", container, "USR1", what=f"asking {container}'s agent to let go")
    deadline = time.monotonic() + RELEASE_TIMEOUT
    signal_at = time.monotonic() + ASKED_TIMEOUT
    while os.path.lexists(socket_path + ".pid"):
        if time.monotonic() >= deadline:
            raise ProviderError(f"gvisor: {container}'s agent did not let go of its socket")
        if asked and time.monotonic() >= signal_at:
            asked = False
            runsc.run("kill", container, "USR1", what=f"asking {container}'s agent to let go")
        time.sleep(0.002)
    # Not always removable from inside (a gofer-made socket): the agent's
    # next listen would find it in its way.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)


def checkpoint(
    container: str, directory: str, socket_path: str, *, fault: str, pid_file: str,
    asked: bool = False,
) -> None:
    """The container's state into ``directory``, the container gone (its
    memory freed: runsc answers once the image is written, and its sandbox
    process ends a little later, tens of milliseconds for a big one; it is
    waited for, by the pid runsc wrote to ``pid_file``). Blocking. The agent
    has let go when it returns, also when it fails (the caller asks it to
    listen again).

    The image is written beside ``directory`` (``.partial``), with its
    record written first: should hutch die once runsc has written it (the
    sandbox stopped, its state only there), :func:`settle` finds it whole
    and puts it in place, so that nothing is lost."""
    work = directory + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sandbox = runsc.sandbox_process(pid_file)
    try:
        write_json(os.path.join(work, META),
                   {"runsc_build": runsc.runsc_build(), "at": time.time()}, durable=False)
        release_agent(container, socket_path, asked=asked)
        runsc.run("checkpoint", "--image-path", work, container,
                  what=f"checkpointing {container}")
        fault_point(fault)
        _put_in_place(work, directory)
        if sandbox is not None and not runsc.await_exit(sandbox, EXIT_WAIT):
            log.warning("gvisor: %s's sandbox process still runs %gs after its checkpoint",
                        container, EXIT_WAIT)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if sandbox is not None:
            os.close(sandbox)
    # Not removed here: the runsc that started it reaps the stopped sandbox
    # and deletes it (a delete now would wait seconds for a big sandbox's
    # memory to be given back); a restore or a close removes what is left.


def discard(directory: str) -> None:
    """A checkpoint no longer needed gone: renamed aside at once (the next
    checkpoint may take its place), its files removed in the background
    (unlinking a 200 MB image takes some 80 ms a resume need not wait for).
    What is left of it at a crash goes with the sandbox's directory."""
    aside = f"{directory}.gone-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return
    threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True},
                     name="gvisor checkpoint removal", daemon=True).start()


def _put_in_place(work: str, directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(work, directory)


def settle(container: str, directory: str) -> None:
    """A checkpoint runsc finished writing while hutch was gone (its
    ``.partial`` holds the image and its record, and the sandbox no longer
    runs: runsc stops it only once the image is written) put in place.
    Blocking; nothing to do otherwise."""
    work = directory + ".partial"
    if not held(work):
        return
    found = runsc.state(container)
    if found is not None and found.get("status") in ("running", "paused", "created"):
        return  # still being written, or a checkpoint that failed and left it running
    _put_in_place(work, directory)


def check_build(directory: str, what: str) -> None:
    with open(os.path.join(directory, META)) as meta:
        recorded = str(json.load(meta).get("runsc_build", ""))
    build = runsc.runsc_build()
    if recorded != build:
        raise CheckpointBuildMismatch(
            f"gvisor: {what} was written by another runsc build "
            f"({recorded.splitlines()[0] if recorded else 'unknown'}; this is "
            f"{build.splitlines()[0] if build else 'unknown'}): a checkpoint restores only "
            "under the build that wrote it"
        )


def restore(
    container: str, directory: str, bundle_dir: str, log_path: str, socket_path: str,
    *, pid_file: str, previous: str | None = None,
) -> None:
    """The container running again from ``directory``, under the id
    ``container``: a new one each time, so that it need not wait for
    ``previous`` (the stopped sandbox its checkpoint came from, giving its
    memory back for seconds where it is big) to be gone; ``previous`` is
    removed in the background. Its agent listens again by itself once it
    finds the wake file made here first (returns once it does, or once
    runsc says the container runs: the caller then wakes it, see
    :func:`listening`). Blocking."""
    check_build(directory, f"{container}'s checkpoint")
    # The previous sandbox's pid goes too: never waited for in another's stead.
    for stale in (socket_path, socket_path + ".pid", pid_file):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    with open(socket_path + ".wake", "w"):
        pass
    bundle.for_container(bundle_dir, container)
    cgroups.hold(container, bundle_dir)
    deadline = time.monotonic() + RESTORE_WAIT
    while True:
        try:
            runsc.start("restore", "--image-path", directory, "--bundle", bundle_dir,
                        "--pid-file", pid_file, container,
                        container=container, log_path=log_path, what=f"restoring {container}",
                        ready=lambda: listening(socket_path))
            break
        except ProviderError as exc:
            # Left by an attempt that died half-way (a daemon before a
            # restart): removed, and tried again.
            if not any(said in str(exc) for said in _NOT_YET_GONE) \
                    or time.monotonic() >= deadline:
                raise
        if runsc.state(container) is not None:
            runsc.remove(container)
        time.sleep(0.05)
    if previous is not None and previous != container:
        runsc.remove_when_ended(previous)
    cgroups.release(deaths.sandbox_of(container))  # earlier containers' (this one runs)


def listening(socket_path: str) -> bool:
    """Whether the agent has said it listens (its pid file, written once it does)."""
    return os.path.exists(socket_path + ".pid")


def copy_image(source: str, target: str) -> None:
    """A checkpoint's files under ``target`` too: hard links where the file
    system allows (a checkpoint's files are never written again), else
    copies. Blocking."""
    work = target + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        for entry in os.scandir(source):
            if entry.is_file(follow_symlinks=False):
                into = os.path.join(work, entry.name)
                try:
                    os.link(entry.path, into)
                except OSError:
                    shutil.copy2(entry.path, into)
        os.rename(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def write_text(path: str, value: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as out:
        out.write(value)
    os.replace(tmp, path)


def read_text(path: str) -> str | None:
    try:
        with open(path) as found:
            return found.read().strip() or None
    except FileNotFoundError:
        return None


