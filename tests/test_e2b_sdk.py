"""The unmodified E2B SDKs against ``hutch serve`` on docker (the E2B wire).

Each case is a real script run in its own process with nothing but the E2B
environment variables pointing at the daemon: the current Python SDK (the
test extra), Python 2.45 (the v1 routes, the key's format checked) and the
npm SDK under node, both installed by scripts/ensure-e2b-sdks.sh. One
daemon serves the module; the cases that allow it share one sandbox.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hutch.server.e2b.keys import e2b_key

from .daemon_fixture import DaemonProcess

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SDK_CACHE = ROOT / ".cache" / "e2b-sdks"
PY_OLD = SDK_CACHE / "py-2.45.1"
NODE_DIR = SDK_CACHE / "node"

#: A server for the sandbox's port 8000 that needs nothing but Python's socket
#: module (the test image's Python is python3-minimal: no http.server).
PORT_SERVER = textwrap.dedent("""\
    import socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8000))
    s.listen()
    while True:
        c, _ = s.accept()
        path = c.recv(65536).split(b" ")[1]
        body = b"hello from " + path
        c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(body), body))
        c.close()
""")


#: A websocket echo server for port 8001, on sockets alone (RFC 6455: the
#: handshake, then one masked text frame of under 126 bytes echoed back).
WEBSOCKET_SERVER = textwrap.dedent("""\
    import base64, hashlib, socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8001))
    s.listen()
    while True:
        c, _ = s.accept()
        head = c.recv(65536).decode()
        key = [l.split(":", 1)[1].strip() for l in head.split("\\r\\n")
               if l.lower().startswith("sec-websocket-key:")][0]
        accept = base64.b64encode(hashlib.sha1(
            (key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        c.sendall(("HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n"
                   "Connection: Upgrade\\r\\nSec-WebSocket-Accept: " + accept
                   + "\\r\\n\\r\\n").encode())
        frame = c.recv(65536)
        length, mask = frame[1] & 0x7F, frame[2:6]
        text = bytes(b ^ mask[i % 4] for i, b in enumerate(frame[6:6 + length]))
        reply = b"echo: " + text
        c.sendall(bytes([0x81, len(reply)]) + reply)
        c.close()
""")


@pytest.fixture(scope="module")
def sdks() -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "ensure-e2b-sdks.sh"), sys.executable],
                   check=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def daemon(sdks: None) -> Iterator[DaemonProcess]:
    d = DaemonProcess(provider="docker").start()
    try:
        yield d
    finally:
        d.close()


def e2b_env(d: DaemonProcess, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("E2B_", "HUTCH_")) and k != "PYTHONPATH"}
    env.update(
        E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url, E2B_API_KEY=e2b_key(d.token),
        # get_host's domain: the daemon's own port, so that the host it builds
        # reaches hutch once it resolves to loopback (a hosts line, see README).
        E2B_DOMAIN=f"e2b.local:{d.port}", HUTCH_URL=d.url,
    )
    env.update(extra)
    return env


def run_python(d: DaemonProcess, script: str, *, old: bool = False, **extra: str) -> str:
    env = e2b_env(d, **extra)
    if old:
        env["PYTHONPATH"] = str(PY_OLD)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
        text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, f"script failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_node(d: DaemonProcess, script: str, **extra: str) -> str:
    node = shutil.which("node")
    assert node is not None, "node is needed for the npm SDK's cases"
    env = e2b_env(d, NODE_PATH=str(NODE_DIR / "node_modules"), **extra)
    done = subprocess.run(
        [node, "--input-type=module", "-e", textwrap.dedent(script)], env=env,
        capture_output=True, text=True, timeout=180, check=False, cwd=NODE_DIR,
    )
    assert done.returncode == 0, f"script failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def shared(daemon: DaemonProcess) -> str:
    """One sandbox the cases that leave it as they found it share."""
    out = run_python(daemon, """
        from e2b import Sandbox
        print(Sandbox.create(envs={"FROM_CREATE": "yes"}, metadata={"case": "shared"}).sandbox_id)
    """)
    return out.strip().splitlines()[-1]


# -- the control plane -------------------------------------------------------------------------


def test_create_info_list_timeout_kill(daemon: DaemonProcess) -> None:
    run_python(daemon, """
        from e2b import Sandbox, SandboxQuery, SandboxState
        from e2b.exceptions import NotFoundException
        a = Sandbox.create(metadata={"team": "red", "n": "1"}, timeout=120)
        b = Sandbox.create(metadata={"team": "blue", "n": "2"})
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id and info.template_id == "base", info
        assert info.metadata == {"team": "red", "n": "1"}, info.metadata
        assert info.state == SandboxState.RUNNING
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121, info
        red = Sandbox.list(query=SandboxQuery(metadata={"team": "red"})).next_items()
        assert [s.sandbox_id for s in red] == [a.sandbox_id], red
        assert Sandbox.list(query=SandboxQuery(metadata={"team": "green"})).next_items() == []
        # Newest first, one a page, the next page by its token.
        pages = Sandbox.list(limit=1)
        first = pages.next_items()
        assert [s.sandbox_id for s in first] == [b.sandbox_id] and pages.has_next
        second = pages.next_items()
        assert a.sandbox_id in [s.sandbox_id for s in second], second
        a.set_timeout(600)
        assert (a.get_info().end_at - info.end_at).total_seconds() > 400
        assert a.is_running()
        assert a.kill() is True
        assert Sandbox.kill(a.sandbox_id) is False
        try:
            Sandbox.connect(a.sandbox_id)
        except NotFoundException:
            pass
        else:
            raise AssertionError("connect to a killed sandbox")
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert b.sandbox_id not in [s.sandbox_id for s in paused]
        b.kill()
    """)


def test_every_control_plane_error_is_a_json_code_and_message(
    daemon: DaemonProcess, shared: str,
) -> None:
    # The SDKs' generated client parses every error status as {code, message}.
    key = {"X-API-KEY": e2b_key(daemon.token)}
    url = daemon.url
    answers = {
        401: httpx.get(f"{url}/v2/sandboxes"),
        404: httpx.get(f"{url}/sandboxes/sb-000000000000", headers=key),
        400: httpx.post(f"{url}/sandboxes/{shared}/timeout", json={"timeout": "soon"},
                        headers=key),
    }
    # A body announced past the daemon's cap is refused before any of it is sent.
    connection = http.client.HTTPConnection("127.0.0.1", daemon.port)
    connection.putrequest("POST", "/v2/sandboxes")
    connection.putheader("X-API-KEY", key["X-API-KEY"])
    connection.putheader("Content-Length", str(10**12))
    connection.endheaders()
    refused = connection.getresponse()
    assert refused.status == 413
    body = json.loads(refused.read())
    assert body["code"] == 413 and "over the cap" in body["message"], body
    connection.close()
    answers[405] = httpx.put(f"{url}/sandboxes/{shared}/pause", headers=key)
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)
        body = answer.json()
        assert body["code"] == status and isinstance(body["message"], str), body
        assert "error" not in body


def test_wrong_key_is_refused(daemon: DaemonProcess) -> None:
    run_python(daemon, """
        from e2b import Sandbox
        from e2b.exceptions import AuthenticationException
        try:
            Sandbox.create()
        except AuthenticationException as exc:
            print("refused", exc)
        else:
            raise AssertionError("created with a wrong key")
    """, E2B_API_KEY="e2b_" + b"wrong".hex())


def test_pause_and_connect_resume_with_files_intact(daemon: DaemonProcess) -> None:
    run_python(daemon, """
        from e2b import Sandbox, SandboxState
        sbx = Sandbox.create()
        sbx.files.write("/tmp/kept.txt", "still here")
        assert sbx.pause() is True
        assert sbx.pause() is False  # already paused: 409
        assert sbx.get_info().state == SandboxState.PAUSED
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.files.read("/tmp/kept.txt") == "still here"
        assert sbx.commands.run("cat /tmp/kept.txt").stdout == "still here"
        # Dropping memory (a suspend): the files stay all the same.
        assert again.pause(mode="filesystem") is True
        assert Sandbox.connect(sbx.sandbox_id).files.read("/tmp/kept.txt") == "still here"
        again.kill()
    """)


def test_auto_pause_at_the_timeout(daemon: DaemonProcess) -> None:
    run_python(daemon, """
        import time
        from e2b import Sandbox, SandboxState
        sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"})
        sbx.files.write("/tmp/kept.txt", "paused, not killed")
        for _ in range(300):
            if sbx.get_info().state == SandboxState.PAUSED:
                break
            time.sleep(0.1)
        assert sbx.get_info().state == SandboxState.PAUSED
        again = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert again.files.read("/tmp/kept.txt") == "paused, not killed"
        again.kill()
    """)


def test_snapshots_and_forks(daemon: DaemonProcess) -> None:
    run_python(daemon, """
        from e2b import Sandbox
        origin = Sandbox.create(metadata={"case": "fork"})
        origin.files.write("/tmp/state.txt", "before")
        snap = origin.create_snapshot(name="setup-done")
        assert snap.snapshot_id and snap.names == ["setup-done"], snap
        listed = Sandbox.list_snapshots(sandbox_id=origin.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id], listed
        origin.files.write("/tmp/state.txt", "after")
        from_snapshot = Sandbox.create(template=snap.snapshot_id)
        assert from_snapshot.files.read("/tmp/state.txt") == "before"
        branches = origin.fork(count=2)
        assert len(branches) == 2 and all(isinstance(b, Sandbox) for b in branches), branches
        branches[0].files.write("/tmp/state.txt", "branch 0")
        assert branches[1].files.read("/tmp/state.txt") == "after"
        assert origin.files.read("/tmp/state.txt") == "after"
        for sbx in [origin, from_snapshot, *branches]:
            sbx.kill()
        # The fork captured the origin too: its snapshot is listed, newest first,
        # and stands on the named one (removed first: hutch keeps a parent its
        # children need).
        made = Sandbox.list_snapshots(sandbox_id=origin.sandbox_id).next_items()
        assert len(made) == 2 and made[1].snapshot_id == snap.snapshot_id, made
        for one in made:
            assert Sandbox.delete_snapshot(one.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    """)


# -- commands ------------------------------------------------------------------------------------


def test_commands_foreground_background_stdin_list_kill(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, """
        import os
        from e2b import Sandbox, CommandExitException
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        out, err = [], []
        r = sbx.commands.run("echo one; echo two >&2; echo $FROM_CREATE",
                             on_stdout=out.append, on_stderr=err.append)
        assert r.exit_code == 0 and r.stdout == "one\\nyes\\n" and r.stderr == "two\\n", r
        assert "".join(out) == "one\\nyes\\n" and "".join(err) == "two\\n", (out, err)
        try:
            sbx.commands.run("exit 3")
        except CommandExitException as exc:
            assert exc.exit_code == 3
        else:
            raise AssertionError("a non-zero exit did not raise")
        seen = []
        handle = sbx.commands.run("sleep 0.3; echo later", background=True)
        assert handle.wait(on_stdout=seen.append).stdout == "later\\n"
        assert seen == ["later\\n"], seen
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "through stdin\\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "through stdin\\n"
        sleeper = sbx.commands.run("sleep 300", background=True)
        assert sleeper.pid in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(sleeper.pid) is True
        assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
        assert sbx.commands.kill(sleeper.pid) is False
    """, SANDBOX=shared)


def test_pty_with_resize(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, """
        import os
        from e2b import Sandbox, PtySize
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        data = []
        pty = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(pty.pid, PtySize(rows=33, cols=101))
        sbx.pty.send_stdin(pty.pid, b"stty size; exit\\n")
        pty.wait(on_pty=data.append)
        text = b"".join(data).decode(errors="replace")
        assert "33 101" in text, text
    """, SANDBOX=shared)


def test_command_over_its_timeout_is_killed(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, """
        import os, time
        from e2b import Sandbox, TimeoutException
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        try:
            sbx.commands.run("sleep 120; touch /tmp/not-killed", timeout=2)
        except TimeoutException as exc:
            assert "deadline_exceeded" in str(exc) or "timed out" in str(exc).lower(), exc
        else:
            raise AssertionError("a command over its timeout was not stopped")
        for _ in range(50):  # the kill is under way as the stream ends
            running = " ".join(" ".join([p.cmd, *p.args]) for p in sbx.commands.list())
            if "sleep 120" not in running:
                break
            time.sleep(0.1)
        assert "sleep 120" not in running, running
        assert not sbx.files.exists("/tmp/not-killed")
    """, SANDBOX=shared)


# -- files ---------------------------------------------------------------------------------------


def test_files(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, """
        import io, os
        from e2b import Sandbox, FileType
        from e2b.sandbox.filesystem.filesystem import WriteEntry
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        root = "/tmp/files case"
        sbx.files.write(f"{root}/a.txt", "text é")
        sbx.files.write(f"{root}/b.bin", bytes(range(256)))
        sbx.files.write(f"{root}/c.dat", io.BytesIO(b"streamed" * 1000))
        sbx.files.write_files([WriteEntry(path=f"{root}/sub/d.txt", data="d"),
                               WriteEntry(path=f"{root}/sub/e.txt", data=b"e")])
        assert sbx.files.read(f"{root}/a.txt") == "text é"
        assert sbx.files.read(f"{root}/b.bin", format="bytes") == bytes(range(256))
        assert b"".join(sbx.files.read(f"{root}/c.dat", format="stream")) == b"streamed" * 1000
        top = {e.name: e for e in sbx.files.list(root)}
        assert set(top) == {"a.txt", "b.bin", "c.dat", "sub"}, top
        assert top["sub"].type == FileType.DIR and top["a.txt"].type == FileType.FILE
        deep = {e.path for e in sbx.files.list(root, depth=2)}
        assert f"{root}/sub/e.txt" in deep, deep
        assert sbx.files.exists(f"{root}/a.txt") and not sbx.files.exists(f"{root}/none")
        info = sbx.files.get_info(f"{root}/b.bin")
        assert info.size == 256 and info.type == FileType.FILE, info
        moved = sbx.files.rename(f"{root}/a.txt", f"{root}/moved.txt")
        assert moved.path == f"{root}/moved.txt"
        assert not sbx.files.exists(f"{root}/a.txt")
        assert sbx.files.make_dir(f"{root}/new/deeper") is True
        assert sbx.files.make_dir(f"{root}/new/deeper") is False
        sbx.files.remove(f"{root}/moved.txt")
        sbx.files.remove(f"{root}/moved.txt")  # idempotent
        assert not sbx.files.exists(f"{root}/moved.txt")
        sbx.files.remove(root)
    """, SANDBOX=shared)


def test_watch_dir_sync_and_async(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, """
        import asyncio, os, time
        from e2b import AsyncSandbox, FilesystemEventType, Sandbox
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        sbx.files.make_dir("/tmp/watched")
        handle = sbx.files.watch_dir("/tmp/watched")
        sbx.files.write("/tmp/watched/one.txt", "1")
        sbx.files.rename("/tmp/watched/one.txt", "/tmp/watched/two.txt")
        sbx.files.remove("/tmp/watched/two.txt")
        events = []
        for _ in range(50):
            events += handle.get_new_events()
            if any(e.type == FilesystemEventType.REMOVE for e in events):
                break
            time.sleep(0.1)
        handle.stop()
        kinds = {e.type for e in events}
        assert {FilesystemEventType.CREATE, FilesystemEventType.REMOVE} <= kinds, events
        assert FilesystemEventType.RENAME in kinds, events

        async def watch_async():
            asbx = await AsyncSandbox.connect(os.environ["SANDBOX"])
            seen = []
            done = asyncio.Event()

            def on_event(event):
                seen.append(event)
                if event.name == "three.txt" and event.type == FilesystemEventType.WRITE:
                    done.set()

            watcher = await asbx.files.watch_dir("/tmp/watched", on_event)
            await asbx.files.write("/tmp/watched/three.txt", "3")
            await asyncio.wait_for(done.wait(), 20)
            await watcher.stop()
            return seen

        assert asyncio.run(watch_async())
        sbx.files.remove("/tmp/watched")
    """, SANDBOX=shared)


# -- templates ---------------------------------------------------------------------------------


def test_a_template_with_e2b_s_user_shape(daemon: DaemonProcess) -> None:
    # E2B's templates run as `user`, with passwordless sudo: hutch image build
    # --sudo-user user makes that shape, and its name is a template ID.
    name = f"e2b-shape-{os.getpid()}"
    cli = [sys.executable, "-m", "hutch.cli.main", "image"]
    home = {**os.environ, "HUTCH_HOME": daemon.data_dir}
    built = subprocess.run([*cli, "build", name, "--packages", "python3-minimal",
                            "--sudo-user", "user"], env=home, capture_output=True, text=True,
                           timeout=600, check=False)
    assert built.returncode == 0, built.stderr
    try:
        run_python(daemon, """
            import os
            from e2b import Sandbox
            sbx = Sandbox.create(template=os.environ["TEMPLATE"])
            assert sbx.get_info().template_id == os.environ["TEMPLATE"]
            r = sbx.commands.run("id -un; sudo -n id -un; echo $HOME", user="user")
            assert r.stdout == "user\\nroot\\n/home/user\\n", r
            assert sbx.commands.run("id -un", user="root").stdout == "root\\n"
            sbx.files.write("/home/user/mine.txt", "x", user="user")
            info = sbx.files.get_info("/home/user/mine.txt")
            assert info.owner == "user", info
            sbx.kill()
        """, TEMPLATE=name)
    finally:
        subprocess.run([*cli, "rm", "--force", name], env=home, capture_output=True,
                       check=False)


# -- a server in the sandbox ---------------------------------------------------------------------


def test_get_host_reaches_a_server_in_the_sandbox(daemon: DaemonProcess, shared: str) -> None:
    run_python(daemon, f"""
        import os, time, httpx
        from e2b import Sandbox
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        sbx.files.write("/tmp/port_server.py", {PORT_SERVER!r})
        server = sbx.commands.run("python3 /tmp/port_server.py", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{{sbx.sandbox_id}}.{{os.environ['E2B_DOMAIN']}}", host
        # The host resolves to hutch (a hosts line, see the README): here, by hand.
        hutch = os.environ["HUTCH_URL"]
        for _ in range(50):
            answer = httpx.get(f"{{hutch}}/some/page?x=1", headers={{"Host": host}})
            if answer.status_code == 200:
                break
            time.sleep(0.1)
        assert answer.text == "hello from /some/page?x=1", answer.text
        server.kill()

        # A websocket too, through the same host scheme.
        sbx.files.write("/tmp/ws_server.py", {WEBSOCKET_SERVER!r})
        ws_server = sbx.commands.run("python3 /tmp/ws_server.py", background=True)
        import socket
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect
        port = int(hutch.rsplit(":", 1)[1])
        for _ in range(50):
            try:
                # The host's name, the daemon's address (as a hosts line would make it).
                with connect(f"ws://{{sbx.get_host(8001)}}/chat",
                             sock=socket.create_connection(("127.0.0.1", port))) as ws:
                    ws.send("hi")
                    assert ws.recv() == "echo: hi"
                break
            except (OSError, InvalidStatus):  # refused until the server listens
                time.sleep(0.1)
        else:
            raise AssertionError("no websocket reached the sandbox")
        ws_server.kill()
    """, SANDBOX=shared)


# -- the older Python SDK and the npm SDK -------------------------------------------------------


def test_python_sdk_2_45_with_the_key_hutch_token_prints(daemon: DaemonProcess) -> None:
    # 2.45 checks the key's format (e2b_ and hex) before it sends it.
    printed = subprocess.run(
        [sys.executable, "-m", "hutch.cli.main", "token", "--e2b"], capture_output=True,
        text=True, check=True, env={**os.environ, "HUTCH_TOKEN": daemon.token},
    ).stdout.strip()
    assert printed == e2b_key(daemon.token)
    out = run_python(daemon, """
        import e2b, importlib.metadata
        from e2b import Sandbox
        assert importlib.metadata.version("e2b") == "2.45.1", importlib.metadata.version("e2b")
        sbx = Sandbox.create(metadata={"sdk": "old"})
        assert sbx.commands.run("echo old sdk").stdout == "old sdk\\n"
        sbx.files.write("/tmp/old.txt", "v1 routes")
        assert sbx.files.read("/tmp/old.txt") == "v1 routes"
        assert sbx.pause() is True
        assert Sandbox.connect(sbx.sandbox_id).files.read("/tmp/old.txt") == "v1 routes"
        assert sbx.kill() is True
        print("ok")
    """, old=True, E2B_API_KEY=printed)
    assert out.strip().endswith("ok")


def test_npm_sdk(daemon: DaemonProcess) -> None:
    out = run_node(daemon, """
        import { Sandbox } from 'e2b'
        import assert from 'node:assert/strict'
        const sbx = await Sandbox.create({ metadata: { sdk: 'js' }, envs: { FROM_JS: 'yes' } })
        const r = await sbx.commands.run('echo js $FROM_JS')
        assert.equal(r.stdout, 'js yes\\n')
        let streamed = ''
        const bg = await sbx.commands.run('sleep 0.2; echo bg', {
          background: true, onStdout: (d) => { streamed += d } })
        assert.equal((await bg.wait()).stdout, 'bg\\n')
        assert.equal(streamed, 'bg\\n')
        await sbx.files.write('/tmp/js dir/a.txt', 'from node')
        assert.equal(await sbx.files.read('/tmp/js dir/a.txt'), 'from node')
        const names = (await sbx.files.list('/tmp/js dir')).map((e) => e.name)
        assert.deepEqual(names, ['a.txt'])
        const listed = await Sandbox.list({ query: { metadata: { sdk: 'js' } } }).nextItems()
        assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
        await sbx.setTimeout(120_000)
        assert.equal(await sbx.pause(), true)
        const again = await Sandbox.connect(sbx.sandboxId)
        assert.equal(await again.files.read('/tmp/js dir/a.txt'), 'from node')
        await again.kill()
        assert.equal(await Sandbox.kill(sbx.sandboxId), false)
        console.log('ok')
    """)
    assert out.strip().endswith("ok")


def test_npm_sdk_in_the_sandbox(daemon: DaemonProcess, shared: str) -> None:
    # The in-sandbox half of the acceptance list through the npm SDK.
    out = run_node(daemon, """
        import { Sandbox, CommandExitError, TimeoutError } from 'e2b'
        import assert from 'node:assert/strict'
        const sbx = await Sandbox.connect(process.env.SANDBOX)
        // stdin to a background command, then closed
        const cat = await sbx.commands.run('cat', { background: true, stdin: true })
        await sbx.commands.sendStdin(cat.pid, 'to node\\n')
        await sbx.commands.closeStdin(cat.pid)
        assert.equal((await cat.wait()).stdout, 'to node\\n')
        // a non-zero exit, list and kill
        await assert.rejects(sbx.commands.run('exit 4'), (e) => e instanceof CommandExitError
          && e.exitCode === 4)
        const sleeper = await sbx.commands.run('sleep 300', { background: true })
        assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid))
        assert.equal(await sbx.commands.kill(sleeper.pid), true)
        // over its timeout: killed, deadline_exceeded
        await assert.rejects(sbx.commands.run('sleep 60', { timeoutMs: 1500 }),
          (e) => e instanceof TimeoutError)
        // a terminal, resized
        let typed = ''
        const pty = await sbx.pty.create({ cols: 80, rows: 24,
          onData: (d) => { typed += new TextDecoder().decode(d) } })
        await sbx.pty.resize(pty.pid, { cols: 120, rows: 40 })
        await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\\n'))
        await pty.wait()
        assert.match(typed, /40 120/)
        // files: several at once, bytes, info, rename, make_dir, remove
        const root = '/tmp/node files'
        await sbx.files.write([{ path: `${root}/a.txt`, data: 'a' },
                               { path: `${root}/b.bin`, data: new Uint8Array([0, 255]) }])
        const bytes = await sbx.files.read(`${root}/b.bin`, { format: 'bytes' })
        assert.deepEqual(Array.from(bytes), [0, 255])
        assert.equal((await sbx.files.getInfo(`${root}/a.txt`)).size, 1)
        await sbx.files.rename(`${root}/a.txt`, `${root}/c.txt`)
        assert.equal(await sbx.files.exists(`${root}/a.txt`), false)
        assert.equal(await sbx.files.makeDir(`${root}/d/e`), true)
        assert.equal(await sbx.files.makeDir(`${root}/d/e`), false)
        const deep = (await sbx.files.list(root, { depth: 2 })).map((e) => e.path)
        assert.ok(deep.includes(`${root}/d/e`), deep)
        // watching a directory
        const seen = []
        const watcher = await sbx.files.watchDir(root, (event) => { seen.push(event) })
        await sbx.files.write(`${root}/watched.txt`, 'w')
        for (let i = 0; i < 100 && !seen.some((e) => e.name === 'watched.txt'); i++) {
          await new Promise((resolve) => setTimeout(resolve, 100))
        }
        await watcher.stop()
        assert.ok(seen.some((e) => e.name === 'watched.txt'), JSON.stringify(seen))
        await sbx.files.remove(root)
        assert.equal(await sbx.files.exists(root), false)
        console.log('ok')
    """, SANDBOX=shared)
    assert out.strip().endswith("ok")


def test_a_ref_opens_its_one_sandbox(daemon: DaemonProcess, shared: str) -> None:
    answer = httpx.post(f"{daemon.url}/v1/sandboxes/{shared}/refs", json={},
                        headers={"Authorization": f"Bearer {daemon.token}"})
    assert answer.status_code == 201, answer.text
    ref = answer.json()["ref"]
    run_python(daemon, """
        import os
        from e2b import Sandbox
        from e2b.exceptions import SandboxException
        sbx = Sandbox.connect(os.environ["SANDBOX"])
        assert sbx.commands.run("echo by ref").stdout == "by ref\\n"
        try:
            Sandbox.create()
        except SandboxException as exc:
            print("refused", exc)
        else:
            raise AssertionError("a ref made a sandbox")
    """, SANDBOX=shared, E2B_API_KEY=e2b_key(ref))
