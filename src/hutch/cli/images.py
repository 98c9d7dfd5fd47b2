"""``hutch image build | ls | rm``: environments built once, used by name by
the docker and bubblewrap providers (see :mod:`hutch.images`). They act on
this host's hutch home directly, as ``docker build`` acts on its engine."""

from __future__ import annotations

import time

import typer

from ._common import console, err_console, reports_errors
from ._listing import Column, print_json, print_table

image_app = typer.Typer(
    help="Images: environments built once, used by name by docker and bubblewrap.",
    no_args_is_help=True,
)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n //= 1024
    return f"{n} GiB"


@image_app.command("build")
def build(
    name: str,
    file: str | None = typer.Option(None, "--file", "-f", help="A Dockerfile to build."),
    context: str | None = typer.Option(None, help="The Dockerfile's build context."),
    packages: str | None = typer.Option(
        None, "--packages", "-p",
        help="Debian packages to install on a bookworm minbase, comma separated.",
    ),
    rebuild: bool = typer.Option(False, help="Build again even if it was built."),
    sudo_user: str | None = typer.Option(
        None, "--sudo-user", metavar="USER",
        help="Also make USER (uid 1000) with passwordless sudo: E2B's templates' shape "
        "is --sudo-user user.",
    ),
) -> None:
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


@image_app.command("ls")
def list_(
    as_json: bool = typer.Option(False, "--json", help="Print them as JSON."),
) -> None:
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


@image_app.command("rm")
def remove(
    name: str,
    force: bool = typer.Option(False, help="Remove it even while sandboxes use it."),
) -> None:
    """Remove image NAME (refused while sandboxes use it, unless forced)."""
    from .. import images

    @reports_errors
    def run() -> None:
        images.remove(name, force=force)
        console.print(f"{name} removed")

    run()
