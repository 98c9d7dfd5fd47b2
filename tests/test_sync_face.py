"""The generated sync faces: up to date, the async classes' twins member for
member, and the same behaviour on a real provider.

``scripts/gen_sync.py`` writes ``hutch._sync_generated`` from the async
source; these tests hold it to that source without trusting the generator:
every public method and property of each async class has a sync twin with
the same parameters, defaults and (un-awaited) result, and the sync face does
on bubblewrap what the async one does.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import hutch
import hutch._sync_generated as generated
from tests.conftest import TEST_IMAGE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_sync  # noqa: E402

#: async name -> sync twin's name, for every face the generator writes.
TWINS = {face.name: face.sync_name for face in gen_sync.FACES}


def test_the_generated_faces_are_up_to_date() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_sync.py"), "--check"],
        capture_output=True, text=True, check=False,
    )
    assert checked.returncode == 0, checked.stderr


def _twin(annotation: Any) -> Any:
    """An async annotation (a string: hutch postpones them) as the sync face says it."""
    if annotation is inspect.Parameter.empty:
        return annotation
    text = str(annotation)
    return re.sub(r"\b(" + "|".join(TWINS) + r")\b", lambda m: TWINS[m.group(1)], text)


def _iterated(annotation: Any) -> str:
    """``AsyncIterator[X]`` (or an async generator of X) as the sync face gives it."""
    match = re.fullmatch(r"Async(?:Iterator|Generator|Iterable)\[(.*?)(?:, None)?\]",
                         str(annotation))
    assert match, f"an async iterator is annotated as one, not {annotation}"
    return f"Iterator[{_twin(match.group(1))}]"


def _public(cls: type) -> dict[str, Any]:
    names = {n for n in dir(cls) if not n.startswith("_")} | {"__aenter__", "__aexit__",
                                                              "__aiter__"}
    return {n: inspect.getattr_static(cls, n) for n in names if hasattr(cls, n)}


def _faces() -> list[tuple[type, type]]:
    return [
        (getattr(importlib.import_module(face.module), face.name),
         getattr(generated, face.sync_name))
        for face in gen_sync.FACES
    ]


@pytest.mark.parametrize(("async_cls", "sync_cls"), _faces(),
                         ids=[f.sync_name for f in gen_sync.FACES])
def test_every_async_member_has_a_sync_twin_with_its_signature(
    async_cls: type, sync_cls: type
) -> None:
    assert "__getattr__" not in vars(sync_cls), "a face says its members, it does not proxy"
    for name, member in _public(async_cls).items():
        sync_name = {"__aenter__": "__enter__", "__aexit__": "__exit__",
                     "__aiter__": "__iter__"}.get(name, name)
        twin = inspect.getattr_static(sync_cls, sync_name, None)
        assert twin is not None, f"{sync_cls.__name__} has no {sync_name}"
        where = f"{sync_cls.__name__}.{sync_name}"
        if isinstance(member, property):
            assert isinstance(twin, property), where
            assert twin.fget is not None and member.fget is not None
            assert _twin(inspect.signature(member.fget).return_annotation) == \
                inspect.signature(twin.fget).return_annotation, where
            assert (member.fset is None) == (twin.fset is None), f"{where}: settable alike"
            continue
        assert inspect.isfunction(member), f"{async_cls.__name__}.{name} is a method"
        assert inspect.isfunction(twin), where
        assert not inspect.iscoroutinefunction(twin) and not inspect.isasyncgenfunction(twin)
        ours, theirs = inspect.signature(member), inspect.signature(twin)
        assert [(p.name, p.kind, p.default, _twin(p.annotation))
                for p in ours.parameters.values()] == \
            [(p.name, p.kind, p.default, p.annotation) for p in theirs.parameters.values()], where
        wrapped = getattr(member, "__wrapped__", None)
        if inspect.isasyncgenfunction(member) or inspect.isasyncgenfunction(wrapped):
            # An async iterator (or an async context manager over one) gives
            # an iterator (or a context manager over one).
            expected = _iterated(ours.return_annotation)
        elif name == "__aenter__":
            expected = sync_cls.__name__
        else:
            expected = _twin(ours.return_annotation)
        assert theirs.return_annotation == expected, where
        if inspect.isasyncgenfunction(wrapped):
            assert inspect.isgeneratorfunction(getattr(twin, "__wrapped__", None)), where
    extra = set(_public(sync_cls)) - set(_public(async_cls)) - {"__enter__", "__exit__",
                                                                  "__iter__"}
    # Beyond the class's own members, its instances' public attributes (the
    # behaviour test below checks those against real objects).
    assert all(isinstance(inspect.getattr_static(sync_cls, n), property) for n in extra), extra


CLIENT_TWINS = [
    (hutch.client.AsyncClient, hutch.client.Client),
    (hutch.client.AsyncRemoteSandbox, hutch.client.RemoteSandbox),
    (hutch.client.AsyncRemoteProcess, hutch.client.RemoteProcess),
    (hutch.client.AsyncRemoteFork, hutch.client.RemoteFork),
]


def _client_twin(annotation: Any) -> Any:
    """A client's async annotation as its sync face says it."""
    if annotation is inspect.Parameter.empty:
        return annotation
    text = re.sub(r"\bAsyncIterator\[", "Iterator[", str(annotation))
    text = re.sub(r"\bAbstractAsyncContextManager\[", "AbstractContextManager[", text)
    return re.sub(r"\bAsync(Remote\w+|Client)\b", r"\1", text)


@pytest.mark.parametrize(("async_cls", "sync_cls"), CLIENT_TWINS,
                         ids=[s.__name__ for _, s in CLIENT_TWINS])
def test_the_clients_faces_are_twins_member_for_member(async_cls: type, sync_cls: type) -> None:
    renamed = {"__aenter__": "__enter__", "__aexit__": "__exit__", "aclose": "close"}
    async_names = {n for n in dir(async_cls) if not n.startswith("_")} | {"__aenter__"}
    sync_names = {n for n in dir(sync_cls) if not n.startswith("_")} | {"__enter__"}
    assert {renamed.get(n, n) for n in async_names if hasattr(async_cls, n)} == \
        {n for n in sync_names if hasattr(sync_cls, n)}
    for name in async_names:
        if not hasattr(async_cls, name):
            continue
        member = inspect.getattr_static(async_cls, name)
        twin = inspect.getattr_static(sync_cls, renamed.get(name, name))
        where = f"{sync_cls.__name__}.{renamed.get(name, name)}"
        if isinstance(member, property):
            assert isinstance(twin, property), where
            continue
        if not inspect.isfunction(member):
            continue
        if member is twin:  # a check made on the spot (path, require): one function for both
            continue
        ours, theirs = inspect.signature(member), inspect.signature(twin)
        assert [(p.name, p.kind, p.default, _client_twin(p.annotation))
                for p in ours.parameters.values()] == \
            [(p.name, p.kind, p.default, p.annotation) for p in theirs.parameters.values()], where
        assert _client_twin(ours.return_annotation) == theirs.return_annotation, where
        assert theirs.return_annotation is not inspect.Parameter.empty, f"{where} is typed"
        assert not inspect.iscoroutinefunction(twin), where
        returns = str(ours.return_annotation)
        assert inspect.iscoroutinefunction(member) or returns.startswith(
            ("AsyncIterator[", "AbstractAsyncContextManager[")
        ), f"{async_cls.__name__}.{name} is awaited, iterated or entered"


def test_the_faces_are_exported_and_typed() -> None:
    assert hutch.SyncSandbox is generated.SyncSandbox
    assert hutch.create_sandbox_sync is generated.create_sandbox_sync
    assert inspect.signature(hutch.create_sandbox_sync).return_annotation == "SyncSandbox"
    create, create_sync = (inspect.signature(f).parameters.values()
                           for f in (hutch.create_sandbox, hutch.create_sandbox_sync))
    assert [(p.name, p.kind, p.default, p.annotation) for p in create] == \
        [(p.name, p.kind, p.default, p.annotation) for p in create_sync]


# -- the same behaviour, on a real provider ------------------------------------------------


def _exec(result: hutch.ExecResult) -> tuple[int, bytes, bytes]:
    return result.exit_code, result.stdout_bytes, result.stderr_bytes


def _events(events: list[Any]) -> tuple[bytes, bytes, Any]:
    """A stream's output by stream (their interleaving is the command's), and its end."""
    def joined(stream: str) -> bytes:
        return b"".join(e.data for e in events if isinstance(e, hutch.OutputChunk)
                        and e.stream == stream)
    return joined("stdout"), joined("stderr"), events[-1]


async def _through_async() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    async with await hutch.create_sandbox("bubblewrap", image=TEST_IMAGE) as sb:
        seen["exec"] = _exec(await sb.exec("echo out; echo err >&2; exit 3"))
        seen["argv"] = _exec(await sb.exec(["printf", "%s|", "a b", "c"], env={"X": "1"}))
        await sb.write_text("notes.txt", "hello\n")
        seen["read"] = await sb.read_text("notes.txt")
        seen["stat"] = ((await sb.stat("notes.txt")).type, (await sb.stat("notes.txt")).size)
        seen["exists"] = (await sb.exists("notes.txt"), await sb.exists("missing"))
        seen["list"] = sorted(f.path.rsplit("/", 1)[-1] for f in await sb.list_dir("."))
        try:
            await sb.read_text("missing")
        except FileNotFoundError as exc:
            seen["missing"] = type(exc)
        try:
            await sb.write_text("notes.txt", "again")
            seen["guard"] = "written"
        except hutch.ReadBeforeWrite as exc:
            seen["guard"] = type(exc)
        seen["stream"] = _events([e async for e in sb.exec_stream("echo a; echo b >&2")])
        process = await sb.start("sleep 0.2; echo bg")
        seen["started"] = process.running
        seen["wait"] = _exec(await process.wait(timeout=30))
        seen["ended"] = (process.running, process.exit_code)
        seen["pieces"] = b"".join([p async for p in sb.read_pieces("notes.txt")])
        seen["processes"] = [p.command for p in sb.processes()]
        seen["state"] = (sb.state, sb.status().state, sb.closed)
        fork = await sb.fork("parity", count=1)
        branch = fork.branches[0]
        await branch.write_text("branch.txt", "only here")
        seen["fork"] = (await branch.read_text("notes.txt"), await sb.exists("branch.txt"),
                        fork.snapshot.label, len(fork.branches))
        await fork.close()
        seen["fork_closed"] = branch.closed
        seen["attributes"] = {
            type(o).__name__: sorted(n for n in vars(o) if not n.startswith("_"))
            for o in (sb, process, fork)
        }
    seen["closed"] = sb.closed
    return seen


def _through_sync(attributes: dict[str, list[str]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with hutch.create_sandbox_sync("bubblewrap", image=TEST_IMAGE) as sb:
        seen["exec"] = _exec(sb.exec("echo out; echo err >&2; exit 3"))
        seen["argv"] = _exec(sb.exec(["printf", "%s|", "a b", "c"], env={"X": "1"}))
        sb.write_text("notes.txt", "hello\n")
        seen["read"] = sb.read_text("notes.txt")
        seen["stat"] = (sb.stat("notes.txt").type, sb.stat("notes.txt").size)
        seen["exists"] = (sb.exists("notes.txt"), sb.exists("missing"))
        seen["list"] = sorted(f.path.rsplit("/", 1)[-1] for f in sb.list_dir("."))
        try:
            sb.read_text("missing")
        except FileNotFoundError as exc:
            seen["missing"] = type(exc)
        try:
            sb.write_text("notes.txt", "again")
            seen["guard"] = "written"
        except hutch.ReadBeforeWrite as exc:
            seen["guard"] = type(exc)
        seen["stream"] = _events(list(sb.exec_stream("echo a; echo b >&2")))
        process = sb.start("sleep 0.2; echo bg")
        seen["started"] = process.running
        seen["wait"] = _exec(process.wait(timeout=30))
        seen["ended"] = (process.running, process.exit_code)
        seen["pieces"] = b"".join(sb.read_pieces("notes.txt"))
        seen["processes"] = [p.command for p in sb.processes()]
        seen["state"] = (sb.state, sb.status().state, sb.closed)
        fork = sb.fork("parity", count=1)
        branch = fork.branches[0]
        branch.write_text("branch.txt", "only here")
        seen["fork"] = (branch.read_text("notes.txt"), sb.exists("branch.txt"),
                        fork.snapshot.label, len(fork.branches))
        fork.close()
        seen["fork_closed"] = branch.closed
        # Every public attribute of an async object is a property of its face,
        # and the face has no other property its class does not have.
        seen["attributes"] = {
            name: sorted(
                n for n in set(_public(type(face))) - set(_public(getattr(hutch, name)))
                if isinstance(inspect.getattr_static(type(face), n), property)
            )
            for name, face in (("Sandbox", sb), ("Process", process), ("Fork", fork))
        }
        assert sb.id.startswith("sb-") and sb.session_id and sb.created_at > 0
    seen["closed"] = sb.closed
    return seen


@pytest.mark.docker
def test_the_sync_face_does_what_the_async_one_does_on_bubblewrap() -> None:
    through_async = asyncio.run(_through_async())
    through_sync = _through_sync(through_async["attributes"])
    assert through_sync == through_async
    assert through_sync["exec"] == (3, b"out\n", b"err\n")
    assert through_sync["wait"] == (0, b"bg\n", b"")
    assert through_sync["fork"] == ("again", False, "parity", 1)
    assert through_sync["closed"] and through_sync["fork_closed"]


@pytest.mark.docker
def test_background_work_goes_on_between_sync_calls() -> None:
    """The face's loop keeps running while its caller does something else: a
    background command's end is seen without another call in between."""
    with hutch.create_sandbox_sync("bubblewrap", image=TEST_IMAGE) as sb:
        process = sb.start("echo done")
        deadline = time.monotonic() + 30
        while process.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process.running and process.exit_code == 0


@pytest.mark.docker
def test_a_closed_sync_sandbox_refuses_with_a_typed_error() -> None:
    sb = hutch.create_sandbox_sync("bubblewrap", image=TEST_IMAGE)
    sb.close()
    sb.close()  # idempotent
    assert sb.closed
    with pytest.raises(hutch.SandboxUnavailable):
        sb.exec("true")


@pytest.mark.docker
def test_a_pty_through_the_sync_face() -> None:
    with (
        hutch.create_sandbox_sync("docker", image=TEST_IMAGE) as sb,
        sb.pty(["sh", "-c", "read line; echo got-$line"]) as term,
    ):
        term.write(b"hi\n")
        seen = b""
        while b"got-hi" not in seen:
            chunk = term.read()
            if chunk is None:
                break
            seen += chunk.data
        assert b"got-hi" in seen
        assert term.wait() == 0
