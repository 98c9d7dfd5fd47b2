"""Docker's event stream (:func:`watch_runtimes`): containers of hutch's that die
or go, and sandboxes' images deleted, told as runtime notices in words for a person."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import anyio
import anyio.to_thread

from ..._errors import HutchError
from .._docker_engine import ContainerGone, engine
from .._docker_engine import call as _call
from ..base import RuntimeNotice, RuntimeReport
from .labels import MANAGED_LABEL, SANDBOX_LABEL, SUSPENDED_REPOSITORY
from .outside import preserved_container_removed

log = logging.getLogger("hutch.docker")


#: The running watchers (``watch_runtimes``): their loops and report callbacks.
WATCHERS: list[tuple[asyncio.AbstractEventLoop, RuntimeReport]] = []
TELLING: set[asyncio.Future[None]] = set()


async def _oom_message(container_id: str) -> str:
    try:
        details = await _call(engine().inspect_container, container_id)
        limit = (details.get("HostConfig") or {}).get("Memory") or 0
    except HutchError:
        limit = 0
    within = f" of {limit} bytes" if limit else ""
    return f"the OOM killer killed a process in it: it reached its memory limit{within}"


def suspended_state_removed(image_id: str, sandbox_id: str) -> str:
    """The reason a sandbox whose suspend image went fails."""
    return (f"its suspended state (image {image_id.removeprefix('sha256:')[:12]}, "
            f"{SUSPENDED_REPOSITORY}:{sandbox_id}) was removed outside hutch")


async def death_reason(container_id: str, action: str) -> str:
    """What happened to a container that died or went, in words for a person."""
    short = container_id[:12]
    removed = f"its container {short} was removed outside hutch"
    details: dict[str, Any] = {}
    # A `docker rm -f` is a kill, a die and a destroy in quick succession:
    # after a die, watch a moment for the removal before calling it a stop.
    for _ in range(20 if action == "die" else 1):
        try:
            details = await _call(engine().inspect_container, container_id)
        except ContainerGone:
            return removed
        except HutchError as exc:
            return f"its container {short} {action}d ({exc})"
        state = details.get("State") or {}
        if state.get("Status") == "removing" or state.get("Dead"):
            return removed
        if action == "die":
            await asyncio.sleep(0.1)
    state = details.get("State") or {}
    if state.get("OOMKilled") or action == "oom":
        limit = (details.get("HostConfig") or {}).get("Memory") or 0
        within = f" (memory limit {limit} bytes)" if limit else ""
        return f"its container {short} was OOM-killed{within}"
    code = state.get("ExitCode")
    if isinstance(code, int) and code > 128:
        return f"its container {short} was killed by signal {code - 128} outside hutch"
    return f"its container {short} stopped outside hutch (exit code {code})"


async def watch_runtimes(report: RuntimeReport) -> None:
    """Docker's event stream: every hutch container that dies or is
    removed is reported, with what its last inspect says happened, and
    every image of a sandbox's that is deleted (a suspended sandbox's
    state, if it was that one)."""
    loop = asyncio.get_running_loop()
    deaths: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    stop = threading.Event()
    current: list[Any] = []

    #: Image id -> the sandbox whose labelled image lost a tag: an image's
    #: delete event carries no labels, its untag before it does.
    untagged: dict[str, str] = {}

    def pump() -> None:
        backoff = 0.5
        # From when the watch began, and after a reconnect from the last
        # event seen: the Engine replays what came before the stream was
        # open, so a death (an OOM kill) between the first sandbox's start
        # and this thread's connection, or during a reconnect, is not lost.
        since_ns = time.time_ns()
        while not stop.is_set():
            try:
                # No label filter: an image's delete event has no labels to match.
                stream = engine().events(decode=True, since=f"{since_ns / 1e9:.9f}", filters={
                    "type": ["container", "image"],
                    "event": ["die", "destroy", "oom", "untag", "delete"],
                })
                current[:] = [stream]
                backoff = 0.5
                for event in stream:
                    at_ns = int(event.get("timeNano") or 0)
                    if at_ns and at_ns < since_ns:
                        continue  # told before the reconnect
                    since_ns = max(since_ns, at_ns + 1)
                    actor = event.get("Actor") or {}
                    attributes = actor.get("Attributes") or {}
                    thing = str(actor.get("ID") or "")
                    action = str(event.get("Action") or event.get("status") or "")
                    sandbox_id = attributes.get(SANDBOX_LABEL)
                    if event.get("Type") == "image":
                        if action == "untag" and sandbox_id and attributes.get(
                            MANAGED_LABEL
                        ) == "1":
                            if len(untagged) > 1000:
                                untagged.pop(next(iter(untagged)))
                            untagged[thing] = sandbox_id
                            continue
                        if action != "delete" or thing not in untagged:
                            continue
                        sandbox_id, action = untagged.pop(thing), "image deleted"
                    elif attributes.get(MANAGED_LABEL) != "1":
                        continue
                    if sandbox_id:
                        with contextlib.suppress(RuntimeError):  # the loop is gone
                            loop.call_soon_threadsafe(
                                deaths.put_nowait, (sandbox_id, thing, action)
                            )
            except Exception as exc:
                if not stop.is_set():
                    log.info("docker event stream broke (%s); reconnecting", exc)
            if not stop.wait(backoff):
                backoff = min(backoff * 2, 10.0)

    async def tell(sandbox_id: str, container_id: str, action: str) -> None:
        try:
            if action == "destroy" and await anyio.to_thread.run_sync(
                preserved_container_removed, sandbox_id
            ):
                return  # its sandbox was deleted before: nothing to fail
            if action == "image deleted":
                # Told of every image of the sandbox's; it fails only if this
                # was the state it is suspended in (checked by is_suspended).
                await report(RuntimeNotice(
                    sandbox_id, suspended_state_removed(container_id, sandbox_id),
                    of_suspended=True,
                ))
            elif action == "oom":
                # A process in it hit the memory limit; a die follows if it was PID 1.
                await report(RuntimeNotice(
                    sandbox_id, await _oom_message(container_id), may_have_died=False
                ))
            else:
                await report(RuntimeNotice(
                    sandbox_id, await death_reason(container_id, action)
                ))
        except Exception:
            log.exception("sandbox %s: reporting its container's %s failed",
                          sandbox_id, action)

    thread = threading.Thread(target=pump, name="hutch-docker-events", daemon=True)
    thread.start()
    tasks: set[asyncio.Task[None]] = set()
    watcher = (loop, report)
    WATCHERS.append(watcher)
    try:
        while True:
            sandbox_id, container_id, action = await deaths.get()
            task = loop.create_task(tell(sandbox_id, container_id, action))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        WATCHERS.remove(watcher)
        stop.set()
        for stream in current:
            with contextlib.suppress(Exception):
                stream.close()
        for task in tasks:
            task.cancel()
