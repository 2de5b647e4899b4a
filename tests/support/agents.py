"""Node agents as nodes on this machine for tests and benchmarks: the head listens on 127.0.0.2, each
node has its own root (its own machine for the node runtime: gang flag, ``.ranks``, ``.pgids``), and
the agent runs as the single file a backend copies to a node, under ``python -I -S`` (no site
packages, nothing of this package importable): what a node has is what it gets."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from airflow_provider_sky.agent import AGENT_FILE, agent_args, new_token
from airflow_provider_sky.agent.client import AgentClient, AgentStatus, node_plan
from airflow_provider_sky.agent.node import read_rank
from airflow_provider_sky.model.gang import classify
from airflow_provider_sky.node.runtime import STATUS_SCRIPT, Guard, RankLaunch, parse_status, status_args
from integration.test_containment import _alive as _alive_only
from integration.test_containment import _marked, _wait_for

HEAD_IP = "127.0.0.2"
TOKEN = new_token()
SLEEP = "sleep 10000"


PROXY_IP = "127.0.0.3"


class Proxy:
    """A TCP relay on 127.0.0.3 in front of the head, in a thread of its own: it records every byte that
    passes (what the cluster's network sees) and can cut every connection at once (a network blip)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.captured = bytearray()
        self.loop = asyncio.new_event_loop()
        self.writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        #: a partition: every byte is dropped and nothing is reset (as a network that lost its route)
        self.partitioned = False
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._relay, PROXY_IP, 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                if self.partitioned:
                    continue
                self.captured.extend(data)
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    async def _relay(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.partitioned:  # a connection attempt into the partition hears nothing
            if await r.read(65536) == b"":
                w.close()
                return
        try:
            hr, hw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self.writers |= {w, hw}
        await asyncio.gather(self._pipe(r, hw), self._pipe(hr, w), return_exceptions=True)
        self.writers -= {w, hw}

    def cut(self) -> None:
        """Reset every connection through the relay (new ones are relayed again)."""

        def reset() -> None:
            for w in list(self.writers):
                w.transport.abort()

        self.loop.call_soon_threadsafe(reset)

    def partition(self, on: bool = True) -> None:
        """Drop every byte both ways from now on (``on=False``: relay again), resetting nothing."""
        self.partitioned = on

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            for w in list(self.writers):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Cluster:
    """Agents as nodes on this machine: ``n0`` is the head; ``roots[node]`` is each node's root."""

    def __init__(
        self,
        tmp: Path,
        nodes: int,
        *,
        lost_after: float = 10.0,
        beat: float = 0.2,
        head_pid1: bool = False,
        via_proxy: tuple[str, ...] = (),
        python: str = sys.executable,
        scan: float = 0.05,
    ) -> None:
        self.tmp = tmp
        self.scan = scan
        self.python = python  # the node's interpreter
        self.agent = tmp / "shipped" / "agent.py"  # the one file a node gets
        self.agent.parent.mkdir(parents=True)
        shutil.copy(AGENT_FILE, self.agent)
        self.token_file = tmp / "token"
        self.token_file.write_bytes(TOKEN + b"\n")
        self.token_file.chmod(0o600)
        self.lost_after, self.beat = lost_after, beat
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.roots = {f"n{i}": str(tmp / "nodes" / f"n{i}") for i in range(nodes)}
        for root in self.roots.values():
            Path(root).mkdir(parents=True)
        port_file = tmp / "port"
        # head_pid1: the head runs as a pod's own process does, pid 1 of its own pid namespace
        pre = ["unshare", "--pid", "--fork", "--mount-proc"] if head_pid1 else []
        self.procs["n0"] = self._agent(
            "n0", "--listen", f"{HEAD_IP}:0", "--port-file", str(port_file), pre=pre
        )
        assert _wait_for(port_file.exists, 10), self.log("n0")
        self.port = int(port_file.read_text())
        # via_proxy: these nodes reach the head through a relay the test can cut (a network blip)
        self.proxy = Proxy(HEAD_IP, self.port) if via_proxy else None
        for i in range(1, nodes):
            node = f"n{i}"
            head = (
                f"{PROXY_IP}:{self.proxy.port}"
                if self.proxy and node in via_proxy
                else f"{HEAD_IP}:{self.port}"
            )
            self.procs[node] = self._agent(node, "--head", head)
        assert _wait_for(lambda: self.all_up(), 10), self.log("n0")

    def _agent(self, node: str, *args: str, pre: list[str] | None = None) -> subprocess.Popen[bytes]:
        listen = dict(zip(args[::2], args[1::2], strict=True))
        cmd = agent_args(
            str(self.agent),
            node,
            str(self.token_file),
            listen=listen.get("--listen"),
            head=listen.get("--head"),
            port_file=listen.get("--port-file"),
            beat=self.beat,
            lost_after=self.lost_after,
            scan=self.scan,
            python=self.python,
        )
        cmd[1:1] = ["-I", "-S"]  # no site packages: only what a node has
        with open(self.tmp / f"{node}.log", "wb") as log:  # the agent keeps its own copy of the descriptor
            return subprocess.Popen(
                [*(pre or []), *cmd], stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/"
            )

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")[-3000:]

    def client(self) -> AgentClient:
        return AgentClient(HEAD_IP, self.port, TOKEN)

    def all_up(self) -> bool:
        nodes = asyncio.run(with_client(self.client(), lambda c: c.nodes()))
        return len(nodes) == len(self.roots) and all(v["up"] for v in nodes.values())

    def plan(
        self,
        job: str,
        ranks: dict[str, list[int]],
        run: str,
        grace: float = 1.0,
        secrets: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        out = {}
        for node, rs in ranks.items():
            root = self.roots[node]
            items = [
                (root, RankLaunch(r, run, {"SKYPILOT_NODE_RANK": str(r)}, dict(secrets or {}), root), Guard())
                for r in rs
            ]
            out[node] = node_plan(job, items, grace=grace)
        return out

    def rank_dir(self, node: str, job: str, rank: int) -> str:
        return f"{self.roots[node]}/jobs/{job}/{rank}"

    def agent_pid(self, node: str) -> int:
        """The agent's pid here (under ``unshare`` it is that process's child)."""
        pid = self.procs[node].pid
        try:
            exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if exe.endswith(b"unshare"):
                return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
        return pid

    def agents_left(self) -> list[int]:
        """Pids of this cluster's agents still running (none once it is closed)."""
        mine = str(self.agent).encode()
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if mine in Path(f"/proc/{entry}/cmdline").read_bytes():
                        left.append(int(entry))
                except OSError:
                    pass
        return _alive_only(left)

    def kill(self, node: str) -> None:
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait()

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        for node, p in self.procs.items():
            if p.poll() is None:
                # under unshare the agent is the child, pid 1 of its namespace: killing it ends the namespace
                agent = self.agent_pid(node)
                if agent != p.pid:
                    os.kill(agent, signal.SIGKILL)
                p.kill()
                p.wait()
        for pid in _marked(str(self.tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


async def with_client(client: AgentClient, fn: Any) -> Any:
    try:
        return await fn(client)
    finally:
        await client.aclose()


def records(c: Cluster, job: str, ranks: dict[str, list[int]]) -> dict[int, dict[str, Any]]:
    """Every rank's record as its node's wrapper wrote it (read from disk, not from the agents)."""
    return {r: read_rank(c.rank_dir(n, job, r)) for n, rs in ranks.items() for r in rs}


def over(c: Cluster, job: str, ranks: dict[str, list[int]]) -> bool:
    return all(rec["state"] == "exited" for rec in records(c, job, ranks).values())


def final_status(c: Cluster, job: str, within: float = 5.0) -> AgentStatus:
    """The head's status once it says the job is over (it follows the disk by one scan and one report)."""
    got: list[AgentStatus] = []

    def done() -> bool:
        got.append(asyncio.run(with_client(c.client(), lambda cl: cl.status(job))))
        return got[-1].done

    _wait_for(done, within)
    return got[-1]


def per_node_view(
    c: Cluster, job: str, ranks: dict[str, list[int]]
) -> dict[int, tuple[str, int | None, str]]:
    """Each rank's (state, exit code, reason) as the per-node path reads it: the node runtime's status
    script on each node root, then the gang policy (``gang.classify``)."""
    view = {}
    for node, rs in ranks.items():
        args = status_args([(c.roots[node], job, r, 0, 0) for r in rs], now=None)
        out = subprocess.run(
            ["sh", "-s", "--", *args],
            input=STATUS_SCRIPT.encode(),
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
        for raw in parse_status(out):
            st = classify(raw, node, time.time())
            view[raw.rank] = (st.state, st.exit_code, st.reason)
    return view


def agent_view(status: AgentStatus) -> dict[int, tuple[str, int | None, str]]:
    """The same, from the head's one status call."""
    out = {}
    for r in status.ranks:
        st = classify(r.to_raw(status.job_id), r.node, time.time())
        out[r.rank] = (st.state, st.exit_code, st.reason)
    return out
