"""The hutch command against a real daemon: output, and exit codes scripts rely on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import click
import pytest

from hutch import __version__
from hutch.cli.main import app
from tests.daemon_fixture import DaemonProcess, free_port

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.remove_everything()
    d.stop()
    shutil.rmtree(d.data_dir, ignore_errors=True)


def hutch(d: DaemonProcess | None, *args: str, token: str | None = None,
          cwd: str | None = None, stdin: str | None = None,
          columns: str | None = "200") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = columns
    if d is not None:
        env.update(HUTCH_URL=d.url, HUTCH_TOKEN=token if token is not None else d.token)
    # Output is always a pipe here, as in a script.
    return subprocess.run([*HUTCH, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=cwd, input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None)


def make_local(d: DaemonProcess, *flags: str) -> str:
    made = hutch(d, "create", "--provider", "local", "--workdir", tempfile.mkdtemp(), *flags)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_demo_runs_with_no_daemon() -> None:
    result = hutch(None, "demo")
    assert result.returncode == 0, result.stderr
    assert "hello from" in result.stdout
    assert "a result, not an error" in result.stdout


def test_create_exec_ls_kill(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    made = hutch(daemon, "create", "--provider", "local", "--workdir", workdir,
                 "--idle-timeout", "600")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    ran = hutch(daemon, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, "out\n", "err\n")
    listing = hutch(daemon, "ls")
    assert sid in listing.stdout and "running" in listing.stdout
    assert hutch(daemon, "set-timeout", sid, "90000").returncode == 2
    assert hutch(daemon, "pause", sid).returncode == 1  # capability_unsupported
    assert hutch(daemon, "kill", sid).returncode == 0
    assert hutch(daemon, "exec", sid, "--", "true").returncode == 4  # closed: unavailable


def test_exit_codes_for_missing_and_unauthorized(daemon: DaemonProcess) -> None:
    assert hutch(daemon, "exec", "sb-nothing", "--", "true").returncode == 3
    denied = hutch(daemon, "ls", token="wrong")
    assert denied.returncode == 5
    assert "unauthorized" in denied.stderr


def test_config_file_is_below_flags(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    config_dir = tempfile.mkdtemp()
    with open(os.path.join(config_dir, "hutch.toml"), "w") as fh:
        fh.write(f'[sandbox]\nprovider = "local"\nmax_lifetime = 50\n'
                 f'[providers.local]\nworkdir = "{workdir}"\n')
    made = hutch(daemon, "create", "--max-lifetime", "500", cwd=config_dir)
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    shown = hutch(daemon, "ls", "--json")
    entry = next(line for line in shown.stdout.split("{") if sid in line)
    assert workdir in entry
    assert hutch(daemon, "kill", sid).returncode == 0


def test_snapshot_create_ls_rm_and_fork(daemon: DaemonProcess) -> None:
    made = hutch(daemon, "create", "--provider", "local")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    snap = hutch(daemon, "snapshot", "create", sid, "--label", "setup")
    assert snap.returncode == 0, snap.stderr
    root = snap.stdout.split()[0]
    forked = hutch(daemon, "fork", sid, "-n", "2", "--label", "try")
    assert forked.returncode == 0, forked.stderr
    lines = forked.stdout.split()
    child, branches = lines[1], lines[2:]
    assert len(branches) == 2 and all(b.startswith("sb-") for b in branches)
    tree = hutch(daemon, "snapshot", "ls").stdout.splitlines()
    # The fork's snapshot is drawn under the one it descends from.
    assert tree[0].startswith(f"{root} setup")
    assert tree[1].startswith(f"└─ {child} try")
    refused = hutch(daemon, "snapshot", "rm", root)
    assert refused.returncode == 2 and "still needed" in refused.stderr
    for branch in branches[1:]:
        assert hutch(daemon, "kill", branch).returncode == 0
    # Forced: it says what it broke (the branch still on it).
    forced = hutch(daemon, "snapshot", "rm", "--force", child)
    assert forced.returncode == 0, forced.stderr
    assert f"still needed by sandbox {branches[0]}" in forced.stdout
    assert hutch(daemon, "kill", branches[0]).returncode == 0
    plain = hutch(daemon, "snapshot", "rm", root)
    assert plain.returncode == 0 and "needed" not in plain.stdout
    assert hutch(daemon, "snapshot", "ls", "--json").stdout.strip() == "[]"
    assert hutch(daemon, "kill", sid).returncode == 0


# -- what a person uses ----------------------------------------------------------------------


@pytest.mark.parametrize("columns", ["80", None])
def test_ls_is_one_line_a_sandbox_at_80_columns(daemon: DaemonProcess,
                                                columns: str | None) -> None:
    ids = [make_local(daemon, "--idle-timeout", "600", "--max-lifetime", "7200")
           for _ in range(2)]
    try:
        listing = hutch(daemon, "ls", columns=columns)
        assert listing.returncode == 0, listing.stderr
        lines = listing.stdout.splitlines()
        assert lines[0].split() == ["ID", "PROVIDER", "STATE", "AGE", "IDLE", "DEADLINE"]
        for line in lines:
            assert len(line) <= 80, line
        for sid in ids:
            mine = [line for line in lines if sid in line]
            assert len(mine) == 1, listing.stdout
            cells = mine[0].split()
            assert cells[:3] == [sid, "local", "running"], mine[0]
            assert re.fullmatch(r"\d+s", cells[3]) and re.fullmatch(r"\d+s", cells[4])
            assert cells[5:] == ["in", "2.0h"], mine[0]  # the max_lifetime
        wide = hutch(daemon, "ls", "--wide", columns=columns)
        header = wide.stdout.splitlines()[0].split()
        assert header[:6] == ["ID", "PROVIDER", "STATE", "AGE", "IDLE", "DEADLINE"]
        assert {"MEMORY", "RUNNING", "PAUSED", "SUSPENDED", "WORKDIR"} <= set(header)
        for sid in ids:
            assert len([line for line in wide.stdout.splitlines() if sid in line]) == 1
        as_json = hutch(daemon, "ls", "--json", columns=columns)
        assert {s["id"] for s in json.loads(as_json.stdout)} >= set(ids)
    finally:
        for sid in ids:
            hutch(daemon, "kill", sid)


def _options() -> Iterator[tuple[str, click.Option]]:
    """Every option of every command (the lazy ones loaded)."""
    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                yield f"{path} {param.opts[0]}", param
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, f"{path} {name}"
                yield from walk(sub, f"{path} {name}")
    yield from walk(app, "hutch")


def test_every_option_is_described_with_its_unit() -> None:
    options = list(_options())
    assert len(options) > 20
    for where, option in options:
        assert option.help, f"{where} has no help"
        if isinstance(option.type, click.types.FloatParamType | click.types.IntParamType):
            assert re.search(r"\b(seconds|bytes|TCP port|how many)\b", option.help, re.I), (
                f"{where}: {option.help!r} does not say its unit")


def test_version() -> None:
    shown = hutch(None, "--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"hutch {__version__}"


def test_exec_forwards_stdin_and_caps_output(daemon: DaemonProcess) -> None:
    sid = make_local(daemon)
    try:
        fed = hutch(daemon, "exec", "-i", sid, "--", "sh", "-c", "tr a-z A-Z; echo done",
                    stdin="hello stdin\n")
        assert (fed.returncode, fed.stdout) == (0, "HELLO STDIN\ndone\n"), fed.stderr
        # Without -i the command's stdin is empty, whatever ours holds.
        unfed = hutch(daemon, "exec", sid, "--", "sh", "-c", "wc -c", stdin="not given\n")
        assert (unfed.returncode, unfed.stdout.strip()) == (0, "0"), unfed.stderr
        capped = hutch(daemon, "exec", sid, "--output-limit", "1000", "--",
                       "head", "-c", "100000", "/dev/zero")
        assert capped.returncode != 0
        assert "output_limit_exceeded" in capped.stderr and "1000" in capped.stderr
    finally:
        hutch(daemon, "kill", sid)


@pytest.mark.parametrize("command", ["exec", "attach"])
def test_exec_under_a_harness_whose_stdin_stays_open(daemon: DaemonProcess,
                                                     command: str) -> None:
    """An agent's harness runs commands with a pipe for stdin that it never
    closes: the command runs and hutch exits with it."""
    sid = make_local(daemon)
    try:
        target = sid
        if command == "attach":
            target = hutch(daemon, "ref", sid).stdout.strip()
        env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([*HUTCH, command, target, "--", "echo", "ran"], env=env,
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, text=True)
            try:
                # The pipe stays open (communicate() would close it): a hang
                # here is the bug, and the limit only ends the test.
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"hutch {command} waited on a stdin it was not asked to forward")
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
            out.seek(0)
            err.seek(0)
            assert (proc.returncode, out.read()) == (0, "ran\n"), err.read()
    finally:
        hutch(daemon, "kill", sid)


def test_cp_overwrites_as_cp_does(daemon: DaemonProcess) -> None:
    """Each hutch call is a new session that has read nothing: a person's
    copy still replaces the file (read-before-write is for agents)."""
    sid = make_local(daemon)
    local = tempfile.mkdtemp()
    source = os.path.join(local, "notes.txt")
    tree = os.path.join(local, "tree")
    os.makedirs(tree)
    try:
        for version in ("first\n", "second\n"):
            with open(source, "w") as fh:
                fh.write(version)
            with open(os.path.join(tree, "inner.txt"), "w") as fh:
                fh.write(version)
            copied = hutch(daemon, "cp", source, f"{sid}:notes.txt")
            assert copied.returncode == 0, copied.stderr
            again = hutch(daemon, "cp", tree, f"{sid}:.")  # into ., as ./tree
            assert again.returncode == 0, again.stderr
            shown = hutch(daemon, "exec", sid, "--", "cat", "notes.txt", "tree/inner.txt")
            assert shown.stdout == version * 2, shown.stderr
            back = os.path.join(local, "back.txt")
            assert hutch(daemon, "cp", f"{sid}:notes.txt", back).returncode == 0
            with open(back) as fh:
                assert fh.read() == version
    finally:
        hutch(daemon, "kill", sid)
        shutil.rmtree(local, ignore_errors=True)


def test_ref_revoke_needs_only_the_ref(daemon: DaemonProcess) -> None:
    sid = make_local(daemon)
    try:
        ref = hutch(daemon, "ref", sid).stdout.strip()
        assert hutch(daemon, "attach", ref, "--", "true").returncode == 0
        revoked = hutch(daemon, "ref", "--revoke", ref)
        assert revoked.returncode == 0, revoked.stderr
        assert sid in revoked.stderr
        assert hutch(daemon, "attach", ref, "--", "true").returncode == 5
        # A bare ref id does not say its sandbox: a usage error that says so.
        bare = hutch(daemon, "ref", "--revoke", "ref-0123456789abcdef")
        assert bare.returncode == 2 and "SANDBOX" in bare.stderr, bare.stderr
        assert hutch(daemon, "ref").returncode == 2
    finally:
        hutch(daemon, "kill", sid)


def _tree(root: str) -> dict[str, bytes]:
    found = {}
    for here, _, files in os.walk(root):
        for name in files:
            full = os.path.join(here, name)
            with open(full, "rb") as fh:
                found[os.path.relpath(full, root)] = fh.read()
    return found


def test_cp_files_and_directories_both_ways(daemon: DaemonProcess) -> None:
    sid = make_local(daemon)
    local = tempfile.mkdtemp()
    source = os.path.join(local, "src")
    os.makedirs(os.path.join(source, "deep", "er"))
    files = {"a.txt": b"alpha\n", "deep/b c'\"€.bin": bytes(range(256)),
             "deep/er/empty": b"", "deep/er/z.sh": b"#!/bin/sh\necho z\n"}
    for rel, data in files.items():
        with open(os.path.join(source, rel), "wb") as fh:
            fh.write(data)
    os.chmod(os.path.join(source, "deep/er/z.sh"), 0o755)
    try:
        # A directory in, then out again: the same tree, byte for byte.
        assert hutch(daemon, "cp", source, f"{sid}:copied").returncode == 0
        ran = hutch(daemon, "exec", sid, "--", "sh", "-c", "cat 'copied/deep/b c'\\''\"€.bin' "
                    "| wc -c; ./copied/deep/er/z.sh")
        assert ran.stdout.split() == ["256", "z"], (ran.stdout, ran.stderr)
        back = os.path.join(local, "back")
        out = hutch(daemon, "cp", f"{sid}:copied", back)
        assert out.returncode == 0, out.stderr
        assert _tree(back) == files
        assert os.stat(os.path.join(back, "deep/er/z.sh")).st_mode & 0o111
        # Into an existing directory, the source keeps its name (as cp does).
        into = hutch(daemon, "cp", os.path.join(source, "a.txt"), f"{sid}:copied/deep")
        assert into.returncode == 0, into.stderr
        one = os.path.join(local, "one.txt")
        assert hutch(daemon, "cp", f"{sid}:copied/deep/a.txt", one).returncode == 0
        with open(one, "rb") as fh:
            assert fh.read() == b"alpha\n"
        missing = hutch(daemon, "cp", f"{sid}:nothing/here", local)
        assert missing.returncode == 3 and "nothing/here" in missing.stderr
    finally:
        hutch(daemon, "kill", sid)


def test_serve_refuses_before_it_claims_to_serve(tmp_path: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = hutch(None, "serve", "--port", port, "--data-dir", str(tmp_path / "d1"))
    assert busy.returncode != 0
    assert "serving" not in busy.stdout
    assert port in busy.stderr and "in use" in busy.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = hutch(None, "serve", "--port", str(free_port()), "--data-dir", str(blocker / "d"))
    assert bad.returncode != 0
    assert "serving" not in bad.stdout
    assert str(blocker) in bad.stderr


def test_unauthorized_names_the_token_variable(daemon: DaemonProcess) -> None:
    denied = hutch(daemon, "ls", token="wrong")
    assert denied.returncode == 5
    assert "HUTCH_TOKEN" in denied.stderr


def _peak_kib_of(argv: list[str], env: dict[str, str]) -> tuple[int, int, str]:
    """(exit code, peak resident KiB, stderr) of a child run to its end.

    The peak is the child's own VmHWM, read until it exits (it only grows):
    wait4's ru_maxrss would also count the test process's resident set, which
    the child's memory starts as until it execs.
    """
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                 stdin=subprocess.DEVNULL)
        peak = 0
        while child.poll() is None:
            with contextlib.suppress(OSError), open(f"/proc/{child.pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
            time.sleep(0.005)
        err.seek(0)
        return child.returncode, peak, err.read().decode(errors="replace")


def test_cp_streams_a_large_file_both_ways(daemon: DaemonProcess) -> None:
    """200 MB in and out through hutch cp: the client holds a piece at a
    time, never the file, and every byte arrives."""
    sid = make_local(daemon)
    local = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    source, back = os.path.join(local, "big.bin"), os.path.join(local, "back.bin")
    block = os.urandom(1024 * 1024)
    with open(source, "wb") as fh:
        for _ in range(200):
            fh.write(block)
        fh.write(b"tail")
    env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
    try:
        for argv in ([*HUTCH, "cp", source, f"{sid}:big.bin"],
                     [*HUTCH, "cp", f"{sid}:big.bin", back]):
            code, peak_kib, err = _peak_kib_of(argv, env)
            assert code == 0, err
            # An interpreter with httpx and typer is ~60 MiB; the file is 200.
            assert peak_kib < 120 * 1024, f"{argv[3]}: peak {peak_kib // 1024} MiB"
        with open(source, "rb") as a, open(back, "rb") as b:
            assert hashlib.file_digest(a, "sha256").digest() == hashlib.file_digest(
                b, "sha256").digest()
    finally:
        hutch(daemon, "kill", sid)
        shutil.rmtree(local, ignore_errors=True)


def test_the_command_table_names_every_command_with_its_own_line() -> None:
    """``hutch --help`` lists the commands from ``_commands.COMMANDS`` without
    importing them: each entry's line is its command's own first paragraph,
    and every command the modules of ``hutch.cli`` define has an entry."""
    import importlib
    import pkgutil

    import hutch.cli
    from hutch.cli._common import short_help
    from hutch.cli.main import COMMANDS

    ctx = click.Context(app)
    for name, (_, line) in COMMANDS.items():
        found = app.get_command(ctx, name)
        assert found is not None and found.name == name
        assert short_help(found) == line, name
    defined = set()
    for info in pkgutil.iter_modules(hutch.cli.__path__):
        module = importlib.import_module(f"hutch.cli.{info.name}")
        for value in vars(module).values():
            if isinstance(value, click.Command) and value is not app and (
                    value.callback is None or value.callback.__module__ == module.__name__):
                defined.add(value)
    grouped = {sub for g in defined if isinstance(g, click.Group) for sub in g.commands.values()}
    assert {c.name for c in defined - grouped} == set(COMMANDS)


def test_a_mistyped_command_is_usage_with_the_commands_it_is_close_to() -> None:
    typo = hutch(None, "lss")
    assert typo.returncode == 2
    assert "No such command 'lss'. Did you mean 'ls'?" in typo.stderr
    unknown = hutch(None, "zzzz")
    assert unknown.returncode == 2 and "Did you mean" not in unknown.stderr


def _modules_after_ls(daemon: DaemonProcess, then: str = "") -> list[str]:
    """The modules a ``hutch ls`` process has loaded when the command is done
    (and ``then``, Python run after it in the same process, has run)."""
    code = ("import sys, json\nfrom hutch.cli.main import app\n"
            "try:\n    app(['ls'])\nexcept SystemExit:\n    pass\n"
            f"{then}\nprint(json.dumps(sorted(sys.modules)))")
    env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def test_ls_loads_no_pydantic_provider_or_server(daemon: DaemonProcess) -> None:
    """``hutch ls`` prints the daemon's JSON as it came: it decodes no wire
    model (pydantic costs as much again as the rest of the command) and
    loads nothing of the in-process core."""
    modules = _modules_after_ls(daemon)
    assert "hutch.client" in modules and "hutch.cli.sandboxes" in modules
    assert [m for m in modules if m.split(".")[0] in ("pydantic", "typer")] == []
    assert [m for m in modules if m.startswith(("hutch.providers", "hutch.server",
                                                "hutch.daemon", "hutch.core", "hutch.wire"))] == []


def test_ls_builds_no_value_class_and_loads_no_http2(daemon: DaemonProcess) -> None:
    """``hutch ls`` prints dicts: it imports none of the classes answers are
    decoded into (``hutch._types``, ``hutch.states``: their data classes take
    milliseconds to build), nor HTTP/2 (``h2``, which httpcore imports whenever
    it is installed and the command never speaks), nor anyio's threads (the
    async client's uploads). HTTP/2 is there all the same for what runs next
    in the process: a connection that negotiates it gets httpcore's real one."""
    modules = _modules_after_ls(daemon)
    assert "hutch.client._core" in modules
    assert [m for m in modules if m in ("hutch._types", "hutch.states", "anyio.to_thread")
            or m.split(".")[0] in ("h2", "hpack", "hyperframe")] == []
    pytest.importorskip("h2")
    after = _modules_after_ls(daemon, then=(
        "import httpcore\nfrom httpcore._sync.http2 import HTTP2Connection\n"
        "HTTP2Connection(origin=httpcore.Origin(b'http', b'localhost', 80), stream=None)"))
    assert "h2.connection" in after


@pytest.mark.parametrize("args", [["--help"], []])
def test_the_help_printed_without_click_is_the_groups_own(
        args: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``hutch --help`` and ``hutch`` alone are printed from the command table
    with no click loaded; the click group lays out the same page (its own
    ``--help`` path, taken by ``hutch --version``'s neighbours) from the same
    table: the same text, to the character, and the same exit code."""
    from hutch.cli.main import main

    monkeypatch.setenv("COLUMNS", "93")
    with pytest.raises(SystemExit) as fast:
        main(args)
    printed = capsys.readouterr()
    with pytest.raises(SystemExit) as grouped:
        app.main(args, prog_name="hutch")
    by_click = capsys.readouterr()
    assert printed.out == by_click.out and printed.err == by_click.err == ""
    assert (fast.value.code or 0) == (grouped.value.code or 0) == (0 if args else 2)
    assert "│ ls " in printed.out and "--version" in printed.out


def test_hutch_alone_prints_its_help_on_standard_output() -> None:
    shown = hutch(None)
    assert shown.returncode == 2 and shown.stderr == ""
    assert "Usage:" in shown.stdout and "ls" in shown.stdout
    group = hutch(None, "workspace")
    assert group.returncode == 2 and "suspend" in group.stdout


def test_a_relative_workdir_is_the_callers_directory_not_the_daemons(
        daemon: DaemonProcess) -> None:
    # The daemon runs elsewhere (its own working directory): `--workdir sub`
    # typed in a directory means that directory's `sub`, as `--rootfs` does.
    here = tempfile.mkdtemp(prefix="hutch-cli-cwd-")
    try:
        made = hutch(daemon, "create", "--provider", "local", "--workdir", "sub", cwd=here)
        assert made.returncode == 0, made.stderr
        sid = made.stdout.strip()
        try:
            ran = hutch(daemon, "exec", sid, "--", "pwd")
            assert ran.stdout.strip() == os.path.join(here, "sub"), ran.stderr
        finally:
            hutch(daemon, "kill", sid)
    finally:
        shutil.rmtree(here, ignore_errors=True)


@pytest.mark.parametrize("columns", [None, "0", "57", "wide"])
def test_the_helps_width_is_the_one_shutil_finds(
        columns: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The help finds the terminal's width as :func:`shutil.get_terminal_size`
    does (``COLUMNS``, else the terminal, else 80) without importing shutil."""
    from hutch.cli._help import _columns

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert _columns() == shutil.get_terminal_size((80, 24)).columns
