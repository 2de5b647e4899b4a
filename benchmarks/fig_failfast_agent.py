"""Figure 1c on SSH hosts with node agents: a rank's exit -> its last sibling on another host gone,
with nothing on the Airflow side polling, and the status calls a poll costs at N hosts.

``python -m benchmarks.fig_failfast_agent [--hosts 64] [--reps 5] [--out FILE]``: N real sshd hosts on
loopback (``tests/support/sshd.py``, each its own user), one SSH cluster provisioned with agents (one per
host, the head on rank 0's host). Each rep starts a gang (one call to the head): rank 1 ``sleep 2; exit 1``,
the others ``sleep 10000``; nobody polls; a /proc watcher sees the last sibling go. Then a gang that runs
is polled ``--polls`` times (one ``peek`` per poll interval) through the head, and once the per-node way
(the same cluster's handle without ``extra["agent"]``), counting calls. Goals: exit -> last sibling
gone < 0.3 s; status calls per poll independent of N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests" / "support"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from sshd import SSHDCluster  # noqa: E402

from airflow_provider_sky.backends.nodeagents import EXTRA_KEY  # noqa: E402
from airflow_provider_sky.backends.ssh import SSHBackend  # noqa: E402
from airflow_provider_sky.runners import ssh  # noqa: E402
from airflow_provider_sky.spec import task_from_args  # noqa: E402
from airflow_provider_sky.watch.jobs import GangClient  # noqa: E402
from benchmarks.common import GoneWatcher, say  # noqa: E402

FAIL_RANK = 1
SLEEP_ARGV = ("sleep", "10000")
RUN = f'if [ "$SKYPILOT_NODE_RANK" = "{FAIL_RANK}" ]; then sleep 2; exit 1; fi\nsleep 10000\n'


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fail_fast(b: SSHBackend, h: Any, n: int, job: str) -> dict[str, Any]:
    """One rep: exit -> last sibling gone, nothing polling (the /proc watcher is the only observer)."""
    c = GangClient(b, h)
    watcher = GoneWatcher(job, n - 1, SLEEP_ARGV, limit=60)
    t0 = time.monotonic()
    words = c.launch(task_from_args(num_nodes=n, run=RUN), job)
    launch = time.monotonic() - t0
    watcher.start()
    watcher.join(timeout=90)
    calls_meanwhile = (c.agent_calls, c.node_calls)
    status = c.peek(job)
    deadline = time.monotonic() + 10
    while any(r.state.value == "running" for r in status.ranks) and time.monotonic() < deadline:
        time.sleep(0.2)  # the last exit records (written just after the processes went)
        status = c.peek(job)
    failed = status.by_rank(FAIL_RANK)
    gone = (watcher.gone_at - failed.end) if watcher.gone_at and failed.end else None
    states = sorted({r.state.value for r in status.ranks})
    named = all(f"rank {FAIL_RANK} failed first" in r.reason for r in status.ranks if r.rank != FAIL_RANK)
    return {
        "job": job,
        "started": sorted(set(words.values())),
        "launch_s": round(launch, 3),
        "exit_to_last_sibling_gone_s": round(gone, 3) if gone is not None else None,
        "calls_until_gone": {"agent": calls_meanwhile[0], "per_node": calls_meanwhile[1]},
        "states": states,
        "cause_named": named,
        "error": watcher.error,
    }


def status_calls(b: SSHBackend, h: Any, n: int, job: str, polls: int, interval: float) -> dict[str, Any]:
    """Calls per poll of a running gang: through the head, and the per-node way (no agent in the handle)."""
    c = GangClient(b, h)
    c.launch(task_from_args(num_nodes=n, run="sleep 10000"), job)
    per_poll: list[int] = []
    took: list[float] = []
    for _ in range(polls):
        before = c.agent_calls + c.node_calls
        t = time.monotonic()
        c.peek(job)
        took.append(time.monotonic() - t)
        per_poll.append(c.agent_calls + c.node_calls - before)
        time.sleep(interval)
    plain = dataclasses.replace(h, extra={k: v for k, v in h.extra.items() if k != EXTRA_KEY})
    p = GangClient(b, plain)
    t = time.monotonic()
    p.peek(job)
    per_node_took = time.monotonic() - t
    c.cancel(job, grace=1.0, reason="benchmark done")
    return {
        "agent_calls_per_poll": per_poll,
        "agent_poll_s_median": round(statistics.median(took), 4),
        "per_node_calls_per_poll": p.node_calls,
        "per_node_poll_s": round(per_node_took, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--polls", type=int, default=10)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    n = args.hosts
    load_before = os.getloadavg()
    out: dict[str, Any] = {"figure": "1c-agent", "hosts": n, "load_before": load_before}
    with SSHDCluster(n, tempfile.mkdtemp(prefix="bench-agent-")) as cl:
        b = SSHBackend(
            cl.host_list(),
            user="",
            key_file=cl.client_key_path,
            known_hosts=cl.known_hosts_path,
            connect_timeout=20.0,
            ready_timeout=60.0,
            max_parallel=32,
        )
        try:
            t = time.monotonic()
            h = b.provision("bench-agent", task_from_args(num_nodes=n, run="true"))
            out["provision_with_agents_s"] = round(time.monotonic() - t, 2)
            out["agents"] = EXTRA_KEY in h.extra
            say(f"provisioned {n} hosts in {out['provision_with_agents_s']}s, agents: {out['agents']}")
            if not out["agents"]:
                raise SystemExit("the agents did not join: nothing to measure")
            reps = []
            for i in range(args.reps):
                r = fail_fast(b, h, n, f"ffa{i}")
                say(f"  rep {i + 1}: exit->last sibling gone {r['exit_to_last_sibling_gone_s']}s, {r}")
                reps.append(r)
            out["fail_fast"] = reps
            gone = [
                r["exit_to_last_sibling_gone_s"] for r in reps if r["exit_to_last_sibling_gone_s"] is not None
            ]
            out["exit_to_last_sibling_gone_median_s"] = _median(gone)
            out["goal_gone_under_0.3s_met"] = bool(gone) and statistics.median(gone) < 0.3
            out["status"] = status_calls(b, h, n, "sta", args.polls, args.interval)
            say(f"  status: {out['status']}")
        finally:
            b.terminate("bench-agent", grace=1.0)
            b.close()
            ssh.close_all()
    out["load_after"] = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out["commit"] = commit
    path = Path(args.out or f"benchmarks/results/fig1c-agent-{time.strftime('%Y-%m-%d')}-{commit}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
