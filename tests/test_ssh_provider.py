"""The ssh provider against a real OpenSSH server on loopback: what the
conformance suite does not cover (connecting, failing, reconnecting, the
host's own rules). See tests/ssh_server.py for the server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hutch
from hutch._sandbox import backend_of
from hutch.providers._hostproc import pids_with_env
from hutch.providers.ssh.config import SshConfig
from hutch.providers.ssh.connection import SshTarget, acquire, release
from hutch.providers.ssh.gitsource import GitSource, current_source, https_url
from hutch.providers.ssh.provider import SshSandbox
from hutch.states import SandboxState
from hutch.testing._support import settle
from tests.daemon_fixture import DaemonProcess
from tests.ssh_server import ALIAS, SshServer, shared_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def server() -> SshServer:
    return shared_server()


@pytest.fixture
def own_server() -> Iterator[SshServer]:
    """An sshd of this test's own, free to be killed."""
    s = SshServer().start()
    yield s
    s.cleanup()


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hutch-ssh-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def make(server: SshServer, workdir: str, **settings: Any) -> Any:
    settings.setdefault("destination", ALIAS)
    settings.setdefault("config_file", server.config_file)
    return await hutch.create_sandbox(
        "ssh", working_directory=workdir, read_before_write=False, **settings
    )


@pytest.fixture
async def sandbox(server: SshServer, workdir: str) -> AsyncIterator[Any]:
    async with await make(server, workdir) as sb:
        yield sb


def backend(sb: Any) -> SshSandbox:
    found = backend_of(sb)
    assert isinstance(found, SshSandbox)
    return found


# -- destinations and config ------------------------------------------------------


async def test_user_at_host_with_port_and_key_from_the_config(
    server: SshServer, workdir: str
) -> None:
    config = os.path.join(server.dir, f"by-address-{uuid.uuid4().hex}")
    with open(config, "w") as fh:
        fh.write(f"Host 127.0.0.1\n  Port {server.port}\n  IdentityFile {server.user_key}\n"
                 f"  UserKnownHostsFile {server.known_hosts}\n")
    async with await make(
        server, workdir, destination=f"{server.user}@127.0.0.1", config_file=config
    ) as sb:
        assert (await sb.exec(["id", "-un"])).stdout.strip() == server.user


async def test_ssh_url_with_a_port(server: SshServer, workdir: str) -> None:
    config = os.path.join(server.dir, f"by-url-{uuid.uuid4().hex}")
    with open(config, "w") as fh:  # the key and known hosts only: the port is in the URL
        fh.write(f"Host 127.0.0.1\n  IdentityFile {server.user_key}\n"
                 f"  UserKnownHostsFile {server.known_hosts}\n")
    destination = f"ssh://{server.user}@127.0.0.1:{server.port}"
    async with await make(server, workdir, destination=destination, config_file=config) as sb:
        assert (await sb.exec(["pwd"])).stdout.strip() == workdir
    for bad in ["ssh://host:notaport", "ssh://host/path", "ssh://"]:
        with pytest.raises(hutch.InvalidArgument):
            await make(server, workdir, destination=bad, config_file=config)


async def test_proxy_jump_from_the_config(server: SshServer, workdir: str) -> None:
    config = os.path.join(server.dir, f"jump-{uuid.uuid4().hex}")
    server.write_client_config(config, server.user_key, alias="jumphost")
    with open(config, "a") as fh:
        fh.write(
            "Host behind-the-jump\n  HostName 127.0.0.1\n"
            f"  Port {server.port}\n  User {server.user}\n  IdentityFile {server.user_key}\n"
            f"  UserKnownHostsFile {server.known_hosts}\n  ProxyJump jumphost\n"
        )
    async with await make(server, workdir, destination="behind-the-jump", config_file=config) as sb:
        # Through the jump, the target sees a connection from the jump host's sshd.
        result = await sb.exec("echo $SSH_CONNECTION")
        assert result.stdout.startswith("127.0.0.1 ")
        assert (await sb.exec(["pwd"])).stdout.strip() == workdir


async def test_destination_that_is_an_option_is_refused(server: SshServer, workdir: str) -> None:
    with pytest.raises(hutch.InvalidArgument):
        await make(server, workdir, destination="-oProxyCommand=touch /tmp/x")


async def test_relative_working_directory_is_refused(server: SshServer) -> None:
    with pytest.raises(hutch.InvalidArgument):
        await make(server, "relative/dir")


async def test_missing_working_directory_is_created(server: SshServer, workdir: str) -> None:
    target = os.path.join(workdir, "new", "deeper")
    async with await make(server, target) as sb:
        assert (await sb.exec(["pwd"])).stdout.strip() == target
    assert os.path.isdir(target)


# -- failures are typed, name the destination, and do not hang ---------------------------


async def test_wrong_host_key_is_refused(server: SshServer, workdir: str) -> None:
    known = os.path.join(server.dir, f"wrong-known-{uuid.uuid4().hex}")
    with open(server.other_key + ".pub") as fh:
        wrong = fh.read().strip()
    with open(known, "w") as fh:
        fh.write(f"[127.0.0.1]:{server.port} {wrong}\n")
    started = time.monotonic()
    with pytest.raises(hutch.ProviderError) as info:
        await make(server, workdir, known_hosts=known, connect_timeout=10)
    assert ALIAS in str(info.value)
    assert "host key" in str(info.value)
    assert time.monotonic() - started < 10


async def test_unknown_host_key_is_refused_by_default(server: SshServer, workdir: str) -> None:
    empty = os.path.join(server.dir, f"empty-known-{uuid.uuid4().hex}")
    open(empty, "w").close()
    with pytest.raises(hutch.ProviderError) as info:
        await make(server, workdir, known_hosts=empty)
    assert "host key" in str(info.value)
    # Checking can be turned off, knowingly.
    async with await make(server, workdir, known_hosts=empty, check_host_key=False) as sb:
        assert (await sb.exec(["true"])).exit_code == 0


async def test_wrong_user_key_is_refused(server: SshServer, workdir: str) -> None:
    config = server.write_client_config(
        os.path.join(server.dir, f"wrong-key-{uuid.uuid4().hex}"), server.other_key
    )
    started = time.monotonic()
    with pytest.raises(hutch.ProviderError) as info:
        await make(server, workdir, config_file=config, connect_timeout=10)
    assert ALIAS in str(info.value)
    assert "authentication failed" in str(info.value)
    assert time.monotonic() - started < 10


async def test_refused_port_is_unavailable(server: SshServer, workdir: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        config = os.path.join(server.dir, f"refused-{uuid.uuid4().hex}")
        with open(config, "w") as fh:
            fh.write(f"Host nowhere\n  HostName 127.0.0.1\n  Port {port}\n")
        started = time.monotonic()
        with pytest.raises(hutch.SandboxUnavailable) as info:
            await make(server, workdir, destination="nowhere", config_file=config,
                       connect_timeout=5)
    assert "nowhere" in str(info.value)
    assert time.monotonic() - started < 10


async def test_silent_host_times_out(server: SshServer, workdir: str) -> None:
    # Accepts the TCP connection and never says a word (a wedged host).
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    config = os.path.join(server.dir, f"silent-{uuid.uuid4().hex}")
    with open(config, "w") as fh:
        fh.write(f"Host silent\n  HostName 127.0.0.1\n  Port {port}\n")
    started = time.monotonic()
    try:
        with pytest.raises(hutch.SandboxUnavailable) as info:
            await make(server, workdir, destination="silent", config_file=config,
                       connect_timeout=2)
    finally:
        for writer in held:
            writer.close()
        silent.close()
    elapsed = time.monotonic() - started
    assert "silent" in str(info.value)
    assert elapsed < 2 + 5, f"a 2 s connect timeout took {elapsed:.1f} s"


async def test_working_directory_that_cannot_be_made(server: SshServer) -> None:
    with pytest.raises(FileNotFoundError) as info:
        await make(server, "/etc/hostname/work")
    assert info.value.code == "file_not_found"  # type: ignore[attr-defined]
    assert ALIAS in str(info.value) and "/etc/hostname/work" in str(info.value)


async def test_working_directory_removed_later(server: SshServer) -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-ssh-gone-")
    async with await make(server, workdir) as sb:
        os.rmdir(workdir)
        with pytest.raises(FileNotFoundError) as info:
            await sb.exec(["true"])
        assert ALIAS in str(info.value) and workdir in str(info.value)


async def test_sshd_killed_mid_exec_then_next_call_reconnects(
    own_server: SshServer, workdir: str
) -> None:
    async with await make(own_server, workdir, connect_timeout=10) as sb:
        kept = backend(sb)._kept
        assert kept.connects == 1
        running = asyncio.ensure_future(sb.exec("echo started; sleep 60", timeout=120))
        await asyncio.sleep(1.0)
        started = time.monotonic()
        own_server.kill_all()
        with pytest.raises(hutch.SandboxUnavailable) as info:
            await running
        assert time.monotonic() - started < 20
        assert ALIAS in str(info.value)
        own_server.start()
        result = await sb.exec(["echo", "back"])
        assert result.stdout == "back\n"
        assert kept.connects == 2
        await sb.write_text("after.txt", "sftp too")
        assert await sb.read_text("after.txt") == "sftp too"


async def test_sshd_down_is_unavailable_then_back(own_server: SshServer, workdir: str) -> None:
    async with await make(own_server, workdir, connect_timeout=3) as sb:
        own_server.kill_all()
        with pytest.raises(hutch.SandboxUnavailable):
            await sb.exec(["true"])
        with pytest.raises(hutch.SandboxUnavailable):
            await sb.read_text("anything")
        own_server.start()
        assert (await sb.exec(["true"])).exit_code == 0


# -- one kept connection, multiplexed ----------------------------------------------------


async def test_sandboxes_on_one_destination_share_one_connection(
    server: SshServer, workdir: str
) -> None:
    async with await make(server, workdir) as one, await make(server, workdir) as two:
        assert backend(one)._kept is backend(two)._kept
        # Within sshd's default MaxSessions (10): the SFTP session and 8 commands.
        results = await asyncio.gather(
            *(sb.exec(["echo", str(i)]) for i, sb in enumerate([one, two] * 4)),
            *(one.write_text(f"f{i}", str(i)) for i in range(10)),
        )
        assert [r.stdout for r in results[:8]] == [f"{i}\n" for i in range(8)]
        assert backend(one)._kept.connects == 1


async def test_past_the_hosts_session_cap_commands_overflow_to_more_connections(
    workdir: str,
) -> None:
    capped = SshServer(max_sessions=3).start()
    try:
        async with await make(capped, workdir) as sb:
            started = time.monotonic()
            results = await asyncio.gather(*(sb.exec(["sleep", "1"]) for _ in range(8)))
            assert [r.exit_code for r in results] == [0] * 8
            assert time.monotonic() - started < 30
            assert backend(sb)._kept.connects > 1
            # With every session of the kept connection busy, a timeout still
            # reaches the host to kill its command (the kill takes a session
            # too), and files still move (the SFTP session was opened first).
            busy = [await sb.start("sleep 300") for _ in range(3)]
            await sb.write_text("while-busy.txt", "files still move")
            assert await sb.read_text("while-busy.txt") == "files still move"
            with pytest.raises(TimeoutError):
                await sb.exec(["sleep", "300"], timeout=1)
            for process in busy:
                await process.kill()
                assert not process.running
            assert await backend(sb).count_busy_processes() == 0
    finally:
        capped.cleanup()


async def test_the_last_sandbox_closes_the_connection(server: SshServer, workdir: str) -> None:
    sb = await make(server, workdir)
    kept = backend(sb)._kept
    conn = await kept.connection()
    await sb.close()
    assert conn.is_closed()


# -- no user data through a shell -------------------------------------------------------


async def test_argv_env_and_cwd_reach_the_command_verbatim(sandbox: Any, workdir: str) -> None:
    nasty = ["$(touch pwned)", "`touch pwned`", "'; touch pwned; '", "a\nb", "-n", "", "~",
             "*", "\\", "é €", "x\n"]
    result = await sandbox.exec(["printf", "[%s]", *nasty])
    assert result.stdout == "".join(f"[{w}]" for w in nasty)
    odd_dir = "dir $(touch pwned) 'q'"
    await sandbox.write_text(f"{odd_dir}/f", "x")
    env = {"HUTCH_V": "$(touch pwned) ' \" \n end"}
    result = await sandbox.exec('printf "%s|%s" "$HUTCH_V" "$PWD"', env=env, cwd=odd_dir)
    assert result.stdout == f"{env['HUTCH_V']}|{workdir}/{odd_dir}"
    assert not os.path.exists(os.path.join(workdir, "pwned"))
    assert not os.path.exists(os.path.join(workdir, odd_dir, "pwned"))


async def test_bad_env_name_is_invalid(sandbox: Any) -> None:
    with pytest.raises(hutch.InvalidArgument):
        await sandbox.exec(["true"], env={"A B": "x"})


async def test_exit_by_signal_is_128_plus_n(sandbox: Any) -> None:
    assert (await sandbox.exec("kill -KILL $$")).exit_code == 137
    assert (await sandbox.exec("kill -TERM $$")).exit_code == 143


async def test_unknown_user_is_a_command_that_failed_to_start(sandbox: Any) -> None:
    result = await sandbox.exec(["true"], user="hutch-no-such-user")
    assert result.exit_code == 126
    assert "no such user 'hutch-no-such-user'" in result.stderr and ALIAS in result.stderr


# -- the host is not hutch's ----------------------------------------------------------


async def test_close_leaves_the_host_and_its_files(server: SshServer, workdir: str) -> None:
    async with await make(server, workdir) as sb:
        await sb.write_text("kept.txt", "still here")
        caps = sb.capabilities
        assert caps.supports("host_outlives_sandbox")
        assert not caps.pause and not caps.suspend and not caps.snapshot
    with open(os.path.join(workdir, "kept.txt")) as fh:
        assert fh.read() == "still here"


async def test_preview_url(server: SshServer, workdir: str) -> None:
    async with await make(server, workdir) as sb:
        assert not sb.capabilities.preview_url
        with pytest.raises(hutch.CapabilityUnsupported):
            await sb.preview_url(3000)
    async with await make(server, workdir, preview_url_base="http://devbox/") as sb:
        assert sb.capabilities.preview_url
        assert await sb.preview_url(3000) == "http://devbox:3000"


async def test_busy_count_sees_processes_started_through_hutch(sandbox: Any) -> None:
    assert await backend(sandbox).count_busy_processes() == 0
    process = await sandbox.start("sleep 300")
    await sandbox.exec("nohup sleep 300 >/dev/null 2>&1 &")
    await asyncio.sleep(0.5)  # the background one has been started by now
    # A process on the host that hutch did not start is not this sandbox's work.
    outsider = await asyncio.create_subprocess_exec("sleep", "300")
    try:
        assert await backend(sandbox).count_busy_processes() == 2
    finally:
        outsider.kill()
        await outsider.wait()
    await process.kill()
    assert await backend(sandbox).count_busy_processes() == 1
    # The nohup'd one carries the marker it inherited (the host is this machine).
    for pid in pids_with_env("HUTCH_SANDBOX_ID", sandbox.id):
        os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    assert await backend(sandbox).count_busy_processes() == 0



async def test_a_second_sandbox_is_not_busy_with_the_firsts_work(
    server: SshServer, workdir: str
) -> None:
    async with await make(server, workdir) as one, await make(server, workdir) as two:
        process = await one.start("sleep 300")
        try:
            await asyncio.sleep(0.3)
            assert await backend(one).count_busy_processes() == 1
            assert await backend(two).count_busy_processes() == 0
        finally:
            await process.kill()


async def test_grep_and_glob_answer_as_local(server: SshServer, workdir: str) -> None:
    os.makedirs(os.path.join(workdir, "t", "sub"))
    files = {
        "t/a.txt": b"alpha\r\nbeta\n", "t/sub/b.py": b"beta = 1\nALPHA\n",
        "t/bin.dat": b"\0beta", "t/odd name\n.txt": b"beta\n", "t/latin1.txt": b"beta \xe9\n",
    }
    for rel, data in files.items():
        with open(os.path.join(workdir, rel), "wb") as fh:
            fh.write(data)
    os.symlink(os.path.join(workdir, "t", "sub"), os.path.join(workdir, "t", "link-to-dir"))
    os.symlink("missing", os.path.join(workdir, "t", "dangling"))
    async with await make(server, workdir) as remote, await hutch.create_sandbox(
        "local", workdir=workdir, read_before_write=False
    ) as local:
        for pattern, glob in [("beta", None), ("(?i)alpha", "*.py"), ("^$", None)]:
            assert await remote.grep(pattern, "t", glob=glob) == await local.grep(
                pattern, "t", glob=glob
            )
        for pattern in ["**", "*.txt", "sub/*", "**/*.py"]:
            assert await remote.glob(pattern, "t") == await local.glob(pattern, "t")


# -- a git source -------------------------------------------------------------------------


def _git(*args: str, cwd: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd, check=True, capture_output=True, text=True,
    ).stdout


@pytest.fixture
def repository() -> Iterator[str]:
    repo = tempfile.mkdtemp(prefix="hutch-ssh-repo-")
    _git("init", "-q", "-b", "main", cwd=repo)
    with open(os.path.join(repo, "README"), "w") as fh:
        fh.write("main\n")
    _git("add", "README", cwd=repo)
    _git("commit", "-q", "-m", "main", cwd=repo)
    _git("checkout", "-q", "-b", "feature", cwd=repo)
    with open(os.path.join(repo, "feature.txt"), "w") as fh:
        fh.write("on the feature branch\n")
    _git("add", "feature.txt", cwd=repo)
    _git("commit", "-q", "-m", "feature", cwd=repo)
    _git("checkout", "-q", "main", cwd=repo)
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


async def test_clone_a_branch_into_the_working_directory(
    server: SshServer, workdir: str, repository: str
) -> None:
    target = os.path.join(workdir, "clone")
    async with await make(
        server, target, clone=True, repository=repository, branch="feature"
    ) as sb:
        assert await sb.read_text("feature.txt") == "on the feature branch\n"
        assert (await sb.exec(["git", "rev-parse", "--abbrev-ref", "HEAD"])).stdout == "feature\n"
        await sb.write_text("work.txt", "in progress")
    # Made again on the same clone: the work there is kept, not cloned over.
    async with await make(
        server, target, clone=True, repository=repository, branch="feature"
    ) as sb:
        assert await sb.read_text("work.txt") == "in progress"


async def test_clone_refuses_a_directory_with_other_files(
    server: SshServer, workdir: str, repository: str
) -> None:
    with open(os.path.join(workdir, "mine.txt"), "w") as fh:
        fh.write("not a clone")
    with pytest.raises(hutch.InvalidArgument) as info:
        await make(server, workdir, clone=True, repository=repository)
    assert "not empty" in str(info.value)
    with open(os.path.join(workdir, "mine.txt")) as fh:
        assert fh.read() == "not a clone"


async def test_clone_of_a_missing_branch_is_a_provider_error(
    server: SshServer, workdir: str, repository: str
) -> None:
    with pytest.raises(hutch.ProviderError) as info:
        await make(server, os.path.join(workdir, "c"), clone=True, repository=repository,
                   branch="no-such-branch")
    assert "no-such-branch" in str(info.value)


async def test_pool_is_per_loop_and_released(server: SshServer) -> None:
    target = SshTarget.from_config(SshConfig(
        destination=ALIAS, working_directory="/tmp", config_file=server.config_file
    ))
    kept = acquire(target)
    assert acquire(target) is kept
    await release(kept)
    await release(kept)
    fresh = acquire(target)
    assert fresh is not kept
    await release(fresh)


async def test_liveness_is_the_working_directory(own_server: SshServer) -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-ssh-alive-")
    async with await make(own_server, workdir, connect_timeout=3) as sb:
        assert await backend(sb).is_alive()
        own_server.kill_all()
        with pytest.raises(hutch.SandboxUnavailable):  # cannot tell is not "gone"
            await backend(sb).is_alive()
        own_server.start()
        os.rmdir(workdir)
        assert not await backend(sb).is_alive()


# -- the local repository as the source (CLI --clone-current) -----------------------------


@pytest.mark.parametrize(
    ("remote", "https"),
    [
        ("git@github.com:owner/repo.git", "https://github.com/owner/repo.git"),
        ("ssh://git@github.com/owner/repo.git", "https://github.com/owner/repo.git"),
        ("ssh://git@git.example.com:2222/team/repo", "https://git.example.com/team/repo"),
        ("git+ssh://me@host.example/x/y.git", "https://host.example/x/y.git"),
        ("https://github.com/owner/repo.git", "https://github.com/owner/repo.git"),
        ("/srv/git/repo.git", "/srv/git/repo.git"),
        ("file:///srv/git/repo.git", "file:///srv/git/repo.git"),
    ],
)
def test_ssh_remote_urls_become_https(remote: str, https: str) -> None:
    assert https_url(remote) == https


def test_current_source_reads_origin_and_branch(repository: str) -> None:
    checkout = tempfile.mkdtemp(prefix="hutch-ssh-checkout-")
    try:
        _git("clone", "-q", "--branch", "feature", repository, checkout, cwd="/")
        _git("remote", "set-url", "origin", "git@example.com:team/project.git", cwd=checkout)
        assert current_source(checkout) == GitSource(
            "https://example.com/team/project.git", "feature"
        )
        _git("checkout", "-q", "--detach", cwd=checkout)
        assert current_source(checkout) == GitSource(
            "https://example.com/team/project.git", None
        )
    finally:
        shutil.rmtree(checkout, ignore_errors=True)
    assert current_source(tempfile.gettempdir()) is None


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(extra_args=["--allow-provider", "ssh", "--allow", "destination",
                                  "--allow", "config_file"]).start()
    yield d
    d.stop()
    shutil.rmtree(d.data_dir, ignore_errors=True)


async def test_daemon_refuses_a_destination_its_operator_did_not_allow(
    server: SshServer, workdir: str
) -> None:
    # The daemon's ssh keys are its operator's: a client may not aim them
    # anywhere, even where the operator lets clients use ssh.
    d = DaemonProcess(extra_args=["--allow-provider", "ssh"]).start()
    try:
        async with hutch.AsyncClient(d.url, token=d.token) as client:
            with pytest.raises(PermissionError) as info:
                await client.create_sandbox(
                    "ssh", destination=ALIAS, working_directory=workdir,
                    config_file=server.config_file,
                )
        assert info.value.code == "permission_denied"  # type: ignore[attr-defined]
        assert "destination" in str(info.value) or "config_file" in str(info.value)
    finally:
        d.stop()
        shutil.rmtree(d.data_dir, ignore_errors=True)


def test_cli_clone_current(
    daemon: DaemonProcess, server: SshServer, workdir: str, repository: str
) -> None:
    checkout = tempfile.mkdtemp(prefix="hutch-ssh-checkout-")
    target = os.path.join(workdir, "from-cli")
    try:
        _git("clone", "-q", "--branch", "feature", repository, checkout, cwd="/")
        env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
        done = subprocess.run(
            [sys.executable, "-m", "hutch.cli.main", "create", "--provider", "ssh",
             "--destination", ALIAS, "--working-directory", target,
             "--ssh-config", server.config_file, "--clone-current"],
            cwd=checkout, env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 0, done.stderr
        with open(os.path.join(target, "feature.txt")) as fh:
            assert fh.read() == "on the feature branch\n"
        head = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=target)
        assert head == "feature\n"
    finally:
        shutil.rmtree(checkout, ignore_errors=True)


# -- lifecycle on top: idleness and daemon restarts ------------------------------------------


async def test_a_nohup_job_on_the_host_keeps_the_sandbox_from_idling_out(
    server: SshServer, workdir: str
) -> None:
    async with await make(server, workdir, idle_timeout=1) as sb:
        await sb.exec("nohup sleep 5 >/dev/null 2>&1 &")
        await asyncio.sleep(3)
        assert sb.state is SandboxState.RUNNING, "reaped while a job started through hutch ran"
        for _ in range(150):  # up to 30 s
            if sb.state is not SandboxState.RUNNING:
                break
            await asyncio.sleep(0.2)
        assert sb.state is SandboxState.TERMINATED  # idle once the job ended
        assert (await settle(sb.status())).reason == "idle_timeout"


def test_daemon_restart_adopts_an_ssh_sandbox(server: SshServer, workdir: str) -> None:
    d = DaemonProcess(extra_args=["--allow-provider", "ssh", "--allow", "destination",
                                  "--allow", "config_file"]).start()
    try:
        with hutch.Client(d.url, token=d.token) as client:
            sb = client.create_sandbox(
                "ssh", destination=ALIAS, working_directory=workdir,
                config_file=server.config_file, read_before_write=False,
            )
            sb.write_text("kept.txt", "before the crash")
        d.restart()  # SIGKILL, then start: the new daemon reconnects from the store
        with hutch.Client(d.url, token=d.token) as client:
            again = client.get_sandbox(sb.id)
            assert again.info()["state"] == "running"
            assert again.read_text("kept.txt") == "before the crash"
            assert again.exec(["pwd"]).stdout.strip() == workdir
            again.close()
    finally:
        d.stop()
        shutil.rmtree(d.data_dir, ignore_errors=True)


# -- any argv, any variable: what the command gets is what was sent ---------------------------

_WORD = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=24
)


@pytest.fixture(scope="module")
def sync_sandbox() -> Iterator[Any]:
    server = shared_server()
    workdir = tempfile.mkdtemp(prefix="hutch-ssh-prop-")
    sb = hutch.create_sandbox_sync(
        "ssh", destination=ALIAS, working_directory=workdir, config_file=server.config_file,
        read_before_write=False,
    )
    yield sb
    sb.close()
    shutil.rmtree(workdir, ignore_errors=True)


@given(words=st.lists(_WORD, max_size=6), value=_WORD)
@settings(max_examples=40, deadline=None)
def test_any_argv_and_env_value_arrive_verbatim(
    sync_sandbox: Any, words: list[str], value: str
) -> None:
    result = sync_sandbox.exec(
        ["sh", "-c", 'for a; do printf "%s\\0" "$a"; done; printf "%s" "$HUTCH_PROP"', "sh",
         *words],
        env={"HUTCH_PROP": value},
    )
    expected = b"".join(w.encode() + b"\0" for w in words) + value.encode()
    assert result.stdout_bytes == expected


# -- an interactive shell on the host's own pseudo-terminal ------------------------------------


async def test_pty_types_reads_resizes_and_exits(sandbox: Any, workdir: str) -> None:
    async with sandbox.pty(["sh"], rows=30, cols=100, env={"GREETING": "hello"}) as term:
        assert sandbox.open_operations == 1  # an open shell keeps the sandbox busy
        await term.write(b"stty size; echo $GREETING-$((40+2)); pwd\r")
        seen = b""
        while b"hello-42" not in seen or workdir.encode() not in seen.split(b"hello-42", 1)[1]:
            chunk = await term.read()
            assert chunk is not None, seen
            seen += chunk.data
        assert b"30 100" in seen
        await term.resize(40, 120)
        await term.write(b"stty size; exit 7\r")
        while (chunk := await term.read()) is not None:
            seen += chunk.data
        assert b"40 120" in seen
        assert await term.wait() == 7
    assert sandbox.open_operations == 0


async def test_pty_left_open_is_killed_on_leaving(sandbox: Any) -> None:
    async with sandbox.pty(["sh"]) as term:
        await term.write(b"trap '' TERM HUP; sleep 300\r")
        await asyncio.sleep(0.5)
    assert await backend(sandbox).count_busy_processes() == 0
    with pytest.raises(FileNotFoundError):
        async with sandbox.pty(["sh"], cwd="no/such/dir"):
            pass


def test_pty_through_the_daemon(daemon: DaemonProcess, server: SshServer, workdir: str) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as client:
        sb = client.create_sandbox(
            "ssh", destination=ALIAS, working_directory=workdir, config_file=server.config_file
        )
        try:
            with sb.pty(["sh"], rows=33, cols=91, env={"GREETING": "hello"}) as term:
                term.write(b"stty size; echo $GREETING-$((2+2)); exit 4\n")
                seen = b""
                while (chunk := term.read(20)) is not None:
                    seen += chunk.data
                assert b"33 91" in seen and b"hello-4" in seen, seen
                assert term.wait() == 4
        finally:
            sb.close()


async def test_write_from_a_stream_in_pieces(sandbox: Any, workdir: str) -> None:
    data = os.urandom(9 * 1024 * 1024 + 7)  # more than two pieces
    with tempfile.TemporaryFile() as source:
        source.write(data)
        source.seek(0)
        await sandbox.write_from("up/loaded.bin", source)
    with open(os.path.join(workdir, "up", "loaded.bin"), "rb") as fh:
        assert fh.read() == data
    with tempfile.TemporaryFile() as source, pytest.raises(IsADirectoryError):
        await sandbox.write_from("up", source)


async def test_a_fifo_is_not_read_and_grep_passes_it_by(sandbox: Any, workdir: str) -> None:
    # Opening a FIFO over SFTP would hold the host's SFTP server until a writer came.
    os.makedirs(os.path.join(workdir, "pipes"))
    os.mkfifo(os.path.join(workdir, "pipes", "fifo"))
    with open(os.path.join(workdir, "pipes", "text.txt"), "w") as fh:
        fh.write("needle\n")
    with pytest.raises(hutch.InvalidArgument):
        await asyncio.wait_for(sandbox.read_bytes("pipes/fifo"), 30)
    matches = await asyncio.wait_for(sandbox.grep("needle", "pipes"), 30)
    assert [(m.path.rsplit("/", 1)[-1], m.line) for m in matches] == [("text.txt", "needle")]
    assert await sandbox.read_text("pipes/text.txt") == "needle\n"
