"""Out of memory: a rank killed by the kernel's OOM killer reads "out of memory (killed by the OOM
killer)", never ``cancelled`` or a plain SIGKILL. The node is put in a memory-limited cgroup made here (root):
an SSH host whose sshd runs in it, and the local backend with the whole ``dag.test()`` in it (as a worker
container with a memory limit). Everything is real: the kernel kills, the wrapper reads the cgroup's counter."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sshd import SSHDCluster, needs_sshd

REPO = Path(__file__).resolve().parents[2]
OOM = "out of memory (killed by the OOM killer)"


def _own_memory_cgroup() -> tuple[Path, str]:
    """This process's memory cgroup directory and its version ("v1" / "v2")."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), "v2"
    raise FileNotFoundError("no memory cgroup")


def _make_group(name: str) -> tuple[Path, str]:
    """Make ``name`` under this process's memory cgroup, else under the hierarchy's root.

    The own cgroup is the right parent (its limits hold too), but a runner's cgroup may not take
    children (a job cgroup already removed, a delegated one): the root always does for root.
    """
    errors = []
    try:
        own = [_own_memory_cgroup()]
    except OSError as exc:
        own, errors = [], [f"own cgroup: {exc}"]
    v1 = Path("/sys/fs/cgroup/memory")
    root = (v1, "v1") if v1.is_dir() else (Path("/sys/fs/cgroup"), "v2")
    for parent, version in [*own, root]:
        group = parent / name
        try:
            group.mkdir()
        except OSError as exc:
            errors.append(f"{group}: {exc}")
            continue
        return group, version
    raise OSError("; ".join(errors))


@contextlib.contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[Path]:
    """A child memory cgroup limited to ``limit_mb``; yields its ``cgroup.procs``. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    try:
        group, version = _make_group(f"sky-oom-test-{os.getpid()}")
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        limit = str(limit_mb << 20)
        (group / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).write_text(limit)
        if version == "v1" and (group / "memory.memsw.limit_in_bytes").exists():
            with contextlib.suppress(OSError):
                (group / "memory.memsw.limit_in_bytes").write_text(limit)
        yield group / "cgroup.procs"
    finally:
        with contextlib.suppress(OSError):  # whatever is left goes back to the parent first
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (group.parent / "cgroup.procs").write_text(pid)
            group.rmdir()


def _assert_oom(summaries: dict[int, dict[str, object]]) -> None:
    killed, sibling = summaries[1], summaries[0]
    assert killed["state"] == "failed" and killed["exit_code"] == 137, killed
    assert killed["reason"] == OOM, killed
    # the sibling is cancelled (its reason may name the cause), never out of memory itself
    assert sibling["state"] == "cancelled" and str(sibling["reason"]).startswith("cancelled"), sibling


@needs_sshd
def test_an_oom_kill_on_an_ssh_host_in_a_memory_limited_cgroup(
    tmp_path: Path, airflow_db: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from integration.test_dag_test import _out, _run, _states, _xcom

    with SSHDCluster(2, tmp_path) as hosts, memory_cgroup(256) as procs:
        for node in hosts.nodes:  # each host's sshd, and so every session and rank it starts
            assert node.proc is not None
            procs.write_text(str(node.proc.pid))
        monkeypatch.setenv("AIRFLOW_CONN_SKY_DEFAULT", hosts.sky_ssh_connection())
        dr, tis = _run("sky_test_oom", folder="tests/dags")
        out = _out(capfd)
        from airflow_provider_sky.runners.ssh import pool

        pool.close_all()
    assert str(dr.state) == "failed"
    assert _states(tis, "rank") == {0: "failed", 1: "failed"}
    _assert_oom({r: _xcom(dr, "train.rank", "sky_rank", r) for r in (0, 1)})
    assert f"rank 1 (127.0.{hosts.block}.2) exited with code 137: {OOM}; rank 0 cancelled" in out, out[-3000:]
    assert tis[("down", -1)].state == "success"


def test_an_oom_kill_on_the_local_backend_in_a_memory_limited_cgroup(
    tmp_path: Path, airflow_db: Path, sky_home: Path
) -> None:
    """The whole dag.test() (Airflow, the bridge, the ranks) in one limited cgroup, as a worker container
    with a memory limit: the growing rank volunteers as the victim (oom_score_adj 1000)."""
    env = {
        **os.environ,
        "SKY_TEST_OOM_SCORE": "1000",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO / "tests" / "support")]),
    }
    script = (
        "import json, sys; sys.path.insert(0, 'tests')\n"
        "from integration.test_dag_test import _run, _xcom\n"
        "dr, tis = _run('sky_test_oom', folder='tests/dags')\n"
        "print('RESULT ' + json.dumps({'run': str(dr.state), "
        "'ranks': {r: _xcom(dr, 'train.rank', 'sky_rank', r) for r in (0, 1)}}))\n"
    )
    with memory_cgroup(1536) as procs:
        res = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
        )
    import json

    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["run"] == "failed", result
    _assert_oom({int(k): v for k, v in result["ranks"].items()})
