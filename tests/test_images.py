"""hutch images: built once, used by name by bubblewrap and docker, listed with
their users, removed only when nothing uses them."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

import hutch
from hutch import images
from hutch.cli.main import app
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.docker


@pytest.fixture
def home(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("HUTCH_HOME", str(tmp_path))
    yield str(tmp_path)


def _docker_has(name: str) -> bool:
    return subprocess.run(
        ["docker", "image", "inspect", name], capture_output=True, check=False
    ).returncode == 0


@pytest.mark.anyio
async def test_dockerfile_image_serves_bubblewrap_and_docker_by_name(
    home: str, tmp_path: os.PathLike[str]
) -> None:
    name = f"hutch-test-img-{secrets.token_hex(3)}"
    marker = secrets.token_hex(8)
    dockerfile = os.path.join(str(tmp_path), "Dockerfile")
    with open(dockerfile, "w") as fh:
        fh.write(f"FROM {TEST_IMAGE}\nRUN echo {marker} > /built\n")
    lines: list[str] = []
    try:
        info = images.build(name, dockerfile=dockerfile, progress=lines.append)
        assert info.source == "dockerfile" and info.size_bytes > 10 << 20
        assert any("docker build" in line for line in lines), "no progress was shown"
        # Built once: a second build reuses it.
        again: list[str] = []
        images.build(name, dockerfile=dockerfile, progress=again.append)
        assert any("reusing" in line for line in again)
        async with await hutch.create_sandbox(
            "bubblewrap", image=name, ephemeral=True, read_before_write=False
        ) as sb:
            assert (await sb.exec(["cat", "/built"])).stdout == f"{marker}\n"
            (listed,) = [i for i in images.list_images() if i.name == name]
            assert listed.users == [f"bubblewrap:{sb.id}"]
            with pytest.raises(hutch.HutchError) as refused:
                images.remove(name)
            assert refused.value.code == "invalid_state" and sb.id in str(refused.value)
        async with await hutch.create_sandbox(
            "docker", image=name, read_before_write=False
        ) as dsb:
            assert (await dsb.exec(["cat", "/built"])).stdout == f"{marker}\n"
        tag = images.docker_tag(name)
        assert _docker_has(tag)
        images.remove(name)
        assert images.list_images() == []
        assert not _docker_has(tag)
    finally:
        subprocess.run(["docker", "rmi", "-f", images.docker_tag(name)], capture_output=True,
                       check=False)


def test_names_and_sources_are_checked(home: str) -> None:
    with pytest.raises(ValueError):
        images.build("Bad Name", packages=["hello"])
    with pytest.raises(ValueError):
        images.build("ok", packages=["hello; rm -rf /"])
    with pytest.raises(ValueError):
        images.build("ok")
    # A Docker image hutch did not make is never overwritten or removed.
    with pytest.raises(ValueError) as info:
        images.build(TEST_IMAGE, packages=["hello"])
    assert "did not build" in str(info.value)
    assert _docker_has(TEST_IMAGE)
    with pytest.raises(LookupError):
        images.remove("hutch-no-such-image")


@pytest.mark.slow
def test_cli_builds_an_image_from_debian_packages(home: str) -> None:
    # The README's one command for an image with python3, git and pytest.
    name = f"hutch-test-pkgs-{secrets.token_hex(3)}"
    runner = CliRunner()
    try:
        built = runner.invoke(
            app, ["image", "build", name, "--packages", "python3,git,python3-pytest"]
        )
        assert built.exit_code == 0, built.output
        assert "apt-get install" in built.output
        listed = runner.invoke(app, ["image", "ls"])
        assert name in listed.output
        sandbox = hutch.create_sandbox_sync("bubblewrap", image=name, ephemeral=True)
        try:
            result = sandbox.exec("python3 -m pytest --version && git --version")
            assert result.exit_code == 0, result.stderr
        finally:
            sandbox.close()
        removed = runner.invoke(app, ["image", "rm", name])
        assert removed.exit_code == 0, removed.output
        assert name not in runner.invoke(app, ["image", "ls"]).output
    finally:
        subprocess.run(["docker", "rmi", "-f", name], capture_output=True, check=False)


def test_an_image_build_runs_apt_with_a_tmp_every_user_can_write(
    tmp_path: os.PathLike[str],
) -> None:
    # apt-get update hands its downloads to the unprivileged _apt user, which
    # writes its temporary files in /tmp: a 0755 /tmp failed every source and
    # the build went on with the base's stale package lists.
    rootfs = os.path.join(str(tmp_path), "rootfs")
    os.makedirs(rootfs)
    subprocess.run(["tar", "-x", "--numeric-owner", "-f", images.MINBASE_TAR, "-C", rootfs],
                   check=True)
    probe = subprocess.run(
        [*images._apt_sandbox(rootfs), "sh", "-c",
         "stat -c %a /tmp; setpriv --reuid=_apt --regid=nogroup --clear-groups "
         "sh -c 'echo x > /tmp/apt-probe && echo written'"],
        capture_output=True, text=True, check=False,
    )
    assert probe.stdout.split() == ["1777", "written"], probe.stderr


def _dockerfile(directory: str, marker: str) -> str:
    path = os.path.join(directory, "Dockerfile")
    with open(path, "w") as fh:
        fh.write(f"FROM {TEST_IMAGE}\nRUN echo {marker} > /built\n")
    return path


@pytest.mark.anyio
async def test_two_homes_building_one_image_name_keep_their_own_images(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Image names are a home's; Docker's tags are the host's. Two homes
    # building one name must each run their own, and one's `image rm` must
    # leave the other's image in place.
    name = f"hutch-test-shared-{secrets.token_hex(3)}"
    homes = {which: os.path.join(str(tmp_path), which) for which in ("a", "b")}
    tags: dict[str, str] = {}
    try:
        for which, home in homes.items():
            os.makedirs(home)
            monkeypatch.setenv("HUTCH_HOME", home)
            info = images.build(name, dockerfile=_dockerfile(home, f"built-by-{which}"))
            assert info.docker_tag is not None
            tags[which] = info.docker_tag
        assert tags["a"] != tags["b"]
        for which, home in homes.items():
            monkeypatch.setenv("HUTCH_HOME", home)
            async with await hutch.create_sandbox(
                "docker", image=name, read_before_write=False
            ) as sb:
                assert (await sb.exec(["cat", "/built"])).stdout == f"built-by-{which}\n"
        monkeypatch.setenv("HUTCH_HOME", homes["a"])
        images.remove(name)
        assert not _docker_has(tags["a"])
        assert _docker_has(tags["b"]), "removing home a's image removed home b's"
        monkeypatch.setenv("HUTCH_HOME", homes["b"])
        assert [i.name for i in images.list_images()] == [name]
        async with await hutch.create_sandbox(
            "docker", image=name, read_before_write=False
        ) as sb:
            assert (await sb.exec(["cat", "/built"])).stdout == "built-by-b\n"
        images.remove(name)
    finally:
        for tag in tags.values():
            subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, check=False)


def test_a_test_daemons_close_takes_the_docker_images_built_in_its_home(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test daemon's close removes its home and, with it, what hutch built
    there: the Docker images tagged for that home too, which outlived it
    before (three a run of the README's blocks, about 270 MB each)."""
    from tests.daemon_fixture import DaemonProcess, images_of

    daemon = DaemonProcess()
    monkeypatch.setenv("HUTCH_HOME", daemon.data_dir)
    name = f"hutch-test-img-{secrets.token_hex(3)}"
    dockerfile = os.path.join(str(tmp_path), "Dockerfile")
    with open(dockerfile, "w") as fh:
        fh.write(f"FROM {TEST_IMAGE}\nRUN echo {secrets.token_hex(8)} > /built\n")
    tag = images.docker_tag(name)
    try:
        images.build(name, dockerfile=dockerfile)
        assert _docker_has(tag) and images_of(daemon.data_dir) == [f"{tag}:latest"]
        daemon.close()
        assert not _docker_has(tag)
        assert not os.path.exists(daemon.data_dir)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, check=False)
