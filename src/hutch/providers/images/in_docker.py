"""An image's Docker side, through the one Engine client: build from a
Dockerfile, import a root file system, export an image's file system, read
its labels, find the containers standing on it, remove it.

File systems travel as tar streams: unpacked by :func:`hutch._tar.unpack_rootfs`
as ``tar -x --numeric-owner`` did as root (numeric owners, devices, hard
links, modes and times kept), never outside its directory, and packed for an
import by GNU tar, which is ten times faster at it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..._errors import InvalidArgument, ProviderError
from ..._tar import unpack_rootfs
from .._docker_engine import engine, engine_available, explanation

Progress = Callable[[str], None]

#: Lines of a failed step's output kept in its error.
_TAIL = 20
#: The most of a packed file system sent to the Engine at once.
_PIECE = 1 << 20


def available() -> bool:
    """Whether a Docker Engine answers here."""
    return engine_available()


def image_labels(name: str) -> dict[str, str] | None:
    """The labels of Docker image ``name``; None where the Engine has no such
    image (or cannot be asked)."""
    import docker.errors

    try:
        details = engine().inspect_image(name)
    except docker.errors.DockerException:
        return None
    return dict((details.get("Config") or {}).get("Labels") or {})


def image_id(name: str) -> str | None:
    """The id of Docker image ``name``, None where the Engine has none."""
    import docker.errors

    try:
        return str(engine().inspect_image(name)["Id"])
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as exc:  # a name the Engine refuses (upper case, ...)
        raise InvalidArgument(f"image {name!r}: {explanation(exc)}") from None
    except docker.errors.DockerException as exc:
        raise ProviderError(f"image {name!r}: the Docker Engine: {exc}") from None


def containers_from(tag: str) -> list[str]:
    """The names of the containers (running or not) made from image ``tag``."""
    listed = engine().containers(all=True, filters={"ancestor": tag})
    return [str(c["Names"][0]).lstrip("/") for c in listed if c.get("Names")]


def tags_labelled(label: str) -> set[str]:
    """Every tag of the images carrying ``label`` (``key=value``), also
    without its ``:latest``: one call for a listing of many images."""
    tags = set()
    for image in engine().images(filters={"label": label}):
        for tag in image.get("RepoTags") or []:
            tags.add(str(tag))
            tags.add(str(tag).removesuffix(":latest"))
    return tags


def remove_image(tag: str) -> None:
    """Remove Docker image ``tag`` (forced), if it is there."""
    import docker.errors

    try:
        engine().remove_image(tag, force=True)
    except docker.errors.DockerException:
        pass


class _Tail:
    """Passes a step's output lines on as progress, keeping the last few for
    its error."""

    def __init__(self, what: str, progress: Progress) -> None:
        self.what = what
        self.progress = progress
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        for line in text.splitlines():
            line = line.rstrip()
            if line:
                self.lines = [*self.lines[-(_TAIL - 1):], line]
                self.progress(line)

    def failed(self, reason: str = "") -> ProviderError:
        lines = [*self.lines, reason] if reason else self.lines
        return ProviderError(f"{self.what} failed:\n" + "\n".join(lines[-_TAIL:]))


def build_image(
    tag: str, dockerfile: str, context: str, labels: dict[str, str], progress: Progress
) -> None:
    """Build ``dockerfile`` in ``context`` as ``tag`` with the classic builder
    (as ``DOCKER_BUILDKIT=0 docker build --rm``), its output as progress."""
    import docker.errors

    tail = _Tail("docker build", progress)
    try:
        events = engine().build(
            path=context, dockerfile=os.path.abspath(dockerfile), tag=tag, labels=labels,
            rm=True, decode=True,
        )
        for event in events:
            if event.get("error"):
                raise tail.failed(str(event["error"]).strip())
            if "stream" in event:
                tail.say(str(event["stream"]))
            elif event.get("status") and not event.get("progressDetail"):
                where = event.get("id")
                tail.say(f"{where}: {event['status']}" if where else str(event["status"]))
    except (docker.errors.DockerException, OSError) as exc:
        if isinstance(exc, ProviderError):
            raise
        raise tail.failed(explanation(exc)) from None


def import_rootfs(rootfs: str, tag: str, labels: dict[str, str], progress: Progress) -> None:
    """Import the directory ``rootfs`` as Docker image ``tag`` (as
    ``tar -C rootfs -c . | docker import --change LABEL... - tag``).

    The stream is packed by GNU tar: :mod:`tarfile` packed the same archive
    ten times slower (2.4 s of CPU against 0.23 s for a 190 MB Debian root)."""
    import docker.errors

    tail = _Tail("docker import", progress)
    repository, _, version = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "")
    changes = [f"LABEL {key}={value}" for key, value in labels.items()]
    with tempfile.TemporaryFile() as errors:
        packer = subprocess.Popen(
            ["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE, stderr=errors
        )
        assert packer.stdout is not None
        # A wide pipe, read as it fills: tar packs while the last piece is sent.
        with contextlib.suppress(OSError):
            fcntl.fcntl(packer.stdout.fileno(), fcntl.F_SETPIPE_SZ, _PIECE)
        try:
            with packer.stdout as source:
                answer = engine().import_image_from_stream(
                    iter(lambda: os.read(source.fileno(), _PIECE), b""), repository=repository,
                    tag=version or None, changes=changes,
                )
        except (docker.errors.DockerException, OSError) as exc:
            packer.kill()
            raise tail.failed(explanation(exc)) from None
        finally:
            packer.wait()
        # 1 is a file changed while it was read; 2 a cut archive.
        if packer.returncode not in (0, 1):
            remove_image(tag)  # made from a cut stream
            errors.seek(0)
            tail.say(errors.read().decode(errors="replace"))
            raise tail.failed(f"tar exited with {packer.returncode}")
    for line in str(answer).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("error"):
            raise tail.failed(str(event["error"]))
        if isinstance(event, dict) and event.get("status"):
            tail.say(str(event["status"]))


class _Chunks(io.RawIOBase):
    """A readable file over an iterator of byte chunks (the Engine's stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            chunk = next(self._chunks, b"")
            if not chunk:
                return 0
            self._left = memoryview(chunk)
        count = min(len(buffer), len(self._left))
        buffer[:count] = self._left[:count]
        self._left = self._left[count:]
        return count


def unpack(chunks: Iterable[bytes], into: str) -> None:
    """Unpack a tar stream into the directory ``into`` as ``tar -x
    --numeric-owner`` as root did."""
    with io.BufferedReader(_Chunks(chunks), 1 << 20) as stream:
        unpack_rootfs(stream, into)


def export_rootfs(image: str, into: str) -> None:
    """Unpack Docker image ``image``'s file system into the directory ``into``
    (a container made from it, exported, then removed)."""
    import docker.errors

    api = engine()
    try:
        container = api.create_container(
            image, command=["/bin/true"], labels={"hutch.export": "1"}
        )
    except docker.errors.DockerException as exc:
        raise ProviderError(f"unpacking {image}: {explanation(exc)}") from None
    try:
        unpack(api.export(container["Id"]), into)
    except (docker.errors.DockerException, tarfile.TarError, OSError) as exc:
        raise ProviderError(f"unpacking {image}: {explanation(exc)}") from None
    finally:
        api.remove_container(container["Id"], force=True)
