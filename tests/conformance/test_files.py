"""Conformance: files, grep and glob, the same on every provider."""

from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Any

import pytest

import hutch
from tests.conformance.conftest import Harness

pytestmark = pytest.mark.anyio

ODD_NAME = "a b'\"\n€.bin"


async def test_text_round_trip(files_sandbox: Any) -> None:
    await files_sandbox.write_text("hello.txt", "héllo\nwörld\n")
    assert await files_sandbox.read_text("hello.txt") == "héllo\nwörld\n"


async def test_binary_round_trip(files_sandbox: Any) -> None:
    data = bytes(range(256)) * 100
    await files_sandbox.write_bytes("blob.bin", data)
    assert await files_sandbox.read_bytes("blob.bin") == data


async def test_large_binary_with_odd_name(files_sandbox: Any) -> None:
    data = os.urandom(10 * 1024 * 1024)
    await files_sandbox.write_bytes(ODD_NAME, data)
    back = await files_sandbox.read_bytes(ODD_NAME)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    info = await files_sandbox.stat(ODD_NAME)
    assert info.size == len(data)
    assert info.type == hutch.FileType.FILE


async def test_zero_length_file(files_sandbox: Any) -> None:
    await files_sandbox.write_bytes("empty", b"")
    assert await files_sandbox.read_bytes("empty") == b""
    assert (await files_sandbox.stat("empty")).size == 0


@pytest.mark.parametrize(
    "name",
    ["with space.txt", "quote'single.txt", 'quote"double.txt', "new\nline.txt",
     "ünïcødé €.txt", "$(touch pwned).txt", "-leading-dash.txt", "back\\slash.txt"],
)
async def test_odd_names(files_sandbox: Any, name: str) -> None:
    await files_sandbox.write_text(name, name)
    assert await files_sandbox.read_text(name) == name
    names = [info.name for info in await files_sandbox.list_dir(".")]
    assert name in names
    assert "pwned" not in " ".join(names).replace("$(touch pwned).txt", "")


async def test_nested_directories_are_created(files_sandbox: Any) -> None:
    await files_sandbox.write_text("a/b/c/d.txt", "deep")
    assert await files_sandbox.read_text("a/b/c/d.txt") == "deep"
    assert (await files_sandbox.stat("a/b")).type == hutch.FileType.DIRECTORY


async def test_absolute_paths(files_sandbox: Any) -> None:
    path = f"{files_sandbox.workdir}/abs.txt"
    await files_sandbox.write_text(path, "abs")
    assert await files_sandbox.read_text("abs.txt") == "abs"


async def test_overwrite_replaces_content(files_sandbox: Any) -> None:
    await files_sandbox.write_text("f.txt", "a much longer first version")
    await files_sandbox.write_text("f.txt", "short")
    assert await files_sandbox.read_text("f.txt") == "short"


async def test_read_missing_is_file_not_found(files_sandbox: Any) -> None:
    with pytest.raises(FileNotFoundError) as info:
        await files_sandbox.read_text("nope/missing.txt")
    assert info.value.code == "file_not_found"
    assert "missing.txt" in str(info.value)


async def test_stat_missing_is_file_not_found(files_sandbox: Any) -> None:
    with pytest.raises(FileNotFoundError):
        await files_sandbox.stat("missing")
    assert not await files_sandbox.exists("missing")


async def test_read_directory_is_a_directory(files_sandbox: Any) -> None:
    await files_sandbox.write_text("dir/file.txt", "x")
    with pytest.raises(IsADirectoryError) as info:
        await files_sandbox.read_bytes("dir")
    assert info.value.code == "is_a_directory"


async def test_write_over_directory_is_a_directory(files_sandbox: Any) -> None:
    await files_sandbox.write_text("dir2/file.txt", "x")
    with pytest.raises(IsADirectoryError):
        await files_sandbox.write_text("dir2", "y")


async def test_read_limit(files_sandbox: Any) -> None:
    await files_sandbox.write_bytes("big", b"x" * 5000)
    with pytest.raises(hutch.OutputLimitExceeded) as info:
        await files_sandbox.read_bytes("big", limit=4096)
    assert "4096" in str(info.value)
    assert len(await files_sandbox.read_bytes("big", limit=5000)) == 5000


async def test_list_and_stat(files_sandbox: Any) -> None:
    await files_sandbox.write_text("ls/one.txt", "1")
    await files_sandbox.write_text("ls/sub/two.txt", "22")
    entries = {i.name: i for i in await files_sandbox.list_dir("ls")}
    assert set(entries) == {"one.txt", "sub"}
    assert entries["one.txt"].type == hutch.FileType.FILE
    assert entries["one.txt"].size == 1
    assert entries["sub"].type == hutch.FileType.DIRECTORY


async def test_remove_file_and_tree(files_sandbox: Any) -> None:
    await files_sandbox.write_text("rm/a.txt", "a")
    await files_sandbox.write_text("rm/sub/b.txt", "b")
    await files_sandbox.remove("rm/a.txt")
    assert not await files_sandbox.exists("rm/a.txt")
    with pytest.raises(IsADirectoryError):
        await files_sandbox.remove("rm")
    await files_sandbox.remove("rm", recursive=True)
    assert not await files_sandbox.exists("rm")
    with pytest.raises(FileNotFoundError):
        await files_sandbox.remove("rm")


async def test_grep(files_sandbox: Any) -> None:
    await files_sandbox.write_text("src/a.py", "import os\nprint('hello')\n")
    await files_sandbox.write_text("src/pkg/b.py", "x = 1\nHELLO = 2\n")
    await files_sandbox.write_text("src/notes.md", "hello in markdown\n")
    matches = await files_sandbox.grep(r"hel+o", "src")
    found = {(m.path.rsplit("/", 1)[-1], m.line_number, m.line) for m in matches}
    assert found == {("a.py", 2, "print('hello')"), ("notes.md", 1, "hello in markdown")}
    only_py = await files_sandbox.grep("hello", "src", glob="*.py", ignore_case=True)
    assert sorted((m.path.rsplit("/", 1)[-1], m.line_number) for m in only_py) == [
        ("a.py", 2), ("b.py", 2)
    ]


async def test_grep_bad_regex_is_invalid_argument(files_sandbox: Any) -> None:
    with pytest.raises(ValueError):
        await files_sandbox.grep("(unclosed", ".")


async def test_grep_missing_path(files_sandbox: Any) -> None:
    with pytest.raises(FileNotFoundError):
        await files_sandbox.grep("x", "no/such/dir")


async def test_glob(files_sandbox: Any) -> None:
    for path in ["g/a.py", "g/b.txt", "g/sub/c.py", "g/sub/deeper/d.py", "g/sub/e.md"]:
        await files_sandbox.write_text(path, "x")
    root = f"{files_sandbox.workdir}/g"
    assert await files_sandbox.glob("**/*.py", "g") == [
        f"{root}/a.py", f"{root}/sub/c.py", f"{root}/sub/deeper/d.py"
    ]
    assert await files_sandbox.glob("*.py", "g") == [
        f"{root}/a.py", f"{root}/sub/c.py", f"{root}/sub/deeper/d.py"
    ]
    assert await files_sandbox.glob("sub/*.py", "g") == [f"{root}/sub/c.py"]
    assert await files_sandbox.glob("sub/**/*.md", "g") == [f"{root}/sub/e.md"]


async def test_permission_denied_on_write(harness: Harness) -> None:
    # Root ignores mode bits, but not the immutable attribute.
    if harness.host_workdir is None:
        pytest.fail("process providers must expose their host working directory here")
    sandbox = harness.sandbox
    await sandbox.write_text("locked.txt", "original")
    host_file = os.path.join(harness.host_workdir, "locked.txt")
    subprocess.run(["chattr", "+i", host_file], check=True)
    try:
        with pytest.raises(PermissionError) as info:
            await sandbox.write_text("locked.txt", "changed")
        assert info.value.code == "permission_denied"
    finally:
        subprocess.run(["chattr", "-i", host_file], check=True)
    assert await sandbox.read_text("locked.txt") == "original"


async def test_path_with_nul_is_invalid(files_sandbox: Any) -> None:
    with pytest.raises(ValueError):
        await files_sandbox.write_text("bad\0name", "x")
