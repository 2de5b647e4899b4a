"""Figure 4: Airflow end to end. 8 ranks under a real api-server + scheduler + dag-processor + triggerer.

``sky_gang`` over a ``sky_ssh`` connection (``benchmarks/dags/bench_sky.py``) against the SSH
provider's ``SSHOperator.partial(...).expand(...)`` with one ``ssh`` connection per host
(``benchmarks/dags/bench_ssh.py``), on the same 8 sshd hosts. Times come from Airflow's REST API:
a run's ``start_date`` → ``end_date``. The fail-fast SSHOperator run cannot fail before its sleeping
siblings end, so it is given up after a cap (then marked failed through the API and its remote
``sleep``s killed); it is run once, since a capped run has only one possible result.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from benchmarks.common import REPO, Hosts, Row

DAGS = REPO / "benchmarks" / "dags"
RANKS = 8
RUN_TIMEOUT = 300.0


def _env(hosts: Hosts, base: Path) -> dict[str, str]:
    c = hosts.cluster
    nodes = hosts.nodes[:RANKS]
    sky = hosts.sky_connection()
    sky["host"] = ",".join(hosts.entries(RANKS))
    env = {"SKY_PROVIDER_HOME": str(base / "sky-e2e"), "AIRFLOW_CONN_SKY_BENCH": json.dumps(sky)}
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
    from airflow_provider_sky.dev.stack import parse_time

    run = stack.dag_run(dag_id, run_id)
    start, end = parse_time(run.get("start_date")), parse_time(run.get("end_date"))
    if start is None or end is None:
        raise RuntimeError(f"{dag_id} {run_id}: no start/end date in {run}")
    return str(run["state"]), start, end


def _run(stack: Any, dag_id: str) -> tuple[str, str, float, float]:
    run_id = stack.trigger(dag_id)
    state = stack.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)
    _, start, end = _times(stack, dag_id, run_id)
    return run_id, state, start, end


def timeline(stack: Any, dag_id: str, run_id: str, start: float) -> dict[str, list[float | None]]:
    """Every task's (start, end) in seconds after the run's start: where the time goes."""
    from airflow_provider_sky.dev.stack import parse_time

    out: dict[str, list[float | None]] = {}
    for t in stack.task_instances(dag_id, run_id):
        name = t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else "")
        s, e = parse_time(t["start_date"]), parse_time(t["end_date"])
        out[name] = [round(s - start, 2) if s else None, round(e - start, 2) if e else None]
    return out


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

    from airflow_provider_sky.dev.stack import parse_time

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
        http.patch(path, json={"state": "failed"}).raise_for_status()
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
    from airflow_provider_sky.dev.stack import AirflowStack

    home = base / "airflow-e2e"
    (base / "sky-e2e").mkdir(exist_ok=True)
    t = time.monotonic()
    stack = AirflowStack(home, DAGS, _env(hosts, base), parallelism=16, ready_timeout=240)
    stack_cm.enter_context(stack)  # start + wait_ready; stop() when the benchmark ends, whatever happens
    log(f"  Airflow stack ready in {time.monotonic() - t:.0f} s ({stack.url})")
    sky_true: list[float] = []
    ssh_true: list[float] = []
    sky_fail: list[float] = []
    sky_fail_latency: list[float] = []
    once_failed: list[float] = []
    once_siblings: list[float] = []
    timelines: dict[str, Any] = {}
    for i in range(plan.e2e_reps):
        for dag_id, want, into in (
            ("bench_sky_true", "success", sky_true),
            ("bench_ssh_true", "success", ssh_true),
            ("bench_sky_fail_fast", "failed", sky_fail),
            ("bench_sky_at_once", "failed", []),
        ):
            rid, state, s, e = _run(stack, dag_id)
            if state != want:
                raise RuntimeError(
                    f"{dag_id} run {rid} is {state}, expected {want}\n{_why(stack, dag_id, rid)}"
                )
            into.append(e - s)
            timelines.setdefault(dag_id, []).append(timeline(stack, dag_id, rid, s))
            rank_end = _rank_end(stack, dag_id, rid, 2)
            if dag_id == "bench_sky_fail_fast" and rank_end is not None:
                sky_fail_latency.append(e - rank_end)
            if dag_id == "bench_sky_at_once" and rank_end is not None:
                once_failed.append(e - rank_end)
                last = _last_sibling_end(stack, dag_id, rid, 2)
                if last is not None:
                    once_siblings.append(last - rank_end)
        log(
            f"  fig4 #{i + 1}: sky true {sky_true[-1]:.1f} s, ssh true {ssh_true[-1]:.1f} s, "
            f"sky fail-fast {sky_fail[-1]:.1f} s"
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
        Row("4 ratio sky_gang/SSHOperator (true)", RANKS, ratio, "x"),
        Row(
            "4 fail-fast run wall: sky_gang",
            RANKS,
            sky_fail,
            note="run start -> run failed",
            extra={"tasks": timelines["bench_sky_fail_fast"]},
        ),
        Row("4 fail-fast: sky rank 2 exit -> run failed", RANKS, sky_fail_latency),
        Row(
            "4 fails at once: rank 2 exit -> last sibling gone",
            RANKS,
            once_siblings,
            note="goal < 1 s; from the ranks' own end timestamps",
            extra={"tasks": timelines["bench_sky_at_once"]},
        ),
        Row("4 fails at once: rank 2 exit -> run failed", RANKS, once_failed, note="goal < 10 s"),
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
