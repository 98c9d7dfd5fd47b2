"""``hutch image build | ls | rm``: environments built once, used by name by
the docker and bubblewrap providers (see :mod:`hutch.images`). They act on
this host's hutch home directly, as ``docker build`` acts on its engine."""

from __future__ import annotations

import time

import click

from ._common import console, err_console, group, reports_errors
from ._listing import Column, print_json, print_table

image = group("image",
              help="Images: environments built once, used by name by docker and bubblewrap.")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n //= 1024
    return f"{n} GiB"


@image.command("build")
@click.argument("name")
@click.option("--file", "-f", help="A Dockerfile to build.")
@click.option("--context", help="The Dockerfile's build context.")
@click.option("--packages", "-p",
              help="Debian packages to install on a bookworm minbase, comma separated.")
@click.option("--rebuild/--no-rebuild", help="Build again even if it was built.")
@click.option("--sudo-user", metavar="USER",
              help="Also make USER (uid 1000) with passwordless sudo: E2B's templates' shape "
              "is --sudo-user user.")
def build(name: str, file: str | None, context: str | None, packages: str | None,
          rebuild: bool, sudo_user: str | None) -> None:
    """Build image NAME from a Dockerfile or a list of Debian packages."""
    from .. import images

    wanted = [p.strip() for p in (packages or "").split(",") if p.strip()]
    started = time.monotonic()

    def progress(line: str) -> None:
        err_console.print(f"{time.monotonic() - started:6.1f}s {line}",
                          highlight=False, markup=False)

    @reports_errors
    def run() -> None:
        info = images.build(
            name, dockerfile=file, context=context, packages=wanted, progress=progress,
            rebuild=rebuild, sudo_user=sudo_user,
        )
        console.print(f"{info.name}  {_size(info.size_bytes)}  ({info.source})")

    run()


IMAGE_COLUMNS = (
    Column("NAME"), Column("SOURCE", cut=True, drop=2), Column("SIZE"),
    Column("BUILT", drop=1), Column("USED BY", cut=True),
)


@image.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON.")
def list_(as_json: bool) -> None:
    """Images with their sizes and the sandboxes that use them, one line each."""
    from .. import images

    found = images.list_images()
    if as_json:
        print_json([info.as_dict() for info in found])
        return
    print_table(IMAGE_COLUMNS, [
        [info.name, info.source, _size(info.size_bytes),
         time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created_unix)),
         ", ".join(info.users) or "-"]
        for info in found
    ])


@image.command("rm")
@click.argument("name")
@click.option("--force/--no-force", help="Remove it even while sandboxes use it.")
def remove(name: str, force: bool) -> None:
    """Remove image NAME (refused while sandboxes use it, unless forced)."""
    from .. import images

    @reports_errors
    def run() -> None:
        images.remove(name, force=force)
        console.print(f"{name} removed")

    run()
