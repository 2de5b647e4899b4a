"""PostgreSQL and Redis for a distributed test Airflow: throwaway servers, never the system services.

Each server runs from the Debian package's binaries (``postgresql``: ``initdb`` and ``postgres`` under
``/usr/lib/postgresql/<version>/bin``; ``redis-server``) as a child process of the caller, in its own
process group, with its data in a fresh directory and listening on a free loopback port. As root they
run as ``nobody``: PostgreSQL refuses to run as root, and a test server needs no privilege. ``stop()``
ends them (also from :mod:`atexit`) and removes the directory.

With them, ``AirflowStack(home, dags, sql_alchemy_conn=postgres.url, broker_url=redis.url,
celery_workers=2, triggerers=2)`` is the distributed stack; on top of the SQLite stack's settings
(:mod:`devstack.stack`) it sets:

``[database] sql_alchemy_conn = postgresql+psycopg2://...``
    The metadata DB every process shares (Airflow derives the async engine's ``postgresql+asyncpg``
    URL from it, so asyncpg must be installed too).
``[core] executor = CeleryExecutor``, ``[celery] broker_url = redis://...``,
``[celery] result_backend = db+postgresql+psycopg2://...``
    The scheduler queues each task in Redis; any Celery worker (``airflow celery worker``, one
    process group each, ``--celery-hostname worker<N>@%h`` so two on one machine stay distinct)
    takes it and runs it; the task's state comes back through the metadata DB.
``[celery] worker_concurrency``
    Task processes per worker (``parallelism`` split over the workers).
``[celery] worker_prefetch_multiplier = 1``
    A worker takes one task per free slot, so a burst (every rank resuming at once) spreads over both
    workers instead of queueing behind one.
``[triggerer] triggerer_health_check_threshold = 60`` (Airflow's default: 30 s)
    A triggerer whose heartbeat is older than this is dead to the others, which then adopt its
    triggers. A live triggerer's heartbeat stalls while its main loop loads a burst of
    start-from-trigger tasks (it deserializes the DAG for each: 12-15 s for the nine example DAGs at
    once on 2 cores, 45-51 s when the machine's load average was 45). Past the threshold the other
    triggerer adopts the stalled one's triggers, and Airflow 3.3.2 then cancels the stalled copies
    as if a user had acted on the tasks (``on_kill``, which cancels a gang): a move must come from a
    dead triggerer only, so the threshold is raised (10 s made it happen on every run).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from devstack.stack import StackError, free_port, group_members, signal_group

#: the unprivileged user the servers run as when the caller is root
SERVICE_USER = "nobody"


def _postgres_bin(name: str) -> str:
    """``initdb`` / ``postgres`` of the newest PostgreSQL the Debian package installed (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
        key=lambda p: int(p.parent.parent.name),
        reverse=True,
    )
    if not versions:
        raise StackError(
            f"{name} not found (neither on PATH nor in /usr/lib/postgresql/*/bin): install the Debian package "
            "postgresql (`make system-deps` does, as root)"
        )
    return str(versions[0])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Server:
    """A server process in a temp dir owned by the user it runs as; a context manager."""

    name = "server"

    def __init__(self, *, ready_timeout: float = 60.0) -> None:
        self.port = 0
        self.ready_timeout = ready_timeout
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._uid: int | None = None
        self._gid: int | None = None
        if os.geteuid() == 0:
            user = pwd.getpwnam(SERVICE_USER)
            self._uid, self._gid = user.pw_uid, user.pw_gid

    @property
    def log(self) -> Path:
        assert self.dir is not None
        return self.dir / f"{self.name}.log"

    def _make_dir(self) -> Path:
        self.dir = Path(tempfile.mkdtemp(prefix=f"sky-{self.name}-"))
        if self._uid is not None and self._gid is not None:
            os.chown(self.dir, self._uid, self._gid)
        return self.dir

    def _run(self, cmd: list[str], timeout: float = 120.0) -> None:
        """A setup command as the service user; its output goes to the server's log."""
        with open(self.log, "ab") as log:
            res = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                **self._as(),
            )
        if res.returncode != 0:
            raise StackError(f"{' '.join(cmd)} failed ({res.returncode}):\n{_tail(self.log)}")

    def _as(self) -> dict[str, Any]:
        assert self.dir is not None
        kw: dict[str, Any] = {
            "cwd": self.dir,
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"},
        }
        if self._uid is not None:
            kw.update(user=self._uid, group=self._gid, extra_groups=[])
        return kw

    def _spawn(self, cmd: list[str]) -> None:
        log: IO[bytes] = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as(),
            )
        finally:
            log.close()

    def _wait_port(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with code {self.proc.returncode}:\n{_tail(self.log)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.name} not listening on 127.0.0.1:{self.port} after {self.ready_timeout}s"
                )
            time.sleep(0.1)

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self, grace: float = 10.0) -> None:
        """The shutdown signal, SIGKILL after ``grace``; then the data directory goes."""
        proc, self.proc = self.proc, None
        if proc is not None:
            signal_group(proc, self._stop_signal)
            deadline = time.monotonic() + grace
            while group_members(proc.pid) and time.monotonic() < deadline:
                proc.poll()
                time.sleep(0.1)
            signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        atexit.unregister(self.stop)

    _stop_signal = signal.SIGTERM

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Any:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PostgresServer(_Server):
    """``initdb`` + ``postgres`` on a free loopback port; the database ``airflow`` for user ``airflow``.

    Trust authentication on loopback (a throwaway test server). ``fsync = off``: a crash may lose the
    data, which a test server never keeps. ``max_connections = 300``: every Airflow process (scheduler,
    api-server, dag-processor, triggerers, Celery workers and their pool processes) holds a pool.
    """

    name = "postgres"
    _stop_signal = signal.SIGINT  # "fast" shutdown: disconnect the clients, stop at once

    def start(self) -> PostgresServer:
        home = self._make_dir()
        atexit.register(self.stop)
        self.port = free_port()
        data, sockets = home / "data", home / "sockets"
        sockets.mkdir()
        if self._uid is not None and self._gid is not None:
            os.chown(sockets, self._uid, self._gid)
        self._run(
            [
                _postgres_bin("initdb"),
                "-D",
                str(data),
                "-U",
                "airflow",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        self._spawn(
            [
                _postgres_bin("postgres"),
                "-D", str(data),
                "-p", str(self.port),
                "-k", str(sockets),
                "-c", "listen_addresses=127.0.0.1",
                "-c", "fsync=off",
                "-c", "synchronous_commit=off",
                "-c", "full_page_writes=off",
                "-c", "max_connections=300",
                "-c", "log_lock_waits=on",  # a lock held for over deadlock_timeout (1 s) is logged
                "-c", "log_min_duration_statement=5000",  # and so is any statement slower than 5 s
            ]
        )  # fmt: skip
        self._wait_port()
        self._create_database("airflow")
        return self

    def _create_database(self, name: str) -> None:
        import psycopg2

        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="airflow", dbname="postgres")
                break
            except psycopg2.OperationalError as exc:  # "the database system is starting up"
                if time.monotonic() > deadline:
                    raise StackError(f"postgres not answering: {exc}") from exc
                time.sleep(0.2)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``airflow`` database (psycopg2)."""
        return f"postgresql+psycopg2://airflow@127.0.0.1:{self.port}/airflow"


class RedisServer(_Server):
    """``redis-server`` on a free loopback port, no persistence (``save ""``, no AOF): a Celery broker."""

    name = "redis"

    def start(self) -> RedisServer:
        home = self._make_dir()
        atexit.register(self.stop)
        self.port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise StackError(
                "redis-server not found: install the Debian package redis-server (`make system-deps`)"
            )
        self._spawn(
            [
                binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(home),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--protected-mode", "yes",
            ]
        )  # fmt: skip
        self._wait_port()
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"
