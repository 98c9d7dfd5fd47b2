"""Provisioning a bubblewrap sandbox: its root file system, its overlay, its
keeper.

Layout on the host, under ``$HUTCH_HOME/bubblewrap``::

    sandboxes/<id>/hot/        a tmpfs of the sandbox's own (capped at ``disk``)
                   hot/upper   the overlay's upper layer while it runs: file
                   hot/work    creation on tmpfs is ~30x faster than on ext4
                   upper/      the upper layer on disk while suspended (a
                               resume copies it back onto a fresh tmpfs)
                   lower-<n>/  a lower layer stored in the host's ids, through
                               an idmapped mount (see :mod:`.userns`)
    /run/hutch/bubblewrap/root the overlay: lower layers (read-only, shared)
                               + the upper layer; bwrap binds it as ``/``
    /run/hutch/bubblewrap/agent  the agent's binary, bound for bwrap to bind

``hot``, the lower layers' and the ``/run/hutch/bubblewrap`` mount points
are mounted on in the keeper's private mount namespace only (see
:class:`Layers`); on the host they stay empty, and the host reaches them
through ``/proc/<keeper>/root``. bwrap runs as root of the sandboxes' user
namespace, an unprivileged host id, which may not search a data directory
under /root: so what it binds is at a path any user can reach, the same for
every sandbox (each its own in its own namespace).
    snapshots/<id>/layer/      a captured upper layer (a lower layer of forks)

Docker images are exported once into $HUTCH_CACHE_DIR/rootfs/<name>-<id>/
(/var/cache/hutch for root), shared read-only by every data directory.

The keeper is a bwrap process holding the sandbox's namespaces (pid, ipc, uts,
cgroup, net, mount): ``/bin/sh`` blocked reading its stdin, a pipe whose
both ends it holds, under bwrap's own init as PID 1 (which reaps orphans). Execs join its
namespaces (see :mod:`.runtime`). It survives the daemon unless the sandbox
is ``ephemeral`` (``--die-with-parent``), so a restarted daemon adopts it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from ..._atomic import write_json
from ..._errors import InvalidArgument, ProviderError, SandboxUnavailable
from ..._liveness import process_start_time, still_running
from ..._paths import hutch_home
from .. import _mounts
from .._signals import default_signals_prefix
from . import mountns, userns
from .cgroups import JOIN_AND_EXEC, SandboxCgroup
from .seccomp import compile_filter
from .starter import STARTER

T = TypeVar("T")
log = logging.getLogger("hutch.bubblewrap")
_MS_NOSUID = _mounts.MS_NOSUID
_MS_NODEV = _mounts.MS_NODEV
_MS_BIND = _mounts.MS_BIND
#: Characters the overlay's option string cannot carry in a path.
_BAD_LAYER_CHARS = re.compile(r"[:,\\\s]")
#: The namespaces an exec joins (the mount namespace is bwrap's own per exec).
JOINED_NAMESPACES = ("net", "ipc", "uts", "cgroup", "pid")
#: In the keeper's environment only: how the busy count tells it apart.
KEEPER_MARKER = "HUTCH_BWRAP_KEEPER"
#: Where the agent's executable is bound inside.
AGENT_BINARY_PATH = "/.hutch/bin/hutch-agent"
#: Mount points of every keeper's private mount namespace (see the module's
#: doc), where bwrap, as root of the sandboxes' user namespace, reaches them.
SHARED_POINTS = "/run/hutch/bubblewrap"
#: The overlay, in a keeper's private mount namespace.
ROOT_POINT = os.path.join(SHARED_POINTS, "root")
#: The agent's binary, in a keeper's private mount namespace.
AGENT_POINT = os.path.join(SHARED_POINTS, "agent")
#: The host-global knobs of a sandbox's /proc (kernel settings, the SysRq
#: trigger, IRQ affinity, bus and file system tunables), bound read-only over
#: its own /proc, as Docker's readonly paths are: a sandbox's root may not
#: change what holds for the whole host, whatever its uid. (Its /sys is the
#: image's empty directory: no sysfs is mounted.)
READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")


#: What root inside keeps of its capabilities (in its own user namespace
#: only: over files whose owners are mapped there, and its own processes):
#: what package managers use (dpkg chowns and sets modes, apt switches to
#: its _apt user) and no more, as Docker's default set less raw sockets,
#: mknod, chroot, file capabilities and audit. Nothing over the host: no
#: CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE and the rest.
KEPT_CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
                     "CAP_SETGID", "CAP_SETUID")


def capability_args() -> list[str]:
    return ["--cap-drop", "ALL", *(a for c in KEPT_CAPABILITIES for a in ("--cap-add", c))]


def enter_user_namespace(fd: int) -> list[str]:
    """The command prefix that runs bwrap in the sandboxes' user namespace
    (descriptor ``fd``, passed on) as root there: nsenter switches to uid and
    gid 0 inside (the range's first host ids), where bwrap itself would keep
    the host's root uid (it does not change a uid it was started with)."""
    return ["nsenter", f"--user=/proc/self/fd/{fd}", "--"]


def proc_args() -> list[str]:
    """bwrap's arguments for a sandbox's /proc: its own (its PID namespace's),
    the host-global knobs in it read-only."""
    return ["--proc", "/proc", *(a for p in READ_ONLY_PROC for a in ("--ro-bind-try", p, p))]

_SECCOMP: bytes | None = None


def bubblewrap_home() -> str:
    return os.path.join(hutch_home(), "bubblewrap")


def seccomp_fd() -> int:
    """A fresh descriptor holding the compiled filter (bwrap reads and closes it)."""
    global _SECCOMP
    if _SECCOMP is None:
        _SECCOMP = compile_filter()
    fd = os.memfd_create("hutch-seccomp", 0)
    os.write(fd, _SECCOMP)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _umount(target: str) -> None:
    try:
        _mounts.umount(target, detach=True)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):  # not a mount point; gone
            raise ProviderError(exc.strerror or str(exc)) from None


def check_layer_path(path: str) -> str:
    if not os.path.isabs(path):
        raise InvalidArgument(f"root file system {path!r} must be an absolute path")
    if _BAD_LAYER_CHARS.search(path):
        raise InvalidArgument(
            f"root file system path {path!r} has a character an overlay cannot take "
            "(colon, comma, backslash or white space)"
        )
    return path


@dataclass
class Layers:
    """Where one sandbox's overlay lives.

    The tmpfs under the upper layer and the overlay itself are mounted in a
    private mount namespace of the sandbox's own (the keeper's, see
    :class:`~.starter.Starter`), never in the host's: every new mount namespace on the
    host (each bwrap, each container) copies the host's mount table, so two
    mounts a sandbox there would make every sandbox start slower as they
    grow in number (1000 extra mounts: a bare bwrap 19 ms -> 149 ms here).
    The host reaches them through the keeper, ``/proc/<pid>/root``
    (:attr:`view`); a suspended sandbox's upper layer is a plain directory.
    """

    sandbox_dir: str
    #: Lower layers, top first; the last is the root file system.
    lowers: list[str]
    #: ``hot`` (the running sandbox's tmpfs) or ``disk`` (suspended).
    upper_on: str = "hot"
    #: The tmpfs cap, bytes.
    disk_limit: int = 4 << 30
    #: How the host reaches the keeper's mount namespace (``/proc/<pid>/root``),
    #: while there is a keeper.
    view: str = ""
    #: Where the overlay is mounted in that namespace: :data:`ROOT_POINT`; a
    #: keeper started before hutch had user namespaces has it in ``merged``.
    root_point: str = ROOT_POINT

    @property
    def merged(self) -> str:
        """The overlay, as its keeper's namespace names it."""
        return self.root_point or os.path.join(self.sandbox_dir, "merged")

    @property
    def hot(self) -> str:
        return os.path.join(self.sandbox_dir, "hot")

    @property
    def disk_upper(self) -> str:
        return os.path.join(self.sandbox_dir, "upper")

    @property
    def merged_view(self) -> str:
        """The overlay, as the host reaches it."""
        if not self.view:
            raise SandboxUnavailable("the sandbox is not running")
        return self.view + self.merged

    @property
    def upper(self) -> str:
        """The upper layer, as the host reaches it."""
        if self.upper_on == "hot":
            if not self.view:
                raise SandboxUnavailable("the sandbox is not running")
            return self.view + os.path.join(self.hot, "upper")
        return self.disk_upper

    def prepare(self) -> None:
        """The mount points, and the record of what the sandbox stands on."""
        shared_points()
        os.makedirs(self.hot, exist_ok=True)
        # What this sandbox stands on, for the snapshot garbage collector.
        write_json(os.path.join(self.sandbox_dir, "lowers.json"), self.lowers, durable=False)

    @property
    def home(self) -> str:
        """The directory the overlay is mounted from (``$HUTCH_HOME/bubblewrap``):
        lower layers below it are named relative to it, so that a long chain
        of snapshot layers fits the one page a mount's options may fill."""
        return os.path.dirname(os.path.dirname(self.sandbox_dir))

    def overlay_options(self, mounted: list[str] | None = None) -> str:
        """The overlay's options, over ``mounted`` (the lower layers as
        :meth:`mount` mounts them: each stored in host ids through an
        idmapped mount of its own) or the layers themselves."""
        prefix = self.home.rstrip("/") + "/"
        lowers = [p[len(prefix):] if p.startswith(prefix) else p
                  for p in (self.lowers if mounted is None else mounted)]
        options = (
            f"lowerdir={':'.join(lowers)},upperdir={self.hot}/upper,"
            f"workdir={self.hot}/work,"
            # The upper layer must stand alone as a lower layer of forks.
            "redirect_dir=off,metacopy=off,index=off"
        )
        if len(options) > 4000:
            raise ProviderError(
                f"{len(self.lowers)} stacked layers are more than one overlay mount can name; "
                "capture with diff=False to start a new chain"
            )
        return options

    def mount(self) -> None:
        """Mount the sandbox's tmpfs (a suspended upper layer copied back onto
        it) and its overlay, in the calling thread's mount namespace: run by
        the starter thread (:class:`~.starter.Starter`), never in the host's.

        A lower layer stored in the host's ids (a root file system) is
        mounted through an idmapped mount of its own first, so that its root
        owned files are root's inside (see :mod:`.userns`); the upper layer
        is the range's root's, as what the sandbox writes there is."""
        mountns.mount("hutch-upper", self.hot, "tmpfs", _MS_NOSUID | _MS_NODEV,
               f"size={self.disk_limit},mode=0700")
        upper, work = os.path.join(self.hot, "upper"), os.path.join(self.hot, "work")
        if self.upper_on == "disk":
            copy_tree(self.disk_upper, upper)  # cp, started from this thread: in here
        else:
            os.mkdir(upper)
            os.chmod(upper, 0o755)
            os.chown(upper, *userns.id_range().root)
        os.mkdir(work)
        os.chmod(work, 0o755)
        mounted = []
        for index, lower in enumerate(self.lowers):
            if userns.shifted(lower):
                mounted.append(lower)
                continue
            point = os.path.join(self.sandbox_dir, f"lower-{index}")
            os.makedirs(point, exist_ok=True)
            userns.idmapped_mount(lower, point)
            mounted.append(point)
        os.chdir(self.home)  # lower layers are named relative to it
        try:
            self.root_point = ROOT_POINT
            mountns.mount("hutch-overlay", self.merged, "overlay", 0, self.overlay_options(mounted))
        finally:
            os.chdir("/")

    def save_upper(self) -> None:
        """Copy the running sandbox's upper layer to disk (what a suspended
        sandbox keeps); its processes must be held or ended after this."""
        if self.upper_on != "hot":
            return
        # Whole or not at all: a copy on disk is what a program finding the
        # sandbox after this one died takes for its suspended state.
        partial = self.disk_upper + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            copy_tree(self.upper, partial)
        except BaseException:
            # A copy that failed midway (a full disk) holds its room no longer.
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(self.disk_upper, ignore_errors=True)
        os.rename(partial, self.disk_upper)

    def remove(self) -> None:
        # Mounts of an older layout, made on the host, if any are left.
        _umount(os.path.join(self.sandbox_dir, "merged"))
        _umount(self.hot)
        shutil.rmtree(self.sandbox_dir, ignore_errors=True)


def shared_points() -> None:
    """Make :data:`SHARED_POINTS` (empty on the host: mount points), which any
    user may search (hutch's umask may be 077): its own directories are made
    so, the host's above them must be."""
    if os.path.isfile(AGENT_POINT):
        return
    os.makedirs(ROOT_POINT, exist_ok=True)
    ours = (os.path.dirname(SHARED_POINTS), SHARED_POINTS)
    for path in ours:
        mode = os.stat(path).st_mode
        if not mode & 0o001:
            os.chmod(path, mode | 0o001)
    above = os.path.dirname(ours[0])
    while above != "/":
        if not os.stat(above).st_mode & 0o001:
            raise ProviderError(
                f"{above} is not searchable by other users: bubblewrap sandboxes need "
                f"{SHARED_POINTS} reachable by an unprivileged user"
            )
        above = os.path.dirname(above)
    with open(AGENT_POINT, "a"):
        pass


def copy_tree(source: str, target: str) -> None:
    """Copy an overlay layer exactly: whiteouts (0:0 devices), opaque-dir
    xattrs, owners, modes and times (``cp -a``)."""
    done = subprocess.run(
        ["cp", "-a", "--", source, target], capture_output=True, check=False
    )
    if done.returncode != 0:
        raise ProviderError(f"copying {source}: {done.stderr.decode(errors='replace').strip()}")


@dataclass
class Keeper:
    """The process that holds a sandbox's namespaces."""

    #: The outer bwrap (host PID namespace).
    outer_pid: int
    #: bwrap's init, PID 1 inside: whose namespaces an exec joins.
    init_pid: int
    #: Its start time (clock ticks since boot): a PID reused later differs.
    start_time: int
    #: Namespace inodes, to check a descriptor opened later is the same one.
    namespaces: dict[str, int]

    def to_dict(self) -> dict[str, object]:
        # By hand: dataclasses.asdict deep-copies field by field, 40 times
        # as long, on every transition's record of the sandbox.
        return {"outer_pid": self.outer_pid, "init_pid": self.init_pid,
                "start_time": self.start_time, "namespaces": dict(self.namespaces)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Keeper:
        ns = data["namespaces"]
        assert isinstance(ns, dict)
        return cls(
            int(str(data["outer_pid"])), int(str(data["init_pid"])),
            int(str(data["start_time"])), {str(k): int(str(v)) for k, v in ns.items()},
        )

    def alive(self) -> bool:
        """Whether the sandbox runs as hutch reaches it: bwrap's init (its
        PID 1, whose namespaces an exec joins) and the outer bwrap, through
        which the host reaches its files (:attr:`view`). Either one killed
        outside hutch leaves a sandbox no call can use."""
        if not still_running(self.init_pid, self.start_time):
            return False
        if "setup_mnt" not in self.namespaces:
            return True  # recorded before the outer bwrap's was: the init's word stands
        try:
            return os.stat(f"/proc/{self.outer_pid}/ns/mnt").st_ino == self.namespaces["setup_mnt"]
        except OSError:  # gone, or a zombie (whose namespaces are gone)
            return False

    def pidfds(self) -> list[int]:
        """Descriptors that become readable when the outer bwrap or its init
        ends (``pidfd_open``), for a watcher to wait on; one of a process
        already gone is left out (:meth:`alive` says so)."""
        fds = []
        for pid in (self.outer_pid, self.init_pid):
            with contextlib.suppress(OSError):
                fds.append(os.pidfd_open(pid))
        return fds

    @property
    def view(self) -> str:
        """How the host reaches the keeper's private mount namespace."""
        return f"/proc/{self.outer_pid}/root"

    def check_view(self) -> None:
        """That :attr:`view` still leads where it did (no reused PID): called
        after a descriptor was opened through it, so a pass covers that one."""
        try:
            same = os.stat(f"/proc/{self.outer_pid}/ns/mnt").st_ino == self.namespaces.get(
                "setup_mnt"
            )
        except OSError:
            same = False
        if not same:
            raise SandboxUnavailable("the sandbox's keeper has ended")

    def open_setup_mount(self) -> int:
        """A descriptor of the private mount namespace, checked."""
        fd = os.open(f"/proc/{self.outer_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if os.fstat(fd).st_ino != self.namespaces.get("setup_mnt"):
            os.close(fd)
            raise SandboxUnavailable("the sandbox's keeper has ended")
        return fd

    def open_namespaces(self) -> dict[str, int]:
        """Descriptors of the keeper's namespaces, checked to be the recorded ones."""
        fds: dict[str, int] = {}
        # A keeper started before hutch had user namespaces has none to join.
        names = (*JOINED_NAMESPACES, *(("user",) if "user" in self.namespaces else ()))
        try:
            for name in names:
                fd = os.open(f"/proc/{self.init_pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
                fds[name] = fd
                if os.fstat(fd).st_ino != self.namespaces[name]:
                    raise FileNotFoundError(name)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise SandboxUnavailable("the sandbox's keeper has ended") from None
        return fds




def start_keeper(
    layers: Layers,
    cgroup: SandboxCgroup,
    *,
    hostname: str,
    network: bool,
    ephemeral: bool,
    log_path: str,
    agent: tuple[str, int] | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str = "/",
    timeout: float = 30.0,
) -> tuple[Keeper, subprocess.Popen[bytes]]:
    """Start the keeper: ``sh`` blocked on a pipe, or with ``agent`` (its
    binary's host path and a listening socket's descriptor) hutch's agent,
    serving the runtime on that socket; ``env`` is what it (and so
    every command it starts) has as its environment."""
    block_r, block_w = os.pipe()
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    filter_fd = seccomp_fd()
    user_fd = userns.namespace_fd()  # this process's: passed on, never closed here
    passed = [block_w, info_w, filter_fd, user_fd]
    if agent is not None:
        listener = agent[1]
        passed.append(listener)
        keeper_command = [
            "--ro-bind", AGENT_POINT, AGENT_BINARY_PATH,
            "--clearenv", *(a for k, v in (env or {}).items() for a in ("--setenv", k, v)),
            # In the working directory, as docker's keeper is: the agent
            # resolves a relative command against its own directory.
            "--chdir", workdir, "--",
            AGENT_BINARY_PATH, "serve-fd", str(listener),
        ]
    else:
        # Its stdin is a pipe whose write end it holds too: the read never ends.
        keeper_command = ["--chdir", "/", "--", "/bin/sh", "-c", "echo; read _"]
    bwrap = [
        *enter_user_namespace(user_fd),
        "bwrap", "--bind", layers.merged, "/", *proc_args(), "--dev", "/dev",
        "--dir", workdir,
        # The network namespace is the starter's, made for this keeper alone
        # (and the host's user namespace's: root inside has no say over it);
        # the others bwrap makes in the sandboxes' user namespace.
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--hostname", hostname, *capability_args(), "--new-session",
        "--seccomp", str(filter_fd), "--info-fd", str(info_w),
        *(["--die-with-parent"] if ephemeral else []),
        *keeper_command,
    ]
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "HUTCH_CGROUP_PROCS": cgroup.keeper_procs_files(),
        KEEPER_MARKER: "1",
    }

    def mount_and_start(joined: bool) -> subprocess.Popen[bytes]:
        # The keeper inherits the starter's new mount namespace, then holds it
        # alone; and is born in the sandbox's cgroups, or joins them first.
        layers.mount()
        if agent is not None:
            mountns.mount(agent[0], AGENT_POINT, None, _MS_BIND, None)
        # Of the host's mounts copied in, only what runs here uses stays.
        mountns.keep_only((SHARED_POINTS, layers.sandbox_dir))
        argv = bwrap if joined else ["/bin/sh", "-c", JOIN_AND_EXEC, "hutch-keeper", *bwrap]
        # The keeper outlives this call and starts every agent command: it
        # starts with default signals, whatever this program ignores. Decided
        # here, on the thread that spawns it (its mask is what the keeper
        # inherits): through env only when it would inherit an ignored or a
        # blocked signal, not always (an exec more: ~2 ms of each start).
        argv = [*default_signals_prefix(), *argv]
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                argv, env=env, stdin=block_r, stdout=log if agent else ready_w, stderr=log,
                pass_fds=passed, start_new_session=True,
                cwd="/",
            )

    try:
        proc = STARTER.run(mount_and_start, cgroup, own_network=not network)
    except BaseException:
        os.close(info_r)
        os.close(ready_r)
        raise
    finally:
        for fd in (block_r, block_w, info_w, ready_w, filter_fd):
            os.close(fd)
    try:
        return _started_keeper(proc, info_r, ready_r if agent is None else None, log_path,
                               timeout, own_network=not network)
    finally:
        os.close(info_r)
        os.close(ready_r)


def _started_keeper(
    proc: subprocess.Popen[bytes], info_fd: int, ready_fd: int | None, log_path: str,
    timeout: float, *, own_network: bool,
) -> tuple[Keeper, subprocess.Popen[bytes]]:
    info = _read_info(info_fd, proc, timeout)
    if info is None:
        proc.kill()
        proc.wait()
        raise ProviderError(f"bubblewrap did not start: {_tail(log_path)}")
    init_pid = int(str(info["child-pid"]))
    namespaces = {}
    try:
        for name in (*JOINED_NAMESPACES, "mnt", "user"):
            namespaces[name] = os.stat(f"/proc/{init_pid}/ns/{name}").st_ino
        # The private mount namespace the overlay is mounted in (the outer bwrap's).
        namespaces["setup_mnt"] = os.stat(f"/proc/{proc.pid}/ns/mnt").st_ino
    except FileNotFoundError:
        proc.kill()
        proc.wait()
        raise ProviderError(f"bubblewrap's init ended at once: {_tail(log_path)}") from None
    if own_network and namespaces["net"] == os.stat("/proc/self/ns/net").st_ino:
        proc.kill()
        proc.wait()
        raise ProviderError("bubblewrap: the keeper came up in hutch's own network namespace")
    start = process_start_time(init_pid)
    if start is None:
        raise ProviderError(f"bubblewrap's init ended at once: {_tail(log_path)}")
    # bwrap's init starts the keeper's command once the sandbox's file system
    # is set up (until then a command joining it would find no /workspace):
    # the shell keeper says so on its stdout, ``ready_fd`` (the agent, by
    # answering on its socket).
    if ready_fd is not None and not (
        _wait_readable(ready_fd, proc, timeout) and os.read(ready_fd, 1)
    ):
        proc.kill()
        proc.wait()
        raise ProviderError(f"bubblewrap did not set the sandbox up: {_tail(log_path)}")
    return Keeper(proc.pid, init_pid, start, namespaces), proc


def _wait_readable(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``fd`` became readable (or hung up) before ``timeout`` and
    before ``proc`` ended."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if poller.poll(min(remaining, 0.05) * 1000):
            return True
        if proc.poll() is not None:
            return False
    return False


def _read_info(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, object] | None:
    """bwrap's ``--info-fd`` JSON (``child-pid``), or None if it failed first."""
    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        try:
            parsed = json.loads(buf)
        except ValueError:
            pass
        else:
            if isinstance(parsed, dict) and "child-pid" in parsed:
                return parsed
        if not _wait_readable(fd, proc, deadline - time.monotonic()):
            return None
        data = os.read(fd, 4096)
        if not data:
            return None
        buf += data


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read()[-2000:].decode(errors="replace").strip() or "(no message)"
    except OSError:
        return "(no log)"
