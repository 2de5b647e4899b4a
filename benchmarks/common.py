"""Shared pieces of the benchmarks: results, statistics, process watching, test hosts, cleanup.

Nothing here imports Airflow at module level: ``benchmarks.run`` sets ``AIRFLOW_HOME`` & co. first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "support"  # the test helpers the benchmarks reuse: sshd, agents, moto_ec2, ...


def floor_env(folder: Path) -> dict[str, str]:
    """A stack's environment for the floor DAGs (:mod:`benchmarks.floor`): the repository on
    ``PYTHONPATH`` (the DAG files and the triggerer import that module) and the floor's moment files."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "BENCH_FLOOR_DIR": str(folder)}


# ------------------------------------------------------------------------------------------ results


@dataclass
class Row:
    """One line of the table: a figure at one N, from several samples (seconds, ratios or counts)."""

    figure: str
    n: int | str
    samples: list[float]
    unit: str = "s"
    goal: str = ""
    #: True/False when the row has a goal, None when it is informational
    met: bool | None = None
    note: str = ""
    #: a pre-formatted median (e.g. "> 60 s (capped)") overriding the numbers
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def min(self) -> float | None:
        return min(self.samples) if self.samples else None

    @property
    def max(self) -> float | None:
        return max(self.samples) if self.samples else None

    def fmt(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.unit == "s":
            return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
        if self.unit == "x":
            return f"{value:.2f}x"
        if self.unit == "ms":
            return f"{value:.1f} ms"
        return f"{value:.1f}" if abs(value - round(value)) > 1e-9 else f"{value:.0f}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "n": self.n,
            "unit": self.unit,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "runs": len(self.samples),
            "samples": self.samples,
            "goal": self.goal or None,
            "met": self.met,
            "text": self.text,
            "note": self.note or None,
            **({"extra": self.extra} if self.extra else {}),
        }


def table(rows: list[Row]) -> str:
    """The plain text table: figure | N | median | min | max | goal | met."""
    head = ["figure", "N", "median", "min", "max", "runs", "goal", "met"]
    body = []
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        median = r.text if r.text is not None else r.fmt(r.median)
        lo = "-" if r.text is not None and not r.samples else r.fmt(r.min)
        hi = "-" if r.text is not None and not r.samples else r.fmt(r.max)
        body.append([r.figure, str(r.n), median, lo, hi, str(len(r.samples)), r.goal or "-", met])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime) of a pid from /proc/<pid>/stat, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[19])


def find_job_processes(job_id: str, argv: tuple[str, ...]) -> dict[int, int]:
    """Non-zombie processes running exactly ``argv`` with ``SKYPILOT_TASK_ID=<job_id>``: pid -> starttime.

    The environment marks a rank's processes on either backend (SSH users or local), so nothing else
    on the machine (another cluster, another job) is ever counted.
    """
    want_cmd = b"\0".join(a.encode() for a in argv) + b"\0"
    marker = f"SKYPILOT_TASK_ID={job_id}".encode()
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read() != want_cmd:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if marker not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        st = _stat(pid)
        if st is not None and st[0] != "Z":
            found[pid] = st[1]
    return found


class GoneWatcher(threading.Thread):
    """Find ``expected`` processes of a job, then check every ``tick`` seconds until none is left.

    Discovery scans /proc (every 20 ms) until all ``expected`` processes exist; after that only those
    pids are looked at (``/proc/<pid>/stat``: gone, zombie, or a reused pid with another start time),
    which keeps the watcher cheap while the code being measured runs. ``gone_at`` is the wall-clock
    time of the first check that saw none of them alive.
    """

    def __init__(
        self, job_id: str, expected: int, argv: tuple[str, ...], tick: float = 0.005, limit: float = 120.0
    ) -> None:
        super().__init__(daemon=True, name=f"gone-watcher-{job_id}")
        self.job_id = job_id
        self.expected = expected
        self.argv = argv
        self.tick = tick
        self.limit = limit
        self.found = threading.Event()
        self.stop_flag = threading.Event()
        self.pids: dict[int, int] = {}
        self.gone_at: float | None = None
        self.error: str | None = None
        self.checks = 0

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        while not self.stop_flag.is_set():
            self.pids = find_job_processes(self.job_id, self.argv)
            if len(self.pids) >= self.expected:
                break
            if time.monotonic() > deadline:
                self.error = f"found {len(self.pids)} of {self.expected} processes of {self.job_id}"
                self.found.set()
                return
            time.sleep(0.02)
        self.found.set()
        alive = dict(self.pids)
        while alive and not self.stop_flag.is_set():
            self.checks += 1
            for pid, start in list(alive.items()):
                st = _stat(pid)
                if st is None or st[0] in ("Z", "X") or st[1] != start:
                    del alive[pid]
            if not alive:
                self.gone_at = time.time()
                return
            if time.monotonic() > deadline:
                self.error = f"{len(alive)} processes of {self.job_id} still alive after {self.limit}s"
                return
            time.sleep(self.tick)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(5)


def kill_job_processes(job_id: str) -> int:
    """SIGKILL whatever of a job still runs (only after a failed measurement)."""
    marker = f"SKYPILOT_TASK_ID={job_id}".encode()
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if marker not in fh.read().split(b"\0"):
                    continue
            os.kill(int(name), signal.SIGKILL)
            killed += 1
        except OSError:
            continue
    return killed


def processes_under(path: str | os.PathLike[str]) -> list[int]:
    """Live processes whose cwd is inside ``path`` or whose command line names it (leak check)."""
    root = str(Path(path).resolve())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            st = _stat(int(name))
            if st is None or st[0] == "Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
            try:
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:
                cwd = ""
        except OSError:
            continue
        if root in cmd or cwd == root or cwd.startswith(root + "/"):
            found.append(int(name))
    return found


def forget_finished_pids(root: str | os.PathLike[str]) -> int:
    """Remove the ``pid`` file of every rank under ``root`` that has an ``exit`` file.

    Workaround for the teardown script (``runtime.TEARDOWN_SCRIPT``), which SIGKILLs the recorded
    wrapper pid of *every* rank, finished or not: on a busy machine (pid_max 32768) those pids have
    long been reused, by anything, including a thread of this process (kill() on a thread id kills
    its whole process). The local backend runs teardown as root. Returns how many were removed.
    """
    removed = 0
    for d in Path(root).glob("**/jobs/*/*"):
        if (d / "exit").exists() and (d / "pid").exists():
            with contextlib.suppress(OSError):
                (d / "pid").unlink()
                removed += 1
    return removed


# ------------------------------------------------------------------------------------------- hosts


def _sshd_module() -> Any:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import sshd

    return sshd


class Hosts:
    """One set of real sshd test hosts for the whole run (figures use its first N nodes)."""

    def __init__(self, n: int, base_dir: Path) -> None:
        self.cluster: Any = _sshd_module().SSHDCluster(n, base_dir)

    def __enter__(self) -> Hosts:
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.__exit__(*exc)

    @property
    def nodes(self) -> list[Any]:
        return list(self.cluster.nodes)

    def entries(self, n: int | None = None) -> list[str]:
        return [f"{x.user}@{x.host}:{x.port}" for x in self.nodes[:n]]

    def backend(self, n: int | None = None) -> Any:
        from airflow_provider_sky.backends.ssh import SSHBackend

        return SSHBackend(
            self.entries(n),
            user="",
            key_file=self.cluster.client_key_path,
            known_hosts=self.cluster.known_hosts_path,
            connect_timeout=10.0,
            ready_timeout=10.0,
            max_parallel=64,
        )

    def sky_connection(self) -> dict[str, Any]:
        """A ``sky_ssh`` connection over every host (as JSON for ``AIRFLOW_CONN_*``)."""
        return {
            "conn_type": "sky_ssh",
            "host": ",".join(self.entries()),
            "extra": {
                "key_file": self.cluster.client_key_path,
                "known_hosts": self.cluster.known_hosts_path,
                "max_parallel": 64,
            },
        }

    def forget_finished_pids(self) -> int:
        """:func:`forget_finished_pids` on every host's home (they are on this machine)."""
        return sum(forget_finished_pids(Path(x.home) / ".sky_airflow") for x in self.nodes)

    def kill_user_processes(self, n: int | None = None) -> None:
        """Drop every session and process of the hosts' users (sshd keeps listening)."""
        for i in range(len(self.nodes[:n])):
            with contextlib.suppress(Exception):
                self.cluster.kill_sessions(i)


# ----------------------------------------------------------------------------------------- helpers


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so every ``finally`` cleanup runs as on Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
