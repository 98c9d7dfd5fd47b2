"""Files, grep and glob: the same on every provider."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import hutch

from ._support import Case, raises

ODD_NAME = "a b'\"\n€.bin"


async def check_text_round_trip(sandbox: Any) -> None:
    await sandbox.write_text("hello.txt", "héllo\nwörld\n")
    assert await sandbox.read_text("hello.txt") == "héllo\nwörld\n"


async def check_binary_round_trip(sandbox: Any) -> None:
    data = bytes(range(256)) * 100
    await sandbox.write_bytes("blob.bin", data)
    assert await sandbox.read_bytes("blob.bin") == data


async def check_large_binary_with_odd_name(sandbox: Any) -> None:
    data = os.urandom(10 * 1024 * 1024)
    await sandbox.write_bytes(ODD_NAME, data)
    back = await sandbox.read_bytes(ODD_NAME)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    info = await sandbox.stat(ODD_NAME)
    assert info.size == len(data)
    assert info.type == hutch.FileType.FILE


async def check_zero_length_file(sandbox: Any) -> None:
    await sandbox.write_bytes("empty", b"")
    assert await sandbox.read_bytes("empty") == b""
    assert (await sandbox.stat("empty")).size == 0


ODD_NAMES = ["with space.txt", "quote'single.txt", 'quote"double.txt', "new\nline.txt",
             "ünïcødé €.txt", "$(touch pwned).txt", "-leading-dash.txt", "back\\slash.txt"]


async def check_odd_names(sandbox: Any) -> None:
    for name in ODD_NAMES:
        await sandbox.write_text(name, name)
        assert await sandbox.read_text(name) == name
        names = [info.name for info in await sandbox.list_dir(".")]
        assert name in names
        assert "pwned" not in " ".join(names).replace("$(touch pwned).txt", "")


async def check_nested_directories_are_created(sandbox: Any) -> None:
    await sandbox.write_text("a/b/c/d.txt", "deep")
    assert await sandbox.read_text("a/b/c/d.txt") == "deep"
    assert (await sandbox.stat("a/b")).type == hutch.FileType.DIRECTORY


async def check_absolute_paths(sandbox: Any) -> None:
    path = f"{sandbox.workdir}/abs.txt"
    await sandbox.write_text(path, "abs")
    assert await sandbox.read_text("abs.txt") == "abs"


async def check_overwrite_replaces_content(sandbox: Any) -> None:
    await sandbox.write_text("f.txt", "a much longer first version")
    await sandbox.write_text("f.txt", "short")
    assert await sandbox.read_text("f.txt") == "short"


async def check_read_missing_is_file_not_found(sandbox: Any) -> None:
    with raises(FileNotFoundError) as info:
        await sandbox.read_text("nope/missing.txt")
    assert getattr(info.value, "code", None) == "file_not_found"
    assert "missing.txt" in str(info.value)


async def check_stat_missing_is_file_not_found(sandbox: Any) -> None:
    with raises(FileNotFoundError):
        await sandbox.stat("missing")
    assert not await sandbox.exists("missing")


async def check_read_directory_is_a_directory(sandbox: Any) -> None:
    await sandbox.write_text("dir/file.txt", "x")
    with raises(IsADirectoryError) as info:
        await sandbox.read_bytes("dir")
    assert getattr(info.value, "code", None) == "is_a_directory"


async def check_write_over_directory_is_a_directory(sandbox: Any) -> None:
    await sandbox.write_text("dir2/file.txt", "x")
    with raises(IsADirectoryError):
        await sandbox.write_text("dir2", "y")


async def check_read_limit(sandbox: Any) -> None:
    await sandbox.write_bytes("big", b"x" * 5000)
    with raises(hutch.OutputLimitExceeded) as info:
        await sandbox.read_bytes("big", limit=4096)
    assert "4096" in str(info.value)
    assert len(await sandbox.read_bytes("big", limit=5000)) == 5000


async def check_list_and_stat(sandbox: Any) -> None:
    await sandbox.write_text("ls/one.txt", "1")
    await sandbox.write_text("ls/sub/two.txt", "22")
    entries = {i.name: i for i in await sandbox.list_dir("ls")}
    assert set(entries) == {"one.txt", "sub"}
    assert entries["one.txt"].type == hutch.FileType.FILE
    assert entries["one.txt"].size == 1
    assert entries["sub"].type == hutch.FileType.DIRECTORY


async def check_remove_file_and_tree(sandbox: Any) -> None:
    await sandbox.write_text("rm/a.txt", "a")
    await sandbox.write_text("rm/sub/b.txt", "b")
    await sandbox.remove("rm/a.txt")
    assert not await sandbox.exists("rm/a.txt")
    with raises(IsADirectoryError):
        await sandbox.remove("rm")
    await sandbox.remove("rm", recursive=True)
    assert not await sandbox.exists("rm")
    with raises(FileNotFoundError):
        await sandbox.remove("rm")


async def check_grep(sandbox: Any) -> None:
    await sandbox.write_text("src/a.py", "import os\nprint('hello')\n")
    await sandbox.write_text("src/pkg/b.py", "x = 1\nHELLO = 2\n")
    await sandbox.write_text("src/notes.md", "hello in markdown\n")
    matches = await sandbox.grep(r"hel+o", "src")
    found = {(m.path.rsplit("/", 1)[-1], m.line_number, m.line) for m in matches}
    assert found == {("a.py", 2, "print('hello')"), ("notes.md", 1, "hello in markdown")}
    only_py = await sandbox.grep("hello", "src", glob="*.py", ignore_case=True)
    assert sorted((m.path.rsplit("/", 1)[-1], m.line_number) for m in only_py) == [
        ("a.py", 2), ("b.py", 2)
    ]


async def check_grep_bad_regex_is_invalid_argument(sandbox: Any) -> None:
    with raises(ValueError):
        await sandbox.grep("(unclosed", ".")


async def check_grep_missing_path(sandbox: Any) -> None:
    with raises(FileNotFoundError):
        await sandbox.grep("x", "no/such/dir")


async def check_glob(sandbox: Any) -> None:
    for path in ["g/a.py", "g/b.txt", "g/sub/c.py", "g/sub/deeper/d.py", "g/sub/e.md"]:
        await sandbox.write_text(path, "x")
    root = f"{sandbox.workdir}/g"
    assert await sandbox.glob("**/*.py", "g") == [
        f"{root}/a.py", f"{root}/sub/c.py", f"{root}/sub/deeper/d.py"
    ]
    # As pathlib's Path.glob: a pattern without ** stays at its depth.
    assert await sandbox.glob("*.py", "g") == [f"{root}/a.py"]
    assert await sandbox.glob("*/*.py", "g") == [f"{root}/sub/c.py"]
    assert await sandbox.glob("*", "g") == [f"{root}/a.py", f"{root}/b.txt"]
    assert await sandbox.glob("sub/*.py", "g") == [f"{root}/sub/c.py"]
    assert await sandbox.glob("sub/**/*.md", "g") == [f"{root}/sub/e.md"]


async def check_path_with_nul_is_invalid(sandbox: Any) -> None:
    with raises(ValueError):
        await sandbox.write_text("bad\0name", "x")


async def check_file_permissions_agree_with_the_sandboxs_own_user(sandbox: Any) -> None:
    # The file API acts as the sandbox's default user does: what a command
    # of that user may not read, write, create or remove, the API may not
    # either, and the reverse (reads and writes used to disagree).
    if not sandbox.capabilities.processes:
        return
    setup = await sandbox.exec(
        "rm -rf perm && mkdir -p perm/ro && echo secret > perm/locked && chmod 000 perm/locked"
        " && echo a > perm/ro/g && echo b > perm/ro/g2 && chmod 555 perm/ro"
    )
    assert setup.exit_code == 0, setup
    probe = await sandbox.exec(
        "cat perm/locked >/dev/null 2>&1 && echo read; "
        "(echo x >> perm/locked) 2>/dev/null && echo write; "
        "(echo x > perm/ro/new) 2>/dev/null && echo create; "
        "rm -f perm/ro/g 2>/dev/null && echo remove"
    )
    allowed_in_shell = set(probe.stdout.split())

    async def allowed(action: Any) -> bool:
        try:
            await action
        except PermissionError:
            return False
        return True

    allowed_in_api = {
        name for name, action in (
            ("read", sandbox.read_bytes("perm/locked")),
            ("write", sandbox.write_text("perm/locked", "y")),
            ("create", sandbox.write_text("perm/ro/new2", "y")),
            ("remove", sandbox.remove("perm/ro/g2")),
        )
        if await allowed(action)
    }
    await sandbox.exec("chmod -R u+rwx perm; rm -rf perm")
    assert allowed_in_api == allowed_in_shell


FILE_CASES: list[Case] = [
    check_text_round_trip,
    check_binary_round_trip,
    check_large_binary_with_odd_name,
    check_zero_length_file,
    check_odd_names,
    check_nested_directories_are_created,
    check_absolute_paths,
    check_overwrite_replaces_content,
    check_read_missing_is_file_not_found,
    check_stat_missing_is_file_not_found,
    check_read_directory_is_a_directory,
    check_write_over_directory_is_a_directory,
    check_read_limit,
    check_list_and_stat,
    check_remove_file_and_tree,
    check_grep,
    check_grep_bad_regex_is_invalid_argument,
    check_grep_missing_path,
    check_glob,
    check_path_with_nul_is_invalid,
    check_file_permissions_agree_with_the_sandboxs_own_user,
]
