"""Every example DAG under ``dag.test()`` (tasks one at a time, triggers inline), states read from Airflow."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from leaks import bridges, job_processes, processes_under
from siblings import LastAlive, matching

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, folder: str = "dags_examples") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / folder / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, folder: str = "dags_examples") -> tuple[Any, dict[tuple[str, int], Any]]:
    dag = _load(name, folder).dag
    dr = dag.test()
    tis = {(ti.task_id.split(".", 1)[1], ti.map_index): ti for ti in dr.get_task_instances()}
    return dr, tis


def _out(capfd: pytest.CaptureFixture[str]) -> str:
    out, err = capfd.readouterr()
    return out + err


def _states(tis: dict[tuple[str, int], Any], task: str) -> dict[int, str]:
    return {mi: str(ti.state) for (tid, mi), ti in tis.items() if tid == task}


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_sky_hello(sky_home: Path) -> None:
    dr, tis = _run("sky_hello")
    assert str(dr.state) == "success"
    assert _states(tis, "rank") == {0: "success", 1: "success", 2: "success", 3: "success"}
    assert tis[("gang", -1)].state == "success"
    assert tis[("down", -1)].state == "success"
    assert not list((sky_home / "local").glob("sky-*"))  # the cluster directory is gone


def test_sky_fail_fast(sky_home: Path) -> None:
    marker = f"SKY_PROVIDER_MARK={sky_home}/"
    with LastAlive(marker, tick=0.01) as siblings:
        dr, tis = _run("sky_fail_fast")
    assert str(dr.state) == "failed"
    assert _states(tis, "rank") == {0: "failed", 1: "failed", 2: "failed", 3: "failed"}
    assert tis[("gang", -1)].state == "failed"
    assert tis[("down", -1)].state == "success"
    # fails in seconds, not after the 10000 s sleeps
    assert (dr.end_date - dr.start_date).total_seconds() < 120
    assert not [p for p in processes_under(sky_home) if "sleep" in p[1]]
    # rank 2 fails 2 s into the run, while a rank trigger (or the bridge) watches: siblings gone < 1 s
    end2 = float(_xcom(dr, "train.rank", "sky_rank", 2)["end"])
    gone = (siblings.last_alive or end2) - end2
    print(f"\ndag.test, rank 2 exits after 2 s: exit -> last sibling gone {gone:.3f}s")
    assert gone < 1.0, f"a sibling still ran {gone:.2f}s after rank 2 exited"
    assert not bridges(sky_home)


def _xcom(dr: Any, task_id: str, key: str, map_index: int = -1) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(
            run_id=dr.run_id, key=key, task_ids=task_id, dag_ids=dr.dag_id, map_indexes=map_index
        )
        row = session.scalars(query).one()
        return XComModel.deserialize_value(row)


def test_a_rank_failing_at_once_is_cancelled_from_the_first_instant(sky_home: Path) -> None:
    """The seed scenario as written: rank 2 exits at once, before any rank task or trigger runs.

    The job task's launch-side watcher (bridge) cancels the siblings; under ``dag.test()`` the rank
    tasks then only read the outcome.
    """
    marker = f"SKY_PROVIDER_MARK={sky_home}/"
    with LastAlive(marker, tick=0.01) as siblings:
        dr, tis = _run("sky_test_at_once", folder="tests/dags")
    assert str(dr.state) == "failed"
    assert _states(tis, "rank") == {0: "failed", 1: "failed", 2: "failed", 3: "failed"}
    cause = _xcom(dr, "train.rank", "sky_rank", 2)
    assert cause["state"] == "failed" and cause["exit_code"] == 1, cause
    others = [_xcom(dr, "train.rank", "sky_rank", r) for r in (0, 1, 3)]
    assert [o["state"] for o in others] == ["cancelled"] * 3, others
    end2 = float(cause["end"])
    gone = (siblings.last_alive or end2) - end2
    failed = dr.end_date.timestamp() - end2
    print(
        f"\ndag.test, rank 2 exits at once: exit -> last sibling gone {gone:.3f}s "
        f"({len(siblings.seen)} sibling processes seen), -> run failed {failed:.1f}s"
    )
    assert gone < 1.0, f"a sibling still ran {gone:.2f}s after rank 2 exited"
    assert max(o["end"] for o in others) - end2 < 1.0, others
    assert not matching(marker)
    assert not bridges(sky_home), "the launch-side watcher outlived the job"
    assert tis[("down", -1)].state == "success"


def test_the_run_and_rank_notes_say_which_rank_failed_first_and_why(sky_home: Path) -> None:
    """Every rank of the run's rank list read ``failed``; which one failed first, and why,
    was a click into a log. Now the run's note and the rank tasks' notes say it, with its last output."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    dr, _ = _run("sky_test_notes", folder="tests/dags")
    assert str(dr.state) == "failed"
    with create_session() as session:
        run = session.query(DagRun).filter_by(dag_id=dr.dag_id, run_id=dr.run_id).one()
        notes = {
            ti.map_index: ti.note
            for ti in session.query(TaskInstance).filter_by(
                dag_id=dr.dag_id, run_id=dr.run_id, task_id="train.rank"
            )
        }
        run_note = run.note
    first = "rank 1 (127.1.0.2) exited with code 3, failed first"
    assert run_note and run_note.startswith(first), run_note
    assert "CUDA error: an illegal memory access was encountered" in run_note and "step 41" in run_note
    assert notes[1] == run_note
    assert notes[0] == notes[2] == f"cancelled: {first}", notes


def test_sky_segfault(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dr, tis = _run("sky_segfault")
    text = _out(capfd)
    assert str(dr.state) == "failed"
    assert "segmentation fault (SIGSEGV)" in text
    assert "rank 1 (127.1.0.2) exited with code 139: segmentation fault (SIGSEGV)" in text
    assert tis[("down", -1)].state == "success"


def test_sky_failed_setup(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dr, tis = _run("sky_failed_setup")
    text = _out(capfd)
    assert str(dr.state) == "failed"
    assert tis[("cluster", -1)].state == "failed"
    assert "FAILED_SETUP" in text and "rank 1 (127.1.0.2) exit code 1" in text
    assert "pip install failed: no matching distribution" in text  # the tail of its setup log
    assert "Setup stopped on ranks [0, 2]" in text
    assert tis[("job", -1)].state == "upstream_failed"
    # Airflow skips a teardown whose setup failed; the cluster task removed its own nodes instead
    assert not list((sky_home / "local").glob("sky-*"))
    assert not [p for p in processes_under(sky_home) if "sleep" in p[1]]


def test_sky_yaml(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dr, tis = _run("sky_yaml")
    text = _out(capfd)
    assert str(dr.state) == "success"
    assert "hello from a SkyPilot YAML: rank 1/2, master 127.1.0.1:29511" in text
    assert "training step on rank 0" in text
    assert _states(tis, "rank") == {0: "success", 1: "success"}


def test_bad_input_fails_at_dag_parse_time() -> None:
    from airflow.sdk import DAG

    from airflow_provider_sky.spec import SpecError
    from airflow_provider_sky.taskgroup import sky_gang

    with DAG("bad", schedule=None):
        with pytest.raises(SpecError, match="num_nodes"):
            sky_gang("g", num_nodes=0, run="true")
        with pytest.raises(SpecError, match="RANK"):
            sky_gang("h", num_nodes=2, run="true", envs={"RANK": "3"})
        with pytest.raises(SpecError, match="run"):
            sky_gang("i", num_nodes=2, run=["python train.py"])


def test_a_mistyped_argument_is_named_with_the_nearest_valid_one() -> None:
    """``sky_gang(hang_timout=60)`` said ``Invalid arguments were passed to SkyClusterOperator
    (task_id: cluster)``: another function than the one called, and no hint. Each names its own."""
    from airflow.sdk import DAG

    from airflow_provider_sky.operators.cluster import SkyClusterOperator
    from airflow_provider_sky.operators.down import SkyDownOperator
    from airflow_provider_sky.operators.job import SkyJobOperator
    from airflow_provider_sky.operators.rank import SkyRankOperator
    from airflow_provider_sky.sensors.gang import SkyGangSensor
    from airflow_provider_sky.taskgroup import sky_gang

    with DAG("typo", schedule=None):
        with pytest.raises(TypeError) as info:
            sky_gang("g", num_nodes=2, run="true", hang_timout=60)
        assert str(info.value) == "sky_gang: unknown argument 'hang_timout'; did you mean 'hang_timeout'?"
        with pytest.raises(TypeError, match="^sky_gang: unknown argument 'envs_'; did you mean 'envs'"):
            sky_gang("h", num_nodes=2, run="true", envs_={"A": "1"})
        cases: list[tuple[Any, dict[str, Any], str, str]] = [
            (SkyClusterOperator, {"num_nodes": 2, "run": "true"}, "num_node", "num_nodes"),
            (SkyJobOperator, {"cluster": {}, "num_nodes": 2, "run": "true"}, "hang_timout", "hang_timeout"),
            (SkyRankOperator, {"cluster": {}, "rank": 0, "job_id": "j"}, "lost_afer", "lost_after"),
            (SkyGangSensor, {"cluster": {}, "job_id": "j"}, "poll_intervall", "poll_interval"),
            (SkyDownOperator, {"cluster_name": "c"}, "graze", "grace"),
            (SkyClusterOperator, {"num_nodes": 2, "run": "true"}, "retires", "retries"),  # BaseOperator's own
        ]
        for i, (cls, args, typo, meant) in enumerate(cases):
            with pytest.raises(TypeError) as info:
                cls(task_id=f"t{i}", **args, **{typo: 1})
            assert str(info.value) == (
                f"{cls.__name__} (task_id: t{i}): unknown argument {typo!r}; did you mean {meant!r}?"
            )
        with pytest.raises(
            TypeError,
            match=r"^SkyRankOperator \(task_id: r\): unknown argument 'lost_afer'; did you mean 'lost_after'",
        ):
            SkyRankOperator.partial(task_id="r", cluster={}, job_id="j", lost_afer=1).expand(rank=[0, 1])


def test_yaml_errors_say_which_argument_fixes_them(tmp_path: Path) -> None:
    """A SkyPilot key this provider refuses names the ``resources=`` override that drops it. A SkyPilot
    YAML's null env (SkyPilot fills it from ``--env``) loads: it is given at launch
    (tests/integration/test_launch_values.py)."""
    from airflow.sdk import DAG

    from airflow_provider_sky.spec import SpecError
    from airflow_provider_sky.taskgroup import sky_gang

    yaml = tmp_path / "task.yaml"
    yaml.write_text("num_nodes: 2\nrun: echo hi\nenvs:\n  HF_TOKEN:\n")
    with DAG("yaml_hints", schedule=None):
        sky_gang("g", task_yaml=str(yaml))
        sky_gang("g2", task_yaml=str(yaml), envs={"HF_TOKEN": "x"})

        yaml.write_text("num_nodes: 2\nrun: echo hi\nresources:\n  priority: 10\n")
        with pytest.raises(SpecError) as info:
            sky_gang("h", task_yaml=str(yaml))
        assert "resources={'priority': None}" in str(info.value), str(info.value)
        sky_gang("h2", task_yaml=str(yaml), resources={"priority": None})  # the fix it gives works


def test_rank_tasks_refuse_retries() -> None:
    from airflow_provider_sky.operators.rank import SkyRankOperator

    with pytest.raises(ValueError, match="siblings are gone"):
        SkyRankOperator(task_id="r", cluster={}, rank=0, job_id="j", retries=2)


def test_provider_is_registered() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "-o", "plain"], capture_output=True, text=True
    )
    assert "airflow-provider-sky" in out.stdout, out.stderr[-2000:]


def test_a_kept_cluster_goes_down_after_idle_down(sky_home: Path) -> None:
    """``sky_gang(down=False, idle_down=10)``: the run leaves the cluster; the nodes remove it once idle."""
    from airflow_provider_sky.backends.local import LocalBackend

    dr, tis = _run("sky_test_idle_down", folder="tests/dags")
    assert str(dr.state) == "success"
    assert ("down", -1) not in tis
    backend = LocalBackend(sky_home)
    assert backend.find("sky-idle-kept") is not None, "kept after the run"
    deadline = time.time() + 40
    while backend.find("sky-idle-kept") is not None and time.time() < deadline:
        time.sleep(0.2)
    assert backend.find("sky-idle-kept") is None, "the idle cluster is still there"
    assert not (sky_home / "local" / "sky-idle-kept").exists()
    assert not job_processes(sky_home), "the rank's background sleep outlived the idle cluster"


def test_a_kept_cluster_goes_down_after_the_yamls_autostop(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``resources.autostop: {idle_minutes: 1}`` with ``sky_gang(down=False)``: the launch arms every node
    with 60 idle seconds (SkyPilot has minutes only) and warns once that the stop is a teardown here. The
    test then shortens that armed setting on the nodes, so the keeper's teardown comes in seconds, not a
    minute (the short idle path itself: test_a_kept_cluster_goes_down_after_idle_down)."""
    from airflow_provider_sky.backends.local import LocalBackend

    dr, tis = _run("sky_test_autostop", folder="tests/dags")
    text = _out(capfd)
    assert str(dr.state) == "success", text[-3000:]
    assert ("down", -1) not in tis
    backend = LocalBackend(sky_home)
    handle = backend.find("sky-autostop-kept")
    assert handle is not None, "kept after the run"
    roots = [Path(n.root) for n in handle.nodes]
    assert [(r / "idle_down").read_text().strip() for r in roots] == ["60", "60"]
    warning = "SkyPilot would stop the cluster after 1 idle minute and keep its disks"
    assert text.count(warning) == 1, text[-3000:]
    assert "it is torn down instead" in text
    for root in roots:  # the same keeper, armed by the YAML, with a shorter idle time
        (root / "idle_down").write_text("1\n")
    deadline = time.time() + 40
    while backend.find("sky-autostop-kept") is not None and time.time() < deadline:
        time.sleep(0.2)
    assert backend.find("sky-autostop-kept") is None, "the idle cluster is still there"
    assert not (sky_home / "local" / "sky-autostop-kept").exists()


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("AIRFLOW__CORE__MAX_MAP_LENGTH", "3", "[core] max_map_length = 3"),
        ("AIRFLOW__TRIGGERER__CAPACITY", "4", "[triggerer] capacity = 4"),
    ],
)
def test_a_gang_airflow_cannot_map_or_watch_fails_before_provisioning(
    sky_home: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    value: str,
    named: str,
) -> None:
    """4 ranks need max_map_length >= 4 and 5 trigger slots (4 rank tasks + the sensor): said up front."""
    monkeypatch.setenv(setting, value)
    dr, tis = _run("sky_hello")
    assert str(dr.state) == "failed"
    assert tis[("cluster", -1)].state == "failed"
    text = _out(capfd)
    assert named in text and setting in text, text[-3000:]
    assert "Provisioning cluster" not in text
    assert not list((sky_home / "local").glob("sky-*")), "nothing may be provisioned"


def test_a_task_without_run_sets_the_cluster_up_for_a_later_gang(sky_home: Path) -> None:
    """SkyPilot's cluster YAML (no ``run``): setup runs on every node and the cluster stays up; the next
    gang names it and finds what setup left there."""
    dr = _load("sky_test_setup_only", folder="tests/dags").dag.test()
    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    assert str(dr.state) == "success"
    assert ("prepare.down", -1) not in tis
    assert {mi: str(ti.state) for (t, mi), ti in tis.items() if t == "prepare.rank"} == {
        0: "success",
        1: "success",
    }
    assert _xcom(dr, "use.gang", "return_value") == "set up on rank 0"
    assert tis[("use.down", -1)].state == "success"
    assert not (sky_home / "local" / "sky-setup-only").exists()
