"""Docker-specific behaviour, against a real Docker Engine (no mocks).

The generic semantics (exit codes, streams, cwd, env, users, files) are the
conformance suite's; here is what only docker has: the container hutch makes
and how it is hardened, the bind mount, the exec transport under load, pause,
suspend by commit, preserve, reconnect, and grep done inside the container
answering exactly as the base rule does on local.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import docker
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers import _diskcap
from hutch.providers.agent.workload import MEMORY_RESERVE, PIDS_RESERVE
from hutch.providers.docker import DockerSandbox, list_managed_containers
from hutch.providers.docker import snapshots as docker_snapshots
from tests.conftest import TEST_IMAGE
from tests.hazards import loop_devices_left, workload_limits

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

ODD_NAME = "a b'\"\n€.bin"


@pytest.fixture
def api() -> docker.APIClient:
    return docker.APIClient(version="auto")


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, labels={"team": "tests"}, pids_limit=300,
        memory="256m", env={"FROM_CONFIG": "yes"}, read_before_write=False,
    ) as sandbox:
        yield sandbox


def images_of(api: docker.APIClient, sandbox_id: str) -> list[dict[str, Any]]:
    images: list[dict[str, Any]] = api.images(
        all=True, filters={"label": f"hutch.sandbox_id={sandbox_id}"}
    )
    return images


# -- the container hutch makes --------------------------------------------------------


async def test_container_is_labelled_named_and_hardened(sb: Any, api: docker.APIClient) -> None:
    details = api.inspect_container(backend_of(sb).container_id)
    assert details["Name"] == f"/hutch-{sb.id}"
    # The keeper is hutch's agent, its executable mounted read-only.
    assert details["Config"]["Cmd"] == [
        "/.hutch/bin/hutch-agent", "serve", "/.hutch/run/agent.sock"
    ]
    mounts = {m["Destination"]: m for m in details["Mounts"]}
    assert mounts["/.hutch/bin/hutch-agent"]["RW"] is False
    assert sb.capabilities.runtime == "agent"
    assert details["Config"]["WorkingDir"] == "/workspace"
    labels = details["Config"]["Labels"]
    assert labels["hutch.managed"] == "1"
    assert labels["hutch.sandbox_id"] == sb.id
    assert labels["team"] == "tests"
    host = details["HostConfig"]
    assert "no-new-privileges" in host["SecurityOpt"]
    # The caller's limits hold what runs; the container's add the agent's reserve.
    assert workload_limits(backend_of(sb).container_id) == (256 * 1024 * 1024, 300)
    assert host["PidsLimit"] == 300 + PIDS_RESERVE
    assert host["Memory"] == 256 * 1024 * 1024 + MEMORY_RESERVE
    assert "NET_RAW" in host["CapDrop"]
    assert host["Init"] is True  # orphans are reaped, not kept as zombies
    assert (sb.id, backend_of(sb).container_id, "running") in list_managed_containers()


async def test_capabilities_are_really_dropped(sb: Any) -> None:
    status = (await sb.exec(["cat", "/proc/self/status"])).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    cap_eff = int(fields["CapEff"], 16)
    net_raw, mknod = 1 << 13, 1 << 27
    assert cap_eff & net_raw == 0
    assert cap_eff & mknod == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert (await sb.exec(["mknod", "/tmp/dev", "c", "1", "3"])).exit_code != 0
    # Package managers still work as root: chown, setuid and file ownership.
    assert (await sb.exec("useradd -m agent && su agent -c 'id -un'")).stdout == "agent\n"


async def test_pids_limit_holds_a_fork_bomb(sb: Any) -> None:
    result = await sb.exec(
        "for i in $(seq 1 400); do sleep 5 & done 2>/dev/null; jobs -p | wc -l", timeout=30
    )
    assert int(result.stdout.strip() or 0) < 300


async def test_config_env_reaches_every_exec(sb: Any) -> None:
    result = await sb.exec("echo $FROM_CONFIG $HUTCH_SANDBOX_ID $PER_CALL", env={"PER_CALL": "1"})
    assert result.stdout == f"yes {sb.id} 1\n"


async def test_working_directory_is_the_host_bind_mount(sb: Any) -> None:
    await sb.write_text("from-sandbox.txt", "inside")
    host = backend_of(sb).host_workdir
    # Hutch's own, layered (see layers.prepare): the host sees what the sandbox does.
    assert host.endswith(os.path.join("layers", "mounts", sb.id, "merged"))
    with open(os.path.join(host, "from-sandbox.txt")) as fh:
        assert fh.read() == "inside"
    with open(os.path.join(host, "from-host.txt"), "w") as fh:
        fh.write("outside")
    assert (await sb.exec(["cat", "/workspace/from-host.txt"])).stdout == "outside"
    assert (await sb.exec(["pwd"])).stdout == "/workspace\n"


async def test_extra_mounts_and_read_only(api: docker.APIClient) -> None:
    shared = tempfile.mkdtemp(prefix="hutch-mount-")
    with open(os.path.join(shared, "given.txt"), "w") as fh:
        fh.write("given")
    try:
        async with await hutch.create_sandbox(
            "docker", image=TEST_IMAGE, mounts=[f"{shared}:/data:ro"], network_mode="none",
            read_before_write=False,
        ) as sandbox:
            assert await sandbox.read_text("/data/given.txt") == "given"
            refused = await sandbox.exec(["sh", "-c", "echo x > /data/new.txt"])
            assert refused.exit_code != 0 and "Read-only" in refused.stderr
            with pytest.raises(hutch.SandboxPermissionDenied):
                await sandbox.remove("/data/given.txt")
            details = api.inspect_container(backend_of(sandbox).container_id)
            assert details["HostConfig"]["NetworkMode"] == "none"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


async def test_missing_image_without_pull_is_not_found() -> None:
    with pytest.raises(hutch.NotFound, match="no-such-image"):
        await hutch.create_sandbox(
            "docker", image="hutch-no-such-image:never", pull_if_missing=False
        )


@pytest.mark.parametrize("runtime", ["auto", "agent"])
async def test_a_failed_create_leaves_no_directory_behind(
    runtime: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HUTCH_HOME", str(tmp_path))
    with pytest.raises(hutch.NotFound):
        await hutch.create_sandbox(
            "docker", image="hutch-no-such-image:never", pull_if_missing=False, runtime=runtime
        )
    left = [os.path.relpath(os.path.join(d, n), tmp_path)
            for d, dirs, files in os.walk(tmp_path) for n in dirs + files
            if os.path.relpath(d, tmp_path).startswith("sandboxes")
            or n == "sandboxes"]
    assert [p for p in left if p != "sandboxes"] == []


async def test_missing_image_whose_pull_fails_is_not_found_and_says_why() -> None:
    with pytest.raises(hutch.NotFound, match="pulling it failed"):
        await hutch.create_sandbox("docker", image="hutch-no-such-image:never")


async def test_bad_mount_is_invalid_argument() -> None:
    with pytest.raises(hutch.InvalidArgument, match="host:container"):
        await hutch.create_sandbox("docker", image=TEST_IMAGE, mounts=["nocolon"])


# -- exec over the hijacked socket -------------------------------------------------------


async def test_large_binary_stdin_both_ways(sb: Any) -> None:
    data = os.urandom(8 * 1024 * 1024)
    digest = await sb.exec(["sha256sum"], stdin=data)
    assert digest.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    # Fed and read at once: neither side may wait for the other to finish.
    echoed = await sb.exec(["cat"], stdin=data)
    assert echoed.stdout_bytes == data


async def test_timeout_kills_children_that_ignore_sigterm_or_left_the_session(sb: Any) -> None:
    script = (
        "trap '' TERM; (trap '' TERM; exec sleep 300) & "
        "setsid sh -c \"trap '' TERM; sleep 301\" & sleep 302"
    )
    started = time.monotonic()
    with pytest.raises(hutch.ExecTimeout):
        await sb.exec(script, timeout=1.5)
    assert time.monotonic() - started < 12
    left = (await sb.exec(["ps", "-eo", "args"])).stdout
    assert "sleep 30" not in left
    assert "defunct" not in left  # init reaped what the kill left
    assert await backend_of(sb).count_busy_processes() == 0


async def test_background_kill_ends_a_setsid_child(sb: Any) -> None:
    process = await sb.start("setsid sh -c \"trap '' TERM; sleep 303\"; sleep 304")
    for _ in range(50):
        if "sleep 303" in (await sb.exec(["ps", "-eo", "args"])).stdout:
            break
        await asyncio.sleep(0.1)
    await process.kill()
    assert "sleep 30" not in (await sb.exec(["ps", "-eo", "args"])).stdout


async def test_exec_start_failures_are_typed(sb: Any) -> None:
    # An unknown user is a command that failed to start: a result (126).
    unknown = await sb.exec(["id"], user="no-such-user")
    assert unknown.exit_code == 126 and "no-such-user" in unknown.stderr
    with pytest.raises(hutch.SandboxFileNotFound, match="/nope"):
        await sb.exec(["true"], cwd="/nope")
    with pytest.raises(hutch.SandboxFileNotFound, match="no-such-command"):
        await sb.exec(["no-such-command"])
    with pytest.raises(hutch.SandboxPermissionDenied):
        await sb.exec(["/etc/passwd"])
    assert (await sb.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"


async def test_shell_falls_back_to_sh_without_bash(sb: Any) -> None:
    assert (await sb.exec("echo $BASH_VERSION")).stdout.strip() != ""
    await sb.exec(["mv", "/usr/bin/bash", "/usr/bin/bash.off"])
    try:
        result = await sb.exec("echo via-$0; exit 3")
        assert (result.exit_code, result.stdout) == (3, "via-sh\n")
    finally:
        await sb.exec(["mv", "/usr/bin/bash.off", "/usr/bin/bash"])


async def test_busy_processes_count_a_nohup_job(sb: Any) -> None:
    assert await backend_of(sb).count_busy_processes() == 0
    await sb.exec("nohup sleep 60 >/dev/null 2>&1 &")
    assert await backend_of(sb).count_busy_processes() == 1
    await sb.exec(["pkill", "-f", "sleep 60"])
    for _ in range(50):
        if await backend_of(sb).count_busy_processes() == 0:
            break
        await asyncio.sleep(0.1)
    assert await backend_of(sb).count_busy_processes() == 0


async def test_preview_url_reaches_a_server_in_the_container(sb: Any) -> None:
    server = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 8123)); s.listen()\n"
        "c, _ = s.accept(); c.recv(1024)\n"
        "c.sendall(b'HTTP/1.0 200 OK\\r\\nContent-Length: 5\\r\\n\\r\\nhello'); c.close()\n"
    )
    process = await sb.start(["python3", "-c", server])
    url = await sb.preview_url(8123)
    assert url.startswith("http://") and url.endswith(":8123")

    def fetch() -> bytes:
        for _ in range(50):
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    body: bytes = response.read()
                    return body
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"nothing answered at {url}")

    assert await asyncio.to_thread(fetch) == b"hello"
    await process.wait(timeout=10)


# -- files through the archive API ----------------------------------------------------------


async def test_ten_megabytes_with_an_odd_name_round_trip(sb: Any) -> None:
    data = os.urandom(10 * 1024 * 1024)
    for path in (ODD_NAME, f"/root/deep/er/{ODD_NAME}"):
        await sb.write_bytes(path, data)
        assert await sb.read_bytes(path) == data
        size = await sb.exec(["stat", "-c", "%s", path])
        assert size.stdout == f"{len(data)}\n"
    with open(os.path.join(backend_of(sb).host_workdir, ODD_NAME), "rb") as fh:
        assert fh.read() == data
    assert ODD_NAME in [i.name for i in await sb.list_dir(".")]
    assert f"/workspace/{ODD_NAME}" in await sb.glob("*.bin")
    with pytest.raises(hutch.OutputLimitExceeded, match="1000"):
        await sb.read_bytes(ODD_NAME, limit=1000)


async def test_overwrite_keeps_mode_and_writes_through_links(sb: Any) -> None:
    await sb.write_text("run.sh", "#!/bin/sh\necho one\n")
    await sb.exec(["chmod", "755", "run.sh"])
    await sb.write_text("run.sh", "#!/bin/sh\necho two\n")
    assert (await sb.exec(["./run.sh"])).stdout == "two\n"
    await sb.exec(["ln", "-s", "run.sh", "link"])
    await sb.write_text("link", "#!/bin/sh\necho three\n")
    assert (await sb.stat("link")).type == hutch.FileType.SYMLINK
    assert await sb.read_text("run.sh") == "#!/bin/sh\necho three\n"
    assert await sb.read_text("link") == "#!/bin/sh\necho three\n"


async def test_file_errors_are_typed(sb: Any) -> None:
    await sb.write_text("plain", "x")
    with pytest.raises(hutch.SandboxFileNotFound):
        await sb.write_text("plain/below", "y")
    with pytest.raises(hutch.SandboxFileNotFound):
        await sb.stat("plain/below")
    with pytest.raises(hutch.SandboxIsADirectory):
        await sb.read_bytes("/etc")
    with pytest.raises(hutch.SandboxFileNotFound):
        await sb.glob("*", "no-such-dir")


async def test_grep_answers_as_the_base_rule_on_local(sb: Any) -> None:
    """grep -F in the container narrows lines; Python decides, as on local."""
    files: dict[str, bytes] = {
        "crlf.txt": b"foo\r\nbar\r\nfoo bar\r\n",
        "unicode.txt": "café\nnaïve\nplain\nKelvin \u212a\n".encode(),
        "latin1.txt": "café au lait\n".encode("latin-1"),
        "breaks.txt": b"a\rbar\nzzz bar\n\x0cbar\n",
        "late-nul.bin": b"x\n" * 6000 + b"\0\nbar here\n",
        "very-late-nul.bin": b"bar first\n" + b"x\n" * 100000 + b"\0\nbar there\n",
        "early-nul.bin": b"\0bar\n",
        "empty-lines.txt": b"a\n\n\nb\n",
        "src/deep/code.py": b"def foo():\n    return 'bar'\n",
        "src/.hidden.py": b"bar = 1\n",
        f"odd/{ODD_NAME}.txt".replace("\n", "_"): b"bar:2:z\n",
        "odd/we ird\nname.txt": b"bar\n",
    }
    queries: list[tuple[str, str, str | None, bool]] = [
        ("bar", ".", None, False),
        ("bar$", ".", None, False),
        (r"caf\w", ".", None, False),
        (r"na.ve$", ".", None, False),
        ("k", ".", None, True),
        ("BAR|foo", ".", None, True),
        ("^$", ".", None, False),
        (r"(?x) return \s 'bar'  # verbose", ".", None, False),
        (r"\d", ".", None, False),
        ("bar", "src", "*.py", False),
        ("bar", "src", "deep/*.py", False),
        ("bar", "src/deep/code.py", "*.txt", False),
        ("bar", "odd", "**", False),
    ]
    local_dir = tempfile.mkdtemp(prefix="hutch-grep-local-")
    try:
        async with await hutch.create_sandbox(
            "local", workdir=local_dir, read_before_write=False
        ) as local:
            for name, data in files.items():
                await local.write_bytes(name, data)
                await sb.write_bytes(name, data)
            await local.exec(["ln", "-s", "crlf.txt", "link.txt"])
            await sb.exec(["ln", "-s", "crlf.txt", "link.txt"])
            for pattern, path, glob, ignore_case in queries:
                expected = [
                    (os.path.relpath(m.path, local_dir), m.line_number, m.line)
                    for m in await local.grep(pattern, path, glob=glob, ignore_case=ignore_case)
                ]
                got = [
                    (os.path.relpath(m.path, "/workspace"), m.line_number, m.line)
                    for m in await sb.grep(pattern, path, glob=glob, ignore_case=ignore_case)
                ]
                assert got == expected, (pattern, path, glob, ignore_case)
                assert expected or pattern == r"\d", pattern  # each query finds something
            assert [os.path.relpath(p, "/workspace") for p in await sb.glob("**")] == [
                os.path.relpath(p, local_dir) for p in await local.glob("**")
            ]
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


# -- pause, suspend, close ------------------------------------------------------------------


async def test_pause_keeps_files_and_processes(sb: Any, api: docker.APIClient) -> None:
    await sb.exec("nohup sleep 300 >/dev/null 2>&1 &")
    await sb.write_text("/root/kept.txt", "kept")
    await sb.pause()
    assert api.inspect_container(backend_of(sb).container_id)["State"]["Paused"]
    assert await backend_of(sb).is_alive()
    await sb.resume()
    assert await sb.read_text("/root/kept.txt") == "kept"
    assert "sleep 300" in (await sb.exec("ps -eo args")).stdout
    assert await backend_of(sb).count_busy_processes() == 1


async def test_suspend_frees_the_container_and_resume_restores_files(
    sb: Any, api: docker.APIClient
) -> None:
    await sb.write_text("/root/rootfs.txt", "in the container layer")
    await sb.write_text("work.txt", "in the bind mount")
    await sb.exec("nohup sleep 300 >/dev/null 2>&1 &")
    old = backend_of(sb).container_id
    await sb.suspend()
    assert not any(c["Id"] == old for c in api.containers(all=True))
    assert not await backend_of(sb).is_alive()
    image = api.inspect_image(f"hutch-suspended:{sb.id}")
    assert image["Config"]["Labels"]["hutch.sandbox_id"] == sb.id
    # The daemon rebuilds the backend from what the store kept.
    description = backend_of(sb).describe()
    assert description["suspended_image"] == image["Id"]
    again = await DockerSandbox.reconnect(sb.id, description)
    assert again.host_workdir == backend_of(sb).host_workdir
    await sb.resume()
    assert await backend_of(sb).is_alive()
    details = api.inspect_container(backend_of(sb).container_id)
    assert details["Name"] == f"/hutch-{sb.id}"
    assert details["Config"]["Labels"]["team"] == "tests"
    assert details["HostConfig"]["PidsLimit"] == 300 + PIDS_RESERVE
    assert workload_limits(backend_of(sb).container_id)[1] == 300
    assert await sb.read_text("/root/rootfs.txt") == "in the container layer"
    assert await sb.read_text("work.txt") == "in the bind mount"
    # Honest capabilities: a commit keeps files, not processes.
    assert not sb.capabilities.suspend_keeps_processes
    assert await backend_of(sb).count_busy_processes() == 0


async def test_many_suspend_cycles_keep_files_and_flatten_before_the_layer_cap(
    api: docker.APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(docker_snapshots, "MAX_SUSPEND_LAYERS", 3)
    sandbox = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, env={"FROM_CONFIG": "yes"}, read_before_write=False
    )
    try:
        for cycle in range(5):
            await sandbox.write_text(f"/root/cycle-{cycle}", str(cycle))
            await sandbox.write_text(f"work-{cycle}", str(cycle))
            await sandbox.suspend()
            layers = api.inspect_image(backend_of(sandbox).suspended_image)["RootFS"]["Layers"]
            assert len(layers) <= 3
            await sandbox.resume()
            for seen in range(cycle + 1):
                assert await sandbox.read_text(f"/root/cycle-{seen}") == str(seen)
                assert await sandbox.read_text(f"work-{seen}") == str(seen)
        result = await sandbox.exec("echo $FROM_CONFIG; command -v sh; pwd; id -un")
        assert result.stdout == "yes\n/usr/bin/sh\n/workspace\nroot\n"
    finally:
        await sandbox.close()
    assert images_of(api, sandbox.id) == []


async def test_resume_replaces_a_stale_container_of_its_own(
    sb: Any, api: docker.APIClient
) -> None:
    await sb.suspend()
    # A crash between a resume's create and its record leaves this behind.
    api.create_container(
        TEST_IMAGE, ["sleep", "infinity"], name=f"hutch-{sb.id}",
        labels={"hutch.managed": "1", "hutch.sandbox_id": sb.id},
    )
    await sb.resume()
    assert (await sb.exec(["true"])).exit_code == 0


async def test_close_removes_container_image_and_own_workdir(api: docker.APIClient) -> None:
    sandbox = await hutch.create_sandbox("docker", image=TEST_IMAGE)
    await sandbox.exec("echo x > /root/x")
    await sandbox.suspend()
    image = backend_of(sandbox).suspended_image
    await sandbox.resume()
    container, workdir = backend_of(sandbox).container_id, backend_of(sandbox).host_workdir
    await sandbox.close()
    await backend_of(sandbox).close()  # idempotent
    assert not any(c["Id"] == container for c in api.containers(all=True))
    assert not any(i["Id"] == image for i in api.images(all=True))
    assert images_of(api, sandbox.id) == []
    assert not os.path.exists(workdir)


async def test_close_keeps_a_given_host_workdir(api: docker.APIClient) -> None:
    workdir = tempfile.mkdtemp(prefix="hutch-given-")
    try:
        sandbox = await hutch.create_sandbox("docker", image=TEST_IMAGE, host_workdir=workdir)
        await sandbox.write_text("kept.txt", "mine")
        await sandbox.close()
        with open(os.path.join(workdir, "kept.txt")) as fh:
            assert fh.read() == "mine"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def test_preserve_keeps_the_container_and_says_how_to_reach_it(
    api: docker.APIClient, caplog: pytest.LogCaptureFixture
) -> None:
    workdir = tempfile.mkdtemp()
    sandbox = await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, preserve=True, host_workdir=workdir
    )
    container = backend_of(sandbox).container_id
    with caplog.at_level("WARNING", logger="hutch.docker"):
        await sandbox.close()
    try:
        assert api.inspect_container(container)["State"]["Running"]
        assert os.path.isdir(workdir)
        assert f"docker exec -it hutch-{sandbox.id} bash" in caplog.text
    finally:
        api.remove_container(container, force=True)
        shutil.rmtree(workdir, ignore_errors=True)


async def test_preserve_keeps_a_suspended_image(
    api: docker.APIClient, caplog: pytest.LogCaptureFixture
) -> None:
    sandbox = await hutch.create_sandbox("docker", image=TEST_IMAGE, preserve=True)
    await sandbox.write_text("kept.txt", "kept")
    await sandbox.suspend()
    image = backend_of(sandbox).suspended_image
    workdir = backend_of(sandbox).host_workdir
    with caplog.at_level("WARNING", logger="hutch.docker"):
        await sandbox.close()
    try:
        assert api.inspect_image(image)["Id"] == image
        assert f"hutch-suspended:{sandbox.id}" in caplog.text
        assert f"-v {workdir}:/workspace" in caplog.text
        assert os.path.isdir(workdir), "the working directory the message names is gone"
        with open(os.path.join(workdir, "kept.txt")) as fh:  # its files there, to bind
            assert fh.read() == "kept"
    finally:
        api.remove_image(image, force=True)
        await DockerSandbox.discard(sandbox.id)  # its working directory, mounts and all


async def test_reconnect_from_description(sb: Any) -> None:
    await sb.write_text("/root/r.txt", "again")
    again = await DockerSandbox.reconnect(sb.id, backend_of(sb).describe())
    assert await again.is_alive()
    assert again.container_name == f"hutch-{sb.id}"
    assert await again.read_file("/root/r.txt", 100) == b"again"
    result = await again.run_quiet(["cat", "/root/r.txt"])
    assert result == (0, b"again", b"")


def test_a_capped_directory_whose_image_was_deleted_under_its_mount_is_released(
    tmp_path: Any,
) -> None:
    """The leak a test's rmtree made: the image deleted while mounted (its loop
    device then names it "(deleted)"). Releasing the directory still finds the
    loop device by its image, unmounts and lets it go."""
    workdir = str(tmp_path / "workspace")
    _diskcap.mount_capped(workdir, 16 << 20)
    image = _diskcap.image_for(workdir)
    try:
        (device,) = _diskcap.loop_devices_backed_by(image)
        os.unlink(image)
        assert _diskcap.loop_devices_backed_by(image) == [device]
        _diskcap.unmount_capped(workdir)
        assert not os.path.ismount(workdir)
        assert loop_devices_left(image) == []
    finally:
        if os.path.ismount(workdir):
            subprocess.run(["umount", "-l", workdir], check=False)


async def test_a_snapshot_reports_what_it_holds_of_its_own(sb: Any) -> None:
    # A change of a few KB is a few KB of snapshot, not the image below it.
    await sb.exec(["sh", "-c", "head -c 4096 /dev/urandom > /etc/changed; "
                   "head -c 4096 /dev/urandom > /workspace/changed"])
    snapshot = await sb.snapshot("small")
    try:
        assert 0 < snapshot.size_bytes < 2 << 20, snapshot.size_bytes
    finally:
        await hutch.remove_snapshot(snapshot)
