"""A PostgreSQL server for the tests, started from Debian's package
(`/usr/lib/postgresql/*/bin`): one per test session, in a folder of its own,
listening on a Unix socket there and on a loopback port. As root (CI) its
programs run as the `postgres` user, since PostgreSQL refuses root. When it
cannot start, the tests that need it fail: they never skip."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="session-runtime-pg-"))
        self.data, self.port = self.root / "data", _free_port()
        self._as = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.start()

    def start(self) -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60", "start",
                  "-o", f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 -c max_connections=200")

    def crash(self) -> None:
        """Stop at once, as a crash would (every connection dropped, no
        checkpoint); `start` brings it back on the same port with its data."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = (self.root / "log").read_text()[-2000:] if (self.root / "log").exists() else ""
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr[-2000:]}\n{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self.crash()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
