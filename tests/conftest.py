"""Test session setup: a throwaway Airflow home (SQLite) and a per-test state dir with a leak check.

The tests come in three tiers, each a folder (and a marker of the same name, set here from the folder):
``unit`` (no process, no network, no root: ``make unit``), ``integration`` (real processes, sshd hosts,
the Kubernetes test cluster, moto's server) and ``e2e`` (real Airflow stacks and the browser). Helpers shared
by the tiers are modules in ``tests/support`` (on ``sys.path``: ``from sshd import ...``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))
sys.path.insert(
    0, str(REPO / "tests")
)  # the tiers are packages: ``from integration.test_dag_test import _run``
sys.path.insert(0, str(REPO))

# Airflow reads its config at import: set it before any test module imports airflow.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="sky-tests-"))
os.environ["AIRFLOW_HOME"] = str(_SESSION_DIR / "airflow")
# dag.test() only runs DAGs found in the dags folder: the examples plus the tests' own DAGs
DAGS = _SESSION_DIR / "dags"
DAGS.mkdir()
(DAGS / "examples").symlink_to(REPO / "dags_examples")
(DAGS / "tests").symlink_to(REPO / "tests" / "dags")
# a test DAG may import a module beside it (``from sky_test_oom import RUN``), as it does where its
# folder is an Airflow stack's dags folder (on sys.path there)
sys.path.insert(0, str(REPO / "tests" / "dags"))
# the session's Airflow home and dags folder go with the process (each xdist worker has its own), not
# with a child forked from it (Airflow forks task processes, which inherit atexit handlers)
_OWNER = os.getpid()


def _remove_session_dir() -> None:
    if os.getpid() == _OWNER:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


atexit.register(_remove_session_dir)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(DAGS)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
os.environ["SKY_PROVIDER_HOME"] = str(_SESSION_DIR / "sky")

from leaks import bridges, job_processes, processes_under  # noqa: E402

from devstack.airflow_main import tune_gc  # noqa: E402

# a test process imports Airflow too: the garbage collector as in every devstack service (see
# devstack/airflow_main.py: a full collection walks only what was made since the last freeze)
tune_gc()

pytest_plugins = ["k8s_cluster"]  # the Kubernetes test cluster (session fixture k8s, started lazily)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """Migrate the SQLite metadata DB once per test session."""
    home = Path(os.environ["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    return home


@pytest.fixture(autouse=True)
def sky_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every test gets its own state dir; afterwards nothing it started may still run (bridges included)."""
    state = tmp_path / "sky"
    state.mkdir()
    monkeypatch.setenv("SKY_PROVIDER_HOME", str(state))
    yield state
    deadline = time.time() + 5
    left = job_processes(state) + bridges(state)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = job_processes(state) + bridges(state)
    # the local backend's background delete of a torn-down tree is no process of a job: it ends by
    # itself once its files are gone, which for a wide gang's ~20,000 files on a machine loaded by three
    # test lanes took more than 5 s; one still deleting after 120 s is a hang, and fails the test
    # (one scan decides, as above: a second one could see a process the first missed in its exec)
    if not left:
        deadline = time.time() + 120
        left = processes_under(state)
        while left and time.time() < deadline:
            time.sleep(0.2)
            left = processes_under(state)
    # what each one was doing, read before it is killed: a process that outlives its test is a bug
    # to find, and the tmp dir with its rank's records is rotated soon
    seen = "".join(_left_behind(pid, cmd) for pid, cmd in left)
    for pid, _ in left:
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    # a bridge that outlived its test: its own log says what it was doing (the tmp dir is rotated soon)
    logs = (
        "".join(
            f"\n--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            for f in sorted((state / "bridge").glob("*.log"))
        )
        if any("bridge" in cmd for _, cmd in left) and (state / "bridge").is_dir()
        else ""
    )
    assert not left, f"processes left running after the test: {left}{seen}{logs}"


def _left_behind(pid: int, cmd: str) -> str:
    """A left process's state, wait channel, parent and children, and the files of the rank directory
    its command line names (a wrapper's first argument)."""
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        wchan = (proc / "wchan").read_text()
    except OSError:
        return f"\n--- {pid}: gone before it was looked at"
    kids = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid)
    out = f"\n--- {pid}: state {stat[0]}, wchan {wchan or '?'}, parent {stat[1]}, children {kids}"
    for kid in kids:
        out += f"\n    child {kid}: {_cmdline(kid)[:200]}"
    args = cmd.split()
    rank_dir = Path(args[2]) if len(args) > 2 and args[1].endswith("rank.sh") else None
    if rank_dir is not None and rank_dir.is_dir():
        for f in sorted(rank_dir.iterdir()):
            text = f.read_text(errors="replace")[-300:] if f.is_file() and f.name != "log" else ""
            out += f"\n    {f.name}: {text.strip()!r}" if text else f"\n    {f.name}"
    return out


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, from its folder: ``-m "not e2e"`` and the like select by tier."""
    for item in items:
        tier = next((part for part in item.path.parts if part in TIERS), None)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """At the end of the run: the tests skipped for want of a system tool, and the command that fixes it."""
    sshd = sys.modules.get("sshd")  # imported by the SSH test modules; none collected, nothing to say
    if sshd is None or not getattr(sshd, "SKIP_REASON", ""):
        return
    by_module: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        if sshd.SKIP_REASON in reason:
            module, _, name = report.nodeid.partition("::")
            by_module.setdefault(module, []).append(name or "(whole module)")
    if not by_module:
        return
    count = sum(len(names) for names in by_module.values())
    write = terminalreporter.write_line
    terminalreporter.section("SSH tests that did not run", sep="=", yellow=True, bold=True)
    write(f"{count} tests were skipped: {sshd.SKIP_REASON}")
    for module, names in by_module.items():
        write(f"  {module} ({len(names)}): {', '.join(names)}")
    write(f"To run them: {sshd.FIX_COMMAND}", yellow=True, bold=True)
