"""Least privilege around the daemon: its data directory, its token.

Each test tries the door on a real daemon process, as the unprivileged host
user ``nobody`` where the question is what another user can do.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

#: Run a command as the unprivileged host user nobody. runuser, not setpriv:
#: here setpriv's exec reached a file in a root-only directory, proving nothing.
AS_NOBODY = ["runuser", "-u", "nobody", "--"]


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.fixture
def shared_data_dir() -> Iterator[str]:
    """A data directory made the way a default one is (umask 022: 0755),
    in a place every user can traverse."""
    parent = tempfile.mkdtemp(prefix="hutch-priv-")
    os.chmod(parent, 0o755)
    data_dir = os.path.join(parent, "hutch")
    os.makedirs(data_dir)
    os.chmod(data_dir, 0o755)
    yield data_dir
    subprocess.run(["rm", "-rf", parent], check=False)


@pytest.fixture
def daemon(shared_data_dir: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess(shared_data_dir, token=f"tok-{uuid.uuid4().hex}").start()
    yield d
    d.stop()


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- 1. the data directory is the daemon's user's alone -------------------------------------


def test_data_dir_and_store_are_private(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.create_sandbox("virtual").close()
    assert mode(daemon.data_dir) == 0o700
    store_files = [n for n in os.listdir(daemon.data_dir) if n.startswith("hutch.db")]
    assert "hutch.db" in store_files
    for name in store_files:
        assert mode(os.path.join(daemon.data_dir, name)) == 0o600, name
    listing = as_nobody("ls", daemon.data_dir)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


@pytest.mark.docker
def test_a_setuid_shell_made_in_a_sandbox_gives_a_host_user_nothing(
    daemon: DaemonProcess,
) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        try:
            made = sb.exec("cp /bin/bash /workspace/sh && chmod 4755 /workspace/sh "
                           "&& stat -c %a:%u /workspace/sh")
            assert made.stdout.strip() == "4755:0", made
            host_copy = os.path.join(daemon.data_dir, "layers", "mounts", sb.id, "merged", "sh")
            assert os.stat(host_copy).st_mode & stat.S_ISUID  # it is there, setuid root
            tried = as_nobody(host_copy, "-p", "-c", "id -u")
            assert "0" not in tried.stdout.split(), (tried.stdout, tried.stderr)
            assert tried.returncode != 0, tried
            # And were the data directory open, the mount the copy lives on
            # is nosuid: its setuid bit means nothing on the host.
            where = os.path.dirname(host_copy)
            while len(where) >= len(daemon.data_dir):
                os.chmod(where, 0o755)
                where = os.path.dirname(where)
            opened = as_nobody(host_copy, "-p", "-c", "id -u")
            assert opened.stdout.split() == ["65534"], (opened.stdout, opened.stderr)
        finally:
            sb.close()


@pytest.mark.docker
def test_links_planted_in_the_workspace_do_not_lead_the_daemon_onto_host_files(
    daemon: DaemonProcess,
) -> None:
    victim_dir = tempfile.mkdtemp(prefix="hutch-victim-")
    victim_file = os.path.join(victim_dir, "precious")
    with open(victim_file, "w") as fh:
        fh.write("keep me")
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        planted = sb.exec(
            f"ln -s {victim_file} /workspace/file-link && ln -s {victim_dir} /workspace/dir-link"
            f" && mkdir -p /workspace/sub && ln -s / /workspace/sub/root"
        )
        assert planted.exit_code == 0, planted
        host_workdir = os.path.join(daemon.data_dir, "layers", "mounts", sb.id, "merged")
        assert os.path.islink(os.path.join(host_workdir, "dir-link"))
        sb.close()  # the daemon removes the working directory it made
        assert not os.path.exists(host_workdir)
    with open(victim_file) as fh:
        assert fh.read() == "keep me"
    subprocess.run(["rm", "-rf", victim_dir], check=False)


# -- 2. the token stays secret -----------------------------------------------------------------


def test_the_token_is_not_on_the_command_line_nor_in_a_sandbox(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/cmdline", "rb") as fh:
        cmdline = fh.read()
    assert daemon.token.encode() not in cmdline
    environ = as_nobody("cat", f"/proc/{daemon.proc.pid}/environ")
    assert daemon.token not in environ.stdout and environ.returncode != 0
    with hutch.Client(daemon.url, token=daemon.token) as c, tempfile.TemporaryDirectory() as wd:
        sb = c.create_sandbox("local", workdir=wd)
        try:
            seen = sb.exec("env; cat /proc/$PPID/environ | tr '\\0' '\\n'")
        finally:
            sb.close()
    assert seen.exit_code == 0, seen
    assert daemon.token not in seen.stdout


@pytest.mark.docker
def test_the_token_is_not_in_a_docker_sandbox(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        try:
            seen = sb.exec("env; cat /proc/1/environ")
        finally:
            sb.close()
    assert daemon.token not in seen.stdout


def test_the_token_comes_from_a_private_file(shared_data_dir: str) -> None:
    token = f"file-{uuid.uuid4().hex}"
    token_file = os.path.join(shared_data_dir, "token")
    with open(token_file, "w") as fh:
        fh.write(token + "\n")
    os.chmod(token_file, 0o644)
    refused = subprocess.run(
        [sys.executable, "-m", "hutch.server", "--port", "1", "--token-file", token_file],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert refused.returncode != 0
    assert "chmod 600" in refused.stderr and token not in refused.stderr
    os.chmod(token_file, 0o600)
    d = DaemonProcess(shared_data_dir, token=token, extra_args=["--token-file", token_file],
                      extra_env={"HUTCH_TOKEN": ""}).start()
    try:
        import httpx

        assert httpx.get(f"{d.url}/v1/sandboxes").status_code == 401
        ok = httpx.get(f"{d.url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
        assert d.proc is not None
        with open(f"/proc/{d.proc.pid}/cmdline", "rb") as fh:
            assert token.encode() not in fh.read()
    finally:
        d.stop()


def test_serve_takes_no_token_argument_and_says_where_it_comes_from() -> None:
    cli = [sys.executable, "-m", "hutch.cli.main", "serve"]
    helped = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"}, check=False)
    assert "HUTCH_TOKEN" in helped.stdout and "--token-file" in helped.stdout
    given = subprocess.run([*cli, "--token", "x", "--port", "1"], capture_output=True,
                           text=True, timeout=60, check=False)
    assert given.returncode != 0 and "No such option" in given.stderr


# -- 3. no daemon answers without a credential -----------------------------------------------


def route_table() -> list[tuple[str, str, str]]:
    """Every route the daemon serves, from the application's own route table
    (so a route added later is covered): (kind, method, path with each
    parameter filled in)."""
    from starlette.routing import BaseRoute, WebSocketRoute

    from hutch.server import ServerSettings, create_app

    found: list[tuple[str, str, str]] = []

    def walk(routes: list[BaseRoute]) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)  # an included router
            if included is not None:
                walk(included.routes)
                continue
            path = re.sub(r"\{[^}]*\}", "x", getattr(route, "path", ""))
            if isinstance(route, WebSocketRoute):
                found.append(("websocket", "GET", path))
            for method in sorted(getattr(route, "methods", None) or ()):
                found.append(("http", method, path))

    walk(create_app(ServerSettings(token="unused")).routes)
    return found


#: An unprivileged user's client (curl: the host's Python may live where
#: nobody cannot run it): every route read from stdin, with no token, a wrong
#: one, and schemes that are not the token's; a websocket route as its
#: handshake. Prints ``kind method path [auth] -> status`` a line.
NOBODY_CLIENT = r"""
while read -r kind method path; do
  for auth in none 'Bearer wrong' 'bearer wrong' 'Basic d3Jvbmc='; do
    if [ "$auth" = none ]; then set --; else set -- -H "Authorization: $auth"; fi
    if [ "$kind" = websocket ]; then
      set -- "$@" --http1.1 -H 'Connection: Upgrade' -H 'Upgrade: websocket' \
        -H 'Sec-WebSocket-Version: 13' -H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=='
    elif [ "$method" = HEAD ]; then
      set -- "$@" -I
    else
      set -- "$@" -X "$method"
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$@" "$URL$path")
    echo "$kind $method $path [$auth] -> $code"
  done
done
"""


@pytest.fixture
def tokenless() -> Iterator[tuple[DaemonProcess, dict[str, str]]]:
    """A daemon started with no token, on the default data directory of a
    user (its HOME), and that user's environment, with no hutch setup in it
    but the daemon's address."""
    home = tempfile.mkdtemp(prefix="hutch-home-")
    os.chmod(home, 0o755)
    data_dir = os.path.join(home, ".local", "share", "hutch")
    os.makedirs(data_dir, mode=0o755)
    d = DaemonProcess(data_dir, token=None).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUTCH_")}
    env.update(HOME=home, HUTCH_URL=d.url)
    try:
        yield d, env
    finally:
        d.close()
        subprocess.run(["rm", "-rf", home], check=False)


def test_a_daemon_given_no_token_makes_one_its_users_cli_finds(
    tokenless: tuple[DaemonProcess, dict[str, str]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, env = tokenless
    token_file = os.path.join(d.data_dir, "api-token")
    assert mode(token_file) == 0o600 and len(d.token) >= 32
    cli = [sys.executable, "-m", "hutch.cli.main"]

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *argv], env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    # The quick start: the daemon, then the CLI, with nothing set up between.
    made = run("create")
    assert made.returncode == 0, made.stderr
    sandbox = made.stdout.strip()
    ran = run("exec", sandbox, "--", "echo", "hello")
    assert (ran.returncode, ran.stdout) == (0, "hello\n"), ran.stderr
    assert run("kill", sandbox).returncode == 0
    # The SDK alike, its data directory named as the daemon's is.
    monkeypatch.setenv("HUTCH_HOME", d.data_dir)
    monkeypatch.delenv("HUTCH_TOKEN", raising=False)
    with hutch.Client(d.url) as c:
        assert c.list_sandboxes() == []
    # Made once: a later start answers to the same token.
    before = d.token
    d.restart()
    assert d.token == before
    with open(token_file) as fh:
        assert fh.read().strip() == before


def test_another_user_gets_401_on_every_route(
    tokenless: tuple[DaemonProcess, dict[str, str]],
) -> None:
    d, _ = tokenless
    # The token is where its user's clients look, and nowhere another user can read.
    token_file = os.path.join(d.data_dir, "api-token")
    read = as_nobody("cat", token_file)
    assert read.returncode != 0 and d.token not in read.stdout
    routes = route_table()
    assert {kind for kind, _, _ in routes} == {"http", "websocket"} and len(routes) > 40
    tried = subprocess.run(
        [*AS_NOBODY, "env", f"URL={d.url}", "sh", "-c", NOBODY_CLIENT],
        input="".join(f"{kind} {method} {path}\n" for kind, method, path in routes),
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert tried.returncode == 0, tried.stderr
    answers = tried.stdout.splitlines()
    assert len(answers) == 4 * len(routes)
    # The dashboard's pages are open by design: static files with no data (every
    # call they make for data is /v1's, which refuses), and a login and logout
    # that refuse a request without the token in its body (400), so they set no
    # session. Every other route answers 401.
    from hutch.server.middleware import is_dashboard_page

    def dashboard(answer: str) -> bool:
        return is_dashboard_page(answer.split(" ")[2])

    assert [a for a in answers if not dashboard(a) and not a.endswith("-> 401")] == []
    pages = [a for a in answers if dashboard(a)]
    assert pages and all(
        a.endswith(("-> 200", "-> 308", "-> 401")) if " GET " in a
        else a.endswith(("-> 400", "-> 401"))
        for a in pages
    ), pages
    assert "websocket GET /v1/sandboxes/x/pty [none] -> 401" in answers


def test_the_bearer_scheme_is_any_case_and_a_terminal_refused_is_401(
    daemon: DaemonProcess,
) -> None:
    import httpx
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    for scheme in ("Bearer", "bearer", "BEARER"):
        answer = httpx.get(f"{daemon.url}/v1/sandboxes",
                           headers={"Authorization": f"{scheme} {daemon.token}"})
        assert answer.status_code == 200, (scheme, answer.text)
    terminal = "ws" + daemon.url[len("http"):] + "/v1/sandboxes/x/pty"
    for given in ("Bearer wrong", f"Basic {daemon.token}", None):
        with pytest.raises(InvalidStatus) as refused:
            connect(terminal, additional_headers={} if given is None else {"Authorization": given},
                    open_timeout=30)
        assert refused.value.response.status_code == 401, given
        assert b"unauthorized" in (refused.value.response.body or b"")
    with hutch.Client(daemon.url, token="wrong") as c, \
            pytest.raises(hutch.Unauthorized):
        c.list_sandboxes()
