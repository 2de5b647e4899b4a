"""The node agents under faults, on every backend that runs them: the local backend (``node_agent:
true``), real sshd hosts, the Kubernetes test cluster (pods with python3) and EC2 (moto, instances
played by sshd hosts). Each case is the backend's own provisioning and the control plane's own client:

- hostile clients at the head's port (garbage, a wrong token, silent connections) do not stop it from
  serving the gang;
- a worker's agent that stops answering (SIGSTOP, as a hung or cut-off node) fails the gang after
  ``lost_after`` naming its node, and its ranks stop once it answers again (all or nothing);
- a head agent that stops answering makes every worker stop its ranks after ``lost_after``; the control
  plane reads the gang the per-node way meanwhile, and the head, back, fails the gang;
- a partition between a worker and the head (both agents alive; packets dropped by iptables) stops the
  gang on both sides. Not on the local backend, whose agents all talk over 127.0.0.1 as one user (no
  rule can cut one of them off): ``test_node_agent.py`` cuts one through a relay there.

A triggerer killed during a gang is an Airflow case: ``tests/e2e/test_k8s_agent_airflow.py`` and
``tests/e2e/test_reliability_airflow.py`` (SSH hosts with agents).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aws_fixtures import backend as aws_backend
from aws_fixtures import hosts, moto, net  # noqa: F401 (fixtures)
from k8s_cluster import Image, K8sCluster, connection_extras
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.agent.client import AgentClient, AgentError
from airflow_provider_sky.backends.base import Backend, ClusterHandle
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.backends.nodeagents import endpoint
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

pytestmark = [needs_sshd, pytest.mark.cluster_lane]  # see setup.cfg

N = 3
#: the gangs' lost_after (the operator's, which the head and the agents apply: 10 s by default)
LOST_AFTER = 3.0
#: past lost_after before a case gives up: the verdict is one housekeeping tick (1 s) and one message,
#: each node's cancel then takes its grace; 5 s more for a machine shared with other suites
MARGIN = 8.0
SLEEP = "sleep 10000"


@dataclass
class Agents:
    """A provisioned cluster with an agent per node, as one backend made it."""

    kind: str
    backend: Backend
    handle: ClusterHandle

    def client(self) -> GangClient:
        return GangClient(self.backend, self.handle)

    def pid(self, i: int) -> int:
        """The pid (on this machine) of node ``i``'s agent: a process, or a pod's own process."""
        node = self.handle.nodes[i]
        want = f"--node\0{node.node_id}\0".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                b"agent.py\0" in cmd
                and want in cmd
                and (self.kind == "kubernetes" or node.root.encode() in cmd)
            ):
                found.append(int(entry.name))
        assert len(found) == 1, (node.node_id, found)
        return found[0]

    def wait_joined(self, timeout: float = 30.0) -> None:
        """Every node's agent is heard by the head (after a case that cut one off)."""
        found = self.backend.agent_endpoint(self.handle)
        assert found is not None, "the cluster runs no agents"
        deadline = time.monotonic() + timeout
        while True:
            nodes: dict[str, Any] = {}
            with contextlib.suppress(AgentError):
                nodes = asyncio.run(AgentClient(*found).nodes())
            if len(nodes) == N and all(v["up"] for v in nodes.values()):
                return
            assert time.monotonic() < deadline, nodes
            time.sleep(0.5)


def _local(sky_home: Path) -> Iterator[Agents]:
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("flt", task_from_args(num_nodes=N, run="true"))
    try:
        yield Agents("local", b, h)
    finally:
        b.terminate("flt")


@pytest.fixture(scope="module")
def sshd_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    with SSHDCluster(N, tmp_path_factory.mktemp("sshd-faults")) as c:
        yield c
        ssh.close_all()


@pytest.fixture(params=["local", "ssh", "aws"])
def host_agents(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Agents]:
    """A cluster of N nodes with agents on a backend whose agents are processes of this machine."""
    if request.param == "local":
        yield from _local(tmp_path / "local-state")
        return
    if request.param == "ssh":
        c: SSHDCluster = request.getfixturevalue("sshd_hosts")
        b = c.ssh_backend()
    else:
        m = request.getfixturevalue("moto")
        request.getfixturevalue("net")
        b = aws_backend(m.url, request.getfixturevalue("hosts"))
    h = b.provision("flt", task_from_args(num_nodes=N, run="true"))
    try:
        yield Agents(request.param, b, h)
    finally:
        b.terminate("flt")
        b.close()


@pytest.fixture(scope="module")
def pod_agents(k8s: K8sCluster, k8s_python_image: Image) -> Iterator[Agents]:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_python_image))
    h = b.provision("flt", task_from_args(num_nodes=N, run="true"))
    try:
        yield Agents("kubernetes", b, h)
    finally:
        b.terminate("flt")
        b.close()


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: {got!r}"
        time.sleep(0.3)


def _states(c: GangClient, job: str) -> dict[int, tuple[str, str]]:
    return {r.rank: (r.state.value, r.reason) for r in c.peek(job).ranks}


def _until(
    c: GangClient, job: str, pred: Callable[[dict[int, tuple[str, str]]], bool], timeout: float, what: str
) -> dict[int, tuple[str, str]]:
    """Every rank's (state, reason) once ``pred`` holds for them (a status call each 0.3 s)."""
    deadline = time.monotonic() + timeout
    while True:
        states = _states(c, job)
        if pred(states):
            return states
        assert time.monotonic() < deadline, f"{what}: {states}"
        time.sleep(0.3)


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# -- the cases, each run on every backend ----------------------------------------------------------


def hostile_clients_leave_the_head_serving(a: Agents, job: str) -> None:
    # at the head's own port, as another machine of the cluster's network would (on EC2 the control
    # plane's relay is a local port: test_ssh_runner.py floods one)
    where = endpoint(a.handle.extra)
    assert where is not None
    host, port = where
    head = a.pid(0)
    garbage, wrong, silent = [], [], []
    for _ in range(5):
        s = socket.create_connection((host, port), 5)
        s.sendall(os.urandom(4096))
        garbage.append(s)
    for _ in range(5):
        s = socket.create_connection((host, port), 5)
        s.settimeout(5)
        s.recv(8 + 16)  # the greeting: magic and the head's nonce
        s.sendall(os.urandom(16 + 32))  # a nonce and a proof made without the token
        wrong.append(s)
    for _ in range(20):
        silent.append(socket.create_connection((host, port), 5))
    try:
        run = f'if [ "$SKYPILOT_NODE_RANK" = "{N - 1}" ]; then sleep 2; exit 1; fi; {SLEEP}'
        c = a.client()
        c.launch(task_from_args(num_nodes=N, run=run), job, grace=1.0)
        assert (c.agent_calls, c.node_calls) == (1, 0)
        want = {r: "cancelled" for r in range(N - 1)} | {N - 1: "failed"}
        got = _wait(
            lambda: {r: s for r, (s, _) in _states(c, job).items()} == want or None, 2 + MARGIN, "fail-fast"
        )
        assert got and c.node_calls == 0
        assert f"rank {N - 1} failed first" in _states(c, job)[0][1]
        for s in garbage + wrong:  # the head closed each of them; it still runs, the same process
            s.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):
                    pass
        assert a.pid(0) == head
    finally:
        for s in garbage + wrong + silent:
            s.close()


def a_lost_worker_agent_fails_the_gang_and_its_ranks_stop_once_it_answers(a: Agents, job: str) -> None:
    c = a.client()
    c.launch(task_from_args(num_nodes=N, run=SLEEP), job, grace=1.0, lost_after=LOST_AFTER)
    _wait(lambda: {s for s, _ in _states(c, job).values()} == {"running"}, 30, "every rank running")
    node = a.handle.nodes[N - 1].node_id
    with _stopped(a.pid(N - 1)):
        t0 = time.monotonic()
        _wait(
            lambda: all(s == "cancelled" for r, (s, _) in _states(c, job).items() if r < N - 1),
            LOST_AFTER + MARGIN,
            "the others cancelled",
        )
        took = time.monotonic() - t0
        states = _states(c, job)
        print(f"\n{a.kind}: node {node}'s agent stopped -> the others cancelled after {took:.1f} s")
        assert took >= LOST_AFTER - 1.5, took  # lost_after, less a heartbeat: not before
        for r in range(N - 1):
            assert f"node {node} (ranks {N - 1}) lost" in states[r][1], states
        assert states[N - 1][0] == "lost", states
    # it answers again: the head's verdict reaches it, and its rank stops too
    _until(c, job, lambda st: st[N - 1][0] == "cancelled", 15, "the lost node's rank stopped")


def a_lost_head_agent_makes_every_worker_stop_its_ranks(a: Agents, job: str) -> None:
    c = a.client()
    c.launch(task_from_args(num_nodes=N, run=SLEEP), job, grace=1.0, lost_after=LOST_AFTER)
    _wait(lambda: {s for s, _ in _states(c, job).values()} == {"running"}, 30, "every rank running")
    with _stopped(a.pid(0)):
        # the head does not answer: the client reads the gang the per-node way meanwhile
        states = _until(
            c,
            job,
            lambda st: all(st[r][0] == "cancelled" for r in range(1, N)),
            LOST_AFTER + MARGIN + 5.0,  # + the client's wait for the head before it goes per node
            "every worker's rank stopped",
        )
        assert c.node_calls > 0
        for r in range(1, N):
            assert "head node lost" in states[r][1], states
    # the head, back, hears no worker for a while: it fails the gang, and its own node's rank stops
    _until(c, job, lambda st: st[0][0] in ("cancelled", "failed"), 20, "the head node's rank stopped")


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _partitioned(a: Agents, i: int) -> Iterator[None]:
    """Drop every packet between node ``i``'s agent and the head's (nothing reset: a lost route)."""
    where = endpoint(a.handle.extra)  # where the workers reach the head (not the control plane's relay)
    assert where is not None
    host, port = where
    if a.kind == "kubernetes":
        rules = [
            (chain, "-s", src, "-d", dst, "-j", "DROP")
            for chain in ("FORWARD", "INPUT", "OUTPUT")
            for src, dst in ((a.handle.nodes[i].ip, host), (host, a.handle.nodes[i].ip))
        ]
    else:  # sshd hosts on loopback, each its own user: the worker's packets by owner, the head's by port
        pid = a.pid(i)
        uid = next(
            ln.split()[1]
            for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ln.startswith("Uid:")
        )
        out = subprocess.run(
            ["ss", "-tnpH", "state", "established", "dst", f"{host}:{port}"], capture_output=True, text=True
        ).stdout
        local = next(ln.split()[2] for ln in out.splitlines() if f"pid={pid}," in ln)
        lip, lport = local.rsplit(":", 1)
        rules = [
            (
                "OUTPUT",
                "-p",
                "tcp",
                "-m",
                "owner",
                "--uid-owner",
                uid,
                "-d",
                host,
                "--dport",
                str(port),
                "-j",
                "DROP",
            ),
            (
                "OUTPUT",
                "-p",
                "tcp",
                "-s",
                host,
                "--sport",
                str(port),
                "-d",
                lip,
                "--dport",
                lport,
                "-j",
                "DROP",
            ),
        ]
    for rule in rules:
        _iptables("-I", *rule)
    try:
        yield
    finally:
        for rule in rules:
            _iptables("-D", *rule)


def a_partition_between_a_worker_and_the_head_stops_the_gang_on_both_sides(a: Agents, job: str) -> None:
    c = a.client()
    c.launch(task_from_args(num_nodes=N, run=SLEEP), job, grace=1.0, lost_after=LOST_AFTER)
    _wait(lambda: {s for s, _ in _states(c, job).values()} == {"running"}, 30, "every rank running")
    node = a.handle.nodes[N - 1].node_id
    with _partitioned(a, N - 1):
        t0 = time.monotonic()
        states = _until(
            c,
            job,
            lambda st: all(st[r][0] == "cancelled" for r in range(N - 1)),
            LOST_AFTER + MARGIN,
            "the head's side cancelled",
        )
        assert time.monotonic() - t0 >= LOST_AFTER - 1.5
        for r in range(N - 1):
            assert f"node {node} (ranks {N - 1}) lost" in states[r][1], states
        time.sleep(LOST_AFTER)  # the cut-off worker heard nothing from the head as long: it stopped its rank
    states = _until(c, job, lambda st: st[N - 1][0] == "cancelled", 20, "the worker's own stop")
    assert "head node lost" in states[N - 1][1], states


IDS = {
    "hostile_clients_leave_the_head_serving": "hostile",
    "a_lost_worker_agent_fails_the_gang_and_its_ranks_stop_once_it_answers": "lost-worker",
    "a_lost_head_agent_makes_every_worker_stop_its_ranks": "lost-head",
    "a_partition_between_a_worker_and_the_head_stops_the_gang_on_both_sides": "partition",
}
CASES = [
    hostile_clients_leave_the_head_serving,
    a_lost_worker_agent_fails_the_gang_and_its_ranks_stop_once_it_answers,
    a_lost_head_agent_makes_every_worker_stop_its_ranks,
]


@pytest.mark.parametrize("case", CASES, ids=lambda f: IDS[f.__name__])
def test_agents_on_hosts(host_agents: Agents, case: Callable[[Agents, str], None]) -> None:
    case(host_agents, f"j{CASES.index(case)}")


@pytest.mark.parametrize("host_agents", ["ssh", "aws"], indirect=True)
def test_a_partition_on_hosts(host_agents: Agents) -> None:
    a_partition_between_a_worker_and_the_head_stops_the_gang_on_both_sides(host_agents, "partition")


@pytest.mark.parametrize(
    "case",
    [*CASES, a_partition_between_a_worker_and_the_head_stops_the_gang_on_both_sides],
    ids=lambda f: IDS[f.__name__],
)
def test_agents_on_pods(pod_agents: Agents, case: Callable[[Agents, str], None]) -> None:
    pod_agents.wait_joined()  # a case before may have cut one off
    case(pod_agents, f"p{int(time.time() * 10) % 100000}")
