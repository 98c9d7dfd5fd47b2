"""Every listing command of the hutch command, as a person and a script use it:
with nothing to list and with a thousand entries, on a terminal 80 columns
wide (one line an entry) and in a pipe (whole ids, nothing cut), and as JSON."""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import hutch
from hutch._refwire import decode_ref
from hutch.cli._listing import Column, table_lines
from hutch.images import ImageInfo
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]

#: Every command that lists something, and how to find an entry's id in its JSON.
LISTINGS: dict[tuple[str, ...], str] = {
    ("ls",): "id",
    ("ls", "--wide"): "id",
    ("ls", "--all"): "id",
    ("workspace", "list"): "name",
    ("snapshot", "ls"): "id",
    ("image", "ls"): "name",
    ("events",): "subject",
    ("definitions",): "id",
}

MANY = 1000
#: Listings not filled a thousand times here: events come of the others, and
#: definitions are the operator's (a few, from hutch.toml).
FEW = {("events",), ("definitions",)}


@dataclass
class Home:
    """A daemon and the environment a person's shell would have for it."""

    daemon: DaemonProcess
    env: dict[str, str] = field(default_factory=dict)
    #: The ids each listing must show, whole.
    expected: dict[tuple[str, ...], set[str]] = field(default_factory=dict)


def _env(d: DaemonProcess) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    # image ls reads the hutch home itself, as docker reads its engine.
    env.update(HUTCH_URL=d.url, HUTCH_TOKEN=d.token, HUTCH_HOME=d.data_dir)
    return env


def piped(home: Home, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HUTCH, *args], capture_output=True, text=True, env=home.env,
                          timeout=300, stdin=subprocess.DEVNULL)


def on_terminal(home: Home, *args: str, columns: int = 80) -> tuple[int, list[str], str]:
    """Run on a pseudo-terminal ``columns`` wide: (exit code, lines shown, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([*HUTCH, *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=subprocess.PIPE, env=home.env)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            try:
                piece = os.read(master, 65536)
            except OSError as exc:  # EIO: the other side closed
                if exc.errno != errno.EIO:
                    raise
                break
            if not piece:
                break
            out += piece
    finally:
        os.close(master)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
        code = proc.wait(300)
    text = out.decode().replace("\r\n", "\n")
    # What a terminal shows: escape sequences take no room.
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return code, shown.splitlines(), err


@pytest.fixture(scope="module")
def empty() -> Iterator[Home]:
    d = DaemonProcess().start()
    yield Home(d, _env(d))
    d.close()


@pytest.mark.parametrize("listing", list(LISTINGS), ids=" ".join)
def test_a_listing_of_nothing_is_not_an_error(empty: Home, listing: tuple[str, ...]) -> None:
    shown = piped(empty, *listing)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    as_json = piped(empty, *listing, "--json")
    assert as_json.returncode == 0, as_json.stderr
    found = json.loads(as_json.stdout)
    # The daemon's own doings (its start, say) may be events already.
    assert found == [] if listing != ("events",) else isinstance(found, list)
    code, lines, err = on_terminal(empty, *listing)
    assert code == 0, err
    assert all(len(line) <= 80 for line in lines), lines


def _fill(d: DaemonProcess) -> dict[tuple[str, ...], set[str]]:
    """A thousand of everything: sandboxes, snapshots (one lineage, a thousand
    deep), workspaces and images."""
    with hutch.Client(d.url, token=d.token) as c:
        sandboxes = {c.create_sandbox(provider="virtual").id for _ in range(MANY)}
        origin = c.get_sandbox(next(iter(sandboxes)))
        snapshots = {origin.snapshot(f"step-{i}").id for i in range(MANY)}
        workspaces = set()
        for i in range(MANY):
            ws = c.create_workspace(f"ws-{i:04d}-with-a-rather-long-name", provider="virtual")
            workspaces.add(ws["name"])
            sandboxes.add(ws["live_sandbox_id"])
    images = set()
    for i in range(MANY):
        # As `hutch image build` leaves one (building a thousand would take hours).
        name = f"img-{i:04d}"
        directory = os.path.join(d.data_dir, "images", name)
        os.makedirs(os.path.join(directory, "rootfs"))
        info = ImageInfo(name, "packages", 4096 * i, time.time(), ["python3"])
        with open(os.path.join(directory, "image.json"), "w") as fh:
            json.dump(info.as_dict(), fh)
        images.add(name)
    return {
        ("ls",): sandboxes, ("ls", "--wide"): sandboxes, ("ls", "--all"): sandboxes,
        ("workspace", "list"): workspaces, ("snapshot", "ls"): snapshots,
        ("image", "ls"): images,
    }


@pytest.fixture(scope="module")
def full() -> Iterator[Home]:
    d = DaemonProcess().start()
    try:
        home = Home(d, _env(d), _fill(d))
        yield home
    finally:
        # Virtual sandboxes hold nothing outside the data directory.
        d.stop()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(d.data_dir)


@pytest.mark.parametrize("listing", [k for k in LISTINGS if k not in FEW], ids=" ".join)
def test_a_thousand_entries_one_line_each(full: Home, listing: tuple[str, ...]) -> None:
    wanted = full.expected[listing]
    as_json = piped(full, *listing, "--json")
    assert as_json.returncode == 0, as_json.stderr
    key = LISTINGS[listing]
    assert {entry[key] for entry in json.loads(as_json.stdout)} == wanted
    # In a pipe: every id whole, one line an entry.
    shown = piped(full, *listing)
    assert shown.returncode == 0, shown.stderr
    # Names are words of [\w.-]: counted as whole words, in one pass over the
    # output (a search per name is seconds of a thousand scans).
    assert all(re.fullmatch(r"[\w.-]+", name) for name in wanted)
    words = collections.Counter(re.findall(r"[\w.-]+", shown.stdout))
    assert [name for name in wanted if words[name] != 1] == []
    assert len(shown.stdout.splitlines()) in (len(wanted), len(wanted) + 1)  # a header
    # On a terminal 80 columns wide: one line an entry, none wider.
    code, lines, err = on_terminal(full, *listing)
    assert code == 0, err
    assert len(lines) in (len(wanted), len(wanted) + 1), lines[:5]
    too_wide = [line for line in lines if len(line) > 80]
    assert not too_wide, too_wide[:3]


def test_refs_of_a_sandbox_are_listed_whole(empty: Home) -> None:
    with hutch.Client(empty.daemon.url, token=empty.daemon.token) as c:
        sb = c.create_sandbox(provider="virtual")
        try:
            none = piped(empty, "refs", sb.id, "--json")
            assert (none.returncode, json.loads(none.stdout)) == (0, []), none.stderr
            made = {decode_ref(sb.ref(expires_in=600)).ref_id for _ in range(3)}
            as_json = piped(empty, "refs", sb.id, "--json")
            assert {r["ref_id"] for r in json.loads(as_json.stdout)} == made
            shown = piped(empty, "refs", sb.id)
            assert shown.returncode == 0, shown.stderr
            assert all(sum(ref in line for line in shown.stdout.splitlines()) == 1
                       for ref in made)
            code, lines, err = on_terminal(empty, "refs", sb.id)
            assert code == 0, err
            assert len(lines) == 4 and all(len(line) <= 80 for line in lines), lines
        finally:
            c.delete_sandbox(sb.id)


def test_a_terminal_line_leaves_columns_out_before_it_cuts_an_id() -> None:
    columns = (Column("ID"), Column("NOTE", cut=True), Column("EXTRA", drop=1))
    rows = [["sb-" + "a" * 12, "x" * 100, "e" * 30]]
    header, line = table_lines(columns, rows, 40)
    assert "EXTRA" not in header and len(line) == 40
    # The note is cut only as far as it has to be, once EXTRA is out of the way.
    assert line == "sb-" + "a" * 12 + "  " + "x" * 22 + "…"
    # In a pipe nothing is cut or left out.
    assert table_lines(columns, rows, None)[1].endswith("x" * 100 + "  " + "e" * 30)
