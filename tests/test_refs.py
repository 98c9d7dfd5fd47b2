"""Shared references (SPEC §4, issue 9): an owner hands out a ref, other
sessions attach and work in the same live sandbox without owning it."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

import hutch
from hutch._refwire import decode_ref

pytestmark = pytest.mark.anyio


async def local_sandbox() -> hutch.Sandbox:
    return await hutch.create_sandbox("local", workdir=tempfile.mkdtemp())


async def test_attached_session_shares_files_processes_and_lifecycle() -> None:
    owner = await local_sandbox()
    ref = await owner.ref()
    assert isinstance(ref, str) and owner.id not in ref  # opaque
    worker = await hutch.attach(ref)
    assert worker.id == owner.id
    await owner.write_text("from-owner.txt", "o")
    assert await worker.read_text("from-owner.txt") == "o"
    await worker.write_text("from-worker.txt", "w")
    assert await owner.read_text("from-worker.txt") == "w"
    job = await worker.start("sleep 30")
    assert [p.id for p in owner.processes()] == [job.id]
    listed = (await owner.info())["attachments"]
    ref_id = decode_ref(ref).ref_id  # type: ignore[union-attr]
    assert [(a["session"], a["ref_id"]) for a in listed] == [(worker.session_id, ref_id)]
    await job.kill()
    await owner.close()


async def test_attached_close_only_detaches() -> None:
    owner = await local_sandbox()
    worker = await hutch.attach(await owner.ref())
    await worker.close()
    assert worker.closed
    with pytest.raises(hutch.SandboxUnavailable, match="detached"):
        await worker.exec("true")
    assert (await owner.exec("echo still")).stdout == "still\n"
    assert owner.state is hutch.SandboxState.RUNNING
    assert (await owner.info())["attachments"] == []
    await owner.close()


async def test_owner_close_ends_it_for_every_attached_session() -> None:
    owner = await local_sandbox()
    workers = [await hutch.attach(await owner.ref()) for _ in range(2)]
    await owner.close()
    for worker in workers:
        with pytest.raises(hutch.SandboxUnavailable, match="owner's cleanup ended it"):
            await worker.read_text("anything")
        await worker.close()  # closing what is gone is not an error


async def test_read_before_write_is_per_session() -> None:
    owner = await local_sandbox()
    await owner.write_text("shared.txt", "v1")
    worker = await hutch.attach(await owner.ref())
    await owner.read_text("shared.txt")
    with pytest.raises(hutch.ReadBeforeWrite):
        await worker.write_text("shared.txt", "v2")  # the owner's read is not the worker's
    await worker.read_text("shared.txt")
    await worker.write_text("shared.txt", "v2")
    assert await owner.read_text("shared.txt") == "v2"
    await owner.close()


async def test_only_the_owner_hands_out_refs_and_revoked_or_expired_refs_fail() -> None:
    owner = await local_sandbox()
    worker = await hutch.attach(await owner.ref())
    with pytest.raises(hutch.SandboxPermissionDenied, match="owner"):
        await worker.ref()
    revoked = await owner.ref()
    await owner.revoke_ref(revoked)
    with pytest.raises(hutch.Unauthorized):
        await hutch.attach(revoked)
    # A session already attached is refused too, once its ref is revoked or expires.
    spent = await owner.ref()
    holder = await hutch.attach(spent)
    await holder.exec("true")
    await owner.revoke_ref(spent)
    with pytest.raises(hutch.Unauthorized, match="revoked"):
        await holder.exec("true")
    short = await owner.ref(expires_in=0.5)
    early = await hutch.attach(short)
    await asyncio.sleep(1.0)
    with pytest.raises(hutch.Unauthorized, match="expired"):
        await hutch.attach(short)
    with pytest.raises(hutch.Unauthorized, match="expired"):
        await early.read_text("anything")
    # Listed: the sessions whose refs still work (not the revoked's, not the expired's).
    assert [a["session"] for a in (await owner.info())["attachments"]] == [worker.session_id]
    with pytest.raises(hutch.InvalidArgument):
        await owner.ref(expires_in=float("nan"))
    with pytest.raises(hutch.Unauthorized):
        await hutch.attach("not-a-ref")
    await owner.close()


async def test_activity_of_an_attached_session_keeps_it_awake() -> None:
    engine = hutch.LifecycleEngine()
    owner = await hutch.create_sandbox("virtual", engine=engine, idle_suspend_after=1.0,
                                       read_before_write=False)
    worker = await hutch.attach(await owner.ref())
    slept = None
    for i in range(12):  # 3 s of work, three idle windows
        await worker.write_text("tick", str(i))
        assert owner.state is hutch.SandboxState.RUNNING, f"suspended under a busy worker ({i})"
        # A write would resume it: that its time asleep never grows says it stayed up.
        slept = owner.meter["suspended_s"] if slept is None else slept
        assert owner.meter["suspended_s"] == slept, f"suspended under a busy worker ({i})"
        await asyncio.sleep(0.25)
    deadline = asyncio.get_running_loop().time() + 10
    while owner.state is not hutch.SandboxState.SUSPENDED:  # idle for real: it sleeps
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    await owner.close()
    await engine.close()
