"""mkdir and rename: the same on every provider, with the same typed errors."""

from __future__ import annotations

from typing import Any

import hutch

from ._support import Case, raises


async def _is_dir(sandbox: Any, path: str) -> bool:
    return bool((await sandbox.stat(path)).type == hutch.FileType.DIRECTORY)


async def check_mkdir_makes_a_directory(sandbox: Any) -> None:
    await sandbox.mkdir("made")
    assert await _is_dir(sandbox, "made")
    assert "made" in [e.name for e in await sandbox.list_dir(".")]
    await sandbox.write_text("made/inside.txt", "x")  # a directory files go in
    with raises(FileExistsError, code="file_exists"):
        await sandbox.mkdir("made")
    await sandbox.mkdir("made", exist_ok=True)
    await sandbox.mkdir("made", parents=True, exist_ok=True)
    assert await sandbox.read_text("made/inside.txt") == "x"


async def check_mkdir_parents(sandbox: Any) -> None:
    with raises(FileNotFoundError, code="file_not_found"):
        await sandbox.mkdir("p1/p2/p3")
    assert not await sandbox.exists("p1")
    await sandbox.mkdir("p1/p2/p3", parents=True)
    assert await _is_dir(sandbox, "p1/p2/p3")
    with raises(FileExistsError):
        await sandbox.mkdir("p1/p2/p3", parents=True)
    await sandbox.mkdir("ünï côdé 'dir'", parents=True)
    assert await _is_dir(sandbox, "ünï côdé 'dir'")


async def check_mkdir_with_a_file_in_the_way(sandbox: Any) -> None:
    await sandbox.write_text("plain", "a file")
    # A file where the directory would be: never "already exists, fine".
    with raises(FileExistsError, code="file_exists"):
        await sandbox.mkdir("plain")
    with raises(FileExistsError, code="file_exists"):
        await sandbox.mkdir("plain", exist_ok=True)
    # A file where a parent must be.
    with raises(NotADirectoryError, code="not_a_directory"):
        await sandbox.mkdir("plain/sub")
    with raises(NotADirectoryError, code="not_a_directory"):
        await sandbox.mkdir("plain/sub/deeper", parents=True)
    assert await sandbox.read_text("plain") == "a file"


async def check_rename_a_file(sandbox: Any) -> None:
    await sandbox.write_text("old name.txt", "contents")
    await sandbox.rename("old name.txt", "new 'name' ü.txt")
    assert await sandbox.read_text("new 'name' ü.txt") == "contents"
    assert not await sandbox.exists("old name.txt")
    await sandbox.mkdir("into")
    await sandbox.rename("new 'name' ü.txt", "into/moved.txt")
    assert await sandbox.read_text("into/moved.txt") == "contents"
    # To an absolute path inside the sandbox, and back.
    await sandbox.rename("into/moved.txt", sandbox.path("back.txt"))
    assert await sandbox.read_text("back.txt") == "contents"


async def check_rename_a_directory_with_what_is_in_it(sandbox: Any) -> None:
    await sandbox.write_text("tree/a/one.txt", "1")
    await sandbox.write_text("tree/two.txt", "2")
    await sandbox.rename("tree", "grove")
    assert not await sandbox.exists("tree")
    assert await sandbox.read_text("grove/a/one.txt") == "1"
    assert await sandbox.read_text("grove/two.txt") == "2"


async def check_rename_onto_something_there(sandbox: Any) -> None:
    await sandbox.write_text("from.txt", "from")
    await sandbox.write_text("to.txt", "to")
    with raises(FileExistsError, code="file_exists"):
        await sandbox.rename("from.txt", "to.txt")
    assert await sandbox.read_text("from.txt") == "from"
    assert await sandbox.read_text("to.txt") == "to"
    await sandbox.rename("from.txt", "to.txt", overwrite=True)
    assert await sandbox.read_text("to.txt") == "from"
    assert not await sandbox.exists("from.txt")
    # overwrite follows rename(2): a directory replaces an empty directory ...
    await sandbox.write_text("full/x", "x")
    await sandbox.mkdir("empty")
    await sandbox.rename("full", "empty", overwrite=True)
    assert await sandbox.read_text("empty/x") == "x"
    # ... never a non-empty one, a file or a directory of another kind.
    await sandbox.write_text("other/y", "y")
    with raises(FileExistsError):
        await sandbox.rename("other", "empty", overwrite=True)
    with raises(IsADirectoryError):
        await sandbox.rename("to.txt", "empty", overwrite=True)
    with raises(NotADirectoryError):
        await sandbox.rename("other", "to.txt", overwrite=True)
    assert await sandbox.read_text("other/y") == "y"
    assert await sandbox.read_text("to.txt") == "from"


async def check_rename_errors(sandbox: Any) -> None:
    with raises(FileNotFoundError, code="file_not_found"):
        await sandbox.rename("never-was", "anything")
    await sandbox.write_text("stays.txt", "s")
    with raises(FileNotFoundError, code="file_not_found"):
        await sandbox.rename("stays.txt", "no/such/dir/stays.txt")
    with raises(NotADirectoryError, code="not_a_directory"):
        await sandbox.rename("stays.txt", "stays.txt/inside")
    assert await sandbox.read_text("stays.txt") == "s"
    await sandbox.mkdir("self")
    with raises(hutch.InvalidArgument):
        await sandbox.rename("self", "self/below")
    await sandbox.rename("stays.txt", "./stays.txt")  # onto itself: nothing to do
    assert await sandbox.read_text("stays.txt") == "s"


async def check_the_working_directory_is_not_renamed(sandbox: Any) -> None:
    await sandbox.write_text("keep.txt", "k")
    for spelling in (".", "", sandbox.workdir, "sub/.."):
        with raises(hutch.InvalidArgument):
            await sandbox.rename(spelling, "elsewhere")
    with raises(hutch.InvalidArgument):
        await sandbox.rename("keep.txt", ".", overwrite=True)
    parent = sandbox.workdir.rstrip("/").rsplit("/", 1)[0] or "/"
    with raises(hutch.InvalidArgument):
        await sandbox.rename(parent, "elsewhere")
    await sandbox.mkdir(".", exist_ok=True)
    assert await sandbox.read_text("keep.txt") == "k"


async def check_rename_a_directory_of_the_image(sandbox: Any) -> None:
    """Outside the working directory, on an isolating provider: a directory
    that came with the image (on overlayfs, of a lower layer, which rename(2)
    refuses to move) is moved all the same, what is in it kept."""
    caps = sandbox.capabilities
    if caps.runs_on_host or not caps.processes:
        return  # the host's own directories are not the suite's to move
    made = await sandbox.exec(
        "d=$(mktemp -d /usr/local/hutch-image-dir.XXXXXX) && echo kept > $d/f && echo $d")
    assert made.exit_code == 0, made.stderr
    # Made by a command, in the container's upper layer: the image's own
    # directory is its parent, /usr/local, whose subdirectory is renamed below.
    image_dir = "/usr/local/share"
    if not await sandbox.exists(image_dir):
        return
    await sandbox.rename(image_dir, "/usr/local/share-moved")
    try:
        assert not await sandbox.exists(image_dir)
        assert (await sandbox.stat("/usr/local/share-moved")).type == hutch.FileType.DIRECTORY
    finally:
        await sandbox.rename("/usr/local/share-moved", image_dir)
    moved = made.stdout.strip() + "-moved"
    await sandbox.rename(made.stdout.strip(), moved)
    assert await sandbox.read_text(moved + "/f") == "kept\n"
    await sandbox.remove(moved, recursive=True)


FILE_OP_CASES: list[Case] = [
    check_mkdir_makes_a_directory,
    check_mkdir_parents,
    check_mkdir_with_a_file_in_the_way,
    check_rename_a_file,
    check_rename_a_directory_with_what_is_in_it,
    check_rename_onto_something_there,
    check_rename_errors,
    check_the_working_directory_is_not_renamed,
    check_rename_a_directory_of_the_image,
]
