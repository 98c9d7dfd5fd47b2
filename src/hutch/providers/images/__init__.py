"""hutch images: an environment built once, used by name by docker and bubblewrap.

``build(name, dockerfile=...)`` builds it on the Docker Engine (the classic
builder, as ``docker build`` did) and unpacks the result;
``build(name, packages=[...])`` starts from a Debian bookworm minbase root
file system (the tarball ``scripts/ensure-docker.sh`` caches, else
debootstrap) and installs the packages with apt, inside bubblewrap. Either
way the image ends as two things with the same name:

- ``$HUTCH_HOME/images/<name>/rootfs``: the unpacked root file system a
  ``bubblewrap`` sandbox stands on (``image="<name>"``), shared read-only;
- a Docker image (imported from that root file system when it was built
  from packages), which a ``docker`` sandbox runs (``image="<name>"``) when a
  Docker Engine is there. Its tag is scoped to the hutch home
  (``hutch-<home id>/<name>``): Docker's tags are the whole host's, a hutch
  image name is its data directory's, and two homes building one name must
  not replace or remove each other's image.

``ls`` says how big each is and which sandboxes stand on it; ``rm`` refuses
an image in use unless forced.

Every Docker call goes through the one Engine client (:mod:`.in_docker`
over ``providers._docker_engine``); no docker CLI.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._errors import InvalidArgument, InvalidState, NotFound, ProviderError
from ..._faults import fault_point
from ..._liveness import still_running, this_process
from ..._paths import hutch_home
from . import in_docker as docker_side

#: Names Docker takes as a repository (and hutch as a directory).
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}(:[A-Za-z0-9_.-]{1,64})?$")
#: A user name useradd takes (Debian's default NAME_REGEX, no capitals).
_USER = re.compile(r"\A[a-z_][a-z0-9_-]{0,31}\Z")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(=[A-Za-z0-9.+~:-]+)?$")
MINBASE_TAR = os.path.join(
    os.environ.get("HUTCH_CACHE_DIR", "/var/cache/hutch"), "bookworm-minbase.tar"
)
Progress = Callable[[str], None]


def images_home() -> str:
    return os.path.join(hutch_home(), "images")


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidArgument(
            f"image name {name!r} must be lowercase letters, digits, '.', '_' or '-' "
            "(with an optional :tag)"
        )
    return name


def _directory(name: str) -> str:
    return os.path.join(images_home(), _check_name(name).replace(":", "@"))


def docker_tag(name: str) -> str:
    """The Docker tag of this home's hutch image ``name``."""
    home = os.path.realpath(hutch_home()).encode()
    return f"hutch-{hashlib.sha256(home).hexdigest()[:12]}/{_check_name(name)}"


def docker_reference(image: str) -> str:
    """The Docker image a ``docker`` sandbox asking for ``image`` runs: this
    home's hutch image of that name where one was built, else ``image`` as
    Docker knows it."""
    if not _NAME.match(image):
        return image
    try:
        with open(os.path.join(_directory(image), "image.json")) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return image
    # Built before tags were scoped: Docker has it under its bare name.
    return str(data.get("docker_tag") or image) if "docker_tag" in data else image


def hutch_image_rootfs(name: str) -> str | None:
    """The unpacked root file system of hutch image ``name``, if it was built."""
    if not _NAME.match(name):
        return None
    path = os.path.join(_directory(name), "rootfs")
    return path if os.path.isdir(path) else None


@dataclass
class ImageInfo:
    name: str
    source: str
    size_bytes: int
    created_unix: float
    packages: list[str] = field(default_factory=list)
    #: Sandboxes standing on it: bubblewrap sandbox ids, docker container names.
    users: list[str] = field(default_factory=list)
    #: Its Docker image's tag, where it has one.
    docker_tag: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "source": self.source, "size_bytes": self.size_bytes,
            "created_unix": self.created_unix, "packages": self.packages, "users": self.users,
            "docker_tag": self.docker_tag,
        }


def _run(argv: Sequence[str], what: str, progress: Progress, **kwargs: Any) -> None:
    """Run a build step, passing its output lines on as progress."""
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        if line:
            tail = [*tail[-19:], line]
            progress(line)
    if proc.wait() != 0:
        raise ProviderError(f"{what} failed:\n" + "\n".join(tail))


def _disk_usage(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _docker_available() -> bool:
    return docker_side.available()


_LABEL = "hutch.image"


def _docker_image_owner(name: str) -> str | None:
    """``hutch`` if Docker has image ``name`` made by hutch, ``other`` if it has
    one made otherwise, None if it has none (or there is no engine)."""
    if not _docker_available():
        return None
    labels = docker_side.image_labels(name)
    if labels is None:
        return None
    return "hutch" if labels.get(_LABEL) == "1" else "other"


def build(
    name: str,
    *,
    dockerfile: str | None = None,
    context: str | None = None,
    packages: Sequence[str] = (),
    progress: Progress = lambda _line: None,
    rebuild: bool = False,
    sudo_user: str | None = None,
) -> ImageInfo:
    """Build image ``name`` once; an image already built is reused unless ``rebuild``.

    ``sudo_user``: also make that user (uid 1000, a home, bash) with
    passwordless sudo, the shape of E2B's templates (whose user is ``user``).
    """
    directory = _directory(name)
    if (dockerfile is None) == (not packages):
        raise InvalidArgument("build an image from a Dockerfile or from packages, not both")
    if sudo_user is not None:
        if not _USER.match(sudo_user):
            raise InvalidArgument(f"{sudo_user!r} is not a user name (lowercase, a-z0-9_-)")
        if dockerfile is not None:
            raise InvalidArgument(
                "a Dockerfile makes its own users; for a user with passwordless sudo add:\n"
                f"RUN apt-get update && apt-get install -y sudo && useradd -m -s /bin/bash "
                f"-u 1000 {sudo_user} && echo '{sudo_user} ALL=(ALL) NOPASSWD:ALL' > "
                f"/etc/sudoers.d/{sudo_user} && chmod 0440 /etc/sudoers.d/{sudo_user}"
            )
        packages = [*packages, "sudo"] if "sudo" not in packages else list(packages)
    for package in packages:
        if not _PACKAGE.match(package):
            raise InvalidArgument(f"{package!r} is not a Debian package name")
    if os.path.isdir(os.path.join(directory, "rootfs")) and not rebuild:
        progress(f"image {name} is already built; reusing it (rebuild to make it again)")
        return inspect(name)
    if _docker_image_owner(name) == "other":
        raise InvalidArgument(
            f"Docker already has an image {name} that hutch did not build; choose another name"
        )
    os.makedirs(images_home(), exist_ok=True)
    _remove_dead_builds()
    pid, start = this_process()
    # Named by its builder: a build whose process died is found and removed.
    work = tempfile.mkdtemp(prefix=f".build-{pid}-{start}-", dir=images_home())
    rootfs = os.path.join(work, "rootfs")
    tag = docker_tag(name)
    try:
        if dockerfile is not None:
            source = "dockerfile"
            _from_dockerfile(tag, dockerfile, context, rootfs, progress)
            in_docker = True
        else:
            source = "packages"
            _from_packages(list(packages), rootfs, progress)
            if sudo_user is not None:
                _add_sudo_user(rootfs, sudo_user, progress)
            in_docker = _docker_available()
            if in_docker:
                progress(f"importing {name} into Docker")
                docker_side.import_rootfs(rootfs, tag, {_LABEL: "1"}, progress)
        fault_point("image-build.unpacked")
        info = ImageInfo(name, source, _disk_usage(rootfs), time.time(), list(packages),
                         docker_tag=tag if in_docker else None)
        with open(os.path.join(work, "image.json"), "w") as fh:
            json.dump(info.as_dict(), fh)
        fault_point("image-build.described")
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.rename(work, directory)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    progress(f"image {name} built: {info.size_bytes // (1 << 20)} MiB")
    return info


def _remove_dead_builds() -> None:
    """Remove what builds whose process died (killed part-way) left."""
    for entry in os.listdir(images_home()):
        if not entry.startswith(".build-"):
            continue
        try:
            pid, start = (int(x) for x in entry.split("-")[1:3])
        except ValueError:
            continue  # not one of ours (or of a hutch before builds were named)
        if not still_running(pid, start):
            shutil.rmtree(os.path.join(images_home(), entry), ignore_errors=True)


def _from_dockerfile(
    tag: str, dockerfile: str, context: str | None, rootfs: str, progress: Progress
) -> None:
    if not os.path.isfile(dockerfile):
        raise NotFound(f"no Dockerfile at {dockerfile}")
    if not _docker_available():
        raise ProviderError("building from a Dockerfile needs a Docker Engine")
    context = context or os.path.dirname(os.path.abspath(dockerfile))
    progress(f"docker build -t {tag}")
    docker_side.build_image(tag, dockerfile, context, {_LABEL: "1"}, progress)
    progress("unpacking its file system")
    os.makedirs(rootfs)
    docker_side.export_rootfs(tag, rootfs)


def _from_packages(packages: list[str], rootfs: str, progress: Progress) -> None:
    os.makedirs(rootfs)
    if os.path.isfile(MINBASE_TAR):
        progress(f"unpacking the bookworm minbase ({MINBASE_TAR})")
        _run(["tar", "-x", "--numeric-owner", "-f", MINBASE_TAR, "-C", rootfs], "tar", progress)
    elif shutil.which("debootstrap"):
        progress("debootstrap --variant=minbase bookworm")
        os.rmdir(rootfs)
        _run(["debootstrap", "--variant=minbase", "bookworm", rootfs], "debootstrap", progress)
    else:
        raise ProviderError(
            f"no bookworm base: neither {MINBASE_TAR} (scripts/ensure-docker.sh caches it) "
            "nor debootstrap is on this host"
        )
    inside = _apt_sandbox(rootfs)
    progress("apt-get update")
    # A source that fails to update fails the build (apt's default only warns).
    _run([*inside, "apt-get", "update", "--error-on=any"], "apt-get update", progress)
    progress(f"apt-get install {' '.join(packages)}")
    _run([*inside, "apt-get", "install", "-y", "--no-install-recommends", *packages],
         "apt-get install", progress)
    _run([*inside, "apt-get", "clean"], "apt-get clean", progress)
    shutil.rmtree(os.path.join(rootfs, "var/lib/apt/lists"), ignore_errors=True)
    os.makedirs(os.path.join(rootfs, "var/lib/apt/lists/partial"), exist_ok=True)


def _add_sudo_user(rootfs: str, user: str, progress: Progress) -> None:
    """``user`` (uid 1000, a home, bash) with passwordless sudo, in ``rootfs``."""
    progress(f"adding user {user} with passwordless sudo")
    _run([*_apt_sandbox(rootfs), "useradd", "--create-home", "--shell", "/bin/bash",
          "--uid", "1000", "--user-group", user], "useradd", progress)
    sudoers = os.path.join(rootfs, "etc", "sudoers.d", user)
    with open(sudoers, "w") as fh:
        fh.write(f"{user} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(sudoers, 0o440)


def _apt_sandbox(rootfs: str) -> list[str]:
    """The argv prefix that runs a command on ``rootfs`` for an image build:
    apt inside bubblewrap, with the host's network and resolver and root's
    capabilities (package scripts chown); the build is the operator's."""
    resolv = os.path.realpath("/etc/resolv.conf")
    return [
        "bwrap", "--bind", rootfs, "/", "--proc", "/proc", "--dev", "/dev",
        # /tmp as on any Debian system (1777): apt-get update hands its
        # downloads to the unprivileged _apt user, which writes there; under a
        # 0755 /tmp every source failed and the build went on with the base's
        # stale package lists.
        "--perms", "1777", "--tmpfs", "/tmp", "--ro-bind", resolv, "/etc/resolv.conf",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
        "--setenv", "DEBIAN_FRONTEND", "noninteractive",
        "--setenv", "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--",
    ]


def _bubblewrap_lowers() -> dict[str, list[str]]:
    """Each bubblewrap sandbox's lower layers (root file systems), by sandbox id."""
    found: dict[str, list[str]] = {}
    sandboxes = os.path.join(hutch_home(), "bubblewrap", "sandboxes")
    with contextlib.suppress(FileNotFoundError):
        for sandbox in sorted(os.listdir(sandboxes)):
            try:
                with open(os.path.join(sandboxes, sandbox, "lowers.json")) as fh:
                    found[sandbox] = [str(lower) for lower in json.load(fh)]
            except (OSError, ValueError, TypeError):
                continue
    return found


def _docker_tags() -> set[str] | None:
    """The tags of the images hutch built that Docker has (None: no Engine)."""
    if not _docker_available():
        return None
    return docker_side.tags_labelled(f"{_LABEL}=1")


def _users(rootfs: str, tag: str | None, lowers: dict[str, list[str]],
           docker_tags: set[str] | None) -> list[str]:
    users = [f"bubblewrap:{sandbox}" for sandbox, found in lowers.items() if rootfs in found]
    # The Engine is asked only about images it has: a listing of many images
    # costs one call for all of them, and one more for each that Docker has.
    if tag is not None and docker_tags is not None and tag in docker_tags:
        users.extend(f"docker:{n}" for n in docker_side.containers_from(tag))
    return users


def inspect(name: str) -> ImageInfo:
    return _inspect(name, _bubblewrap_lowers(), _docker_tags())


def _inspect(name: str, lowers: dict[str, list[str]], docker_tags: set[str] | None) -> ImageInfo:
    directory = _directory(name)
    try:
        with open(os.path.join(directory, "image.json")) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        raise NotFound(f"no hutch image {name!r} (hutch image build {name} ...)") from None
    # Built before tags were scoped: Docker has it under its bare name.
    tag = data.get("docker_tag") if "docker_tag" in data else name
    return ImageInfo(
        str(data["name"]), str(data["source"]), int(data["size_bytes"]),
        float(data["created_unix"]), [str(p) for p in data.get("packages") or []],
        _users(os.path.join(directory, "rootfs"), tag and str(tag), lowers, docker_tags),
        docker_tag=tag and str(tag),
    )


def list_images() -> list[ImageInfo]:
    try:
        names = sorted(os.listdir(images_home()))
    except FileNotFoundError:
        return []
    lowers, docker_tags = _bubblewrap_lowers(), _docker_tags()
    out = []
    for entry in names:
        if entry.startswith("."):
            continue
        with contextlib.suppress(NotFound, InvalidArgument):
            out.append(_inspect(entry.replace("@", ":"), lowers, docker_tags))
    return out


def remove(name: str, *, force: bool = False) -> None:
    """Remove image ``name`` (its root file system and its Docker image)."""
    info = inspect(name)
    if info.users and not force:
        raise InvalidState(
            f"image {name} is in use by {', '.join(info.users)}; end those first "
            "(or force, which breaks them)"
        )
    shutil.rmtree(_directory(name), ignore_errors=True)
    if info.docker_tag is not None and _docker_image_owner(info.docker_tag) == "hutch":
        docker_side.remove_image(info.docker_tag)
