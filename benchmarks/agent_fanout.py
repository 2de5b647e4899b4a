"""The head agent's fan-out at the scale of a 1,024-node gang: one real head, N nodes' agents simulated in this process.

``python -m benchmarks.agent_fanout [--nodes 1024]``. The head is the shipped file (``tests/support/agents.py``),
and N protocol clients in one asyncio loop play the other nodes' agents: each joins, answers the head's
``run`` as a node whose rank started, and beats every second. Then one of them reports its rank failed
and each notes when the head's cancel reached it. Figures: the head's CPU with N agents beating; the
start (one call); the status call (N ranks); a failure's report -> the last agent told (what every real
agent then acts on in its own node, see ``benchmarks/agent.py``). The simulated agents share this
process's CPU with the protocol work of N connections, so the fan-out figure is an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests" / "support"  # the test helpers: sshd, agents, ...
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from agents import HEAD_IP, TOKEN, Cluster  # noqa: E402

from airflow_provider_sky.agent.client import AgentClient, NodePlan  # noqa: E402
from airflow_provider_sky.agent.node import Channel, connect  # noqa: E402
from benchmarks.agent import _cpu_share  # noqa: E402


class FakeAgent:
    """A node's agent as the head sees it: joins, answers ``run``, beats, notes the cancel."""

    def __init__(self, node: str, rank: int) -> None:
        self.node, self.rank = node, rank
        self.chan: Channel | None = None
        self.cancelled_at: float | None = None

    async def run(self, port: int) -> None:
        hello = {"op": "hello", "role": "agent", "node": self.node}
        for attempt in range(20):  # as a real agent does: try again until the head answers
            try:
                self.chan = await connect(HEAD_IP, port, TOKEN, hello, 30)
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                await asyncio.sleep(0.1 * (attempt + 1))
        assert self.chan is not None
        beats = asyncio.ensure_future(self._beats())
        try:
            while True:
                msg = await self.chan.recv()
                if msg["op"] == "run":
                    rec = {
                        "rank": self.rank,
                        "state": "running",
                        "code": None,
                        "start": time.time(),
                        "why": "",
                    }
                    await self.chan.send({"op": "report", "job": msg["job"], "ranks": [rec]})
                    await self.chan.send(
                        {"op": "ran", "job": msg["job"], "rc": 0, "out": f"STARTED {self.rank} 1\n"}
                    )
                elif msg["op"] == "cancel" and self.cancelled_at is None:
                    self.cancelled_at = time.time()
        finally:
            beats.cancel()

    async def _beats(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            assert self.chan is not None
            await self.chan.send({"op": "beat"})

    async def fail(self, job: str) -> float:
        assert self.chan is not None
        rec = {"rank": self.rank, "state": "exited", "code": 1, "end": time.time(), "why": "", "own": True}
        t0 = time.time()
        await self.chan.send({"op": "report", "job": job, "ranks": [rec]})
        return t0


async def bench(c: Cluster, nodes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    fakes = [FakeAgent(f"s{i}", i + 1) for i in range(nodes - 1)]
    tasks = []
    t = time.time()
    for i in range(0, len(fakes), 64):  # join in waves, as nodes coming up do
        tasks += [asyncio.ensure_future(f.run(c.port)) for f in fakes[i : i + 64]]
        await asyncio.sleep(0.05)
    client = AgentClient(HEAD_IP, c.port, TOKEN, timeout=60)
    try:
        for _ in range(600):
            if sum(v["up"] for v in (await client.nodes()).values()) == nodes:
                break
            await asyncio.sleep(0.1)
        out["all_joined_s"] = time.time() - t
        head = c.procs["n0"].pid
        out["head_cpu_idle_beating"] = (
            await asyncio.get_running_loop().run_in_executor(None, _cpu_share, [head], 5.0)
        )[0]
        plan = {f.node: NodePlan([("/nonexistent", f.rank)], "exit 0", "") for f in fakes}
        # the head's own node runs a real rank: sleep
        root = c.roots["n0"]
        plan["n0"] = c.plan("job", {"n0": [0]}, "sleep 10000")["n0"]
        t = time.perf_counter()
        res = await client.start("job", plan, grace=1.0, timeout=120)
        out["start_one_call_s"] = time.perf_counter() - t
        out["start_errors"] = len(res.errors())
        took = []
        for _ in range(10):
            t = time.perf_counter()
            st = await client.status("job")
            took.append(time.perf_counter() - t)
        out["status_call_ms"] = [x * 1000 for x in took]
        out["status_ranks"] = len(st.ranks)
        t0 = await fakes[-1].fail("job")
        for _ in range(300):
            if all(f.cancelled_at for f in fakes[:-1]):
                break
            await asyncio.sleep(0.02)
        arrivals = [f.cancelled_at - t0 for f in fakes[:-1] if f.cancelled_at]
        out["told"] = len(arrivals)
        out["report_to_last_told_s"] = max(arrivals)
        out["report_to_median_told_s"] = statistics.median(arrivals)
        out["root"] = root
    finally:
        await client.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "agent-fanout-latest.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sky-agent-fanout-"))
    c = Cluster(tmp, 1, beat=1.0, lost_after=30.0)
    try:
        res = asyncio.run(bench(c, args.nodes))
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.nodes} nodes: all joined in {res['all_joined_s']:.1f} s")
    print(f"head CPU with {args.nodes - 1} agents beating every second: {res['head_cpu_idle_beating']:.1%}")
    print(f"gang start, one call: {res['start_one_call_s']:.2f} s ({res['start_errors']} node errors)")
    print(
        f"status call, {res['status_ranks']} ranks: median {statistics.median(res['status_call_ms']):.1f} ms"
    )
    print(
        f"a failure's report -> every other agent told: {res['told']} agents, last {res['report_to_last_told_s']:.3f} s,"
        f" median {res['report_to_median_told_s']:.3f} s"
    )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
