"""A throwaway PostgreSQL cluster for tests: Debian's server, started by the
test run itself on a private socket directory (no TCP port), stopped and
removed at the end. Each test gets a database of its own in it.

The server refuses to run as root, so the cluster belongs to the
``postgres`` user the Debian package makes. It starts in about a second;
``fsync=off`` because a test's durability question is whether hutch
committed, not whether this machine's disk kept it (the server is never
killed under a test).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid

import pytest

PORT = 5432  # only names the socket file: the server listens on no TCP address


def server_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else None


def available() -> bool:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return False
    return server_bin("initdb") is not None and server_bin("pg_ctl") is not None


class PostgresCluster:
    def __init__(self) -> None:
        initdb, pg_ctl = server_bin("initdb"), server_bin("pg_ctl")
        if initdb is None or pg_ctl is None or not available():
            pytest.fail("PostgreSQL's server is not installed (scripts/test.sh installs it)")
        self._pg_ctl = pg_ctl
        self.root = tempfile.mkdtemp(prefix="hutch-pg-")
        account = pwd.getpwnam("postgres")
        os.chown(self.root, account.pw_uid, account.pw_gid)
        self.data = os.path.join(self.root, "data")
        self._as_postgres([initdb, "-D", self.data, "-U", "postgres", "--auth=trust",
                           "-E", "UTF8", "--no-sync", "--no-instructions"])
        self._as_postgres([
            pg_ctl, "-D", self.data, "-w", "-t", "60", "-l", os.path.join(self.root, "log"),
            "-o", f"-k {self.root} -p {PORT} -c listen_addresses= -c fsync=off "
                  "-c max_connections=300",
            "start",
        ])

    @staticmethod
    def _as_postgres(argv: list[str]) -> None:
        done = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True,
                              text=True, check=False, cwd="/")
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stdout}{done.stderr}")

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host={self.root} port={PORT} user=postgres dbname={dbname}"

    def new_database(self) -> str:
        """A new empty database's conninfo (a libpq keyword string)."""
        import psycopg

        name = f"hutch_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
        return self.conninfo(name)

    def url(self, conninfo: str) -> str:
        """``conninfo`` as the ``postgresql://`` URL a user gives ``--store``."""
        dbname = conninfo.rsplit("dbname=", 1)[1]
        return f"postgresql://postgres@/{dbname}?host={self.root}&port={PORT}"

    def close(self) -> None:
        try:
            self._as_postgres([self._pg_ctl, "-D", self.data, "-m", "immediate", "-w", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
