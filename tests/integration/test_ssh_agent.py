"""The node agent on SSH hosts (real sshd hosts on loopback, each its own user): one agent per host,
started over SSH at provisioning; the gang's start, status and cancel are one call to the head's agent,
and a rank's failure stops its siblings on every host with nothing on this side polling."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import SSHDCluster, needs_sshd, user_processes

from airflow_provider_sky.backends.nodeagents import EXTRA_KEY, endpoint, host_agent_dir
from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

pytestmark = needs_sshd

N = 4
#: how long after the failing rank's exit every sibling on every host must have ended: the head's
#: decision is one scan (0.05 s) and one message; the rest is each host's own cancel on this shared
#: 2-core machine (the tight figure is benchmarks/fig_failfast.py's, figure 1c with agents)
FAILFAST_MARGIN = 3.0
#: the agents' lost_after (10 s) plus the same margin
LOST_MARGIN = 10.0 + FAILFAST_MARGIN


def _backend(c: SSHDCluster, **kw: Any) -> SSHBackend:
    return c.ssh_backend(**kw)


def _procs(c: SSHDCluster, pattern: str) -> dict[int, list[int]]:
    """Per host index, the pids of its user's processes whose command line has ``pattern``."""
    out: dict[int, list[int]] = {}
    for n in c.nodes:
        for pid in user_processes(n.user):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pattern in cmd:
                out.setdefault(n.index, []).append(pid)
    return out


def _wait_running(c: SSHDCluster, pattern: str, hosts: int, timeout: float = 10) -> dict[int, list[int]]:
    """Per host, the pids matching ``pattern`` once ``hosts`` hosts run one (or at ``timeout``): a launch
    returns once the agents started the wrappers, and a loaded host execs the command a moment later."""
    deadline = time.monotonic() + timeout
    while len(running := _procs(c, pattern)) < hosts and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def _wait_gone(c: SSHDCluster, pattern: str, timeout: float) -> dict[int, list[int]]:
    deadline = time.monotonic() + timeout
    while (left := _procs(c, pattern)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    with SSHDCluster(N, tmp_path_factory.mktemp("sshd-agent")) as c:
        yield c
        ssh.close_all()
        deadline = time.time() + 10
        while time.time() < deadline and any(user_processes(n.user) for n in c.nodes):
            time.sleep(0.1)
        assert {n.user: user_processes(n.user) for n in c.nodes if user_processes(n.user)} == {}


@pytest.fixture()
def cluster(hosts: SSHDCluster) -> Iterator[tuple[SSHBackend, Any]]:
    b = _backend(hosts)
    h = b.provision("agt", task_from_args(num_nodes=N, run="true"))
    try:
        yield b, h
    finally:
        b.terminate("agt")
        # teardown leaves no agent behind on any host
        assert _wait_gone(hosts, "agent.py", 10) == {}
        b.close()


def test_every_host_runs_an_agent_and_the_token_stays_in_its_0600_file(
    hosts: SSHDCluster, cluster: tuple[SSHBackend, Any]
) -> None:
    b, h = cluster
    where = endpoint(h.extra)
    assert where is not None and where[0] == h.nodes[0].ip  # the head's host, its own port
    agents = _procs(hosts, "agent.py --node ")
    assert sorted(agents) == list(range(N)) and all(len(p) == 1 for p in agents.values()), agents
    b.forget_agent(h)  # as a fresh process would: the token is read back from the head, one call
    found = b.agent_endpoint(h)
    assert found is not None and found[:2] == where
    token = found[2]
    assert len(token) >= 32
    assert token.decode() not in json.dumps(h.to_dict())  # not in the handle (XCom)
    assert token.decode() not in json.dumps(b.records("agt").load("agt"))  # nor in the record on the head
    for n in hosts.nodes:
        d = host_agent_dir(h.nodes[n.index].root)
        assert oct(os.stat(d).st_mode & 0o777) == "0o700"
        assert oct(os.stat(f"{d}/token").st_mode & 0o777) == "0o600"
        assert Path(f"{d}/token").read_bytes().strip() == token
        assert token not in Path(f"{d}/log").read_bytes()
    for pids in agents.values():  # nor on any agent's command line or in its environment
        for pid in pids:
            assert token not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert token not in Path(f"/proc/{pid}/environ").read_bytes()


def test_start_status_and_cancel_are_one_call_each_to_the_head(cluster: tuple[SSHBackend, Any]) -> None:
    b, h = cluster
    c = GangClient(b, h)
    assert c.launch(task_from_args(num_nodes=N, run="sleep 10000"), "cx") == dict.fromkeys(
        range(N), "STARTED"
    )
    assert (c.agent_calls, c.node_calls) == (1, 0)  # the start: one call to the head, no SSH call per host
    status = c.peek("cx")
    assert (c.agent_calls, c.node_calls) == (2, 0)  # a status: one call
    assert {r.state.value for r in status.ranks} == {"running"}
    c.cancel("cx", grace=1.0, reason="marked failed by a user")
    assert c.node_calls == 0
    status = c.peek("cx")
    assert {r.state.value for r in status.ranks} == {"cancelled"}
    assert all("marked failed by a user" in r.reason for r in status.ranks), status.ranks


def test_a_failure_on_host_3_stops_the_siblings_on_every_host_with_nothing_polling(
    hosts: SSHDCluster, cluster: tuple[SSHBackend, Any]
) -> None:
    """Rank 3 exits 1 while nothing on this side polls (no watcher, no bridge, no trigger): the
    head's agent cancels the others itself, and the failing rank is named as the cause."""
    b, h = cluster
    run = f'if [ "$SKYPILOT_NODE_RANK" = "{N - 1}" ]; then sleep 2; exit 1; fi; sleep 10000'
    c = GangClient(b, h)
    c.launch(task_from_args(num_nodes=N, run=run), "ff")
    # the siblings run, each on its own host
    assert len(_wait_running(hosts, "sleep 10000", N - 1)) == N - 1
    t0 = time.monotonic()
    left = _wait_gone(hosts, "sleep 10000", 2 + FAILFAST_MARGIN + 5)
    assert left == {}, left
    took = time.monotonic() - t0
    assert (c.agent_calls, c.node_calls) == (1, 0)  # nothing polled meanwhile
    status = c.peek("ff")
    states = {r.rank: r.state.value for r in status.ranks}
    assert states == {0: "cancelled", 1: "cancelled", 2: "cancelled", N - 1: "failed"}, (states, took)
    assert all(
        f"rank {N - 1} failed first: exited with code 1" in status.by_rank(r).reason for r in range(N - 1)
    )
    failed = status.by_rank(N - 1)
    assert failed.end is not None
    last = max(r.end or 0 for r in status.ranks)
    assert last - failed.end < FAILFAST_MARGIN, {r.rank: r.end for r in status.ranks}


def test_a_lost_head_agent_makes_the_workers_stop_their_ranks(
    hosts: SSHDCluster, cluster: tuple[SSHBackend, Any]
) -> None:
    b, h = cluster
    c = GangClient(b, h)
    c.launch(task_from_args(num_nodes=N, run="sleep 10000"), "lh")
    running = _wait_running(hosts, "sleep 10000", N)
    assert sorted(running) == list(range(N))
    (head_agent,) = _procs(hosts, "agent.py --node node-0 ")[0]
    os.kill(head_agent, signal.SIGKILL)
    # the head host's own rank stays (its agent is gone; the per-node path or the keeper ends it);
    # every worker's agent stops its ranks after lost_after without the head
    deadline = time.monotonic() + LOST_MARGIN
    while time.monotonic() < deadline and set(_procs(hosts, "sleep 10000")) - {0}:
        time.sleep(0.2)
    assert set(_procs(hosts, "sleep 10000")) - {0} == set()
    for n in h.nodes[1:]:
        reason = Path(f"{n.root}/jobs/lh/{h.nodes.index(n)}/cancel").read_text()
        assert "head node lost" in reason, reason
    # the control plane's next call finds the head gone and reads the gang the per-node way
    status = c.peek("lh")
    assert c.node_calls > 0
    assert {r.rank: r.state.value for r in status.ranks}[1] == "cancelled"


def test_node_agent_off_in_the_connection_keeps_the_per_node_path(hosts: SSHDCluster) -> None:
    from airflow_provider_sky.backends.ssh.config import parse_ssh_config

    assert parse_ssh_config({"host": "h1", "node_agent": "false"}).node_agent is False
    b = _backend(hosts, node_agent=False)
    try:
        h = b.provision("agt-off", task_from_args(num_nodes=2, run="true"))
        assert EXTRA_KEY not in h.extra and b.agent_endpoint(h) is None
        assert _procs(hosts, "agent.py") == {}
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=2, run="true"), "off")
        c.peek("off")
        assert c.agent_calls == 0 and c.node_calls == 2  # a status call per host
    finally:
        b.terminate("agt-off")
        b.close()


def test_idle_down_ends_the_agents_with_the_cluster(hosts: SSHDCluster) -> None:
    """The keeper's idle_down (no teardown, no Airflow) removes the node's files and ends its agent."""
    b = _backend(hosts)
    spec = task_from_args(num_nodes=2, run="true")
    h = b.provision("agt-idle", spec)
    try:
        assert endpoint(h.extra) is not None and len(_procs(hosts, "agent.py --node ")) == 2
        GangClient(b, h).launch(spec, "j", idle_down=2)
        left = _wait_gone(hosts, "agent.py --node ", 30)
        assert left == {}, left
        # the keeper kills the agent (its mark) before it removes the files: they go a moment later
        deadline = time.monotonic() + 10
        while any(Path(n.root).exists() for n in h.nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(Path(n.root).exists() for n in h.nodes)
    finally:
        b.terminate("agt-idle")
        b.close()


def test_a_spare_host_that_takes_a_rank_gets_an_agent_that_joins_the_head(hosts: SSHDCluster) -> None:
    hl = hosts.host_list()
    b_hosts = SSHBackend(
        hl[:3],
        spare_hosts=tuple(hl[3:]),
        user="",
        key_file=hosts.client_key_path,
        known_hosts=hosts.known_hosts_path,
        connect_timeout=5.0,
        ready_timeout=5.0,
    )
    spec = task_from_args(num_nodes=3, run="true")
    h = b_hosts.provision("agt-spare", spec)
    try:
        assert endpoint(h.extra) is not None
        hosts.kill_node(1)  # the host is lost (its agent with it)
        new = b_hosts.replace_nodes(h, [1])
        assert new.nodes[1].ip == hosts.nodes[3].host and endpoint(new.extra) == endpoint(h.extra)
        assert 3 in _procs(hosts, "agent.py --node " + new.nodes[1].node_id + " ")
        c = GangClient(b_hosts, new)  # the start names the spare's node: the head knows it
        c.launch(task_from_args(num_nodes=3, run="sleep 1"), "sp")
        assert (c.agent_calls, c.node_calls) == (1, 0)
    finally:
        b_hosts.terminate("agt-spare")
        b_hosts.close()
        hosts.restart_node(1)
        ssh.close_all()
    assert _wait_gone(hosts, "agent.py", 10) == {}
