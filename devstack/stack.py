"""A real Airflow on this machine: api-server, scheduler, dag-processor and triggerer as subprocesses.

:class:`AirflowStack` runs the ``airflow`` CLI (``db migrate``, then the four services, each in its own
process group, logging to ``<home>/logs/<service>.log``) and reads every state back the way a user
would: through the public REST API v2 (``/api/v2``) of the api-server it started. Airflow itself is
never imported here, so the caller's process keeps whatever Airflow config it had.

Why each setting exists (all passed as ``AIRFLOW__SECTION__KEY`` environment variables, so every
process, including the LocalExecutor's task processes, sees the same config; ``airflow.cfg`` in the
home is whatever ``db migrate`` writes and is overridden by these):

``AIRFLOW_HOME``, ``[database] sql_alchemy_conn``
    A throwaway home with a SQLite DB in it: nothing on the machine is shared with another stack.
``[core] executor = LocalExecutor``, ``[core] parallelism = 16``
    Real task processes on this machine. A gang of up to 8 ranks plus the gang sensor, the job,
    cluster and teardown tasks of two concurrent runs must fit: a deferred task frees its slot, but
    every rank resumes in a worker at about the same moment when the gang ends.
    ``[core] max_active_tasks_per_dag = 16`` keeps the per-DAG limit from being the bottleneck.
``[core] load_examples = False``
    Only the DAGs of ``dags_folder`` get parsed (parsing Airflow's ~80 examples costs minutes of CPU).
``[api] host/port``, ``[api] base_url``, ``[core] execution_api_server_url``
    The api-server listens on a free loopback port; the LocalExecutor's task processes reach the
    Execution API through ``http://127.0.0.1:<port>/execution/`` (the default assumes port 8080).
``[api_auth] jwt_secret``, ``[api] secret_key``, ``[core] fernet_key``
    One random value per stack shared by every process: the scheduler signs the task tokens that the
    api-server's Execution API verifies (a mismatch fails every task with 403), the api-server signs
    log continuation tokens, and connections are encrypted with the same Fernet key everywhere.
    Passing them explicitly also avoids depending on which process wrote ``airflow.cfg`` first.
``[core] auth_manager`` (simple) with ``[core] simple_auth_manager_all_admins = True``
    Every API request is an admin without a login: the stack calls the public API with no token.
``[core] dags_are_paused_at_creation = True`` (Airflow's default, kept)
    As for a user: :meth:`AirflowStack.trigger` unpauses the DAG first (``unpause=True``).
``[dag_processor] refresh_interval = 5``, ``bundle_refresh_check_interval = 1``,
``min_file_process_interval = 600``, ``dag_bundle_storage_path = <home>/dag_bundles``
    New or changed files are found within seconds (a file whose mtime changed is parsed again
    whatever the interval); an unchanged file is not parsed again for 10 min: every 30 s (Airflow's
    default) cost an idle stack 0.07 of a core with 9 DAG files; bundle copies stay inside the home.
``[scheduler] scheduler_heartbeat_sec = 1``, ``scheduler_idle_sleep_time = 0.5``
    The scheduler notices a finished trigger, a finished task or a new run within half a second (it
    sleeps only after a loop that found nothing to do): the time from a rank's failure to the end of
    the run is mostly Airflow's own latency. Each idle loop costs ~10 ms of CPU: at 0.2 s an idle
    scheduler used 0.075 of a core, at 0.5 s 0.04 (Airflow's default, 1 s, would add up to 0.5 s to
    each step of a run).
``[scheduler] parsing_cleanup_interval = 30``, ``task_queued_timeout_check_interval = 30``
    Housekeeping loops that need not wait minutes in a short-lived stack.
``[triggerer]`` (capacity 1000, the default) and ``[triggerer] job_heartbeat_sec = 2``
    One triggerer runs every rank trigger and gang sensor trigger; a frequent heartbeat lets
    :meth:`AirflowStack.restart_triggerer` see the new triggerer's job quickly.
``scheduler --skip-serve-logs``, ``triggerer --skip-serve-logs``, free ``[logging] *_log_server_port``
    Every process shares one disk, so the api-server reads task and trigger logs straight from
    ``<home>/logs``; no log-server processes are needed, and the ports point at nothing that another
    stack on this machine (default 8793/8794) could answer.
``python -m devstack.airflow_main`` instead of ``python -m airflow``
    The same CLI with Python's garbage collector tuned for Airflow's heap (see
    :mod:`devstack.airflow_main`): with Python's default a fifth to a quarter of the api-server's,
    the triggerer's and the scheduler's CPU went to full collections.
``[logging] base_log_folder = <home>/logs``
    Task logs (``dag_id=.../run_id=.../task_id=...``) sit next to the services' own ``*.log``.

The distributed variant (PostgreSQL, Celery, several triggerers) and why each of its settings exists:
:mod:`devstack.services`.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import math
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar
from urllib.parse import quote

import httpx

#: ``[database] sql_alchemy_connect_args`` of a SQLite stack: a writer waits up to 60 s for the database
#: lock (sqlite3's default is 5 s). With four services writing on a busy 2-core machine a commit can wait
#: longer than 5 s, and the scheduler then dies of "database is locked" (seen at a load average of 12-15).
SQLITE_CONNECT_ARGS: dict[str, Any] = {"timeout": 60}
#: a SQLite stack's database is in WAL mode (set once after the migration; it stays with the file):
#: readers never block a commit and a commit is one append and fsync. In the default rollback journal,
#: with 9 task starts, the scheduler, the dag-processor and the triggerer all writing at once beside a
#: busy disk, every service's writers were seen queued in SQLite's busy wait (py-spy: every thread in
#: ``do_execute``) and the api-server answered nothing for more than 30 s
SQLITE_JOURNAL_MODE = "wal"
#: the api-server's own wait for the lock: short. Airflow's audit log (``action_logging``) commits a sync
#: session on the api-server's event loop before a write request runs; when another request's session in
#: the same process holds SQLite's write lock and needs that loop to commit, the two wait on each other
#: until the loop's wait times out (py-spy and the lock table of a stall: the api-server held the write
#: lock, its loop in ``INSERT INTO log``). With 60 s the api-server answered nothing for a minute; with
#: 5 s that request fails with "database is locked" before it did anything, and the client asks again
SQLITE_API_CONNECT_ARGS: dict[str, Any] = {"timeout": 5}
#: how often the client asks again after a 5xx ("database is locked": nothing of the request was done)
API_RETRIES = 4

#: start order; ``stop()`` terminates them all at once
SERVICES: tuple[str, ...] = ("api-server", "scheduler", "dag-processor", "triggerer")
#: Celery workers are named ``celery-worker-1``, ``celery-worker-2``...; triggerers after the first
#: ``triggerer-2``, ``triggerer-3``...
CELERY_WORKER = "celery-worker"
FINISHED_RUN_STATES = frozenset({"success", "failed"})


def _children(pid: int) -> list[str]:
    """The pids of a process's children (a forking api-server's workers)."""
    found: list[str] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += (task / "children").read_text().split()
    return found


class StackError(RuntimeError):
    """A service died, the API answered with an error, or something did not happen in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_time(value: str | None) -> float | None:
    """An API timestamp (ISO 8601, ``Z`` or offset) as epoch seconds."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the process group ``proc`` leads, if the number is still its: while ``proc`` is not
    reaped its pid stays taken; once reaped, only members left keep the number taken (and no process
    has that pid then). A number freed is given out again within minutes on a busy machine, and a
    signal to it would reach another test's processes."""
    if proc.poll() is not None and (Path(f"/proc/{proc.pid}").exists() or not group_members(proc.pid)):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def processes_under(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose cwd is inside ``path`` or whose command line names it.

    Every test's leak check scans /proc with this: a process's command line and cwd are read first,
    its state only when it matches."""
    root = str(Path(path).resolve())
    under = root + "/"
    me = str(os.getpid())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            try:
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                cwd = ""
            if not (root in cmd or cwd == root or cwd.startswith(under)):
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except (OSError, IndexError):
            continue
        found.append((int(name), cmd or cwd))
    return found


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def render_log(content: Iterable[Any]) -> str:
    """The structured log messages of the log API as text lines, exceptions included."""
    skip = {"timestamp", "event", "level", "logger", "error_detail"}
    out = []
    for item in content:
        if not isinstance(item, Mapping):
            out.append(str(item))
            continue
        event = str(item.get("event", ""))
        if event in ("::group::Log message source details", "::endgroup::") or not (
            item.get("timestamp") or item.get("level")
        ):
            out.append(event)  # the sources header
            continue
        head = " ".join(
            str(part)
            for part in (item.get("timestamp"), f"[{item.get('level', '')}]", item.get("logger"))
            if part
        )
        extra = " ".join(f"{k}={v}" for k, v in item.items() if k not in skip)
        out.append(f"{head} - {event}" + (f" {extra}" if extra else ""))
        for exc in item.get("error_detail") or []:
            if isinstance(exc, Mapping):
                out.append(f"{exc.get('exc_type', 'Exception')}: {exc.get('exc_value', '')}")
                for fr in exc.get("frames") or []:
                    if isinstance(fr, Mapping):
                        out.append(
                            f"  File {fr.get('filename')}, line {fr.get('lineno')}, in {fr.get('name')}"
                        )
            else:
                out.append(str(exc))
    return "\n".join(out)


class AirflowStack:
    """api-server + scheduler + dag-processor + triggerer with LocalExecutor and SQLite, on loopback.

    Use it as a context manager (``with AirflowStack(home, dags) as stack:``): ``start()`` and
    ``wait_ready()`` on enter, ``stop()`` on exit, whatever happened; ``stop()`` is also registered
    with :mod:`atexit`. Every ``timeout`` is in seconds.

    :param home: ``AIRFLOW_HOME`` (created); the DB, ``airflow.cfg`` and ``logs/`` live there.
    :param dags_folder: the DAG files to parse.
    :param env: extra environment for every service (e.g. ``SKY_PROVIDER_HOME``); wins over the
        stack's own settings. Inherited ``AIRFLOW__*`` / ``AIRFLOW_*`` variables are dropped, so the
        caller's Airflow config never leaks into the stack.
    :param parallelism: ``[core] parallelism`` (LocalExecutor worker slots; with Celery, the
        scheduler's limit, split over the workers as ``[celery] worker_concurrency``).
    :param sql_alchemy_conn: the metadata DB (default: SQLite in ``home``).
    :param broker_url: a Redis URL: run the CeleryExecutor with ``celery_workers`` workers.
    :param triggerers: how many triggerer processes (``triggerer``, ``triggerer-2``, ...).
    """

    #: the stacks started and not stopped yet in this process (a failed test keeps their logs)
    running: ClassVar[list[AirflowStack]] = []
    #: per Python interpreter, the home migrated once for every new SQLite stack of this process
    _templates: ClassVar[dict[str, Path]] = {}

    def __init__(
        self,
        home: str | os.PathLike[str],
        dags_folder: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        *,
        parallelism: int = 16,
        sql_alchemy_conn: str | None = None,
        broker_url: str | None = None,
        celery_workers: int = 2,
        triggerers: int = 1,
        python: str = sys.executable,
        ready_timeout: float = 120.0,
        stop_grace: float = 10.0,
    ) -> None:
        self.home = Path(home).resolve()
        self.dags_folder = Path(dags_folder).resolve()
        self.logs = self.home / "logs"
        self.python = python
        self.parallelism = parallelism
        self.sql_alchemy_conn = sql_alchemy_conn
        self.broker_url = broker_url
        self.celery_workers = celery_workers if broker_url else 0
        self.triggerers = triggerers
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.port = 0
        self.extra_env = dict(env or {})
        self.env: dict[str, str] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._groups: list[int] = []  # every process group ever started, for leftover_processes()
        self._client: httpx.Client | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def services(self) -> list[str]:
        """Every service this stack runs, in start order."""
        names = [s for s in SERVICES if s != "triggerer"]
        names += ["triggerer"] + [f"triggerer-{i}" for i in range(2, self.triggerers + 1)]
        return names + [f"{CELERY_WORKER}-{i}" for i in range(1, self.celery_workers + 1)]

    @property
    def airflow(self) -> list[str]:
        """The ``airflow`` command: the CLI under :mod:`devstack.airflow_main` (its GC setting)."""
        return [self.python, "-m", "devstack.airflow_main"]

    @property
    def executor(self) -> str:
        return "CeleryExecutor" if self.broker_url else "LocalExecutor"

    def _build_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        h = str(self.home)
        env.update(
            {
                "AIRFLOW_HOME": h,
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.sql_alchemy_conn or f"sqlite:///{h}/airflow.db",
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__EXECUTOR": self.executor,
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(self.parallelism),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                "AIRFLOW__CORE__AUTH_MANAGER": (
                    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
                ),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__BASE_URL": self.url,
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
                "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": f"{h}/dag_bundles",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
                "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
                "AIRFLOW__SCHEDULER__PARSING_CLEANUP_INTERVAL": "30",
                "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "30",
                "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.logs),
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.broker_url:
            db = self.sql_alchemy_conn or f"sqlite:///{h}/airflow.db"
            env.update(
                {
                    "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
                    "AIRFLOW__CELERY__RESULT_BACKEND": "db+"
                    + db,  # the driver stays: SQLAlchemy's default is psycopg 3
                    "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(
                        max(1, math.ceil(self.parallelism / self.celery_workers))
                    ),
                    "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
                }
            )
        if not self.sql_alchemy_conn:  # SQLite: writers wait for the lock (see SQLITE_CONNECT_ARGS)
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"] = f"{__name__}.SQLITE_CONNECT_ARGS"
        if self.triggerers > 1:  # see devstack/services.py: a stalled triggerer must not lose its triggers
            env["AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD"] = "60"
        env.update(self.extra_env)
        # the Airflow processes import this module (SQLITE_CONNECT_ARGS above): devstack is not installed,
        # so its folder's parent goes on their path, after whatever the caller put there
        root = str(Path(__file__).resolve().parents[1])
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([*paths, root])
        return env

    def _command(self, service: str) -> list[str]:
        if service.startswith(CELERY_WORKER):
            name = f"worker{service.rsplit('-', 1)[1]}@%h"
            return [
                *self.airflow,
                "celery",
                "worker",
                "--celery-hostname",
                name,
                "--skip-serve-logs",
            ]
        if service.startswith("triggerer"):
            return [*self.airflow, "triggerer", "--skip-serve-logs"]
        cmd = [*self.airflow, service]
        if service == "scheduler":
            cmd.append("--skip-serve-logs")
        return cmd

    def _spawn(self, service: str) -> None:
        log: IO[bytes] = open(self.logs / f"{service}.log", "ab")
        try:
            env = self.env
            if service == "api-server" and not self.sql_alchemy_conn:
                env = {
                    **env,
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.SQLITE_API_CONNECT_ARGS",
                }
            if service.startswith("triggerer"):
                # Airflow records a job's unixname from LOGNAME: it tells which triggerer runs which trigger
                env = {**env, "LOGNAME": service}
            self.procs[service] = subprocess.Popen(
                self._command(service),
                env=env,
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills the whole tree
            )
            self._groups.append(self.procs[service].pid)
        finally:
            log.close()

    def start(self) -> AirflowStack:
        """``airflow db migrate``, then every service; on any failure nothing is left running."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = self._build_env()
        atexit.register(self.stop)
        AirflowStack.running.append(self)
        try:
            db = self.home / "airflow.db"
            if self.sql_alchemy_conn or db.exists():
                self._migrate(self.home, self.env)
            else:  # a new SQLite stack: a copy of the migrated template, as ``db migrate`` would leave it
                template = self._sqlite_template()
                shutil.copyfile(template / "airflow.db", db)
                cfg = (template / "airflow.cfg").read_text().replace(str(template), str(self.home))
                (self.home / "airflow.cfg").write_text(cfg)
            if not self.sql_alchemy_conn:
                with contextlib.closing(sqlite3.connect(db)) as conn:
                    conn.execute(f"PRAGMA journal_mode={SQLITE_JOURNAL_MODE}")
            for service in self.services:
                self._spawn(service)
        except BaseException:
            self.stop()
            raise
        return self

    def _migrate(self, home: Path, env: Mapping[str, str]) -> None:
        with open(self.logs / "db-migrate.log", "ab") as log:
            res = subprocess.run(
                [*self.airflow, "db", "migrate"],
                env=env,
                cwd=home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        if res.returncode != 0:
            raise StackError(
                f"airflow db migrate failed ({res.returncode}):\n{_tail(self.logs / 'db-migrate.log')}"
            )

    def _sqlite_template(self) -> Path:
        """A home migrated once per process and Python: its SQLite DB (rollback journal) and the
        ``airflow.cfg`` that ``db migrate`` wrote there. A copy is what a migration leaves, in
        milliseconds instead of ~3.5 s of CPU per stack."""
        template = AirflowStack._templates.get(self.python)
        if template is None or not (template / "airflow.db").is_file():
            template = Path(tempfile.mkdtemp(prefix="sky-devstack-db-"))
            atexit.register(shutil.rmtree, template, True)
            env = {
                **self.env,
                "AIRFLOW_HOME": str(template),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{template}/airflow.db",
            }
            self._migrate(template, env)
            AirflowStack._templates[self.python] = template
        return template

    def check_alive(self) -> None:
        """Raise (with the end of its log) if a service has exited."""
        for service, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise StackError(
                    f"airflow {service} exited with code {code}; end of {self.logs / service}.log:\n"
                    + _tail(self.logs / f"{service}.log")
                )

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self._request("GET", "/api/v2/monitor/health")
        return data

    def wait_ready(self, timeout: float | None = None, dag_ids: Sequence[str] | None = None) -> None:
        """Wait until the api-server answers, every service heartbeats and the DAGs are serialized.

        :param dag_ids: the DAGs to wait for; by default every ``*.py`` file of ``dags_folder`` must
            have produced a DAG (a file with an import error raises at once, with the error).
        """
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        last = "api-server not answering"
        while True:
            self.check_alive()
            try:
                health = self.health()
                bad = [k for k, v in health.items() if (v or {}).get("status") != "healthy"]
                if bad:
                    last = f"not healthy yet: {bad}"
                else:
                    missing = self._dags_missing(dag_ids)
                    if not missing:
                        self._warm_execution_api(deadline)
                        return
                    last = f"DAGs not parsed yet: {missing}"
            except (httpx.TransportError, StackError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise StackError(f"stack not ready after {timeout}s: {last}")
            time.sleep(0.5)

    def _warm_execution_api(self, deadline: float) -> None:
        """One request to the Execution API before the first task makes one. Its app (Cadwyn) builds the
        routes of every API version on its first request, on the api-server's event loop: ~3.5 s of CPU
        idle, more than the client's 30 s on a loaded machine, during which the api-server answered
        nothing (py-spy of a stall: the loop in ``Cadwyn._cadwyn_initialize``). Here it is paid within
        the ready wait."""
        self._request("GET", "/execution/health", timeout=max(deadline - time.monotonic(), 30.0))

    def _dags_missing(self, dag_ids: Sequence[str] | None) -> list[str]:
        errors = self._request("GET", "/api/v2/importErrors", params={"limit": 100})["import_errors"]
        if errors:
            raise StackError(
                "DAG import errors:\n" + "\n".join(f"{e['filename']}: {e['stack_trace']}" for e in errors)
            )
        dags = self._request("GET", "/api/v2/dags", params={"limit": 1000})["dags"]
        if dag_ids is not None:
            have = {d["dag_id"] for d in dags}
            missing = [d for d in dag_ids if d not in have]
        else:
            files = {Path(d["fileloc"]).resolve() for d in dags if d.get("fileloc")}
            missing = [p.name for p in sorted(self.dags_folder.glob("*.py")) if p.resolve() not in files]
        for dag_id in [d["dag_id"] for d in dags if dag_ids is None or d["dag_id"] in dag_ids]:
            if not missing:  # the serialized DAG (what the scheduler runs) must be there too
                try:
                    self._request("GET", f"/api/v2/dags/{quote(dag_id)}/tasks")
                except StackError:
                    missing.append(dag_id)
        return missing

    def stop(self) -> None:
        """SIGTERM every process group this stack started, SIGKILL what is left after the grace."""
        if self._client is not None:
            self._client.close()
            self._client = None
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            signal_group(proc, signal.SIGTERM)
        self._reap(procs.values(), self.stop_grace)
        atexit.unregister(self.stop)
        with contextlib.suppress(ValueError):
            AirflowStack.running.remove(self)

    def keep_logs(self, label: str) -> Path:
        """A copy of every log of the stack (the services', the tasks' and the triggers') and of the
        provider's own (``SKY_PROVIDER_HOME``: the bridges'), in ``$SKY_TEST_DUMPS`` (default
        ``/tmp/sky-stack-dumps``), outside the test's tmp dir, which pytest rotates away."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
        out = Path(os.environ.get("SKY_TEST_DUMPS", "/tmp/sky-stack-dumps")) / (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{safe}"
        )
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copytree(self.logs, out / "airflow-logs", dirs_exist_ok=True)
        sky = self.extra_env.get("SKY_PROVIDER_HOME")
        if sky and Path(sky, "bridge").is_dir():
            with contextlib.suppress(OSError):
                shutil.copytree(Path(sky, "bridge"), out / "bridge", dirs_exist_ok=True)
        return out

    def log_tail(self, service: str, lines: int = 30) -> str:
        """The last lines of a service's own log."""
        return _tail(self.logs / f"{service}.log", lines)

    def _reap(self, procs: Iterable[subprocess.Popen[bytes]], grace: float) -> None:
        procs = list(procs)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()
            if not any(group_members(p.pid) for p in procs):
                break
            time.sleep(0.1)
        for p in procs:
            signal_group(p, signal.SIGKILL)  # only what is left of a group that is still its
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        deadline = time.monotonic() + 5
        while any(group_members(p.pid) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)

    def leftover_processes(self) -> list[int]:
        """Processes still alive in any group this stack started (empty after ``stop()``)."""
        return [pid for pgid in self._groups for pid in group_members(pgid)]

    def restart_triggerer(self, timeout: float = 60.0) -> None:
        """Stop the triggerer (SIGTERM, its triggers are released) and start a new one; wait for it."""
        old = self.procs.pop("triggerer", None)
        if old is not None:
            signal_group(old, signal.SIGTERM)
            self._reap([old], self.stop_grace)
        started = time.time()
        self._spawn("triggerer")
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.TransportError, StackError):
                tr = self.health().get("triggerer") or {}
                beat = parse_time(tr.get("latest_triggerer_heartbeat"))
                if tr.get("status") == "healthy" and beat is not None and beat >= started:
                    return
            if time.monotonic() > deadline:
                raise StackError(f"the new triggerer did not heartbeat within {timeout}s")
            time.sleep(0.5)

    def restart_triggerers(self, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> None:
        """Stop every triggerer (SIGTERM: each releases its triggers and ends its job), then start them
        all again with ``env`` added to the stack's environment (kept for every later start); wait until
        each new one's job is alive. For a setting read at a triggerer's start (e.g.
        ``[triggerer] triggerer_health_check_threshold``) that a part of a test needs changed."""
        names = [s for s in self.services if s.startswith("triggerer")]
        old = [self.procs.pop(s) for s in names if s in self.procs]
        for proc in old:
            signal_group(proc, signal.SIGTERM)
        self._reap(old, self.stop_grace)
        self.env.update(env or {})
        self.extra_env.update(env or {})
        started = time.time()
        for service in names:
            self._spawn(service)
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.TransportError, StackError):
                jobs = self._request(
                    "GET", "/api/v2/jobs", params={"job_type": "TriggererJob", "limit": 100}
                )["jobs"]
                fresh = {
                    str(j["unixname"])
                    for j in jobs
                    if not j.get("end_date") and (parse_time(j.get("latest_heartbeat")) or 0) >= started
                }
                if fresh >= set(names):
                    return
            if time.monotonic() > deadline:
                raise StackError(f"the new triggerers {names} did not all start a job within {timeout}s")
            time.sleep(0.5)

    def kill_service(self, service: str, sig: int = signal.SIGKILL) -> None:
        """Kill one service's whole process group (a crash when SIGKILL); the stack goes on without it."""
        proc = self.procs.pop(service)
        signal_group(proc, sig)
        self._reap([proc], self.stop_grace)

    def start_service(self, service: str) -> None:
        """Start one service again (e.g. a Celery worker after :meth:`kill_service`); no wait."""
        if service in self.procs:
            raise StackError(f"{service} is already running")
        self._spawn(service)

    def signal_service(self, service: str, sig: int) -> None:
        """Send a signal to one service's process group and keep it (SIGSTOP / SIGCONT: a stall)."""
        signal_group(self.procs[service], sig)

    def triggerer_jobs(self) -> dict[int, str]:
        """Triggerer job id -> the service running it (``triggerer``, ``triggerer-2``...): the newest open
        job of each service running now. A triggerer that did not end within the stop grace was killed and
        its job never got an end date; the job its service started since is the live one."""
        jobs = self._request("GET", "/api/v2/jobs", params={"job_type": "TriggererJob", "limit": 100})["jobs"]
        newest: dict[str, int] = {}
        for j in jobs:
            name, job_id = str(j["unixname"]), int(j["id"])
            if not j.get("end_date") and name in self.procs and job_id > newest.get(name, -1):
                newest[name] = job_id
        return {job_id: name for name, job_id in newest.items()}

    def service_processes(self, service: str) -> list[int]:
        """Live processes of a service (its process group: e.g. a triggerer and its trigger runner)."""
        return group_members(self.procs[service].pid)

    def __enter__(self) -> AirflowStack:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the REST API --------------------------------------------------------------------------

    def _http(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.url, timeout=30.0)
        return self._client

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """``timeout``: this request's, instead of the client's 30 s."""
        given = {k: v for k, v in (params or {}).items() if v is not None}
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        for attempt in range(API_RETRIES + 1):
            try:
                resp = self._http().request(method, path, params=given, json=json, **extra)
            except httpx.TimeoutException as exc:
                raise StackError(
                    f"{method} {path}: the api-server did not answer ({exc!r}); {self.dump_api_server()}"
                ) from exc
            locked = resp.status_code >= 500 and not self.sql_alchemy_conn
            if not locked or attempt == API_RETRIES:
                break
            time.sleep(1.0)  # see SQLITE_API_CONNECT_ARGS
        if resp.status_code >= 400:
            raise StackError(f"{method} {path} -> {resp.status_code}: {resp.text[:2000]}")
        return resp.json() if resp.content else None

    def dump_api_server(self) -> str:
        """Every service's Python stacks (py-spy, every thread, their children too) when the api-server
        stops answering: the process that holds what it waits for (with SQLite, the database's one write
        lock) is then seen at it. Written with the services' logs to ``$SKY_TEST_DUMPS`` (default
        ``/tmp/sky-stack-dumps``), outside the test's tmp dir, which pytest rotates away."""
        beside = Path(sys.executable).parent / "py-spy"  # the dev environment has it (pyproject's dev group)
        spy = os.environ.get("SKY_TEST_PYSPY") or (
            str(beside) if beside.exists() else shutil.which("py-spy") or ""
        )
        if not spy:
            return "no stacks (py-spy not found: uv sync the dev group or set SKY_TEST_PYSPY)"
        out = Path(os.environ.get("SKY_TEST_DUMPS", "/tmp/sky-stack-dumps")) / (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        )
        out.mkdir(parents=True, exist_ok=True)
        for service, proc in self.procs.items():
            with (out / f"{service}.stacks.txt").open("w") as f:
                for pid in [proc.pid] + [int(c) for c in _children(proc.pid)]:
                    f.write(f"=== pid {pid}\n")
                    f.flush()
                    subprocess.run(
                        [spy, "dump", "--locals", "--pid", str(pid)],
                        stdout=f,
                        stderr=f,
                        timeout=60,
                        check=False,
                    )
        for log_file in self.logs.glob("*.log"):
            with contextlib.suppress(OSError):
                shutil.copy(log_file, out / log_file.name)
        # who holds the SQLite database's locks (fcntl locks on its file, by pid): the process every
        # waiter waits for
        if not self.sql_alchemy_conn:
            with contextlib.suppress(OSError):
                # the database file and, in WAL mode, its shared-memory index (where WAL's locks are)
                inodes = {
                    (self.home / f).stat().st_ino
                    for f in ("airflow.db", "airflow.db-shm")
                    if (self.home / f).exists()
                }
                held = [
                    line
                    for line in Path("/proc/locks").read_text().splitlines()
                    if any(f":{inode} " in line for inode in inodes)
                ]
                who = {
                    p: s for s, proc in self.procs.items() for p in [proc.pid, *map(int, _children(proc.pid))]
                }
                lines = []
                for line in held:  # "N: [-> ]POSIX ADVISORY WRITE <pid> <maj:min:inode> <start> <end>"
                    words = line.split()
                    holder = next(
                        (
                            w
                            for w, nxt in zip(words, words[1:], strict=False)
                            if any(nxt.endswith(f":{inode}") for inode in inodes)
                        ),
                        "",
                    )
                    lines.append(f"{line}  ({who.get(int(holder), '?') if holder.isdigit() else '?'})\n")
                (out / "db-locks.txt").write_text("".join(lines) or "no lock held\n")
        log_tail = "\n".join((self.logs / "api-server.log").read_text(errors="replace").splitlines()[-20:])
        return f"every service's stacks and logs: {out}; the last lines of the api-server's log:\n{log_tail}"

    @staticmethod
    def _ti_path(dag_id: str, run_id: str, task_id: str = "") -> str:
        path = f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        return f"{path}/{quote(task_id)}" if task_id else path

    def unpause(self, dag_id: str) -> None:
        self._request("PATCH", f"/api/v2/dags/{quote(dag_id)}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, *, unpause: bool = True) -> str:
        """Start a manual run now; returns its run id."""
        if unpause:
            self.unpause(dag_id)
        run = self._request(
            "POST",
            f"/api/v2/dags/{quote(dag_id)}/dagRuns",
            json={"logical_date": None, "conf": dict(conf or {})},
        )
        return str(run["dag_run_id"])

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """The run as the API shows it (``state``, ``start_date``, ``end_date``, ...)."""
        run: dict[str, Any] = self._request(
            "GET", f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id, safe='')}"
        )
        return run

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 120.0) -> str:
        """Wait until the run is ``success`` or ``failed``; returns that state.

        Polled every 0.5 s for 15 s, then every 1 s, and every 2 s after a minute: the tests wait on
        minutes-long runs side by side, and each poll is an API request the api-server serves on the
        cores the runs need (at 0.5 s throughout, a third of an e2e run's requests).
        """
        start = time.monotonic()
        deadline = start + timeout
        while True:
            self.check_alive()
            state = str(self.dag_run(dag_id, run_id)["state"])
            if state in FINISHED_RUN_STATES:
                return state
            if time.monotonic() > deadline:
                tis = ", ".join(
                    f"{t['task_id']}[{t['map_index']}]={t['state']}"
                    for t in self.task_instances(dag_id, run_id)
                )
                raise StackError(f"{dag_id} run {run_id} still {state} after {timeout}s: {tis}")
            waited = time.monotonic() - start
            time.sleep(0.5 if waited < 15 else 1.0 if waited < 60 else 2.0)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """Every task instance of the run (mapped ones one per map index), sorted by task and index.

        Read page by page: the API serves at most ``[api] maximum_page_limit`` (100) per request.
        """
        found: list[dict[str, Any]] = []
        while True:
            page = self._request(
                "GET", self._ti_path(dag_id, run_id), params={"limit": 100, "offset": len(found)}
            )
            found += page["task_instances"]
            if not page["task_instances"] or len(found) >= int(page.get("total_entries", 0)):
                break
        data = {"task_instances": found}
        keys = (
            "task_id",
            "map_index",
            "rendered_map_index",
            "state",
            "start_date",
            "end_date",
            "duration",
            "try_number",
            "note",
        )
        tis = [{k: ti.get(k) for k in keys} for ti in data["task_instances"]]
        return sorted(tis, key=lambda t: (t["task_id"], t["map_index"]))

    def task_instance(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        """One task instance as the API returns it, with its ``trigger`` (``triggerer_id``) while deferred."""
        path = self._ti_path(dag_id, run_id, task_id) + (f"/{map_index}" if map_index >= 0 else "")
        ti: dict[str, Any] = self._request("GET", path)
        return ti

    def task_log(
        self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, try_number: int = 1
    ) -> str:
        """The task's whole log as text: the worker's part and the triggerer's part, interleaved."""
        data = self._request(
            "GET",
            f"{self._ti_path(dag_id, run_id, task_id)}/logs/{try_number}",
            params={"map_index": map_index, "full_content": "true"},
        )
        return render_log(data.get("content") or [])

    def filed_trigger_lines(
        self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, log: str | None = None
    ) -> list[str]:
        """A started-from-trigger task's log lines that Airflow's triggerer filed in its own log instead.

        Known Airflow race: the triggerer gets a trigger's log lines and its end over two sockets, and
        when it handles the end first it drops the trigger's log file, so the last lines go to
        ``triggerer*.log`` (seen when many triggers end in one burst). ``log``: the task log, when the
        caller has already read it.
        """
        text = self.task_log(dag_id, run_id, task_id, map_index) if log is None else log
        if "Trigger fired event" in text or "trigger completed" in text:
            return []
        mine = (f"dag_id={dag_id} ", f"run_id={run_id} ", f"map_index={map_index} ")
        return [
            line
            for path in sorted(self.logs.glob("triggerer*.log"))
            for line in path.read_text(errors="replace").splitlines()
            if all(m in line + " " for m in mine)
            and ("task_id=" not in line or f"task_id={task_id} " in line + " ")
        ]

    def xcom(
        self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1
    ) -> Any:
        """The XCom value (JSON-decoded); ``None`` if there is none."""
        try:
            entry = self._request(
                "GET",
                f"{self._ti_path(dag_id, run_id, task_id)}/xcomEntries/{quote(key)}",
                params={"map_index": map_index},
            )
        except StackError as exc:
            if "-> 404" in str(exc):
                return None
            raise
        value = entry.get("value")
        if isinstance(value, str):
            import json

            with contextlib.suppress(ValueError):
                return json.loads(value)
        return value

    def mark_failed(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> None:
        """What a user does in the UI: set the task instance's state to failed."""
        path = self._ti_path(dag_id, run_id, task_id)
        if map_index >= 0:
            path += f"/{map_index}"
        self._request("PATCH", path, json={"new_state": "failed"})
