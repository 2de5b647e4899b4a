"""``make demo``: run ``sky_hello`` and ``sky_fail_fast`` under a real Airflow and show what happened.

Starts one :class:`~devstack.stack.AirflowStack` (api-server, scheduler with the
LocalExecutor, dag-processor, triggerer; SQLite) with ``AIRFLOW_HOME=<repo>/.airflow-demo/airflow``
and ``SKY_PROVIDER_HOME=<repo>/.airflow-demo/sky`` (both wiped first), triggers both DAGs at once
and prints, for each run, a table read back from Airflow's REST API: every rank's node IP, task
state, exit code and reason (from the ``sky_rank`` XCom each rank task pushes, even when it
fails), the gang sensor and teardown states and the run's state. For the failing run it prints
how long Airflow took from the root-cause rank's exit to the end of the run.

Exit status: 0 when ``sky_hello`` succeeded, ``sky_fail_fast`` failed, and no process was left
behind; 1 otherwise. The stack is stopped in every case (also on Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from devstack.stack import AirflowStack, parse_time, processes_under

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / ".airflow-demo"
EXPECTED = {"sky_hello": "success", "sky_fail_fast": "failed"}


def _fmt(value: Any, spec: str = "") -> str:
    if value is None or value == "":
        return "-"
    return format(value, spec)


def report(stack: AirflowStack, dag_id: str, run_id: str) -> tuple[str, float | None]:
    """Print the run's table; returns the run state and, for a failed run, failure → run end."""
    run = stack.dag_run(dag_id, run_id)
    tis = stack.task_instances(dag_id, run_id)
    ranks = [t for t in tis if t["task_id"].endswith(".rank")]
    others = {t["task_id"].rsplit(".", 1)[-1]: t for t in tis if not t["task_id"].endswith(".rank")}
    print(f"\n{dag_id}  (run {run_id})")
    header = (
        f"  {'rank':<5} {'node IP':<12} {'task':<9} {'rank state':<10} {'exit':>4}  {'duration':>8}  reason"
    )
    print(header)
    print("  " + "-" * (len(header) + 20))
    summaries: list[dict[str, Any]] = []
    for t in sorted(ranks, key=lambda t: t["map_index"]):
        s = stack.xcom(dag_id, run_id, t["task_id"], "sky_rank", t["map_index"]) or {}
        summaries.append(s)
        dur = s["end"] - s["start"] if s.get("end") and s.get("start") else None
        label = t["rendered_map_index"] or str(t["map_index"])
        print(
            f"  {_fmt(s.get('rank', label if t['map_index'] >= 0 else None)):<5} {_fmt(s.get('ip')):<12} "
            f"{_fmt(t['state']):<9} {_fmt(s.get('state')):<10} {_fmt(s.get('exit_code')):>4}  "
            f"{_fmt(dur, '.1f') + ' s' if dur is not None else '-':>8}  {_fmt(s.get('reason'))}"
        )
    what = {"cluster": "cluster (setup)", "job": "job (start)", "gang": "gang sensor", "down": "teardown"}
    for name, title in what.items():
        task = others.get(name)
        if task is not None:
            print(f"  {title:<17} {_fmt(task['state']):<16} {_fmt(task['duration'], '.1f')} s")
    state = str(run["state"])
    start, end = parse_time(run.get("start_date")), parse_time(run.get("end_date"))
    took = f" in {end - start:.1f} s" if start and end else ""
    print(f"  run: {state}{took}")
    latency = None
    bad = [s for s in summaries if s.get("state") in ("failed", "lost") and s.get("end")]
    if state == "failed" and bad and end:
        cause = min(bad, key=lambda s: (s["end"], s["rank"]))
        latency = end - float(cause["end"])
        print(f"  root cause: rank {cause['rank']} ({cause['ip']}) {cause['reason']}")
        print(f"  failure → run end: {latency:.1f} s")
    return state, latency


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    home, sky = DEMO / "airflow", DEMO / "sky"
    left = processes_under(DEMO)
    if left:
        print(f"processes from an earlier demo still run under {DEMO}; stop them first: {left}")
        return 1
    for d in (home, sky):
        shutil.rmtree(d, ignore_errors=True)
    sky.mkdir(parents=True)
    t0 = time.monotonic()
    print(f"Starting Airflow (AIRFLOW_HOME={home}, SKY_PROVIDER_HOME={sky}); logs in {home / 'logs'}")
    stack = AirflowStack(home, REPO / "dags_examples", {"SKY_PROVIDER_HOME": str(sky)})
    ok = True
    try:
        stack.start()
        stack.wait_ready()
        print(
            f"api-server {stack.url}, scheduler (LocalExecutor), dag-processor and triggerer ready "
            f"after {time.monotonic() - t0:.0f} s"
        )
        runs = {dag_id: stack.trigger(dag_id) for dag_id in EXPECTED}
        print(f"Triggered {', '.join(runs)}; waiting for both runs")
        for dag_id, run_id in runs.items():
            stack.wait_run(dag_id, run_id, timeout=90)
        for dag_id, run_id in runs.items():
            state, _ = report(stack, dag_id, run_id)
            if state != EXPECTED[dag_id]:
                print(f"  UNEXPECTED: {dag_id} should have ended {EXPECTED[dag_id]}, it ended {state}")
                ok = False
    finally:
        stack.stop()
    deadline = time.monotonic() + 5
    left = processes_under(DEMO)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_under(DEMO)
    left += [(pid, "airflow service") for pid in stack.leftover_processes()]
    if left:
        print(f"\nLEFT BEHIND: {left}")
        ok = False
    else:
        print("\nStack stopped; no process left behind.")
    print(f"Demo {'passed' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
