"""Figure 4: Airflow end to end. 8 ranks under a real api-server + scheduler + dag-processor + triggerer.

``sky_gang`` over a ``sky_ssh`` connection (``benchmarks/dags/bench_sky.py``) against the SSH
provider's ``SSHOperator.partial(...).expand(...)`` with one ``ssh`` connection per host
(``benchmarks/dags/bench_ssh.py``), on the same 8 sshd hosts. Times come from Airflow's REST API:
a run's ``start_date`` → ``end_date``. The fail-fast SSHOperator run cannot fail before its sleeping
siblings end, so it is given up after a cap (then marked failed through the API and its remote
``sleep``s killed); it is run once, since a capped run has only one possible result.

Goals: a trivial gang (every rank ``true``) in at most twice the SSHOperator run's time, and
a rank's failing exit to a failed run in under 5 s. Each DAG runs once untimed first: the first run
after the stack starts also pays one-time costs of a fresh triggerer and fresh workers (its figure is
reported on its own line). Every timed run keeps its tasks' start/end offsets, and the sky ``true``
runs are cut into segments (``segments``) so the table shows where the time goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from benchmarks.common import REPO, Hosts, Row, floor_env

DAGS = REPO / "benchmarks" / "dags"
RANKS = 8
RUN_TIMEOUT = 300.0
#: the goals: sky_gang true run / SSHOperator true run, and a rank's failing exit -> run failed
RATIO_GOAL = 2.0
EXIT_TO_FAILED_GOAL = 5.0
#: the sky_gang tasks in the order they run (``gang.rank`` / ``gang.gang``: the mapped rank tasks and the
#: gang sensor, both started in the triggerer)
_CLUSTER, _JOB, _DOWN = "gang.cluster", "gang.job", "gang.down"


#: Airflow's own defaults for the settings that pace a run, over the test stack's faster values
#: (``dev/stack.py``: scheduler idle sleep 0.2 s, heartbeats 1-2 s): the figures are what a user gets
#: without tuning. ``SKY_BENCH_STACK_SETTINGS=1`` keeps the stack's values (the README says what
#: each does).
AIRFLOW_DEFAULTS = {
    "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "1",
    "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "5",
    "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "5",
}


#: Airflow's floor (``benchmarks/dags/bench_floor.py``): sky_gang's DAG shape with tasks that do
#: nothing, and the shape with one hand-off less; dag id -> what the row calls it
FLOORS = {
    "bench_floor_true": "sky_gang's shape (4 hops)",
    "bench_floor_three_hops": "3 hops (cluster + job as one task)",
}


def _floor_rows(
    floors: dict[str, list[float]], ssh_true: list[float], timelines: dict[str, Any]
) -> list[Row]:
    """The floor runs and their ratio to the SSHOperator run: the least a gang of that shape takes."""
    rows = []
    for dag_id, name in FLOORS.items():
        walls = floors[dag_id]
        rows.append(
            Row(
                f"4 Airflow's floor: {name}, no provider work",
                RANKS,
                walls,
                note="the same tasks doing nothing; ranks start and end in the triggerer",
                extra={"tasks": timelines.get(dag_id, [])},
            )
        )
        ratio = [a / b for a, b in zip(walls, ssh_true, strict=False)]
        rows.append(
            Row(
                f"4 ..floor/SSHOperator: {name}",
                RANKS,
                ratio,
                "x",
                f"<= {RATIO_GOAL:g} leaves room",
                bool(ratio) and statistics.median(ratio) <= RATIO_GOAL,
                note="above the goal: no provider work can meet it with this shape",
            )
        )
    return rows


def settings_used() -> str:
    """Which scheduler pacing and bytecode the figures were taken with, for the table's notes."""
    if os.environ.get("SKY_BENCH_STACK_SETTINGS"):
        out = "the test stack's scheduler settings (idle sleep 0.2 s, heartbeat 1 s)"
    else:
        out = "Airflow's default scheduler settings (idle sleep 1 s, heartbeat 5 s)"
    return out + (", no bytecode cache" if os.environ.get("SKY_BENCH_NO_BYTECODE") else ", bytecode cached")


def _env(hosts: Hosts, base: Path) -> dict[str, str]:
    c = hosts.cluster
    nodes = hosts.nodes[:RANKS]
    sky = hosts.sky_connection()
    sky["host"] = ",".join(hosts.entries(RANKS))
    env = {
        "SKY_PROVIDER_HOME": str(base / "sky-e2e"),
        "AIRFLOW_CONN_SKY_BENCH": json.dumps(sky),
        **floor_env(base / "floor"),
    }
    if not os.environ.get("SKY_BENCH_STACK_SETTINGS"):
        env.update(AIRFLOW_DEFAULTS)
    if not os.environ.get("SKY_BENCH_NO_BYTECODE"):
        # Python's bytecode cache, as any installed Airflow has (pip compiles at install): without it
        # (PYTHONDONTWRITEBYTECODE here) every task process compiles Airflow, paramiko and the
        # provider from source, seconds per task on 2 cores. Kept under the benchmark's own
        # directory, the shared virtualenv untouched; the untimed warm-up run fills it.
        env["PYTHONDONTWRITEBYTECODE"] = ""
        env["PYTHONPYCACHEPREFIX"] = str(base / "pycache")
    for i, node in enumerate(nodes):
        env[f"AIRFLOW_CONN_SSH_BENCH_{i}"] = json.dumps(
            {
                "conn_type": "ssh",
                "host": node.host,
                "login": node.user,
                "port": node.port,
                "extra": {
                    "key_file": c.client_key_path,
                    "host_key": node.host_pubkey,
                    "look_for_keys": "false",
                },
            }
        )
    return env


def _times(stack: Any, dag_id: str, run_id: str) -> tuple[str, float, float]:
    from devstack.stack import parse_time

    run = stack.dag_run(dag_id, run_id)
    start, end = parse_time(run.get("start_date")), parse_time(run.get("end_date"))
    if start is None or end is None:
        raise RuntimeError(f"{dag_id} {run_id}: no start/end date in {run}")
    return str(run["state"]), start, end


def _run(stack: Any, dag_id: str) -> tuple[str, str, float, float]:
    import httpx

    run_id = stack.trigger(dag_id)
    deadline = time.monotonic() + RUN_TIMEOUT
    while True:  # an API read that times out on a loaded machine is asked again, not a failed figure
        try:
            state = stack.wait_run(dag_id, run_id, timeout=max(1.0, deadline - time.monotonic()))
            break
        except httpx.TimeoutException:
            if time.monotonic() > deadline:
                raise
    _, start, end = _times(stack, dag_id, run_id)
    return run_id, state, start, end


def timeline(stack: Any, dag_id: str, run_id: str, start: float) -> dict[str, list[float | None]]:
    """Every task's (start, end) in seconds after the run's start: where the time goes."""
    from devstack.stack import parse_time

    out: dict[str, list[float | None]] = {}
    for t in stack.task_instances(dag_id, run_id):
        name = t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else "")
        s, e = parse_time(t["start_date"]), parse_time(t["end_date"])
        out[name] = [round(s - start, 2) if s else None, round(e - start, 2) if e else None]
    return out


def segments(tl: dict[str, list[float | None]], wall: float) -> dict[str, float]:
    """A sky_gang run cut into consecutive segments (seconds) from its task timeline.

    ``scheduler`` segments are the gaps where no task of the run was active (the scheduler and executor
    between one task's end and the next task's start); ``watch (triggerer)`` runs from the job task's
    end to the last rank task's or gang sensor's end: the scheduler's deferral of the rank tasks, the
    triggerer's pick-up, the watch itself and the triggerer's report of the end.
    """
    watchers = [v for k, v in tl.items() if k.startswith(("gang.rank", "gang.gang"))]
    try:
        c0, c1 = tl[_CLUSTER]
        j0, j1 = tl[_JOB]
        d0, d1 = tl[_DOWN]
        w1 = max(v[1] for v in watchers if v[1] is not None)
    except (KeyError, ValueError, TypeError):
        return {}
    if None in (c0, c1, j0, j1, d0, d1):
        return {}
    assert c0 is not None and c1 is not None and j0 is not None and j1 is not None
    assert d0 is not None and d1 is not None
    return {
        "run start -> cluster task (scheduler)": c0,
        "cluster task (provision + setup)": c1 - c0,
        "cluster -> job (scheduler)": j0 - c1,
        "job task (gang start)": j1 - j0,
        "watch (triggerer): job end -> last watcher end": w1 - j1,
        "watchers -> down (scheduler)": d0 - w1,
        "down task (teardown)": d1 - d0,
        "down -> run end (scheduler)": wall - d1,
    }


def _why(stack: Any, dag_id: str, run_id: str) -> str:
    """Task states and the end of each failed task's log, for an unexpected run state."""
    out = []
    for t in stack.task_instances(dag_id, run_id):
        out.append(f"  {t['task_id']}[{t['map_index']}] = {t['state']}")
        if t["state"] == "failed":
            with contextlib.suppress(Exception):
                tail = stack.task_log(dag_id, run_id, t["task_id"], t["map_index"]).splitlines()[-25:]
                out += [f"      {line[:300]}" for line in tail]
    return "\n".join(out)


def _last_sibling_end(stack: Any, dag_id: str, run_id: str, failing: int) -> float | None:
    """When the last cancelled sibling's process ended (its wrapper's own ``end`` timestamp)."""
    ends = [_rank_end(stack, dag_id, run_id, r) for r in range(RANKS) if r != failing]
    return None if None in ends else max(e for e in ends if e is not None)


def _rank_end(stack: Any, dag_id: str, run_id: str, rank: int) -> float | None:
    """The failing rank's own end timestamp (the ``sky_rank`` XCom its task pushes)."""
    with contextlib.suppress(Exception):
        s = stack.xcom(dag_id, run_id, "gang.rank", "sky_rank", rank) or {}
        if s.get("end"):
            return float(s["end"])
    return None


def _capped_run(
    stack: Any, hosts: Hosts, dag_id: str, cap: float, log: Callable[..., None]
) -> dict[str, Any]:
    """Trigger; wait until the run ends or ``cap`` seconds after its start; then stop it for good."""
    import httpx

    from devstack.stack import parse_time

    run_id = stack.trigger(dag_id)
    deadline = time.monotonic() + cap + 120  # bound: the run must at least start
    start: float | None = None
    state = "queued"
    while time.monotonic() < deadline:
        stack.check_alive()
        run = stack.dag_run(dag_id, run_id)
        state = str(run["state"])
        start = parse_time(run.get("start_date"))
        if state in ("success", "failed"):
            break
        if start is not None and time.time() - start >= cap:
            break
        time.sleep(0.5)
    out: dict[str, Any] = {"run_id": run_id, "state_at_cap": state, "start": start}
    if state in ("success", "failed"):
        _, s, e = _times(stack, dag_id, run_id)
        out.update(capped=False, state=state, wall=e - s)
        return out
    out["capped"] = True
    tis = stack.task_instances(dag_id, run_id)
    out["tasks_at_cap"] = {str(t["map_index"]): t["state"] for t in tis}
    log(f"  fig4 {dag_id}: still {state} {cap:g} s after it started ({out['tasks_at_cap']}); stopping it")
    path = f"{stack.url}/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id, safe='')}"
    with httpx.Client(timeout=30) as http:
        for attempt in range(5):  # SQLite under load may answer 500 ("database is locked"): ask again
            res = http.patch(path, json={"state": "failed"})
            if res.status_code < 500 or attempt == 4:
                res.raise_for_status()
                break
            time.sleep(2)
    hosts.kill_user_processes(RANKS)  # the remote `sleep 10000`s outlive their SSH sessions
    end = time.monotonic() + 60
    while time.monotonic() < end:  # the killed tasks' processes wind down before the next run
        if not [t for t in stack.task_instances(dag_id, run_id) if t["state"] in ("running", "queued")]:
            break
        time.sleep(0.5)
    return out


def run(
    plan: Any, hosts: Hosts, base: Path, stack_cm: contextlib.ExitStack, log: Callable[..., None]
) -> list[Row]:
    from devstack.stack import AirflowStack

    home = base / "airflow-e2e"
    (base / "sky-e2e").mkdir(exist_ok=True)
    t = time.monotonic()
    stack = AirflowStack(home, DAGS, _env(hosts, base), parallelism=16, ready_timeout=240)
    stack_cm.enter_context(stack)  # start + wait_ready; stop() when the benchmark ends, whatever happens
    log(f"  Airflow stack ready in {time.monotonic() - t:.0f} s ({stack.url}); {settings_used()}")
    # untimed: the first run after the stack starts pays one-time costs (a fresh triggerer starts its
    # in-process API server on the first XCom read, workers import the provider cold)
    cold: dict[str, Any] = {}
    for dag_id in ("bench_sky_true", "bench_ssh_true", *FLOORS):
        rid, state, s, e = _run(stack, dag_id)
        if state != "success":
            raise RuntimeError(f"{dag_id} run {rid} is {state}\n{_why(stack, dag_id, rid)}")
        cold[dag_id] = {"wall": e - s, "tasks": timeline(stack, dag_id, rid, s), "load": os.getloadavg()}
    log(
        f"  fig4 warm-up (untimed): sky true {cold['bench_sky_true']['wall']:.1f} s, "
        f"ssh true {cold['bench_ssh_true']['wall']:.1f} s"
    )
    sky_true: list[float] = []
    ssh_true: list[float] = []
    parts: dict[str, list[float]] = {}
    loads: list[float] = []
    sky_fail: list[float] = []
    sky_fail_latency: list[float] = []
    once_failed: list[float] = []
    once_siblings: list[float] = []
    timelines: dict[str, Any] = {}
    floors: dict[str, list[float]] = {dag_id: [] for dag_id in FLOORS}
    order: list[tuple[str, str, list[float]]] = [
        ("bench_sky_true", "success", sky_true),
        ("bench_ssh_true", "success", ssh_true),
        *((floor, "success", floors[floor]) for floor in FLOORS),
        ("bench_sky_fail_fast", "failed", sky_fail),
        ("bench_sky_at_once", "failed", []),
    ]
    for i in range(plan.e2e_reps):
        for dag_id, want, into in order:
            loads.append(os.getloadavg()[0])
            rid, state, s, e = _run(stack, dag_id)
            if state != want:
                raise RuntimeError(
                    f"{dag_id} run {rid} is {state}, expected {want}\n{_why(stack, dag_id, rid)}"
                )
            into.append(e - s)
            tl = timeline(stack, dag_id, rid, s)
            timelines.setdefault(dag_id, []).append(tl)
            if dag_id == "bench_sky_true":
                for name, value in segments(tl, e - s).items():
                    parts.setdefault(name, []).append(value)
            rank_end = _rank_end(stack, dag_id, rid, 2)
            if dag_id == "bench_sky_fail_fast" and rank_end is not None:
                sky_fail_latency.append(e - rank_end)
            if dag_id == "bench_sky_at_once" and rank_end is not None:
                once_failed.append(e - rank_end)
                last = _last_sibling_end(stack, dag_id, rid, 2)
                if last is not None:
                    once_siblings.append(last - rank_end)
        log(
            f"  fig4 #{i + 1} (load {loads[-len(order)]:.1f}): sky true {sky_true[-1]:.1f} s, "
            f"ssh true {ssh_true[-1]:.1f} s, Airflow's floor "
            + ", ".join(f"{FLOORS[d]} {v[-1]:.1f} s" for d, v in floors.items())
            + f"; sky fail-fast {sky_fail[-1]:.1f} s"
            + (f" (rank 2 exit -> run failed {sky_fail_latency[-1]:.1f} s)" if sky_fail_latency else "")
            + (
                f"; fails at once: siblings gone {once_siblings[-1]:.2f} s, run failed {once_failed[-1]:.1f} s"
                if once_siblings and once_failed
                else ""
            )
        )
    cap = plan.e2e_cap
    capped = _capped_run(stack, hosts, "bench_ssh_fail_fast", cap, log)
    ratio = [a / b for a, b in zip(sky_true, ssh_true, strict=True)]
    rows = [
        Row(
            "4 run wall: sky_gang, ranks run true",
            RANKS,
            sky_true,
            extra={"tasks": timelines["bench_sky_true"]},
        ),
        Row(
            "4 run wall: SSHOperator.expand, true",
            RANKS,
            ssh_true,
            extra={"tasks": timelines["bench_ssh_true"]},
        ),
        Row(
            "4 ratio sky_gang/SSHOperator (true)",
            RANKS,
            ratio,
            "x",
            f"<= {RATIO_GOAL:g}",
            bool(ratio) and statistics.median(ratio) <= RATIO_GOAL,
            note=f"{settings_used()}; load average at each run: {', '.join(f'{x:.1f}' for x in loads)}",
        ),
        *(
            Row(f"4 sky true: {name}", RANKS, values, note="median over the timed runs")
            for name, values in parts.items()
        ),
        *_floor_rows(floors, ssh_true, timelines),
        Row(
            "4 fail-fast run wall: sky_gang",
            RANKS,
            sky_fail,
            note="run start -> run failed",
            extra={"tasks": timelines["bench_sky_fail_fast"]},
        ),
        Row(
            "4 fail-fast: sky rank 2 exit -> run failed",
            RANKS,
            sky_fail_latency,
            goal=f"< {EXIT_TO_FAILED_GOAL:g} s",
            met=bool(sky_fail_latency) and statistics.median(sky_fail_latency) < EXIT_TO_FAILED_GOAL,
        ),
        Row(
            "4 fails at once: rank 2 exit -> last sibling gone",
            RANKS,
            once_siblings,
            goal="< 1 s",
            met=bool(once_siblings) and statistics.median(once_siblings) < 1.0,
            note="from the ranks' own end timestamps",
            extra={"tasks": timelines["bench_sky_at_once"]},
        ),
        Row(
            "4 fails at once: rank 2 exit -> run failed",
            RANKS,
            once_failed,
            goal="< 10 s",
            met=bool(once_failed) and statistics.median(once_failed) < 10.0,
            note="rank 2 exits while the job task still runs: includes the rest of that task",
        ),
        Row(
            "4 first sky_gang true run after the stack starts",
            RANKS,
            [cold["bench_sky_true"]["wall"]],
            note="untimed warm-up: a fresh triggerer and cold workers",
            extra={"tasks": [cold["bench_sky_true"]["tasks"]], "load": cold["bench_sky_true"]["load"]},
        ),
        Row(
            "4 first SSHOperator true run after the stack starts",
            RANKS,
            [cold["bench_ssh_true"]["wall"]],
            note="untimed warm-up",
            extra={"tasks": [cold["bench_ssh_true"]["tasks"]], "load": cold["bench_ssh_true"]["load"]},
        ),
    ]
    if capped["capped"]:
        rows.append(
            Row(
                "4 fail-fast run wall: SSHOperator",
                RANKS,
                [],
                text=f"> {cap:g} s (capped)",
                note=f"still {capped['state_at_cap']} at the cap; tasks {capped['tasks_at_cap']}",
                extra=capped,
            )
        )
    else:
        rows.append(
            Row(
                "4 fail-fast run wall: SSHOperator",
                RANKS,
                [capped["wall"]],
                note=capped["state"],
                extra=capped,
            )
        )
    return rows
