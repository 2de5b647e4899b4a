"""``make bench``: the provider's figures on this machine, against the local backend and real sshd hosts.

    python -m benchmarks.run [--quick] [--only 1,2,3,4,5,6,7,8,9,10] [--out PATH]

Prints a table (figure | N | median | min | max | runs | goal | met) and writes
``benchmarks/results/latest.json`` (the figures, the machine's core count, versions of python, airflow,
paramiko, openssh, pdsh). Every sshd host, rank, Airflow service and temp dir it starts is removed
again, also on Ctrl-C, SIGTERM or an error. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Hosts,
    Row,
    forget_finished_pids,
    processes_under,
    say,
    sigterm_as_interrupt,
    table,
)
from benchmarks.fig_failfast import TRIGGER_DELAY

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Plan:
    quick: bool
    ns: tuple[int, ...]
    ff_reps: int  # fig 1, poll 0.5, per N and backend
    ff_fast_reps: int  # fig 1 at poll 0.2
    start_reps: int  # fig 2
    mon_reps: int  # fig 3
    mon_window: float
    indep_max_n: int  # fig 3: measure N independent pollers up to this N (N×N printed for all)
    e2e_reps: int  # fig 4
    e2e_cap: float  # fig 4: the SSHOperator fail-fast run is given up after this many seconds
    ff_once_reps: int = 3  # fig 1c (rank fails at once), per N and backend
    #: fig 1c: seconds from the job task's end to the triggers' start
    trigger_delay: float = TRIGGER_DELAY
    at_once_only: bool = False  # `--only 1c`: figure 1's "fails at once" case alone
    scale_ns: tuple[int, ...] = (64, 256, 1024)  # fig 5: gang sizes under the real scheduler
    scale_reps: int = 1  # fig 5: runs of each DAG per N
    #: fig 5: ``[triggerer] max_trigger_to_select_per_loop`` of its stack (None: Airflow's default, 50)
    trigger_select: int | None = None
    k8s_ns: tuple[int, ...] = ()  # fig 6: gang sizes on Kubernetes (empty: 4 + the largest the cluster holds)
    k8s_agent: bool = False  # fig 6 on the node-agent path (pods with python3; sizes 4, 32, 128)

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, (4, 16), 2, 1, 2, 1, 2.0, 4, 1, 20.0, ff_once_reps=1, scale_ns=(64,))
        return cls(False, (4, 16, 64), 5, 3, 5, 3, 5.0, 16, 3, 60.0, ff_once_reps=3)


def _setup_env(base: Path) -> None:
    """Airflow config of this process (the triggers run here), set before anything imports airflow."""
    (base / "airflow").mkdir(parents=True)
    (base / "sky").mkdir()
    for key in [k for k in os.environ if k.startswith("AIRFLOW")]:
        del os.environ[key]
    os.environ.update(
        {
            "AIRFLOW_HOME": str(base / "airflow"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{base}/airflow/airflow.db",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
            "SKY_PROVIDER_HOME": str(base / "sky"),
        }
    )


def _quiet_logs() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    for name in ("airflow", "airflow_provider_sky", "paramiko", "asyncio", "airflow.triggers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def _version(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    text = (res.stdout + res.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def versions() -> dict[str, str]:
    import airflow
    import paramiko

    out = {
        "python": platform.python_version(),
        "airflow": airflow.__version__,
        "paramiko": paramiko.__version__,
        "openssh": _version(["ssh", "-V"]),
        "pdsh": _version(["pdsh", "-V"]),
    }
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        out["apache-airflow-providers-ssh"] = version("apache-airflow-providers-ssh")
    return out


def code_state() -> dict[str, Any]:
    """Which package code was measured: commit, uncommitted package files, a hash of the sources."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((REPO / "airflow_provider_sky").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    out: dict[str, Any] = {"package_sha256": h.hexdigest()[:16]}
    with contextlib.suppress(Exception):
        git = ["git", "-C", str(REPO)]
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        status = subprocess.run(
            [*git, "status", "--porcelain", "--", "airflow_provider_sky"], capture_output=True, text=True
        ).stdout
        out["uncommitted"] = [line[3:] for line in status.splitlines()]
    return out


# ------------------------------------------------------------------------------------------ figures


class Bench:
    def __init__(self, plan: Plan, base: Path, stack: contextlib.ExitStack) -> None:
        self.plan = plan
        self.base = base
        self.stack = stack
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self._hosts: Hosts | None = None
        self._ssh_clusters: list[tuple[Any, str]] = []
        self._local: list[tuple[Any, str]] = []

    # -- resources (each released by the ExitStack)

    def hosts(self, n: int) -> Hosts:
        if self._hosts is None or len(self._hosts.nodes) < n:
            want = max(n, max(self.plan.ns), 8)
            say(f"starting {want} sshd test hosts ...")
            t = time.monotonic()
            self._hosts = self.stack.enter_context(Hosts(want, self.base))
            os.environ["AIRFLOW_CONN_SKY_BENCH"] = json.dumps(self._hosts.sky_connection())
            self.stack.callback(self._close_ssh)
            say(
                f"  {want} hosts up in {time.monotonic() - t:.1f}s (block 127.0.{self._hosts.cluster.block}.x)"
            )
        return self._hosts

    def _close_ssh(self) -> None:
        from airflow_provider_sky.runners import ssh

        if self._hosts is not None:
            self._hosts.forget_finished_pids()  # see common.forget_finished_pids: teardown kills reused pids
        for backend, name in self._ssh_clusters:
            with contextlib.suppress(Exception):
                backend.terminate(name, grace=0.5)
        self._ssh_clusters.clear()
        ssh.close_all()

    def ssh_cluster(self, n: int, name: str) -> tuple[Any, Any]:
        from airflow_provider_sky.spec import task_from_args

        hosts = self.hosts(n)
        backend = hosts.backend(n)
        handle = backend.provision(name, task_from_args(num_nodes=n, run="true"))
        self._ssh_clusters.append((backend, name))
        return backend, handle

    def local_cluster(self, n: int, name: str) -> tuple[Any, Any]:
        from airflow_provider_sky.backends.local import LocalBackend
        from airflow_provider_sky.spec import task_from_args

        backend = LocalBackend(os.environ["SKY_PROVIDER_HOME"])
        if not self._local:
            self.stack.callback(self._close_local)
        handle = backend.provision(name, task_from_args(num_nodes=n, run="true"))
        self._local.append((backend, name))
        return backend, handle

    def _close_local(self) -> None:
        forget_finished_pids(os.environ["SKY_PROVIDER_HOME"])  # teardown (as root!) would kill reused pids
        for backend, name in self._local:
            with contextlib.suppress(Exception):
                backend.terminate(name, grace=0.5)
        self._local.clear()

    # -- figure 1

    def fig1(self) -> None:
        import airflow_provider_sky.triggers.gang  # noqa: F401  (imports Airflow: not inside a measurement)
        from benchmarks import fig_failfast as ff

        say("\n== figure 1: fail-fast latency (poll_interval 0.5 s, grace 3 s) ==")
        variants = [("ssh", 0.5, self.plan.ff_reps), ("local", 0.5, self.plan.ff_reps)]
        if self.plan.ff_fast_reps:
            variants += [("ssh", 0.2, self.plan.ff_fast_reps), ("local", 0.2, self.plan.ff_fast_reps)]
        if self.plan.at_once_only:
            variants = []
        self.notes.append(
            "fig 1: 1a = failing rank's own end timestamp -> last sibling `sleep 10000` gone (/proc, 5 ms); "
            "1b = same start -> the last of the N rank triggers fired. Triggers use poll_interval p "
            "(0.5 s = the default) and grace 3 s (the default); goal: 1a median < 1 s at N=64, p=0.5. "
            "1c = the failing rank's first command is `exit 1`: gang started by the job task "
            "(SkyJobOperator.execute -> its launch-side watcher, which launches and watches), the triggers started "
            f"{self.plan.trigger_delay:g} s after it ended (--trigger-delay, the job task's end -> first "
            "poll under the real scheduler); its exit -> last sibling gone; goal < 1 s at every N."
        )
        for n in self.plan.ns:
            clusters = {
                "ssh": self.ssh_cluster(n, f"bench-ff{n}"),
                "local": self.local_cluster(n, f"bench-ff{n}"),
            }
            for kind, poll, reps in variants:
                backend, handle = clusters[kind]
                conn = "sky_bench" if kind == "ssh" else None
                samples = ff.measure(
                    backend, handle, n, reps, sky_conn_id=conn, poll_interval=poll, label=kind
                )
                good = ff.valid(samples)
                bad = len(samples) - len(good)
                note = f"{bad} of {len(samples)} samples invalid (see log)" if bad else ""
                goal = "< 1 s median" if n == 64 and poll == 0.5 else ""
                gone = [s.gone for s in good if s.gone is not None]
                ev = [s.events for s in good if s.events is not None]
                met = (bool(gone) and statistics.median(gone) < 1.0) if goal else None
                extra = {
                    "poll_interval": poll,
                    "grace": 3.0,
                    "gang_event": [s.gang_event for s in good],
                    "cancel_sent": [s.cancel_sent for s in good],
                    "cancel_returned": [s.cancel_done for s in good],
                    "launch": [s.launch for s in samples],
                    "errors": [s.error for s in samples if s.error],
                }
                self.rows.append(
                    Row(f"1a {kind} exit->siblings gone p={poll}", n, gone, "s", goal, met, note, extra=extra)
                )
                self.rows.append(Row(f"1b {kind} exit->all rank events p={poll}", n, ev, "s", note=note))
                if poll == 0.5:  # where 1a's time goes: detection, then the cancel fan-out
                    sent = [s.cancel_sent for s in good if s.cancel_sent is not None]
                    kill = [
                        s.gone - s.cancel_sent
                        for s in good
                        if s.gone is not None and s.cancel_sent is not None
                    ]
                    self.rows.append(Row(f"1  {kind} ..exit->cancel sent p={poll}", n, sent, "s"))
                    self.rows.append(Row(f"1  {kind} ..cancel sent->gone p={poll}", n, kill, "s"))
            for kind in ("ssh", "local"):
                self._fig1_at_once(n, kind, clusters[kind][1])

    def _fig1_at_once(self, n: int, kind: str, handle: Any) -> None:
        """1c: the failing rank's first command is `exit 1`; started by the job task, triggers later."""
        from benchmarks import fig_failfast as ff

        poll, delay = 0.5, self.plan.trigger_delay
        conn = "sky_bench" if kind == "ssh" else None
        samples = ff.measure_at_once(
            handle,
            n,
            self.plan.ff_once_reps,
            sky_conn_id=conn,
            poll_interval=poll,
            trigger_delay=delay,
            label=kind,
        )
        good = ff.valid_at_once(samples)
        bad = len(samples) - len(good)
        note = f"{bad} of {len(samples)} samples invalid (see log)" if bad else ""
        gone = [s.gone for s in good if s.gone is not None]
        goal = "< 1 s median"
        met = bool(gone) and statistics.median(gone) < 1.0
        extra = {
            "poll_interval": poll,
            "grace": 3.0,
            "trigger_delay": delay,
            "job_task_end": [s.job_end for s in good],
            "triggers_start": [s.triggers_start for s in good],
            "cancel_sent": [s.cancel_sent for s in good],
            "rank_events": [s.events for s in good],
            "gang_event": [s.gang_event for s in good],
            "siblings_seen_running": [s.seen for s in good],
            "job_task_seconds": [s.launch for s in samples],
            "job_task_errors": [s.job_error for s in samples if s.job_error],
            "errors": [s.error for s in samples if s.error],
        }
        label = f"1c {kind} fails at once: exit->siblings gone, triggers +{delay:g}s"
        self.rows.append(Row(label, n, gone, "s", goal, met, note, extra=extra))
        job_end = [s.job_end for s in good if s.job_end is not None]
        self.rows.append(Row(f"1c {kind} ..exit->job task end", n, job_end, "s"))
        sent = [s.cancel_sent for s in good if s.cancel_sent is not None]
        self.rows.append(Row(f"1c {kind} ..exit->first cancel after triggers start", n, sent, "s"))

    # -- figure 2

    def fig2(self) -> None:
        from benchmarks import fig_start

        say("\n== figure 2: gang start (launch -> last rank start) vs pdsh ==")
        if not shutil.which("pdsh"):
            raise RuntimeError("pdsh is not installed: apt-get install -y pdsh")
        self.notes.append(
            "fig 2: launch() called -> last rank's own start timestamp. The goal ratio uses the COLD launch "
            "(fresh connection pool, like pdsh, which connects every time); warm (pooled connections) is shown too."
        )
        for n in self.plan.ns:
            hosts = self.hosts(n)
            name = f"bench-start{n}"
            self.ssh_cluster(n, name)
            r = fig_start.measure(hosts, name, n, self.plan.start_reps, say)
            cold_ratio = [c / p for c, p in zip(r["cold"], r["pdsh"], strict=True)]
            warm_ratio = [w / p for w, p in zip(r["warm"], r["pdsh"], strict=True)]
            goal = "<= 1.5x at N=64" if n == 64 else ""
            met = statistics.median(cold_ratio) <= 1.5 if goal else None
            extra = {"returned": r["cold_returned"]}
            self.rows += [
                Row("2 start cold (launch->last start)", n, r["cold"], extra=extra),
                Row(
                    "2 start warm (launch->last start)", n, r["warm"], extra={"returned": r["warm_returned"]}
                ),
                Row("2 pdsh -R ssh true", n, r["pdsh"]),
                Row("2 ratio cold/pdsh", n, cold_ratio, "x", goal, met),
                Row("2 ratio warm/pdsh", n, warm_ratio, "x"),
                Row("2 start skew cold (last-first start)", n, r["cold_skew"]),
                Row("2 start skew warm (last-first start)", n, r["warm_skew"]),
            ]

    # -- figure 3

    def fig3(self) -> None:
        from benchmarks import fig_monitor

        poll = 0.5
        window = self.plan.mon_window
        say(f"\n== figure 3: remote calls per poll interval (poll {poll} s, {window:g} s window) ==")
        self.notes.append(
            f"fig 3: CALLS over a {window:g} s window / ({window:g} s / {poll} s) intervals, N rank triggers + "
            "the gang trigger sharing one stream; 'N+1 independent' gives every trigger its own stream key."
        )
        for n in self.plan.ns:
            backend, handle = self.ssh_cluster(n, f"bench-mon{n}")
            per: list[float] = []
            polls_made: list[int] = []
            per_poll: list[float] = []
            for i in range(self.plan.mon_reps):
                v, calls, polls = fig_monitor.one_window(
                    backend, handle, n, sky_conn_id="sky_bench", poll_interval=poll, window=window
                )
                say(f"  fig3 N={n} #{i + 1}: {calls} calls, {polls} status polls -> {v:.1f} per interval")
                per.append(v)
                polls_made.append(polls)
                per_poll.append(calls / polls if polls else float("nan"))
            c = 3
            goal = f"<= N+{c} (O(N))"
            met = max(per) <= n + c
            self.rows.append(
                Row(
                    "3 calls/interval shared stream",
                    n,
                    per,
                    "n",
                    goal,
                    met,
                    extra={"status_polls": polls_made, "window": window, "poll_interval": poll},
                )
            )
            self.rows.append(
                Row("3 calls per status poll (incl. one-offs)", n, per_poll, "n", extra={"window": window})
            )
            if n <= self.plan.indep_max_n:
                v, calls, polls = fig_monitor.one_window(
                    backend,
                    handle,
                    n,
                    sky_conn_id="sky_bench",
                    poll_interval=poll,
                    window=window,
                    distinct_streams=True,
                )
                say(f"  fig3 N={n} independent pollers: {calls} calls, {polls} status polls -> {v:.1f}")
                self.rows.append(
                    Row(
                        "3 calls/interval N+1 independent (measured)",
                        n,
                        [v],
                        "n",
                        note="each trigger its own stream key",
                    )
                )
            self.rows.append(
                Row("3 calls/interval N independent (NxN)", n, [], "n", text=str(n * n), note="computed")
            )

    # -- figure 4

    def fig4(self) -> None:
        from benchmarks import fig_airflow

        say("\n== figure 4: Airflow end to end (8 ranks, real scheduler + triggerer) ==")
        hosts = self.hosts(8)
        self.notes.append(
            "fig 4: Airflow REST API run start_date -> end_date; the SSHOperator fail-fast run cannot end before "
            f"its `sleep 10000` siblings, so it is given up after {self.plan.e2e_cap:g} s (run once)."
        )
        self.rows += fig_airflow.run(self.plan, hosts, self.base, self.stack, say)

    # -- figure 5

    def fig5(self) -> None:
        from benchmarks import fig_scale

        ns = ", ".join(f"{n:,}" for n in self.plan.scale_ns)
        say(f"\n== figure 5: scale, sky_gang of N = {ns} local ranks under the real scheduler + triggerer ==")
        self.notes.append(
            f"fig 5: N = {ns}, local backend; overhead = run start_date -> end_date minus {fig_scale.SLEEP:g} s "
            "(every rank `sleep 20`); fail-fast: rank N//2 exits 3 after 5 s, the others `sleep 10000`, "
            "from the ranks' own end timestamps; CPU = scheduler / triggerer process and descendants, "
            "trigger -> run end (/proc utime+stime). A run still going after 300 + 0.6 N s is a failed row."
        )
        self.rows += fig_scale.run(self.plan, self.base, self.stack, say)

    # -- figure 9

    def fig9(self) -> None:
        from benchmarks import fig_mask

        say("\n== figure 9: the secrets' output mask (local backend, one rank) ==")
        self.notes.append(
            "fig 9: one local rank through the real wrapper, with and without a secret, interleaved; rank's "
            "start file -> exit file (written once the mask filter wrote its last byte). Rank `cat` of 100 MiB "
            "of lines (the fastest rank there is); one 300 MiB line without a newline (the filter's VmHWM while "
            "the rank waits after it). Then each filter alone in a pipe: `cat lines | filter > file`."
        )
        self.rows += fig_mask.run(self.plan.quick, self.base, say)

    # -- figure 10

    def fig10(self) -> None:
        from benchmarks import fig_output

        say("\n== figure 10: the watcher's memory, a local rank printing 200 MB ==")
        self.notes.append(
            "fig 10: one local rank prints 200 MB (one line, 100-byte lines, binary); a rank trigger subscribed "
            "as the triggerer does it watches it in a child process: the child's VmHWM minus its RSS before "
            "the launch."
        )
        self.rows += fig_output.run(self.plan.quick, self.base, say)

    # -- figure 6

    def fig6(self) -> None:
        from benchmarks import fig_k8s

        say("\n== figure 6: Kubernetes backend (local test cluster) vs a kubectl exec fan-out ==")
        self.notes.append(
            "fig 6: Kubernetes backend on tests/k8s's local cluster (1.20, two kubelets on this machine), N = 4 "
            "and the largest N provisioned within 120 s (--quick: 4). Processes timed from this machine's /proc "
            "(start ticks, pidfd exits). Start: launch(`sleep 10000`) vs one `kubectl exec` per pod at once "
            "(detached sleep). Fail-fast: rank N-1 `sleep 2; exit 1`, exit = its `sleep 2` ending; watch.watch "
            "(poll 0.5 s, grace 3 s) vs the failing rank's attached kubectl exec returning, then a `kubectl exec "
            "kill` fan-out. Status timestamps are whole seconds in this image."
        )
        if self.plan.k8s_agent:
            self.notes.append(
                "fig 6a: the node-agent path: pods of busybox + this machine's python3 run the agent as their "
                "own process; launch/status/cancel are calls to the head agent. Start vs the kubectl exec "
                "fan-out, fail-fast as in fig 6 (watch.watch polls 0.5 s, the head cancels on its own), calls "
                f"per second counted on the client over {fig_k8s.STEADY:g} s of watching ranks that each print a line a second."
            )
            self.rows += fig_k8s.run_agent(self.plan, say, self.plan.k8s_ns)
            return
        self.rows += fig_k8s.run(self.plan, say, self.plan.k8s_ns)

    # -- figure 7

    def fig7(self) -> None:
        from benchmarks import fig_aws

        say(
            "\n== figure 7: AWS EC2 backend on moto's server (instances reached at sshd hosts): time, API calls =="
        )
        self.notes.append(
            "fig 7: AWS backend against moto's HTTP server, each instance reached at a real sshd host (tests' "
            "FakeNetwork), N = 4 and 16: provision -> find (fresh backend) -> terminate, every EC2 call counted "
            "through a proxy. Times are moto's and this machine's SSH, not AWS's boot times."
        )
        self.rows += fig_aws.run(self.plan, say)

    # -- figure 8

    def fig8(self) -> None:
        from benchmarks import fig_retry

        say("\n== figure 8: whole-gang retry over SSH: failure -> every rank of the next attempt running ==")
        self.notes.append(
            "fig 8: SSH hosts, rank N-1 exits 1 after 2 s, the others `sleep 10000`; retry.watch_attempts "
            "(retries=1, retry_on_exit_codes=[1], no delay, poll 0.5 s, grace 3 s) cancels, checks attempt 1's "
            "processes gone and starts attempt 2; from the ranks' own timestamps (one clock)."
        )
        self.rows += fig_retry.run(self, self.plan, say)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions, N = 4 and 16, figure 5 at N = 64 (a smoke run)",
    )
    ap.add_argument(
        "--only",
        default="1,2,3,4,5,6,7,8,9,10",
        help="figures to run, e.g. 1,2 (default: all); 1c = only figure 1's 'rank fails at once' case",
    )
    ap.add_argument("--ns", default="", help="override the gang sizes of figures 1-3, e.g. 64 or 4,16")
    ap.add_argument("--scale-ns", default="", help="override the gang sizes of figure 5, e.g. 16 or 64,256")
    ap.add_argument(
        "--scale-reps",
        type=int,
        default=None,
        help="figure 5: runs of each DAG per N (default 1), e.g. 10 with --scale-ns 64 for ten in a row",
    )
    ap.add_argument(
        "--k8s-agent",
        action="store_true",
        help="figure 6 on the node-agent path (sizes 4, 32, 128 by default)",
    )
    ap.add_argument(
        "--k8s-ns", default="", help="figure 6's gang sizes instead of 4 + the probed largest, e.g. 4,64"
    )
    ap.add_argument(
        "--trigger-select",
        type=int,
        default=None,
        help="figure 5: the stack's [triggerer] max_trigger_to_select_per_loop (default: Airflow's, 50)",
    )
    ap.add_argument("--out", default=str(RESULTS / "latest.json"), help="where to write the JSON")
    ap.add_argument(
        "--trigger-delay",
        type=float,
        default=None,
        help="figure 1c: seconds from the job task's end to the triggers' start (default 5)",
    )
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only <= {"1", "1c", "2", "3", "4", "5", "6", "7", "8", "9", "10"}:
        ap.error("--only takes figure numbers 1-10 (and 1c)")
    figures = sorted({1 if x == "1c" else int(x) for x in only})
    if os.geteuid() != 0 and not set(figures) <= {5, 9, 10}:  # figures 5, 9 and 10: the local backend only
        say("needs root: the sshd test hosts create users and start sshd (tests/support/sshd.py)")
        return 2
    plan = Plan.make(args.quick)
    if args.ns:
        plan = dataclasses.replace(plan, ns=tuple(int(x) for x in args.ns.split(",") if x.strip()))
    if args.scale_ns:
        plan = dataclasses.replace(
            plan, scale_ns=tuple(int(x) for x in args.scale_ns.split(",") if x.strip())
        )
    if args.scale_reps is not None:
        plan = dataclasses.replace(plan, scale_reps=args.scale_reps)
    if args.k8s_agent:
        plan = dataclasses.replace(plan, k8s_agent=True)
    if args.k8s_ns:
        plan = dataclasses.replace(plan, k8s_ns=tuple(int(x) for x in args.k8s_ns.split(",") if x.strip()))
    if args.trigger_select is not None:
        plan = dataclasses.replace(plan, trigger_select=args.trigger_select)
    if args.trigger_delay is not None:
        plan = dataclasses.replace(plan, trigger_delay=args.trigger_delay)
    if "1c" in only and "1" not in only:
        plan = dataclasses.replace(plan, at_once_only=True)
    base = Path(tempfile.mkdtemp(prefix="sky-bench-"))
    _setup_env(base)
    _quiet_logs()
    vers = versions()  # imports airflow: inside the temp home, before it is removed
    code = code_state()
    load_start = os.getloadavg()
    started = time.time()
    failed: list[str] = []
    out = Path(args.out)
    bench: Bench | None = None

    def save(complete: bool) -> None:
        """Write the JSON (also after every figure: a run cut short keeps what it measured)."""
        assert bench is not None
        doc = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "complete": complete,
            "duration_s": round(time.time() - started, 1),
            "quick": plan.quick,
            "figures_run": figures,
            "plan": dataclasses.asdict(plan),
            "machine": {
                "cores": os.cpu_count(),
                "platform": platform.platform(),
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
            },
            "versions": vers,
            "code": code,
            "code_changed_during_run": code_state()["package_sha256"] != code["package_sha256"],
            "rows": [r.to_dict() for r in bench.rows],
            "notes": bench.notes,
            "failed": failed,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)

    interrupted = False
    with sigterm_as_interrupt():
        try:
            with contextlib.ExitStack() as stack:
                bench = Bench(plan, base, stack)
                for f in figures:
                    try:
                        getattr(bench, f"fig{f}")()
                    except KeyboardInterrupt:
                        raise
                    except Exception as exc:
                        failed.append(f"figure {f}: {type(exc).__name__}: {exc}")
                        say(f"figure {f} FAILED:\n{traceback.format_exc()}")
                    save(complete=False)
        except KeyboardInterrupt:
            interrupted = True
            say("\ninterrupted: everything started was stopped")
        finally:
            left = processes_under(base)
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            if left:
                say(f"killed {len(left)} leftover processes under {base}")
            shutil.rmtree(base, ignore_errors=True)
    assert bench is not None
    print()
    print(table(bench.rows))
    for note in bench.notes:
        print(note)
    for failure in failed:
        print(f"FAILED {failure}")
    if interrupted:
        print(f"\ninterrupted: partial results in {out}" if bench.rows else "\ninterrupted")
        return 130
    save(complete=True)
    print(f"\nwrote {out} ({time.time() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
