"""A throw-away PostgreSQL cluster for tests: `initdb` into a temp directory, `pg_ctl start` on a
free port of 127.0.0.1 with trust auth, and `pg_ctl stop -m immediate` plus removal at the end.

As root the server binaries refuse to run, so they run as the `postgres` OS user, in a directory
it owns. Durability is switched off (`fsync=off`): the cluster lives for one test session.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

_NO_BINARIES = "no PostgreSQL binaries (initdb/pg_ctl) found: apt-get install postgresql"
_STARTUP_TIMEOUT_S = 30


class PostgresUnavailable(Exception):
    """The binaries or the OS user needed to run a cluster are missing (tests should skip)."""


def find_bindir() -> Path:
    """The directory holding both `initdb` and `pg_ctl`: from PATH, else the newest
    /usr/lib/postgresql/*/bin."""
    candidates = [Path(p).resolve().parent for p in (shutil.which("initdb"), shutil.which("pg_ctl")) if p]
    candidates += sorted(
        (Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0,
        reverse=True,
    )
    for d in candidates:
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    raise PostgresUnavailable(_NO_BINARIES)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Cluster:
    def __init__(self, bindir: Path, root: Path, as_postgres: bool) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.as_postgres = as_postgres

    def run(self, tool: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / tool), *args]
        if self.as_postgres:
            if shutil.which("runuser"):
                cmd = ["runuser", "-u", "postgres", "--", *cmd]
            else:
                cmd = ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        return subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout_s)

    def check(self, tool: str, *args: str, timeout_s: float = 60) -> None:
        proc = self.run(tool, *args, timeout_s=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{tool} {shlex.join(args)} failed with exit code {proc.returncode}\n"
                f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n--- server log\n{self.server_log()}"
            )

    def server_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-8000:]
        except OSError:
            return "(no server log)"

    def start(self, port: int) -> None:
        opts = (
            f"-p {port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self.check("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w",
                   "-t", str(_STARTUP_TIMEOUT_S), "-o", opts, timeout_s=_STARTUP_TIMEOUT_S + 10)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", timeout_s=30)


def _wait_ready(admin_url: str, cluster: _Cluster) -> None:
    import psycopg

    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while True:
        try:
            with psycopg.connect(admin_url, connect_timeout=2):
                return
        except psycopg.OperationalError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not accept connections: {e}\n--- server log\n"
                                   f"{cluster.server_log()}") from e
            time.sleep(0.1)


def create_database(url: str, name: str | None = None) -> str:
    """Create a database on the server of `url` (a `postgresql+psycopg://` URL); return its URL."""
    import psycopg

    name = name or f"t_{uuid.uuid4().hex[:12]}"
    base, _, _ = url.rpartition("/")
    with psycopg.connect(_libpq(f"{base}/postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"


def drop_database(url: str) -> None:
    import psycopg

    base, _, name = url.rpartition("/")
    with psycopg.connect(_libpq(f"{base}/postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextlib.contextmanager
def postgres_cluster(dbname: str = "agentrt_test") -> Iterator[str]:
    """Run a cluster for the duration; yield `postgresql+psycopg://postgres@127.0.0.1:PORT/dbname`.

    Raises PostgresUnavailable when it cannot be tried, RuntimeError (with the server log) when
    it fails to start.
    """
    bindir = find_bindir()
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise PostgresUnavailable("psycopg is not installed: pip install 'psycopg[binary]'") from e
    as_postgres = os.geteuid() == 0
    if as_postgres:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError as e:
            raise PostgresUnavailable("running as root and there is no `postgres` OS user to run the server") from e
    # directly under /tmp: postgres must reach it, and a unix socket path must stay short
    cluster = _Cluster(bindir, Path(tempfile.mkdtemp(prefix="agentrt-pg-")), as_postgres)
    try:
        if as_postgres:
            os.chown(cluster.root, pw.pw_uid, pw.pw_gid)
        cluster.check("initdb", "-D", str(cluster.data), "--auth=trust", "-U", "postgres",
                      "-E", "UTF8", "--no-locale", "--no-sync")
        for attempt in range(3):  # the free port can be taken before the server binds it
            port = _free_port()
            try:
                cluster.start(port)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        admin_url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        _wait_ready(admin_url, cluster)
        yield create_database(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", dbname)
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
