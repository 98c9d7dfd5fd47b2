"""``bubblewrap``: a sandbox in Linux namespaces on a shared read-only root
file system, with a writable overlay of its own and cgroup limits.

The provisioning and lifecycle half lives here (create, pause by the freezer,
suspend, resume, close, adoption after a restart); the runtime (exec, files)
in :mod:`.runtime`; the overlay and the keeper in :mod:`.provisioning`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
import weakref
from collections.abc import Mapping
from typing import Any

import anyio.to_thread

from ..._atomic import write_json
from ..._errors import (
    CapabilityUnsupported,
    InvalidArgument,
    ProviderError,
    SandboxUnavailable,
)
from ..._faults import fault_point
from ..._liveness import still_running, this_process
from ..._types import Capabilities, ProviderSnapshot
from .._hostproc import SANDBOX_MARKER
from ..agent import AgentFailure, AgentUnavailable, agent_binary
from ..base import (
    RuntimeReport,
    RuntimeState,
    SandboxBackend,
    SandboxRuntime,
)
from ..network import AllowList, NetworkPolicy
from . import freezes, snapshots
from . import network as net
from .cgroups import SandboxCgroup
from .config import BubblewrapConfig, parse_size
from .deaths import keepers_changed, watch_keepers
from .provisioning import (
    Keeper,
    Layers,
    bubblewrap_home,
    start_keeper,
)
from .rootfs import resolve_rootfs
from .runtime import DEFAULT_PATH, AgentWithNativeUsers, BubblewrapRuntime, SandboxParts

DEFAULT_IMAGE = "hutch-test:bookworm"
#: How long a fresh keeper's agent has to answer.
AGENT_START_TIMEOUT = 15.0
log = logging.getLogger("hutch.bubblewrap")
#: The sandboxes this process holds, for the death watcher.
_live: weakref.WeakValueDictionary[str, BubblewrapSandbox] = weakref.WeakValueDictionary()
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class BubblewrapSandbox(SandboxBackend):
    provider = "bubblewrap"
    # Its keeper is started apart from the daemon, to outlive it (a restart adopts it).
    runtime_outlives_its_daemon = True
    capabilities = Capabilities(
        processes=True,
        pause=True,
        suspend=True,
        # Suspend ends the processes and keeps the upper layer on disk.
        suspend_keeps_processes=False,
        network_isolation=True,
        network_policy=True,
        # A snapshot is the upper layer captured; a fork mounts it, copying nothing.
        snapshot=True,
        fork=True,
        resource_limits=True,
        # What it writes lands on a tmpfs of its own, capped at ``disk``.
        disk_limit=True,
        # Root inside is an unprivileged host id (see .userns): it can install
        # packages and add users, never change the host (README: Security).
        users=True,
    )
    config_model = BubblewrapConfig

    def __init__(
        self,
        sandbox_id: str,
        workdir: str,
        parts: SandboxParts,
        *,
        hostname: str,
        ephemeral: bool,
        keeper_process: subprocess.Popen[bytes] | None = None,
        agent: bool = False,
        network: NetworkPolicy = "none",
        net_index: int | None = None,
    ) -> None:
        super().__init__(sandbox_id, workdir)
        self.network: NetworkPolicy = network
        #: The sandbox's slot of hutch's network range, while it has a network.
        self.net_index = net_index
        self.parts = parts
        self.hostname = hostname
        self.ephemeral = ephemeral
        self._keeper_process = keeper_process
        #: A suspended upper layer's use, by which directory it was (its inode and ctime).
        self._disk_seen: tuple[tuple[int, int], int] | None = None
        self._runtime = BubblewrapRuntime(sandbox_id, workdir, parts)
        #: hutch's agent as the keeper and runtime, or None for the native one.
        self._agent: AgentWithNativeUsers | None = None
        if agent:
            self._agent = AgentWithNativeUsers(
                self._runtime, self.agent_link, self._recover_agent
            )
        self._closed = False
        #: The running sandbox's tmpfs (its upper layer) held open: see _pin_upper.
        self._upper_pin: int | None = None
        _live[sandbox_id] = self

    @property
    def agent_link(self) -> str:
        """Where hutch connects: the agent's listening socket, which hutch
        binds itself in a directory the sandbox cannot reach and hands to the
        agent as a descriptor (nothing inside can plant a link in its place)."""
        return os.path.join(self.parts.layers.sandbox_dir, "agent.sock")

    def _listen_for_agent(self) -> socket.socket:
        """A fresh listening socket at :attr:`agent_link` (one an earlier
        agent held, before a suspend, is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.agent_link)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        directory = os.open(os.path.dirname(self.agent_link),
                            os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Bound through the directory's descriptor: a socket's path has
            # room for 107 bytes, and a hutch home may be longer than that.
            listener.bind(f"/proc/self/fd/{directory}/{os.path.basename(self.agent_link)}")
            os.chmod(self.agent_link, 0o600)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        finally:
            os.close(directory)
        return listener

    @property
    def runtime(self) -> SandboxRuntime:
        return self._agent if self._agent is not None else self._runtime

    def _keeper_env(self) -> dict[str, str]:
        """The agent's environment, and so every command's it starts."""
        return {
            "PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8",
            SANDBOX_MARKER: self.sandbox_id, **self.parts.env,
        }

    async def _await_agent(self, timeout: float = AGENT_START_TIMEOUT) -> None:
        """Until the agent answers: its socket is listening from the start (see
        :meth:`_listen_for_agent`), so a ping waits in its backlog for the
        agent to accept, with no polling; each wait is short enough to notice
        a keeper that died."""
        assert self._agent is not None
        self._agent.drop_connections()
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._agent.ping(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                workload = self.parts.cgroup.workload_dirs()
                if workload is not None:
                    # Before any command: every one starts in the workload's cgroups.
                    await self._agent.place_workload(workload)
                return
            except AgentFailure as exc:
                if time.monotonic() >= deadline or not (
                    self.parts.keeper is not None and self.parts.keeper.alive()
                ):
                    log_tail = _log_tail(self.parts.layers.sandbox_dir)
                    raise ProviderError(
                        f"bubblewrap sandbox {self.sandbox_id}: its agent did not start: "
                        f"{exc} {log_tail}"
                    ) from None
                await anyio.sleep(0.01)  # a refusal comes at once: not a busy loop

    async def _recover_agent(self, reason: str) -> bool:
        """The agent failed a request: a frozen sandbox's agent is held, a dead
        keeper is a lost sandbox; otherwise the connection was at fault
        (False: nothing was restarted, the agent answers)."""
        keeper = self.parts.keeper
        if keeper is None or not keeper.alive():
            raise SandboxUnavailable(
                f"bubblewrap sandbox {self.sandbox_id}: its agent is gone ({reason}); "
                + self.death_reason()
            )
        if self.parts.cgroup.frozen():
            raise SandboxUnavailable(f"bubblewrap sandbox {self.sandbox_id} is paused")
        return False

    # -- provisioning ----------------------------------------------------------------
    @classmethod
    async def create(cls, config: BubblewrapConfig, sandbox_id: str) -> BubblewrapSandbox:
        if not _SAFE_ID.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} cannot name a directory")
        if config.rootfs is not None and config.image is not None:
            raise InvalidArgument("give a bubblewrap sandbox rootfs or image, not both")
        image = config.image or (None if config.rootfs else DEFAULT_IMAGE)
        rootfs = await anyio.to_thread.run_sync(lambda: resolve_rootfs(config.rootfs, image))
        return await cls._from_lowers(config, sandbox_id, [rootfs])

    @classmethod
    async def create_from_layers(
        cls, config: BubblewrapConfig, sandbox_id: str, snapshot_id: str,
        data: Mapping[str, Any],
    ) -> BubblewrapSandbox:
        """A new sandbox on a snapshot's layers, under an empty upper layer of its
        own: nothing is copied. ``config`` gives everything but the files."""
        if not _SAFE_ID.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} cannot name a directory")
        lowers = snapshots.layers_of(snapshot_id, dict(data))
        return await cls._from_lowers(config, sandbox_id, lowers)

    # -- snapshots: the provider seam ----------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        data = await self.capture_layers(snapshot_id, diff=diff)
        return ProviderSnapshot(
            snapshot_id=snapshot_id, provider=self.provider,
            size_bytes=int(data["size_bytes"]), data={"layers": list(data["layers"])},
        )

    @classmethod
    async def create_from_snapshot(
        cls, config: Any, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> BubblewrapSandbox:
        if not isinstance(config, BubblewrapConfig):
            config = BubblewrapConfig.model_validate(
                config if isinstance(config, Mapping) else {}
            )
        return await cls.create_from_layers(config, sandbox_id, snapshot.snapshot_id, snapshot.data)

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        await anyio.to_thread.run_sync(lambda: snapshots.remove(snapshot.snapshot_id))

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        return await anyio.to_thread.run_sync(snapshots.held)

    # -- reconciliation -------------------------------------------------------------
    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        if _SAFE_ID.match(sandbox_id):
            await anyio.to_thread.run_sync(lambda: _discard(sandbox_id))

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        def reap() -> list[str]:
            base = os.path.join(bubblewrap_home(), "sandboxes")
            try:
                names = sorted(os.listdir(base))
            except FileNotFoundError:
                return []
            freed = []
            for name in names:
                if name in known or name in _live or not _SAFE_ID.match(name):
                    continue
                if _owner_alive(os.path.join(base, name)):
                    continue  # another live hutch process's sandbox (in-process use)
                _discard(name)
                freed.append(name)
            return freed
        return await anyio.to_thread.run_sync(reap)

    async def capture_layers(self, snapshot_id: str, *, diff: bool = True) -> dict[str, Any]:
        """Capture this sandbox's files as snapshot ``snapshot_id`` (running,
        paused or suspended; it is left as it was)."""
        running = self.parts.keeper is not None
        return await anyio.to_thread.run_sync(
            lambda: snapshots.capture(
                self.parts.layers, self.parts.cgroup, snapshot_id, diff=diff, running=running
            )
        )

    @staticmethod
    def _agent_wanted(runtime: str) -> bool:
        if runtime == "native":
            return False
        try:
            agent_binary()
        except AgentUnavailable as exc:
            if runtime == "agent":
                raise
            log.warning("bubblewrap: native runtime (%s)", exc)
            return False
        return True

    @classmethod
    async def _from_lowers(
        cls, config: BubblewrapConfig, sandbox_id: str, lowers: list[str]
    ) -> BubblewrapSandbox:
        if not config.workdir.startswith("/"):
            raise InvalidArgument(f"workdir {config.workdir!r} must be an absolute path")
        memory = parse_size(config.memory, "memory")
        disk = parse_size(config.disk, "disk")
        assert disk is not None
        layers = Layers(
            os.path.join(bubblewrap_home(), "sandboxes", sandbox_id), lowers, disk_limit=disk
        )
        if os.path.exists(layers.sandbox_dir):
            raise InvalidArgument(f"sandbox {sandbox_id} already exists")
        return await cls._start(
            sandbox_id, config.workdir, layers,
            memory=memory, pids=config.pids_limit, cpus=config.cpus, env=config.env,
            hostname=config.hostname, ephemeral=config.ephemeral,
            agent=await anyio.to_thread.run_sync(lambda: cls._agent_wanted(config.runtime)),
            network=config.network,
        )

    @classmethod
    async def _start(
        cls,
        sandbox_id: str,
        workdir: str,
        layers: Layers,
        *,
        memory: int | None,
        pids: int | None,
        cpus: float | None,
        env: Mapping[str, str],
        hostname: str,
        ephemeral: bool,
        agent: bool,
        network: NetworkPolicy,
    ) -> BubblewrapSandbox:
        cgroup = SandboxCgroup(sandbox_id)
        parts = SandboxParts(layers, cgroup, None, dict(env))
        sandbox = cls(
            sandbox_id, workdir, parts, hostname=hostname, ephemeral=ephemeral, agent=agent,
            network=network,
        )
        def provision() -> None:
            os.makedirs(layers.sandbox_dir, exist_ok=True)
            _write_owner(layers.sandbox_dir)
            cgroup.create(memory=memory, pids=pids, cpus=cpus)
            layers.prepare()
            if network != "none":
                sandbox.net_index = net.allocate(sandbox_id)
            sandbox._start_keeper()

        try:
            # Off the event loop: the keeper's start waits on bwrap, and a
            # network's setup runs ip and iptables; other callers go on meanwhile.
            await anyio.to_thread.run_sync(provision)
            if network != "none":
                # The host's resolver, reached through the masquerade.
                await sandbox._runtime.files.write_file("/etc/resolv.conf", net.host_resolver())
            if sandbox._agent is not None:
                await sandbox._await_agent()
        except BaseException:
            await sandbox._destroy()
            raise
        return sandbox

    def _start_keeper(self) -> None:
        listener = self._listen_for_agent() if self._agent is not None else None
        try:
            keeper, process = start_keeper(
                self.parts.layers, self.parts.cgroup,
                hostname=self.hostname, network=False, ephemeral=self.ephemeral,
                log_path=os.path.join(self.parts.layers.sandbox_dir, "keeper.log"),
                agent=None if listener is None else (str(agent_binary()), listener.fileno()),
                env=self._keeper_env(), workdir=self.workdir,
            )
        finally:
            if listener is not None:
                listener.close()  # the agent holds it now
        self.parts.keeper = keeper
        self.parts.layers.view = keeper.view
        self._keeper_process = process
        # Found by a program that finds the sandbox after this one died
        # before its record named the keeper (a resume cut short).
        write_json(_keeper_file(self.parts.layers.sandbox_dir), keeper.to_dict(), durable=False)
        self._pin_upper()
        keepers_changed()
        if self.net_index is not None:
            net.connect(keeper.init_pid, self.net_index, self.network)

    def _pin_upper(self) -> None:
        """Hold the running sandbox's tmpfs open. It is mounted in the
        keeper's private mount namespace only, which ends with the keeper:
        held, it outlives a keeper killed outside hutch, and
        :meth:`release_runtime` saves what the sandbox wrote to disk."""
        self._unpin_upper()
        keeper = self.parts.keeper
        if keeper is None:
            return
        try:
            fd = os.open(keeper.view + self.parts.layers.hot,
                         os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return  # gone already: the watcher tells
        try:
            keeper.check_view()  # the view led to this keeper's, not a reused PID's
        except SandboxUnavailable:
            os.close(fd)
            return
        self._upper_pin = fd

    def _unpin_upper(self) -> None:
        pin, self._upper_pin = self._upper_pin, None
        if pin is not None:
            os.close(pin)

    def sandbox_capabilities(self) -> Capabilities:
        # A preview URL needs an address the host reaches: a network of its own.
        return dataclasses.replace(
            super().sandbox_capabilities(), preview_url=self.network != "none"
        )

    async def preview_url(self, port: int) -> str:
        """The sandbox's own address on its veth, which the host routes to
        (its policy lets replies to connections made into it pass)."""
        if self.net_index is None:
            raise CapabilityUnsupported(
                f"bubblewrap sandbox {self.sandbox_id} has no network (network: none), so "
                "nothing outside it reaches its ports: make it with network 'all' or an "
                "allow list for a preview URL"
            )
        return f"http://{net.addresses(self.net_index)[1]}:{port}"

    def describe(self) -> dict[str, Any]:
        layers = self.parts.layers
        return {
            **super().describe(),
            "sandbox_dir": layers.sandbox_dir,
            "lowers": list(layers.lowers),
            "upper_on": layers.upper_on,
            "root_point": layers.root_point,
            "disk_limit": layers.disk_limit,
            "keeper": self.parts.keeper.to_dict() if self.parts.keeper else None,
            "env": dict(self.parts.env),
            "hostname": self.hostname,
            "ephemeral": self.ephemeral,
            "agent": self._agent is not None,
            "network": self.network if isinstance(self.network, str) else self.network.model_dump(),
            "net_index": self.net_index,
        }

    @classmethod
    async def reconnect(
        cls, sandbox_id: str, description: Mapping[str, Any]
    ) -> BubblewrapSandbox:
        layers = Layers(
            str(description["sandbox_dir"]),
            [str(p) for p in description["lowers"]],
            upper_on=str(description.get("upper_on", "hot")),
            # A sandbox described before there was one had it in its own directory.
            root_point=str(description.get("root_point", "")),
            disk_limit=int(description.get("disk_limit", 4 << 30)),
        )
        keeper_data = description.get("keeper")
        keeper = Keeper.from_dict(dict(keeper_data)) if keeper_data else None
        if keeper is not None:
            layers.view = keeper.view
        parts = SandboxParts(
            layers, SandboxCgroup(sandbox_id), keeper, dict(description.get("env") or {})
        )
        sandbox = cls(
            sandbox_id, str(description["workdir"]), parts,
            hostname=str(description.get("hostname", "hutch")),
            ephemeral=bool(description.get("ephemeral", False)),
            agent=bool(description.get("agent", False)),
            network=_policy(description.get("network", "none")),
            net_index=(
                int(description["net_index"]) if description.get("net_index") is not None
                else None
            ),
        )
        if os.path.isdir(layers.sandbox_dir):
            await anyio.to_thread.run_sync(sandbox._mend_cut_short)
        keeper = sandbox.parts.keeper  # the one a resume cut short started, if so
        if keeper is not None and keeper.alive():
            sandbox._pin_upper()
            keepers_changed()
        return sandbox

    async def memory_bytes(self) -> int | None:
        return self.parts.cgroup.memory_usage()

    async def disk_bytes(self) -> int | None:
        layers = self.parts.layers
        if layers.upper_on == "hot":
            if not layers.view:
                return None
            # A running upper layer is a tmpfs of its own: its use is one statvfs.
            try:
                fs = os.statvfs(layers.view + layers.hot)
            except OSError:
                return None
            return (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        # Suspended: a directory, which does not change until the resume
        # copies it back (a new directory then): walked once per suspend.
        try:
            here = os.stat(layers.disk_upper)
        except OSError:
            return None
        key = (here.st_ino, here.st_ctime_ns)
        if self._disk_seen is None or self._disk_seen[0] != key:
            used = await anyio.to_thread.run_sync(snapshots.disk_usage, [layers.disk_upper])
            self._disk_seen = (key, used)
        return self._disk_seen[1]

    async def is_alive(self) -> bool:
        keeper = self.parts.keeper
        if keeper is None:  # suspended: its files are on disk
            return os.path.isdir(self.parts.layers.disk_upper)
        return keeper.alive()

    async def observed_state(self) -> RuntimeState:
        keeper = self.parts.keeper
        if keeper is not None and keeper.alive():
            return RuntimeState.PAUSED if self.parts.cgroup.frozen() else RuntimeState.RUNNING
        if keeper is None and os.path.isdir(self.parts.layers.disk_upper):
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    def _mend_cut_short(self) -> None:
        """Bring a sandbox found again after its program died up to what it
        is: the keeper a resume cut short started (on record in the
        sandbox's directory, not yet in the caller's), a suspend cut short
        after its keeper ended (its files saved), a freeze of hutch's own
        undone, and what a cut step left behind removed. Blocking."""
        layers, cgroup = self.parts.layers, self.parts.cgroup
        started = _read_keeper(layers.sandbox_dir)
        if self.parts.keeper is None and started is not None and started.alive():
            self.parts.keeper, layers.view, layers.upper_on = started, started.view, "hot"
        keeper = self.parts.keeper
        if keeper is not None and keeper.alive():
            freezes.thaw_left(cgroup, layers.sandbox_dir)
            # Running from its tmpfs: a copy on disk is a step's leftover.
            shutil.rmtree(layers.disk_upper, ignore_errors=True)
            return
        if os.path.isdir(layers.disk_upper):
            # Its keeper ended by a suspend cut short (the files were saved
            # first), or a resume's keeper never came up: suspended.
            self.parts.keeper, layers.view, layers.upper_on = None, "", "disk"
            with contextlib.suppress(OSError, ProviderError):
                cgroup.kill_all()  # a keeper a cut resume started, unrecorded
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_keeper_file(layers.sandbox_dir))

    def death_reason(self) -> str:
        """Why the keeper is gone, as far as the host can tell."""
        if self.parts.cgroup.oom_kills() > 0:
            limit = self.parts.cgroup.memory_limit()
            said = f" (memory limit {limit} bytes)" if limit is not None else ""
            return f"killed by the OOM killer{said}"
        keeper = self.parts.keeper
        if keeper is not None and still_running(keeper.init_pid, keeper.start_time):
            return ("its keeper ended outside hutch: its outer bwrap process was killed, "
                    "and the host cannot reach the sandbox any more")
        return "its keeper ended outside hutch (killed, or the host restarted)"

    @property
    def watched_keeper(self) -> Keeper | None:
        """The keeper, while the sandbox is meant to run (for the death watcher)."""
        return None if self._closed else self.parts.keeper

    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Each live sandbox of this process whose keeper ends outside
        hutch's hands (its init or the outer bwrap killed) is reported
        once, with what the cgroup says (see :mod:`.deaths`)."""
        await watch_keepers(lambda: _live, report)

    # -- lifecycle ---------------------------------------------------------------------
    def _require_running(self) -> None:
        if self.parts.keeper is None:
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} is not running")

    async def pause(self) -> None:
        self._require_running()
        self.parts.cgroup.freeze()

    async def unpause(self) -> None:
        self.parts.cgroup.thaw()

    def _end_processes(self) -> None:
        # No keeper first: a watcher must not take hutch's own kill for a death.
        self.parts.keeper = None
        self.parts.layers.view = ""
        self.parts.cgroup.kill_all()
        if self._keeper_process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._keeper_process.wait(5)
            self._keeper_process = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_keeper_file(self.parts.layers.sandbox_dir))
        self._unpin_upper()

    def _drop_agent_connections(self) -> None:
        """The agent ends with the sandbox's processes: the connections kept
        to it for the next request are closed now, not found by garbage
        collection. (Dropping them is harmless where the end then fails: a
        request connects again.)"""
        if self._agent is not None:
            self._agent.drop_connections()

    async def release_runtime(self) -> None:
        """Its keeper ended outside hutch: what the sandbox wrote is saved
        from its tmpfs (held by :meth:`_pin_upper`) to the upper layer on
        disk, as a suspend keeps it, then what is left of its processes,
        its cgroup and its network go; :meth:`close` frees the files."""
        def run() -> None:
            layers = self.parts.layers
            pin = self._upper_pin
            if layers.upper_on == "hot" and pin is not None:
                shutil.rmtree(layers.disk_upper, ignore_errors=True)
                # The tmpfs as this process holds it: its mount namespace may be gone.
                done = subprocess.run(
                    ["cp", "-a", "--", f"/proc/self/fd/{pin}/upper", layers.disk_upper],
                    capture_output=True, pass_fds=(pin,), check=False,
                )
                if done.returncode != 0:
                    log.error("sandbox %s: saving what it wrote failed: %s", self.sandbox_id,
                              done.stderr.decode(errors="replace").strip())
                else:
                    layers.upper_on = "disk"
            self._end_processes()
            for step in (self.parts.cgroup.remove, self._release_network):
                try:
                    step()
                except (OSError, ProviderError) as exc:
                    log.warning("sandbox %s: releasing its dead runtime: %s",
                                self.sandbox_id, exc)
        self._drop_agent_connections()
        await anyio.to_thread.run_sync(run)

    async def suspend(self) -> None:
        """End every process; keep the upper layer, on disk."""
        def run() -> None:
            # Held still while the upper layer is copied out of its tmpfs,
            # which goes with the keeper's mount namespace.
            with freezes.held(self.parts.cgroup, self.parts.layers.sandbox_dir):
                fault_point("suspend.bubblewrap.frozen")
                self.parts.layers.save_upper()
                fault_point("suspend.bubblewrap.saved")
                self._end_processes()
            fault_point("suspend.bubblewrap.ended")
            self.parts.layers.upper_on = "disk"
        self._drop_agent_connections()
        await anyio.to_thread.run_sync(run)

    async def resume(self) -> None:
        if self.parts.keeper is not None and self.parts.keeper.alive():
            return
        def run() -> None:
            layers = self.parts.layers
            layers.prepare()
            self._start_keeper()  # it copies the upper layer back onto its tmpfs
            fault_point("resume.bubblewrap.started")
            layers.upper_on = "hot"
            shutil.rmtree(layers.disk_upper, ignore_errors=True)
        await anyio.to_thread.run_sync(run)
        if self._agent is not None:
            await self._await_agent()

    def _release_network(self) -> None:
        if self.net_index is not None:
            net.disconnect(self.net_index)
            net.release(self.net_index)
            self.net_index = None

    async def _destroy(self) -> None:
        def run() -> None:
            errors: list[str] = []
            steps = (
                self._end_processes, self.parts.layers.remove, self.parts.cgroup.remove,
                snapshots.collect_garbage, self._release_network,
            )
            for step in steps:
                try:
                    step()
                except (OSError, ProviderError) as exc:
                    errors.append(str(exc))
            if errors:
                raise ProviderError(f"closing sandbox {self.sandbox_id}: {'; '.join(errors)}")
        self._drop_agent_connections()
        await anyio.to_thread.run_sync(run)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _live.pop(self.sandbox_id, None)
        await self._destroy()


def _keeper_file(sandbox_dir: str) -> str:
    return os.path.join(sandbox_dir, "keeper.json")


def _read_keeper(sandbox_dir: str) -> Keeper | None:
    """The keeper last started for the sandbox, as its directory records it."""
    try:
        with open(_keeper_file(sandbox_dir)) as fh:
            return Keeper.from_dict(json.load(fh))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_owner(sandbox_dir: str) -> None:
    """Who made the sandbox: reap_orphans leaves a live process's sandboxes alone."""
    with open(os.path.join(sandbox_dir, "owner"), "w") as fh:
        fh.write("{} {}".format(*this_process()))


def _owner_alive(sandbox_dir: str) -> bool:
    """Whether the process that made this sandbox is alive and not this one."""
    try:
        with open(os.path.join(sandbox_dir, "owner")) as fh:
            pid, start = (int(x) for x in fh.read().split())
    except (OSError, ValueError):
        return False
    return pid != os.getpid() and still_running(pid, start)


def _discard(sandbox_id: str) -> None:
    """Free what a sandbox left: processes, mounts, cgroups, network, files."""
    cgroup = SandboxCgroup(sandbox_id)
    with contextlib.suppress(OSError, ProviderError):
        cgroup.kill_all()
    sandbox_dir = os.path.join(bubblewrap_home(), "sandboxes", sandbox_id)
    with contextlib.suppress(OSError, ProviderError):
        Layers(sandbox_dir, []).remove()
    with contextlib.suppress(OSError, ProviderError):
        cgroup.remove()
    net.release_of(sandbox_id)


def _policy(value: Any) -> NetworkPolicy:
    if value in ("none", "all"):
        return str(value)  # type: ignore[return-value]
    return AllowList.model_validate(value)


def _log_tail(sandbox_dir: str) -> str:
    try:
        with open(os.path.join(sandbox_dir, "keeper.log"), "rb") as fh:
            text = fh.read()[-1000:].decode(errors="replace").strip()
    except OSError:
        return ""
    return f"({text})" if text else ""
