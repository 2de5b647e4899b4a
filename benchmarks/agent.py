"""The node agent's footprint and its fail-fast across nodes, with what real nodes have.

``python -m benchmarks.agent [--nodes 16] [--ranks 4] [--reps 3] [--out FILE]``: agents on this machine
as nodes (``tests/support/agents.py``: the head on 127.0.0.2, the shipped single file under ``python -I -S``),
ranks started by today's launch script through the agents. Prints one line per figure and writes every
sample to ``benchmarks/results/agent-latest.json``:

- start: agent spawned -> listening (head), -> joined the head (worker);
- memory: each agent's resident set, the head's with every worker joined;
- idle CPU: an agent's CPU share with no job and with running ranks, heartbeats every second;
- fail-fast: a rank's exit -> the last sibling on another node gone, nothing polling;
- status: one control-plane status call for the whole gang;
- busybox: what a busybox-only node (the Kubernetes test pods) has for an agent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests" / "support"  # the test helpers: sshd, agents, ...
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from agents import SLEEP, Cluster, final_status, over, records, with_client  # noqa: E402
from test_containment import _wait_for  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_share(pids: list[int], seconds: float) -> list[float]:
    before = [_cpu(p) for p in pids]
    time.sleep(seconds)
    return [(_cpu(p) - b) / seconds for p, b in zip(pids, before, strict=True)]


def bench_cluster(nodes: int, ranks: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes, "ranks_per_node": ranks, "failfast": [], "status": []}
    for rep in range(reps):
        tmp = Path(tempfile.mkdtemp(prefix="sky-agent-bench-"))
        try:
            _one_run(tmp, rep, nodes, ranks, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


async def _polls(c: Cluster, job: str, n: int) -> list[float]:
    """``n`` status calls on one connection, each timed."""
    client = c.client()
    took = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            await client.status(job)
            took.append(time.perf_counter() - t)
    finally:
        await client.aclose()
    return took


def _one_run(tmp: Path, rep: int, nodes: int, ranks: int, out: dict[str, Any]) -> None:
    t0 = time.time()
    c = Cluster(tmp, nodes, beat=1.0)
    try:
        if rep == 0:
            out["start_all_joined"] = time.time() - t0
            pids = [p.pid for p in c.procs.values()]
            out["rss_mb"] = {"head": _rss_mb(pids[0]), "worker": statistics.median(map(_rss_mb, pids[1:]))}
            idle = _cpu_share(pids, 5.0)
            out["idle_cpu"] = {"head": idle[0], "worker": statistics.median(idle[1:])}
        plan = {n: list(range(i * ranks, (i + 1) * ranks)) for i, n in enumerate(c.roots)}
        bad = nodes * ranks - 1  # the last rank, on the last node
        run = f'if [ "$SKYPILOT_NODE_RANK" = {bad} ]; then sleep 3; exit 1; fi\n{SLEEP}'
        started = c.plan("job", plan, run)
        asyncio.run(with_client(c.client(), lambda cl: cl.start("job", started)))
        if rep == 0:
            pids = [p.pid for p in c.procs.values()]
            busy = _cpu_share(pids, 2.0)  # the ranks run; the agents read their directories
            out["running_cpu"] = {"head": busy[0], "worker": statistics.median(busy[1:])}
            out["status"] = asyncio.run(_polls(c, "job", 10))
        assert _wait_for(lambda: over(c, "job", plan), 30), records(c, "job", plan)
        recs = records(c, "job", plan)
        failed_node = bad // ranks
        gone = max(r["end"] for k, r in recs.items() if k // ranks != failed_node) - recs[bad]["end"]
        out["failfast"].append(gone)
        # the split: exit -> the head's decision (the failing node's scan, one report), then the
        # decision -> the last sibling gone (one message per node, their cancel, the ranks' ends)
        decided = final_status(c, "job").decided or 0.0
        out.setdefault("to_decision", []).append(decided - recs[bad]["end"])
        print(
            f"  rep {rep}: exit -> last sibling on another node gone {gone:.3f} s "
            f"(exit -> head's decision {decided - recs[bad]['end']:.3f} s)",
            file=sys.stderr,
        )
    finally:
        c.close()


def bench_start(reps: int) -> list[float]:
    """Spawn -> listening, for a lone head agent (the interpreter's start and the agent's imports)."""
    took = []
    for _ in range(reps):
        tmp = Path(tempfile.mkdtemp(prefix="sky-agent-bench-"))
        try:
            t0 = time.time()
            c = Cluster(tmp, 1)
            took.append(time.time() - t0)
            c.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return took


def busybox_facts() -> dict[str, Any]:
    """What a busybox-only node has to build an agent from."""
    bb = shutil.which("busybox")
    if not bb:
        return {"busybox": None}
    applets = set(subprocess.run([bb, "--list"], capture_output=True, text=True).stdout.split())
    wanted = ["nc", "sha256sum", "openssl", "python3", "awk", "mkfifo", "timeout"]
    t = time.perf_counter()
    for _ in range(50):
        subprocess.run([bb, "sh", "-c", "printf x | sha256sum >/dev/null"], check=True)
    return {
        "busybox": subprocess.run([bb], capture_output=True, text=True).stdout.splitlines()[0],
        "applets": {a: a in applets for a in wanted},
        "nc_persistent_server": "-ll"
        in subprocess.run([bb, "nc", "--help"], capture_output=True, text=True).stderr,
        "sh_sha256_fork_ms": (time.perf_counter() - t) / 50 * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "agent-latest.json"))
    args = p.parse_args()
    res: dict[str, Any] = {"python": sys.version.split()[0], "cores": os.cpu_count()}
    res["start_head"] = bench_start(args.reps)
    res["cluster"] = bench_cluster(args.nodes, args.ranks, args.reps)
    res["busybox"] = busybox_facts()
    cl = res["cluster"]
    med = statistics.median
    print(f"agent start (spawn -> listening): median {med(res['start_head']):.3f} s")
    print(f"{args.nodes} agents started and joined: {cl['start_all_joined']:.2f} s")
    print(f"resident memory: head {cl['rss_mb']['head']:.1f} MB, worker {cl['rss_mb']['worker']:.1f} MB")
    print(f"idle CPU: head {cl['idle_cpu']['head']:.2%}, worker {cl['idle_cpu']['worker']:.2%}")
    print(
        f"CPU with {args.ranks} running ranks per node: head {cl['running_cpu']['head']:.2%}, "
        f"worker {cl['running_cpu']['worker']:.2%}"
    )
    print(
        f"fail-fast, {args.nodes} nodes x {args.ranks} ranks, nothing polling: exit -> last sibling on another "
        f"node gone: median {med(cl['failfast']):.3f} s (min {min(cl['failfast']):.3f}, max {max(cl['failfast']):.3f})"
    )
    print(f"  of which exit -> the head's decision: median {med(cl['to_decision']):.3f} s")
    print(f"status call ({args.nodes * args.ranks} ranks): median {med(cl['status']) * 1000:.1f} ms")
    print(f"busybox: {json.dumps(res['busybox'])}")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
