"""Real PostgreSQL and Redis servers for tests, on 127.0.0.1 at free ports, from Debian's `postgresql` and
`redis-server` packages (the README's test command installs them).

Each server runs from a temporary folder of its own and is stopped (and the folder removed) at the end; it
can be stopped and started again on the same port and data within a test (`stop()`, `start()`), to test what
the server does while it is down. PostgreSQL refuses to run as root: as root, its processes run as the
`postgres` user the Debian package creates. Every wait is for a condition (the server answers), bounded.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}\n{tail}")
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def postgres_bin_dir() -> Path | None:
    """The folder of PostgreSQL's server programs (initdb, postgres): Debian keeps them off the PATH, in
    /usr/lib/postgresql/VERSION/bin; the newest version wins."""
    found = shutil.which("initdb")
    if found and Path(found).resolve().with_name("postgres").exists():
        return Path(found).resolve().parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name)
                  if Path(d).parent.name.isdigit() else 0)
    for d in reversed(dirs):
        if (Path(d) / "initdb").exists() and (Path(d) / "postgres").exists():
            return Path(d)
    return None


def missing_postgres() -> str | None:
    """Why PostgreSQL cannot run here (None: it can)."""
    if postgres_bin_dir() is None:
        return "PostgreSQL's server programs (initdb, postgres) are not installed: apt-get install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run PostgreSQL as"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install 'servelm[postgres]'"
    return None


def missing_redis() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed: apt-get install redis-server"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client is not installed: pip install 'servelm[redis]'"
    return None



def _stop(proc: subprocess.Popen | None, sig: int) -> None:
    """End a service started in its own process group with `sig`; SIGKILL the group if it does not exit."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

class Postgres:
    """A PostgreSQL cluster in a temporary folder; `url(db)` for SQLAlchemy, `create_database()` for a fresh
    database per test. Trust authentication, loopback only, no fsync (a test's data need not survive a power
    cut, only a restart)."""

    user = "servelm"

    def __init__(self) -> None:
        self.bin = postgres_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="servelm-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._as = {}
        if os.geteuid() == 0:  # initdb and postgres refuse root
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust",
                        "-E", "UTF8", "--locale=C", "--no-sync"], check=True, capture_output=True,
                       cwd=self.root, **self._as)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
                 "-k", str(self.root), "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True, **self._as)
        _wait(self.ready, START_TIMEOUT_S, "PostgreSQL to accept connections", self.proc, self.log)

    def ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT): connections are ended, the data stays."""
        _stop(self.proc, signal.SIGINT)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, db: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{db}"

    def create_database(self) -> str:
        """A new empty database; its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


class Redis:
    """A redis-server with no persistence (a restart empties it, as a crashed cache would be)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="servelm-redis-"))
        self.log = self.root / "redis.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--dir", str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)
        _wait(self.ready, START_TIMEOUT_S, "redis-server to answer PING", self.proc, self.log)

    def ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2).ping())
        except redis.RedisError:
            return False

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def need(reason: str | None) -> None:
    """Skip when a service cannot run here, saying why; CI installs both, so there a missing one fails."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (the README's test command installs it)")
    pytest.skip(reason)


def new_database(request, tmp_path, kind: str) -> str:
    """A new, empty control-plane database of `kind` (sqlite | postgresql): its URL."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'control.db'}"
    return request.getfixturevalue("postgres_url")


# for a module whose `database_url` is SQLite unless a test asks for both (its heavier fixtures)
both_databases = pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
