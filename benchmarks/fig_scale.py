"""Figure 5: scale. One ``sky_gang`` of N ranks on the local backend under a real Airflow stack.

The DAGs are ``benchmarks/dags/scale/bench_scale.py``: ``bench_scale_<N>`` (every rank ``sleep 20``)
and ``bench_scale_fail_<N>`` (rank N//2 exits 3 after 5 s, the others ``sleep 10000``), on the
default ``sky_default`` connection, i.e. the embedded local backend with its state in
``SKY_PROVIDER_HOME`` (inside the benchmark's temp dir). One :class:`AirflowStack` (LocalExecutor,
SQLite) runs every N, one run at a time, configured for the largest N (:func:`stack_env`).

Per run: its wall time from the REST API (``start_date`` → ``end_date``), the ranks' own start/end
timestamps (the ``sky_rank`` XCom every rank task pushes), and the CPU seconds the scheduler and the
triggerer (each with its descendants) used from just before the trigger to the run's end. A run
still going after :func:`cap_for` seconds is reported as such, marked failed through the API and
its clusters torn down; every local cluster left is torn down when the figure ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from benchmarks import kill_floor
from benchmarks.common import REPO, Hosts, Row, floor_env, forget_finished_pids
from benchmarks.fig_airflow import _capped_run, _times

DAGS = REPO / "benchmarks" / "dags" / "scale"
SLEEP = 20.0  # what every rank of bench_scale_<N> runs
PARALLELISM = 32
OVERHEAD_GOAL = 30.0  # seconds, at GOAL_N
GOAL_N = 1024
GONE_GOAL = 1.0  # seconds, at every N
#: the services whose CPU is measured (all four are in the JSON; the table shows scheduler and triggerer)
SERVICES = ("scheduler", "triggerer", "api-server", "dag-processor")
_TICK = os.sysconf("SC_CLK_TCK")


def cap_for(n: int) -> float:
    """Seconds after its start a run of N ranks is given up (338 s at 64, 454 s at 256, 914 s at 1,024)."""
    return 300.0 + 0.6 * n


def stack_env(ns: Sequence[int], state_dir: Path, trigger_select: int | None = None) -> dict[str, str]:
    """The stack's extra environment: the local backend's state dir and what a gang of max(ns) needs."""
    top = max(ns)
    select = (
        {"AIRFLOW__TRIGGERER__MAX_TRIGGER_TO_SELECT_PER_LOOP": str(trigger_select)} if trigger_select else {}
    )
    return {
        **select,
        **floor_env(state_dir / "floor"),
        "SKY_PROVIDER_HOME": str(state_dir),
        "BENCH_SCALE_NS": ",".join(str(n) for n in ns),
        # a mapped task of N ranks (Airflow's default limit is 1,024)
        "AIRFLOW__CORE__MAX_MAP_LENGTH": str(max(1024, top)),
        # N rank triggers + the gang sensor's in one triggerer (default 1,000)
        "AIRFLOW__TRIGGERER__CAPACITY": str(max(1000, top + 10)),
        # every rank of the gang running or deferred at once (the stack's default is its parallelism)
        "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(max(4096, 2 * top)),
    }


# ------------------------------------------------------------------------------------------------ CPU


def _proc_table() -> dict[int, tuple[int, float, float]]:
    """pid -> (ppid, its own CPU s: utime+stime, its reaped children's: cutime+cstime), zombies too."""
    out: dict[int, tuple[int, float, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                f = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # after "comm)": state ppid ... utime(11) stime(12) cutime(13) cstime(14)
        out[int(name)] = (int(f[1]), (int(f[11]) + int(f[12])) / _TICK, (int(f[13]) + int(f[14])) / _TICK)
    return out


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """CPU seconds used so far by each named process: ``self`` (the process alone) and ``tree`` (with
    every live or zombie descendant and every child already reaped by one of them)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, dict[str, float]] = {}
    for name, root in pids.items():
        if root not in table:
            continue
        tree, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            tree += table[pid][1] + table[pid][2]
            todo += children.get(pid, [])
        out[name] = {"self": table[root][1], "tree": tree}
    return out


def cpu_used(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        svc: {k: round(after[svc][k] - before[svc][k], 2) for k in ("self", "tree")}
        for svc in before
        if svc in after
    }


# ------------------------------------------------------------------------------------ local clusters


class LocalClusters:
    """The local backend's clusters of this figure. ``kill_user_processes`` is what
    :func:`fig_airflow._capped_run` calls on the hosts of a run it stopped at its cap: here it tears
    down every cluster (the ranks are processes of this machine)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def down_all(self) -> list[str]:
        from airflow_provider_sky.backends.local import LocalBackend

        forget_finished_pids(self.state_dir)  # see common.forget_finished_pids: teardown kills reused pids
        backend = LocalBackend(self.state_dir)
        names = sorted(p.stem for p in backend.records_dir.glob("*.json"))
        for name in names:
            with contextlib.suppress(Exception):
                backend.terminate(name, grace=0.5)
        return names

    def kill_user_processes(self, n: int | None = None) -> None:
        self.down_all()


# ---------------------------------------------------------------------------------------------- runs


def task_summary(tis: list[dict[str, Any]], start: float | None) -> dict[str, Any]:
    """Per task id: how many, their states, first/last start and end in seconds after the run's start."""
    from devstack.stack import parse_time

    out: dict[str, Any] = {}
    for task_id in sorted({t["task_id"] for t in tis}):
        mine = [t for t in tis if t["task_id"] == task_id]
        entry: dict[str, Any] = {"count": len(mine), "states": dict(Counter(str(t["state"]) for t in mine))}
        for key in ("start_date", "end_date"):
            times = [x for x in (parse_time(t.get(key)) for t in mine) if x is not None]
            if times and start is not None:
                entry[key.split("_")[0]] = [round(min(times) - start, 2), round(max(times) - start, 2)]
        out[task_id] = entry
    return out


def rank_outcomes(stack: Any, dag_id: str, run_id: str, n: int) -> list[dict[str, Any]]:
    """The ``sky_rank`` XCom of every rank (rank, ip, state, exit code, reason, start, end); {} if none."""
    out = []
    for rank in range(n):
        value: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            value = stack.xcom(dag_id, run_id, "gang.rank", "sky_rank", rank) or {}
        out.append(value)
    return out


def _why(stack: Any, dag_id: str, run_id: str, tis: list[dict[str, Any]]) -> str:
    """The tasks' states and the last log line of the first failed task (a cluster's or job's first)."""
    states = {k: v["states"] for k, v in task_summary(tis, None).items()}
    failed = sorted(
        (t for t in tis if t["state"] == "failed"), key=lambda t: (".rank" in t["task_id"], t["map_index"])
    )
    text = f"tasks {states}"
    if failed:
        with contextlib.suppress(Exception):
            t = failed[0]
            lines = stack.task_log(dag_id, run_id, t["task_id"], t["map_index"]).strip().splitlines()
            text += f"; {t['task_id']}[{t['map_index']}]: {lines[-1][:300] if lines else '(empty log)'}"
    return text


def measure(
    stack: Any,
    clusters: LocalClusters,
    dag_id: str,
    n: int,
    want: str,
    log: Callable[..., None],
    ranks: bool = True,
) -> dict[str, Any]:
    """One run: trigger, wait (at most :func:`cap_for`), CPU before/after, tasks and (``ranks``) the
    ranks' ``sky_rank`` read back."""
    pids = {svc: stack.procs[svc].pid for svc in SERVICES if svc in stack.procs}
    before = cpu_seconds(pids)
    cap = cap_for(n)
    out = _capped_run(stack, cast(Hosts, clusters), dag_id, cap, log)
    after = cpu_seconds(pids)
    out.update(cap=cap, want=want, cpu=cpu_used(before, after), problem=None)
    run_id = out["run_id"]
    if out["capped"]:
        out["problem"] = f"> {cap:.0f} s (capped)"
        out["down_after_cap"] = clusters.down_all()  # also what any later rank process left
        return out
    _, out["start"], out["end"] = _times(stack, dag_id, run_id)
    tis = stack.task_instances(dag_id, run_id)
    out["tasks"] = task_summary(tis, out["start"])
    if out["state"] != want:
        out["problem"] = f"run {out['state']}, expected {want}"
        out["why"] = _why(stack, dag_id, run_id, tis)
        log(f"  fig5 {dag_id}: {out['problem']}: {out['why']}")
    if ranks:
        out["ranks"] = rank_outcomes(stack, dag_id, run_id, n)
    return out


def _cpu_text(cpu: Mapping[str, Any]) -> str:
    return ", ".join(f"{svc} {v['tree']:.1f} s" for svc, v in cpu.items())


def _overhead(stack: Any, clusters: LocalClusters, n: int, reps: int, log: Callable[..., None]) -> list[Row]:
    dag_id = f"bench_scale_{n}"
    over: list[float] = []
    to_last_start: list[float] = []
    last_end_to_run_end: list[float] = []
    cpu: dict[str, list[float]] = {svc: [] for svc in SERVICES}
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    for i in range(reps):
        r = measure(stack, clusters, dag_id, n, "success", log)
        ranks = r.pop("ranks", [])  # N entries: the rows keep what they need
        runs.append(r)
        for svc in SERVICES:
            if svc in r["cpu"]:
                cpu[svc].append(r["cpu"][svc]["tree"])
        if r["problem"]:
            problems.append(r["problem"])
            log(f"  fig5 N={n} sleep #{i + 1}: {r['problem']}; CPU {_cpu_text(r['cpu'])}")
            continue
        over.append(r["wall"] - SLEEP)
        starts = [float(x["start"]) for x in ranks if x.get("start")]
        ends = [float(x["end"]) for x in ranks if x.get("end")]
        if len(starts) == n:
            to_last_start.append(max(starts) - r["start"])
        if len(ends) == n:
            last_end_to_run_end.append(r["end"] - max(ends))
        r["rank_times"] = {"with_start": len(starts), "with_end": len(ends)}
        log(
            f"  fig5 N={n} sleep #{i + 1}: wall {r['wall']:.1f} s (overhead {over[-1]:.1f} s)"
            + (f", run start -> last rank start {to_last_start[-1]:.1f} s" if len(starts) == n else "")
            + f"; CPU {_cpu_text(r['cpu'])}"
        )
    goal = f"< {OVERHEAD_GOAL:g} s" if n == GOAL_N else ""
    met: bool | None = None if not goal and not problems else False
    if goal and not problems and over:
        met = max(over) < OVERHEAD_GOAL
    note = "; ".join(problems) or f"run wall - {SLEEP:g} s"
    text = problems[0] if problems and not over else None
    return [
        Row(
            f"5 overhead: run wall - {SLEEP:g} s (sleep {SLEEP:g})",
            n,
            over,
            "s",
            goal,
            met,
            note,
            text,
            extra={"runs": runs, "cap": cap_for(n)},
        ),
        Row("5 ..run start -> last rank start", n, to_last_start, "s", note="ranks' own start timestamps"),
        Row("5 ..last rank end -> run end", n, last_end_to_run_end, "s"),
        Row(
            "5 scheduler CPU over the sleep run",
            n,
            cpu["scheduler"],
            "s",
            note="with LocalExecutor workers and task processes",
        ),
        Row("5 triggerer CPU over the sleep run", n, cpu["triggerer"], "s", note="with its trigger runner"),
    ]


def _never_started(siblings: Sequence[Mapping[str, Any]], exit_at: Any) -> list[Mapping[str, Any]]:
    """The siblings the gang start recorded cancelled without starting them, because the failing rank
    had already exited: no process ever ran (start = end, both after the exit). They are not "gone"
    (nothing was killed); when their record was written is the row ``exit -> last sibling recorded``."""
    if not exit_at:
        return []
    return [
        x
        for x in siblings
        if x.get("start") and x.get("end") and float(x["start"]) == float(x["end"]) >= float(exit_at)
    ]


def _fail_fast(stack: Any, clusters: LocalClusters, n: int, reps: int, log: Callable[..., None]) -> list[Row]:
    dag_id = f"bench_scale_fail_{n}"
    failing = n // 2
    gone: list[float] = []
    recorded: list[float] = []
    failed: list[float] = []
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    for i in range(reps):
        r = measure(stack, clusters, dag_id, n, "failed", log)
        ranks = r.pop("ranks", [])
        runs.append(r)
        if r["problem"]:
            problems.append(r["problem"])
            log(f"  fig5 N={n} fail-fast #{i + 1}: {r['problem']}; CPU {_cpu_text(r['cpu'])}")
            continue
        exit_at = ranks[failing].get("end")
        siblings = [x for k, x in enumerate(ranks) if k != failing]
        ends = [float(x["end"]) for x in siblings if x.get("end")]
        never = _never_started(siblings, exit_at)
        r["never_started"] = len(never)
        # per rank: start and end after the failing exit, and the state (where the last ones came from)
        r["rank_times"] = [
            [
                k,
                round(float(x["start"]) - float(exit_at), 2) if x.get("start") and exit_at else None,
                round(float(x["end"]) - float(exit_at), 2) if x.get("end") and exit_at else None,
                str(x.get("state")),
            ]
            for k, x in enumerate(ranks)
        ]
        running_ends = [float(x["end"]) for x in siblings if x.get("end") and x not in never]
        r["failing_rank"] = {k: v for k, v in ranks[failing].items() if k != "ip"}
        r["sibling_states"] = dict(Counter(str(x.get("state")) for x in siblings))
        r["siblings_without_end"] = len(siblings) - len(ends)
        if not exit_at:
            problems.append(
                f"no end timestamp for rank {failing} (sky_rank XCom: {ranks[failing] or 'none'})"
            )
            continue
        failed.append(r["end"] - float(exit_at))
        if running_ends:
            gone.append(max(running_ends) - float(exit_at))
        if ends:
            recorded.append(max(ends) - float(exit_at))
        if len(ends) < len(siblings):
            problems.append(f"{len(siblings) - len(ends)} of {len(siblings)} siblings have no end timestamp")
        log(
            f"  fig5 N={n} fail-fast #{i + 1}: rank {failing} exit -> "
            + (f"last running sibling gone {gone[-1]:.2f} s, " if running_ends else "")
            + (
                f"last sibling recorded over {recorded[-1]:.2f} s ({len(never)} never started), "
                if ends
                else ""
            )
            + f"run failed {failed[-1]:.1f} s (wall {r['wall']:.1f} s; siblings {r['sibling_states']}); "
            f"CPU {_cpu_text(r['cpu'])}"
        )
    met = not problems and bool(gone) and max(gone) < GONE_GOAL
    text = problems[0] if problems and not gone else None
    note = "; ".join(problems) or "from the ranks' own end timestamps"
    return [
        Row(
            "5 fail-fast: rank N/2 exit -> last running sibling gone",
            n,
            gone,
            "s",
            f"< {GONE_GOAL:g} s",
            met,
            note,
            text,
            extra={"runs": runs, "cap": cap_for(n)},
        ),
        Row(
            "5 ..exit -> last sibling recorded over",
            n,
            recorded,
            "s",
            note="never-started siblings included (recorded cancelled by the gang start, no process)",
        ),
        Row("5 fail-fast: rank N/2 exit -> run failed", n, failed, "s", text=text if not failed else None),
    ]


def _airflow_floor(
    stack: Any, clusters: LocalClusters, n: int, reps: int, log: Callable[..., None]
) -> list[Row]:
    """``bench_scale_floor_<N>``: sky_gang's shape with no provider work (:mod:`benchmarks.floor`), the
    ranks "running" 20 s from the job task's end: its wall - 20 s is the least overhead Airflow allows."""
    over: list[float] = []
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    for i in range(reps):
        r = measure(stack, clusters, f"bench_scale_floor_{n}", n, "success", log, ranks=False)
        runs.append(r)
        if r["problem"]:
            problems.append(r["problem"])
            log(f"  fig5 N={n} floor #{i + 1}: {r['problem']}")
            continue
        over.append(r["wall"] - SLEEP)
        log(
            f"  fig5 N={n} floor #{i + 1}: wall {r['wall']:.1f} s (overhead {over[-1]:.1f} s); CPU {_cpu_text(r['cpu'])}"
        )
    return [
        Row(
            f"5 floor: Airflow alone, sky_gang's shape, ranks end {SLEEP:g} s after the job task: wall - {SLEEP:g} s",
            n,
            over,
            "s",
            note="; ".join(problems) or "no provider work: the least overhead any provider can have here",
            text=problems[0] if problems and not over else None,
            extra={"runs": runs},
        )
    ]


def _kill_floor(base: Path, n: int, reps: int, log: Callable[..., None]) -> Row:
    """N-1 rank-like process groups ended by one signal, nothing else on the machine (:mod:`kill_floor`)."""
    last: list[float] = []
    medians: list[float] = []
    for i in range(reps):
        top, mid = kill_floor.once(base / f"kill-floor-{n}", n - 1)
        last.append(top)
        medians.append(mid)
        log(
            f"  fig5 N={n} kill floor #{i + 1}: {n - 1} groups, signal -> last waiter {top:.2f} s (median {mid:.2f} s)"
        )
    return Row(
        "5 floor: one signal ends N-1 (bash -> sleep) groups: -> last waiter woken",
        n,
        last,
        "s",
        note="no provider code, nothing else running: the least any fail-fast can take here; medians "
        + ", ".join(f"{m:.2f}" for m in medians)
        + " s",
    )


def _warmup(stack: Any, clusters: LocalClusters, log: Callable[..., None]) -> Row:
    """One rank running ``true`` before anything is measured: the first task a new stack runs waits
    ~10-20 s longer for its worker than any later one, which would land on the first N's overhead."""
    r = measure(stack, clusters, "bench_scale_warmup", 1, "success", log)
    r.pop("ranks", None)
    wall = [r["wall"]] if "wall" in r else []
    log(f"  fig5 warm-up: {r['problem'] or f'wall {wall[0]:.1f} s'}")
    return Row(
        "5 warm-up run wall (1 rank, true; not a figure)",
        1,
        wall,
        "s",
        note=r["problem"] or "the stack's first run",
        extra={"runs": [r]},
    )


def _alone_once(home: Path, n: int) -> tuple[float, Counter[str]]:
    """One gang of N local ranks with no Airflow and no watcher: rank N/2 exits 3 after 5 s, the machine
    stops its siblings; seconds from its exit to the last sibling's end, and the siblings' reasons."""
    from airflow_provider_sky.backends.local import LocalBackend
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.jobs import GangClient

    failing = n // 2
    run = f'if [ "$SKYPILOT_NODE_RANK" = {failing} ]; then sleep 5; exit 3; fi; sleep 10000'
    b = LocalBackend(home)
    task = task_from_args(num_nodes=n, run=run)
    client = GangClient(b, b.provision("alone", task))
    try:
        client.launch(task, "job", grace=1.0)
        deadline = time.monotonic() + 60 + n / 10
        while time.monotonic() < deadline:
            status = client.peek("job")
            if len(status.ranks) == n and all(r.terminal for r in status.ranks):
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"the {n}-rank gang did not end within {60 + n / 10:.0f} s")
        exit_at = status.by_rank(failing).end
        siblings = [r.to_dict() for r in status.ranks if r.rank != failing]
        if exit_at is None or any(x.get("end") is None for x in siblings):
            raise RuntimeError(f"a rank has no end timestamp: {status.to_dict()}")
        never = _never_started(siblings, exit_at)
        reasons = Counter(str(x.get("reason")) for x in siblings)
        reasons[f"(never started: {len(never)})"] = 1
        return max(float(cast(float, x["end"])) for x in siblings if x not in never) - exit_at, reasons
    finally:
        b.terminate("alone")


def _node_alone(base: Path, n: int, reps: int, log: Callable[..., None]) -> Row:
    """Figure 5's fail-fast with the machine to itself: what the provider's node fail-fast costs at N,
    apart from what a busy scheduler and triggerer take from it."""
    gone: list[float] = []
    reasons: Counter[str] = Counter()
    for i in range(reps):
        g, r = _alone_once(base / f"sky-alone-{n}-{i}", n)
        gone.append(g)
        reasons.update(r)
        log(
            f"  fig5 N={n} without Airflow #{i + 1}: rank {n // 2} exit -> last running sibling gone {g:.2f} s"
        )
    return Row(
        "5 fail-fast without Airflow: exit -> last running sibling gone",
        n,
        gone,
        "s",
        f"< {GONE_GOAL:g} s",
        max(gone) < GONE_GOAL,
        note="no stack on the machine, no watcher: the machine's own cancel; siblings' reasons: "
        + "; ".join(f"{k} x{v}" for k, v in reasons.most_common(3)),
    )


def run(plan: Any, base: Path, stack_cm: Any, log: Callable[..., None]) -> list[Row]:
    """Figure 5 for every N of ``plan.scale_ns`` (``plan.scale_reps`` runs of each DAG)."""
    from devstack.stack import AirflowStack

    alone = [_node_alone(base, n, plan.scale_reps, log) for n in plan.scale_ns]
    alone += [_kill_floor(base, n, plan.scale_reps, log) for n in plan.scale_ns]
    state = base / "sky-scale"
    state.mkdir(exist_ok=True)
    clusters = LocalClusters(state)
    stack_cm.callback(clusters.down_all)  # after the stack has stopped (LIFO): nothing launches any more
    t = time.monotonic()
    stack = AirflowStack(
        base / "airflow-scale",
        DAGS,
        stack_env(plan.scale_ns, state, plan.trigger_select),
        parallelism=PARALLELISM,
        ready_timeout=240,
    )
    stack_cm.enter_context(stack)  # start + wait_ready; stop() when the benchmark ends, whatever happens
    log(f"  Airflow stack ready in {time.monotonic() - t:.0f} s ({stack.url})")
    rows = [_warmup(stack, clusters, log)]
    for n in plan.scale_ns:
        rows += _overhead(stack, clusters, n, plan.scale_reps, log)
        rows += _fail_fast(stack, clusters, n, plan.scale_reps, log)
        rows += _airflow_floor(stack, clusters, n, plan.scale_reps, log)
    return rows + alone
