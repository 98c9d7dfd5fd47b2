"""The bubblewrap provider, from inside: tests that try to get out, limits
that must hold, the lifecycle, and adoption after a daemon restart.

Its root file system is the test image, exported from Docker once (so these
tests need the engine, as the docker tests do).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import socket
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import hutch
from hutch.providers.base import ProcessRequest
from tests.conftest import TEST_IMAGE
from tests.hazards import answers_beside_busy_loops, cpu_cgroup, fill_with_processes

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


async def _make(**settings: Any) -> Any:
    return await hutch.create_sandbox(
        "bubblewrap", image=TEST_IMAGE, ephemeral=True, read_before_write=False, **settings
    )


@pytest.fixture
async def sandbox() -> AsyncIterator[Any]:
    sb = await _make()
    try:
        yield sb
    finally:
        await sb.close()


@pytest.fixture(params=["agent", "native"])
async def each_runtime(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A sandbox on each runtime: the file API is the agent's inside the
    sandbox, or the host's through openat2 on the overlay."""
    sb = await _make(runtime=request.param)
    try:
        yield sb
    finally:
        await sb.close()


@pytest.fixture
def canary() -> Any:
    """A host file a sandbox must never read or write, in a host directory."""
    directory = tempfile.mkdtemp(prefix="hutch-canary-")
    path = os.path.join(directory, "canary")
    secret = f"HOST-SECRET-{secrets.token_hex(8)}"
    with open(path, "w") as fh:
        fh.write(secret)
    yield directory, path, secret
    with open(path) as fh:
        assert fh.read() == secret, "the host canary was written"
    assert sorted(os.listdir(directory)) == ["canary"], "a file appeared beside the canary"
    os.remove(path)
    os.rmdir(directory)


# -- isolation ---------------------------------------------------------------------------


#: Bits of the capabilities root inside keeps (linux/capability.h): chown,
#: dac_override, fowner, fsetid, kill, setgid, setuid.
KEPT_CAPABILITY_BITS = sum(1 << bit for bit in (0, 1, 3, 4, 5, 6, 7))


async def test_few_capabilities_no_new_privileges_and_seccomp(sandbox: Any) -> None:
    """Root inside keeps what package managers use, in its own user namespace
    only; another user has none."""
    for user, kept in ((None, KEPT_CAPABILITY_BITS), ("nobody", 0)):
        status = (await sandbox.exec(["cat", "/proc/self/status"], user=user)).stdout
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        assert fields["NoNewPrivs"].strip() == "1"
        assert int(fields["CapEff"], 16) == kept
        assert int(fields["CapPrm"], 16) == kept
        assert fields["Seccomp"].strip() == "2"


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_a_package_manager_works_as_root_inside(runtime: str) -> None:
    """dpkg installs and removes a package, a file can be given to another
    group with a setgid mode, and apt's switch to its _apt user works:
    what root inside keeps is enough for them (no network needed here)."""
    sb = await _make(runtime=runtime)
    try:
        said = await sb.exec(
            "set -e; mkdir -p /tmp/p/DEBIAN /tmp/p/usr/local/bin; "
            "printf 'Package: hutch-probe\\nVersion: 1\\nArchitecture: all\\n"
            "Maintainer: hutch\\nDescription: probe\\n' > /tmp/p/DEBIAN/control; "
            "printf '#!/bin/sh\\necho probe\\n' > /tmp/p/usr/local/bin/hutch-probe; "
            "chmod 755 /tmp/p/usr/local/bin/hutch-probe; "
            "dpkg-deb --root-owner-group --build /tmp/p /tmp/probe.deb >/dev/null; "
            "dpkg -i /tmp/probe.deb >/dev/null; hutch-probe; "
            "chgrp shadow /usr/local/bin/hutch-probe; chmod 2755 /usr/local/bin/hutch-probe; "
            "stat -c '%a %U:%G' /usr/local/bin/hutch-probe; "
            "dpkg -r hutch-probe >/dev/null; test ! -e /usr/local/bin/hutch-probe; "
            "setpriv --reuid=_apt --regid=nogroup --clear-groups id -un"
        )
        assert said.exit_code == 0, said
        assert said.stdout.splitlines() == ["probe", "2755 root:shadow", "_apt"]
    finally:
        await sb.close()


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_root_inside_is_an_unprivileged_host_id(runtime: str) -> None:
    """Root inside is the first id of hutch's range on the host (issue 19: it
    was the host's root): what it writes is owned by that id on the host, a
    file hutch writes from the host side is root's inside, and the image's
    files (owned by the host's root) are root's inside too."""
    from hutch._sandbox import backend_of
    from hutch.providers.bubblewrap.userns import id_range

    ids = id_range()
    sb = await _make(runtime=runtime)
    try:
        await sb.write_bytes("/workspace/from-host/file", b"x")
        said = await sb.exec(
            "cat /proc/self/uid_map /proc/self/gid_map; echo made > /workspace/made; "
            "stat -c '%u:%g %n' /workspace/from-host /workspace/from-host/file /etc/passwd /; "
            "echo more >> /workspace/from-host/file && echo appended; "
            "echo '# touched' >> /etc/passwd && echo image-file-written"
        )
        assert said.exit_code == 0, said
        lines = said.stdout.splitlines()
        assert lines[0].split() == ["0", str(ids.uid), str(ids.count)]
        assert lines[1].split() == ["0", str(ids.gid), str(ids.count)]
        assert lines[2:6] == ["0:0 /workspace/from-host", "0:0 /workspace/from-host/file",
                              "0:0 /etc/passwd", "0:0 /"]
        assert lines[6:] == ["appended", "image-file-written"]
        upper = backend_of(sb).parts.layers.upper
        for path in ("workspace/made", "workspace/from-host/file", "etc/passwd", "."):
            st = os.stat(os.path.join(upper, path))
            assert (st.st_uid, st.st_gid) == ids.root, path
    finally:
        await sb.close()


async def test_syscalls_that_reach_the_kernel_are_refused(sandbox: Any) -> None:
    result = await sandbox.exec(
        "unshare -U true; echo unshare=$?; mount -t tmpfs x /mnt 2>/dev/null; echo mount=$?"
    )
    assert "unshare=0" not in result.stdout
    assert "mount=0" not in result.stdout


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_no_process_inside_takes_another_ones_descriptors(runtime: str) -> None:
    """The keeper's processes hold host files (its log) and hutch's own
    connections: pidfd_getfd on them (or on anything) is refused, as ptrace is."""
    sb = await _make(runtime=runtime)
    try:
        result = await sb.exec(["perl", "-e", (
            "opendir(my $d, '/proc') or die; "
            "for my $pid (grep { /^[0-9]+$/ } readdir $d) { "
            "  my $pidfd = syscall(434, $pid + 0, 0); next if $pidfd < 0; "
            "  for my $fd (0..16) { "
            "    my $got = syscall(438, $pidfd, $fd, 0); "
            "    print \"took $pid/$fd\\n\" if $got >= 0; "
            "    print \"refused $pid/$fd\\n\" if $got < 0 && $! + 0 == 1; "  # EPERM
            "  } "
            "}"
        )])
        assert result.exit_code == 0, result
        assert "took" not in result.stdout, result.stdout
        assert "refused 1/0" in result.stdout  # bwrap's init, whose stdio is a host file
    finally:
        await sb.close()


async def test_no_connection_leaves_the_sandbox(sandbox: Any) -> None:
    # A listener on the host's loopback: the sandbox's loopback is its own.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        targets = [("127.0.0.1", port), ("1.1.1.1", 53), ("169.254.169.254", 80)]
        for address in _host_addresses():
            targets.append((address, port))
        for host, target_port in targets:
            result = await sandbox.exec(
                ["bash", "-c", f"exec 3<>/dev/tcp/{host}/{target_port} && echo connected"],
                timeout=20,
            )
            assert result.exit_code != 0 and "connected" not in result.stdout, (host, target_port)
    interfaces = await sandbox.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
    assert interfaces.stdout.split() == ["lo"]


def _host_addresses() -> list[str]:
    found = []
    with open("/proc/net/fib_trie") as fh:
        lines = fh.read().splitlines()
    for previous, line in itertools.pairwise(lines):
        if "32 host LOCAL" in line:
            address = previous.strip().split()[-1]
            if not address.startswith("127."):
                found.append(address)
    return sorted(set(found))


async def test_each_sandbox_has_a_network_of_its_own() -> None:
    """Network namespaces are made ahead of time: each still serves one
    sandbox only (a server on one's loopback is not reached from another's)."""
    first, second = await _make(), await _make()
    try:
        probe = (
            "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 4242), 2)'"
        )
        await first.exec(
            "nohup python3 -c 'import socket,time; s=socket.socket(); "
            "s.bind((\"127.0.0.1\", 4242)); s.listen(); time.sleep(60)' >/dev/null 2>&1 &"
        )
        for _ in range(100):
            if (await first.exec(probe)).exit_code == 0:
                break
            await anyio.sleep(0.05)
        else:
            raise AssertionError("the server in the first sandbox never listened")
        assert (await second.exec(probe)).exit_code != 0
        inodes = [
            int((await sb.exec("stat -L -c %i /proc/self/ns/net")).stdout) for sb in (first, second)
        ]
        assert inodes[0] != inodes[1]
        assert os.stat("/proc/self/ns/net").st_ino not in inodes
    finally:
        await first.close()
        await second.close()


async def test_host_files_outside_the_root_are_not_visible(sandbox: Any, canary: Any) -> None:
    directory, path, secret = canary
    result = await sandbox.exec(["cat", path])
    assert result.exit_code != 0 and secret not in result.stdout
    listing = await sandbox.exec(["ls", "/"])
    assert os.path.basename(directory) not in listing.stdout
    grep = await sandbox.exec(f"grep -rs {secret} /tmp /root /home /workspace; echo done")
    assert secret not in grep.stdout


async def test_proc_shows_only_the_sandboxs_processes(sandbox: Any) -> None:
    result = await sandbox.exec(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) < 10, lines
    assert not any("pytest" in line or "dockerd" in line for line in lines)


# -- the file API and symlinks made inside -------------------------------------------------


async def test_symlinks_to_host_paths_resolve_inside(each_runtime: Any, canary: Any) -> None:
    sandbox = each_runtime
    directory, path, _secret = canary
    depth = "../" * 12
    await sandbox.exec(
        f"ln -s {path} abs; ln -s {depth}{path.lstrip('/')} rel; ln -s {directory} dir; "
        "ln -s /proc/1/root/etc/shadow magic"
    )
    for name in ("abs", "rel", "dir/canary"):
        with pytest.raises(FileNotFoundError):
            await sandbox.read_bytes(name)
    # /proc/1/root inside is the sandbox's own root: its view, or refused.
    own_shadow = (await sandbox.exec(["cat", "/etc/shadow"])).stdout_bytes
    try:
        assert await sandbox.read_bytes("magic") == own_shadow
    except FileNotFoundError:
        pass
    with pytest.raises(FileNotFoundError):
        await sandbox.list_dir("dir")
    with pytest.raises(FileNotFoundError):
        await sandbox.remove("dir/canary")
    # A write through a link lands in the sandbox's own tree, or fails.
    with pytest.raises(FileNotFoundError):
        await sandbox.write_bytes("dir/new", b"x")
    await sandbox.exec(["mkdir", "-p", os.path.dirname(path)])
    await sandbox.write_bytes("abs", b"written through a link")
    inside = await sandbox.exec(["cat", path])
    assert inside.stdout == "written through a link"
    await sandbox.remove("abs")
    assert (await sandbox.exec(["cat", path])).stdout == "written through a link"
    # The sandbox's /etc/shadow is the image's, not the host's.
    shadow = await sandbox.exec(["cat", "/etc/shadow"])
    assert await sandbox.read_text("/etc/shadow") == shadow.stdout


async def test_directory_swapped_for_a_symlink_during_1000_writes(
    each_runtime: Any, canary: Any
) -> None:
    sandbox = each_runtime
    directory, path, secret = canary
    # Inside, a loop swaps a directory for a link to the host directory's path.
    swapper = await sandbox.start(
        f"while :; do rm -rf sw; mkdir sw; rm -rf sw; ln -s {directory} sw; "
        f"rm -f sw; ln -s {path} sw; rm -f sw; done"
    )
    refused = 0
    try:
        for i in range(1000):
            try:
                await sandbox.write_bytes("sw/canary", f"overwrite {i}".encode())
                await sandbox.write_bytes("sw", b"through the file link")
            except (FileNotFoundError, IsADirectoryError, hutch.HutchError):
                refused += 1
            if i % 100 == 0:
                try:
                    data = await sandbox.read_bytes("sw/canary")
                except (FileNotFoundError, IsADirectoryError, hutch.HutchError):
                    continue
                assert secret.encode() not in data
    finally:
        await swapper.kill()
    assert refused < 2000, "no write got through at all: the swap loop proved nothing"
    # The canary fixture checks the host file and directory are untouched.


# -- limits ------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_fork_bomb_meets_the_pids_limit_with_eagain(runtime: str) -> None:
    # What runs is held in the workload's cgroup; the keeper (the agent: Go,
    # whose threads count as tasks) keeps a reserve above it, and answers.
    sb = await _make(pids_limit=64, runtime=runtime)
    try:
        held, _ = await fill_with_processes(sb)
        answers = await asyncio.gather(
            *(sb.read_text("/etc/os-release") for _ in range(16)),
            *(sb.list_dir("/usr/lib") for _ in range(16)),
        )
        assert all(answers)
        await held.kill()
        result = await sb.exec(
            [
                "python3", "-c",
                "import os, errno, time\n"
                "kids = []\n"
                "while True:\n"
                "    try:\n"
                "        pid = os.fork()\n"
                "    except OSError as e:\n"
                "        print('errno', errno.errorcode[e.errno]); break\n"
                "    if pid == 0:\n"
                "        time.sleep(30); os._exit(0)\n"
                "    kids.append(pid)\n"
                "print('forked', len(kids))\n"
                "for k in kids: os.kill(k, 9)\n",
            ],
            timeout=60,
        )
        assert "errno EAGAIN" in result.stdout, result
        forked = int(result.stdout.split("forked")[1].split()[0])
        assert 10 < forked < 64
        # The host and other sandboxes keep answering.
        other = await _make()
        try:
            assert (await other.exec(["echo", "ok"])).stdout == "ok\n"
        finally:
            await other.close()
        assert (await sb.exec(["echo", "still"])).stdout == "still\n"
    finally:
        await sb.close()


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_commands_run_in_the_workload_cgroup_and_cannot_leave_it(runtime: str) -> None:
    sb = await _make(pids_limit=30, memory="100m", runtime=runtime)
    try:
        for user in (None, "nobody"):
            result = await sb.exec(["cat", "/proc/self/cgroup"], user=user)
            # The whole result is said on a failure (CI once got no pids line).
            said = f"user={user}: {result!r}"
            assert result.exit_code == 0, said
            rows = dict(line.split(":", 2)[1:] for line in result.stdout.splitlines())
            assert rows.get("pids") == rows.get("memory") == "/hutch-workload", said
            assert rows.get("freezer") == "/", said  # pause holds everything
        base = f"/sys/fs/cgroup/pids/hutch/{sb.id}"
        with open(f"{base}/hutch-workload/pids.max") as fh:
            assert int(fh.read()) == 30
        with open(f"{base}/pids.max") as fh:
            assert int(fh.read()) > 30
        # No cgroup file system inside, and no capability to mount one.
        escape = await sb.exec("mkdir -p /tmp/cg && mount -t cgroup -o pids none /tmp/cg "
                               "&& echo $$ > /tmp/cg/cgroup.procs; cat /proc/self/cgroup")
        assert "pids:/hutch-workload" in escape.stdout, escape
    finally:
        await sb.close()


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_busy_loops_share_the_cpu_as_one_beside_the_keeper(runtime: str) -> None:
    # What runs in the sandbox has a cpu cgroup of its own below the
    # sandbox's (which keeps the CPU limit): 50 busy loops weigh as one
    # against the keeper (the agent, or bwrap's init), not as 50.
    sb = await _make(runtime=runtime, cpus=1.0)
    base = f"/sys/fs/cgroup/cpu/hutch/{sb.id}"
    try:
        with open(f"{base}/cpu.cfs_quota_us") as fh:
            assert int(fh.read()) == 100_000
        mine = cpu_cgroup((await sb.exec(["cat", "/proc/self/cgroup"])).stdout)
        assert mine == "/hutch-workload", mine
        if runtime == "agent":
            agent = (await sb.exec(["pgrep", "-x", "hutch-agent"])).stdout.split()
            assert len(agent) == 1, agent
            await answers_beside_busy_loops(sb, int(agent[0]))
        # A suspend ends every process and a resume starts a new keeper: the
        # workload's cgroup holds what runs after it too.
        await sb.suspend()
        await sb.resume()
        mine = cpu_cgroup((await sb.exec(["cat", "/proc/self/cgroup"])).stdout)
        assert mine == "/hutch-workload", mine
    finally:
        await sb.close()
    assert not os.path.exists(base)


async def test_a_command_bwrap_could_not_start_is_an_error_not_its_exit_status() -> None:
    # bwrap clones the command's process, then sets the sandbox up in it; a
    # step that fails there (here: entering a working directory root inside
    # cannot: mode 000, owned by a host id its user namespace does not map,
    # so no capability of its reaches it) ends it with bwrap's words on
    # stderr and exit 1, which were answered as the command's own (CI once
    # got a cat of /proc/self/cgroup back with no pids line).
    from hutch._sandbox import backend_of

    sb = await _make(runtime="native")
    try:
        await sb.exec("mkdir -p /locked && chmod 000 /locked")
        os.chown(backend_of(sb).parts.layers.merged_view + "/locked", 0, 0)
        for argv in (["cat", "/proc/self/cgroup"], ["true"]):
            with pytest.raises(hutch.HutchError, match="Can't chdir to /locked") as caught:
                await sb.exec(argv, cwd="/locked")
            assert caught.value.code == "provider_error", caught.value
        # A command's own exit 1, whatever it says, is still its result.
        own = await sb.exec(["sh", "-c", "echo 'bwrap: not really' >&2; exit 1"])
        assert (own.exit_code, own.stderr) == (1, "bwrap: not really\n"), own
        background = await sb.start(["sh", "-c", "sleep 0.2; exit 4"])
        assert (await background.wait()).exit_code == 4
    finally:
        await sb.close()


async def test_a_native_command_is_not_bound_to_bwraps_passing_setup_process() -> None:
    # Joining the keeper's pid namespace, bwrap forks once more and that
    # parent exits at once; a command armed with --die-with-parent is killed
    # whenever the parent's exit comes after the command's start (1 exec in
    # about 400 under load: exit 137, nothing said; CI once). The command's
    # parent is that passing process, so it must carry no death signal.
    sb = await _make(runtime="native")
    try:
        said = await sb.exec(["setpriv", "--dump"])  # its own, as prctl tells it
        assert said.exit_code == 0, said
        assert "Parent death signal: [none]" in said.stdout.splitlines(), said
    finally:
        await sb.close()


@pytest.mark.parametrize("runtime", ["agent", "native"])
async def test_memory_hog_is_killed_and_said_so(runtime: str) -> None:
    sb = await _make(memory="64m", runtime=runtime)
    try:
        result = await sb.exec(
            ["python3", "-c", "b = bytearray(1 << 30); print('survived')"], timeout=60
        )
        assert result.exit_code == 137
        assert "survived" not in result.stdout
        assert "OOM killer" in result.stderr and str(64 << 20) in result.stderr
        assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
    finally:
        await sb.close()


async def test_writes_meet_the_disk_limit() -> None:
    sb = await _make(disk="8m")
    try:
        result = await sb.exec("head -c 20000000 /dev/zero > big; echo rc=$?")
        assert "rc=0" not in result.stdout
        assert "No space left" in result.stderr
    finally:
        await sb.close()


# -- lifecycle -----------------------------------------------------------------------------


async def test_pause_freezes_processes_and_resume_thaws_them(sandbox: Any) -> None:
    from hutch._sandbox import backend_of

    # Read on the host, in the upper layer: a call through the sandbox would
    # be activity, and could resume it.
    count = backend_of(sandbox).parts.layers.upper + "/tmp/count"

    def read() -> str:
        with open(count) as fh:
            return fh.read()

    counter = await sandbox.start(
        "i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count;"
        " done"
    )
    await anyio.sleep(0.5)
    await sandbox.pause()
    assert sandbox.state.value == "paused"
    held = read()
    await anyio.sleep(0.5)
    assert read() == held, "a paused sandbox kept running"
    await sandbox.resume()
    await anyio.sleep(0.5)
    assert int(read()) > int(held)
    await counter.kill()


async def test_many_suspend_and_pause_cycles_keep_the_files(sandbox: Any) -> None:
    await sandbox.write_text("kept.txt", "cycle 0")
    await sandbox.exec("mkdir -p d && echo inside > d/f && rm -f /etc/motd")
    for cycle in range(1, 6):
        await sandbox.suspend()
        assert sandbox.state.value == "suspended"
        await sandbox.resume()
        assert await sandbox.read_text("kept.txt") == f"cycle {cycle - 1}"
        await sandbox.write_text("kept.txt", f"cycle {cycle}")
        await sandbox.pause()
        await sandbox.resume()
    assert (await sandbox.exec("cat d/f; test -e /etc/motd; echo $?")).stdout == "inside\n1\n"


async def test_suspend_ends_processes_as_declared(sandbox: Any) -> None:
    assert sandbox.capabilities.suspend_keeps_processes is False
    await sandbox.exec("nohup sleep 300 >/dev/null 2>&1 &")
    await sandbox.suspend()
    await sandbox.resume()
    result = await sandbox.exec("for p in /proc/[0-9]*; do cat $p/comm; done")
    assert "sleep" not in result.stdout.split()


def test_an_ephemeral_sandbox_outlives_the_thread_that_made_it() -> None:
    """``--die-with-parent`` ends a keeper when the *thread* that started it
    ends (the kernel's parent-death signal follows the thread): a sandbox
    made from a thread that then exits (an event loop in a worker thread, a
    resume in a thread pool) must live on."""
    import threading
    import time

    from hutch._sandbox import backend_of

    made: list[Any] = []
    maker = threading.Thread(target=lambda: made.append(anyio.run(_make)))
    maker.start()
    maker.join()
    sb = made[0]
    try:
        keeper = backend_of(sb).parts.keeper
        time.sleep(0.5)  # the signal, had it been sent, has landed
        assert keeper.alive()
    finally:
        anyio.run(sb.close)


async def test_hutch_is_never_left_in_a_sandboxs_cgroups() -> None:
    """The keeper is born in its sandbox's cgroups (a thread of hutch's
    passes through them to start it): none of hutch's own is left there, or
    the sandbox's kill, busy count and memory would reach hutch itself."""
    from hutch._sandbox import backend_of

    sandboxes = [await _make(runtime=runtime) for runtime in ("agent", "native")]
    try:
        for sb in sandboxes:
            cgroup = backend_of(sb).parts.cgroup
            assert os.getpid() not in cgroup.pids()
            await sb.suspend()
            await sb.resume()
            assert os.getpid() not in cgroup.pids()
            assert (await sb.exec("echo here")).stdout == "here\n"
    finally:
        for sb in sandboxes:
            await sb.close()


# -- through the daemon: adoption after a restart, a death outside hutch -----------------------


def _end_daemon_sandboxes(data_dir: str) -> None:
    """A daemon's sandboxes outlive it by design (a restart adopts them): a
    test that failed half-way ends what its daemon left."""
    from hutch.providers.bubblewrap.cgroups import SandboxCgroup

    with contextlib.suppress(FileNotFoundError):
        for sandbox_id in os.listdir(os.path.join(data_dir, "bubblewrap", "sandboxes")):
            cgroup = SandboxCgroup(sandbox_id)
            with contextlib.suppress(OSError, hutch.HutchError):
                cgroup.kill_all()
            cgroup.remove()


def test_daemon_adopts_live_sandboxes_after_a_restart() -> None:
    import time

    from tests.daemon_fixture import DaemonProcess

    daemon = DaemonProcess().start()
    try:
        client = hutch.Client(daemon.url, token=daemon.token)
        sb = client.create_sandbox("bubblewrap", image=TEST_IMAGE, read_before_write=False)
        sb.write_text("kept.txt", "before the crash")
        keeper_before = sb.exec("cat /proc/1/stat").stdout.split()[:22]
        client.close()
        daemon.restart()  # SIGKILL: nothing is cleaned up, as in a crash
        client = hutch.Client(daemon.url, token=daemon.token)
        sb = client.get_sandbox(sb.id)
        # The same live sandbox: its upper layer lives on a tmpfs in its
        # keeper's own mount namespace, and its PID 1 is the same process.
        assert sb.read_text("kept.txt") == "before the crash"
        assert sb.exec("cat /proc/1/stat").stdout.split()[:22] == keeper_before
        # Its keeper killed from outside: the sandbox fails, within seconds, saying so.
        from hutch.providers.bubblewrap.cgroups import SandboxCgroup

        SandboxCgroup(sb.id).kill_all()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            info = sb.info()
            if info["state"] == "failed":
                break
            time.sleep(0.2)
        assert info["state"] == "failed", info
        assert "keeper ended" in (info.get("reason") or ""), info
        with pytest.raises(hutch.HutchError) as error:
            sb.exec(["true"])
        assert error.value.code in ("sandbox_unavailable", "not_found")
        sb.close()
        client.close()
    finally:
        daemon.stop()
        _end_daemon_sandboxes(daemon.data_dir)


def test_a_workspace_from_an_image_alone_is_on_the_daemons_provider() -> None:
    """The client does not pick a provider for an image: the daemon's
    configuration does (here bubblewrap, where the built-in would be docker)."""
    import shutil

    from tests.daemon_fixture import DaemonProcess

    config_dir = tempfile.mkdtemp(prefix="hutch-config-")
    config = os.path.join(config_dir, "hutch.toml")
    with open(config, "w") as fh:
        fh.write('[sandbox]\nprovider = "bubblewrap"\n')
    daemon = DaemonProcess(provider=None, extra_args=["--config", config]).start()
    try:
        with hutch.Client(daemon.url, token=daemon.token) as client:
            ws = client.create_workspace("from-image", image=TEST_IMAGE)
            try:
                assert ws["provider"] == "bubblewrap"
                sb = client.get_sandbox(ws["live_sandbox_id"])
                assert sb.exec(["cat", "/etc/debian_version"]).exit_code == 0
            finally:
                client.delete_workspace("from-image")
    finally:
        daemon.stop()
        _end_daemon_sandboxes(daemon.data_dir)
        shutil.rmtree(daemon.data_dir, ignore_errors=True)
        shutil.rmtree(config_dir, ignore_errors=True)


# -- snapshots at the provider: captured upper layers, forks copy nothing ---------------------


async def test_snapshot_and_forks_are_independent_copy_on_write(sandbox: Any) -> None:
    from hutch._sandbox import backend_of
    from hutch.providers.bubblewrap import BubblewrapConfig, BubblewrapSandbox
    from hutch.providers.bubblewrap.snapshots import held, remove

    await sandbox.write_text("shared.txt", "from the origin")
    await sandbox.exec("seq 1 2000 | while read i; do echo $i > f$i; done; rm /etc/motd")
    backend = backend_of(sandbox)
    snap_id = f"snap-{secrets.token_hex(4)}"
    data = await backend.capture_layers(snap_id)
    assert snap_id in held() and data["size_bytes"] > 0
    config = BubblewrapConfig(image=TEST_IMAGE, ephemeral=True)
    branches = [
        await BubblewrapSandbox.create_from_layers(config, f"fork-{secrets.token_hex(4)}",
                                                   snap_id, data)
        for _ in range(2)
    ]
    try:
        for index, branch in enumerate(branches):
            runtime = branch.runtime
            assert await runtime.read_file("/workspace/shared.txt", 100) == b"from the origin"
            await runtime.write_file("/workspace/shared.txt", f"branch {index}".encode())
            # Nothing was copied: the fork's own upper layer holds only its write.
            upper = branch.parts.layers.upper
            assert sum(len(files) for _, _, files in os.walk(upper)) == 1
        assert await branches[0].runtime.read_file("/workspace/shared.txt", 100) == b"branch 0"
        assert await branches[1].runtime.read_file("/workspace/shared.txt", 100) == b"branch 1"
        assert await sandbox.read_text("shared.txt") == "from the origin"
        proc = await branches[0].runtime.start_process(ProcessRequest(
            ["sh", "-c", "cat f1999; test -e /etc/motd; echo $?"], cwd="/workspace",
        ))
        out = b""
        while (chunk := await proc.read()) is not None:
            out += chunk.data
        assert out == b"1999\n1\n"
        # Removing the snapshot keeps its layers while forks stand on them.
        remove(snap_id)
        assert snap_id not in held()
        assert await branches[1].runtime.read_file("/workspace/f7", 100) == b"7\n"
    finally:
        for branch in branches:
            await branch.close()
    from hutch.providers.bubblewrap.snapshots import snapshots_dir

    assert not os.path.exists(os.path.join(snapshots_dir(), snap_id))


async def test_owners_inside_survive_suspend_resume_snapshot_and_fork() -> None:
    """What root inside and another user wrote, and what hutch wrote from the
    host, keep their owners as seen inside across a suspend and a resume,
    and in a fork of a snapshot, where root inside can change them all."""
    from hutch._sandbox import backend_of
    from hutch.providers.bubblewrap import BubblewrapConfig, BubblewrapSandbox

    sb = await _make(runtime="native")
    owners = "stat -c '%U:%G %n' /workspace/host /workspace/root /tmp/nobody /etc/passwd"
    expected = ["root:root /workspace/host", "root:root /workspace/root",
                "nobody:nogroup /tmp/nobody", "root:root /etc/passwd"]
    branch = None
    snap_id = f"snap-{secrets.token_hex(4)}"
    try:
        await sb.write_bytes("/workspace/host", b"h")
        await sb.exec("echo r > /workspace/root")
        await sb.exec("echo n > /tmp/nobody", user="nobody")
        await sb.suspend()
        await sb.resume()
        assert (await sb.exec(owners)).stdout.splitlines() == expected
        data = await backend_of(sb).capture_layers(snap_id)
        config = BubblewrapConfig(image=TEST_IMAGE, ephemeral=True, runtime="native")
        branch = await BubblewrapSandbox.create_from_layers(
            config, f"fork-{secrets.token_hex(4)}", snap_id, data
        )
        proc = await branch.runtime.start_process(ProcessRequest(
            ["sh", "-c", f"{owners} && chown nobody /workspace/host /etc/passwd && "
             "echo more >> /tmp/nobody && echo changed"], cwd="/workspace",
        ))
        out = b""
        while (chunk := await proc.read()) is not None:
            out += chunk.data
        assert out.decode().splitlines() == [*expected, "changed"]
    finally:
        if branch is not None:
            await branch.close()
        await sb.close()
        from hutch.providers.bubblewrap.snapshots import held, remove

        if snap_id in held():
            remove(snap_id)


# -- network policies -------------------------------------------------------------------------


def _resolver() -> str:
    """The host's resolver: an address outside this host, reachable through NAT."""
    with open("/etc/resolv.conf") as fh:
        return next(line.split()[1] for line in fh if line.startswith("nameserver"))


async def test_network_all_reaches_out_but_not_the_host_metadata_or_other_sandboxes() -> None:
    from hutch._sandbox import backend_of

    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        sb = await _make(network="all")
        other = await _make(network="all")
        try:
            assert sb.capabilities.network_policy
            # Out, through the masquerade (the host's resolver, an outside address).
            resolver = _resolver()
            out = await sb.exec(
                ["bash", "-c", f"exec 3<>/dev/tcp/{resolver}/53 && echo connected"], timeout=30
            )
            assert "connected" in out.stdout, out
            other_ip = backend_of(other).describe()["net_index"]
            from hutch.providers.bubblewrap.network import addresses

            targets = [("169.254.169.254", 80), (addresses(other_ip)[1], 22)]
            targets += [(address, port) for address in _host_addresses()]
            for host, target_port in targets:
                result = await sb.exec(
                    ["bash", "-c", f"exec 3<>/dev/tcp/{host}/{target_port} && echo connected"],
                    timeout=30,
                )
                assert "connected" not in result.stdout, (host, target_port)
        finally:
            await sb.close()
            await other.close()


async def test_preview_url_reaches_a_port_inside_from_the_host() -> None:
    import httpx

    sb = await _make(network="all")
    closed = await _make()
    try:
        assert sb.capabilities.preview_url
        # A one-page HTTP server (the image's python3 has no http.server).
        await sb.write_text("serve.py", (
            "import socket\n"
            "s = socket.socket()\n"
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('0.0.0.0', 8000))\n"
            "s.listen()\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    c.recv(65536)\n"
            "    c.sendall(b'HTTP/1.0 200 OK\\r\\ncontent-length: 17\\r\\n\\r\\n'\n"
            "              b'hello from inside')\n"
            "    c.close()\n"
        ))
        server = await sb.start(["python3", "serve.py"])
        url = await sb.preview_url(8000)
        assert url.endswith(":8000")
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(100):
                try:
                    answer = await client.get(f"{url}/index.html", timeout=2)
                    break
                except httpx.TransportError:
                    await anyio.sleep(0.05)
            else:
                raise AssertionError(f"nothing answered at {url}")
        assert answer.text == "hello from inside"
        await server.kill()
        # With no network nothing outside reaches its ports: no URL, and why.
        assert not closed.capabilities.preview_url
        with pytest.raises(hutch.CapabilityUnsupported, match="preview_url"):
            await closed.preview_url(8000)
    finally:
        await sb.close()
        await closed.close()


async def test_network_allow_list_reaches_only_what_it_names() -> None:
    resolver = _resolver()
    sb = await _make(network={"allow": [f"{resolver}/32"]})
    try:
        allowed = await sb.exec(
            ["bash", "-c", f"exec 3<>/dev/tcp/{resolver}/53 && echo connected"], timeout=30
        )
        assert "connected" in allowed.stdout, allowed
        refused = await sb.exec(
            ["bash", "-c", "exec 3<>/dev/tcp/1.1.1.1/53 && echo connected"], timeout=30
        )
        assert "connected" not in refused.stdout
    finally:
        await sb.close()


def test_daemon_keeps_answering_through_a_fork_bomb_and_a_memory_hog() -> None:
    import threading
    import time

    import httpx

    from tests.daemon_fixture import DaemonProcess

    daemon = DaemonProcess().start()
    try:
        client = hutch.Client(daemon.url, token=daemon.token)
        # Two sandboxes: a bomb at its pids limit would leave the hog no
        # process to start with.
        sb = client.create_sandbox(
            "bubblewrap", image=TEST_IMAGE, pids_limit=64, read_before_write=False
        )
        hog_sb = client.create_sandbox(
            "bubblewrap", image=TEST_IMAGE, memory="128m", read_before_write=False
        )
        results: dict[str, Any] = {}

        def bomb() -> None:
            try:
                results["bomb"] = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=8)
            except hutch.HutchError as exc:
                results["bomb"] = exc

        def hog() -> None:
            try:
                results["hog"] = hog_sb.exec(
                    ["python3", "-c", "b = bytearray(1 << 30)"], timeout=60
                )
            except hutch.HutchError as exc:
                results["hog"] = exc

        workers = [threading.Thread(target=bomb), threading.Thread(target=hog)]
        for worker in workers:
            worker.start()
        slowest = 0.0
        while any(w.is_alive() for w in workers):
            started = time.monotonic()
            answer = httpx.get(f"{daemon.url}/healthz", timeout=10,
                               headers={"Authorization": f"Bearer {daemon.token}"})
            assert answer.status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
        for worker in workers:
            worker.join()
        assert slowest < 2.0, f"the daemon took {slowest:.2f} s to answer"
        hogged = results["hog"]
        assert isinstance(hogged, hutch.ExecResult), hogged
        assert hogged.exit_code == 137 and hogged.oom_killed
        other = client.create_sandbox("bubblewrap", image=TEST_IMAGE, read_before_write=False)
        assert other.exec(["echo", "ok"]).stdout == "ok\n"
        other.close()
        sb.close()
        hog_sb.close()
        client.close()
    finally:
        daemon.stop()
        _end_daemon_sandboxes(daemon.data_dir)


async def test_a_link_planted_for_the_agent_socket_leads_nowhere_else() -> None:
    from hutch._sandbox import backend_of

    victim = await _make(runtime="agent")
    attacker = await _make(runtime="agent")
    try:
        await victim.exec("echo victim > /tmp/whoami")
        await attacker.exec("echo attacker > /tmp/whoami")
        # Inside, the agent's socket is swapped for a link to the victim's, by
        # its host path (dangling inside, followed by whoever connects on the host).
        victim_socket = backend_of(victim).agent_link
        await attacker.exec(
            f"rm -f /.hutch/run/agent.sock && ln -s {victim_socket} /.hutch/run/agent.sock"
        )
        backend_of(attacker).runtime.drop_connections()  # the next call connects anew
        assert (await attacker.exec(["cat", "/tmp/whoami"])).stdout == "attacker\n"
        await attacker.write_text("/tmp/planted", "x")
        assert not await victim.exists("/tmp/planted")
    finally:
        await victim.close()
        await attacker.close()


async def test_a_long_chain_of_snapshots_still_mounts() -> None:
    # Each branch stands on its parent's snapshot: 60 layers deep.
    sandbox = await _make()
    branches = []
    try:
        await sandbox.write_text("depth", "0")
        current = sandbox
        for depth in range(1, 61):
            fork = await current.fork(f"depth {depth}")
            current = await fork.attach()
            branches.append(current)
            assert await current.read_text("depth") == str(depth - 1)
            await current.write_text("depth", str(depth))
            if len(branches) > 2:  # keep few alive; their snapshots keep the layers
                await branches.pop(0).close()
        assert (await current.exec(["cat", "depth"])).stdout == "60"
    finally:
        for branch in branches:
            await branch.close()
        await sandbox.close()


async def test_a_hutch_home_longer_than_a_socket_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's socket lives under the hutch home, whose path may be
    longer than the 107 bytes a socket's address holds."""
    home = tmp_path / ("long-" * 16) / "home"
    monkeypatch.setenv("HUTCH_HOME", str(home))
    assert len(str(home / "bubblewrap" / "sandboxes" / "sb-0123456789ab" / "agent.sock")) > 108
    sandbox = await _make(runtime="agent")
    try:
        assert (await sandbox.exec(["echo", "reached"])).stdout == "reached\n"
        await sandbox.suspend()  # a new socket is bound on resume
        assert (await sandbox.exec(["echo", "again"])).stdout == "again\n"
    finally:
        await sandbox.close()


@pytest.mark.parametrize("after", [0.01, 0.05, 0.1, 0.2, 0.4])
async def test_an_in_process_create_cancelled_part_way_leaves_nothing(after: float) -> None:
    """Cancelled at any point of its making (a caller's timeout), an
    in-process create leaves no processes, cgroups or directories of the
    sandbox: what was made is freed then, not never."""
    from hutch.providers.bubblewrap.provisioning import bubblewrap_home
    from tests.daemon_fixture import sandbox_processes

    sandbox_id = "sb-" + secrets.token_hex(6)
    with anyio.move_on_after(after):
        sandbox = await hutch.create_sandbox("bubblewrap", image=TEST_IMAGE,
                                             sandbox_id=sandbox_id)
        await sandbox.close()  # made before the cancel came: closed as ever
    assert sandbox_processes(sandbox_id) == []
    assert not os.path.exists(os.path.join(bubblewrap_home(), "sandboxes", sandbox_id))
    assert not [c for c in ("pids", "memory", "cpu", "freezer")
                if os.path.exists(f"/sys/fs/cgroup/{c}/hutch/{sandbox_id}")]
