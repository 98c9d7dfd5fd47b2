"""hutch's tar rules (``hutch._tar``): a root file system exported by the
Docker Engine is unpacked as root unpacked it, setuid bits, owners, device
nodes and absolute links kept, and nothing of it lands outside its directory."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from hutch.providers.images.in_docker import unpack


def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> list[bytes]:
    """The archive of ``members`` as the Engine streams it: in chunks."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in members:
            if data is not None:
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    raw = out.getvalue()
    return [raw[i:i + 4096] for i in range(0, len(raw), 4096)]


def entry(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644,
          link: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.mode, member.linkname = kind, mode, link
    member.uid = member.gid = 0
    return member


def test_a_root_file_system_keeps_setuid_bits_owners_and_absolute_links(tmp_path: str) -> None:
    into = os.path.join(tmp_path, "rootfs")
    os.mkdir(into)
    unpack(archive(
        (entry("usr", tarfile.DIRTYPE, 0o755), None),
        (entry("usr/bin", tarfile.DIRTYPE, 0o755), None),
        (entry("usr/bin/su", mode=0o4755), b"#!/bin/true\n"),
        (entry("usr/bin/dash", mode=0o755), b"dash"),
        (entry("bin", tarfile.DIRTYPE, 0o755), None),
        (entry("bin/sh", tarfile.SYMTYPE, 0o777, link="/usr/bin/dash"), None),
        (entry("bin/dash", tarfile.LNKTYPE, link="usr/bin/dash"), None),
    ), into)
    assert stat.S_IMODE(os.stat(os.path.join(into, "usr/bin/su")).st_mode) == 0o4755
    assert os.readlink(os.path.join(into, "bin/sh")) == "/usr/bin/dash"
    assert os.stat(os.path.join(into, "bin/dash")).st_ino == os.stat(
        os.path.join(into, "usr/bin/dash")).st_ino
    if os.geteuid() == 0:
        assert os.stat(os.path.join(into, "usr/bin/su")).st_uid == 0


@pytest.mark.parametrize("hostile", [
    # a link to a directory outside, then a file through it
    lambda outside: [(entry("etc", tarfile.SYMTYPE, link=outside), None),
                     (entry("etc/planted"), b"owned")],
    # a name that climbs out
    lambda outside: [(entry(f"../{os.path.basename(outside)}/planted"), b"owned")],
    # a hard link to a file outside
    lambda outside: [(entry("planted", tarfile.LNKTYPE,
                            link=f"../{os.path.basename(outside)}/victim"), None)],
])
def test_nothing_of_a_root_file_system_lands_outside_its_directory(
    tmp_path: str, hostile: object
) -> None:
    outside = os.path.join(tmp_path, "outside")
    os.mkdir(outside)
    with open(os.path.join(outside, "victim"), "w") as fh:
        fh.write("mine")
    into = os.path.join(tmp_path, "rootfs")
    os.mkdir(into)
    with pytest.raises(tarfile.FilterError):
        unpack(archive(*hostile(outside)), into)  # type: ignore[operator]
    assert sorted(os.listdir(outside)) == ["victim"]
    with open(os.path.join(outside, "victim")) as fh:
        assert fh.read() == "mine"
    assert os.stat(os.path.join(outside, "victim")).st_nlink == 1
