"""The node agent on real processes: several agents on this machine act as nodes (the head listens on
127.0.0.2), each with its own node root and rank processes started by today's launch script; nothing
but the agents connects the nodes (each node root is its own machine for the node runtime: its own
gang flag, ``.ranks``, ``.pgids``), so a failure crosses nodes only through the agents.

The agent runs as the single file a backend copies to a node, under ``python -I -S`` (no site
packages, nothing of this package importable): what a node has is what it gets.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import (
    HEAD_IP,
    PROXY_IP,
    SLEEP,
    TOKEN,
    Cluster,
    Proxy,
    agent_view,
    final_status,
    over,
    per_node_view,
    records,
    with_client,
)

from airflow_provider_sky.agent import AGENT_FILE, agent_args
from airflow_provider_sky.agent.client import AgentClient, AgentError, AgentStatus, AgentUnreachable
from airflow_provider_sky.agent.node import MAGIC, PEER_GRACE, client_handshake
from integration.test_containment import _alive, _marked, _wait_for


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(nodes: int, **kw: Any) -> Cluster:
        made.append(Cluster(tmp_path, nodes, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()
    assert _wait_for(lambda: not _alive(_marked(str(tmp_path))), 5)
    assert _wait_for(lambda: not any(c.agents_left() for c in made), 5), [c.agents_left() for c in made]


#: four nodes, two ranks each: rank r on node r // 2
RANKS = {f"n{i}": [2 * i, 2 * i + 1] for i in range(4)}


def test_a_failing_rank_on_one_node_cancels_every_node_through_the_head(cluster_of: Any) -> None:
    """Rank 5 (node n2) exits 3; nothing polls: the head hears it from n2's agent and tells every agent,
    whose cancel stops their ranks with the cause as the reason. Measured: from rank 5's exit record to
    the last sibling's on another node."""
    c = cluster_of(4)
    run = f'if [ "$SKYPILOT_NODE_RANK" = 5 ]; then sleep 1.5; exit 3; fi\n{SLEEP}'

    async def start() -> Any:
        return await c.client().start("job", c.plan("job", RANKS, run), grace=1.0)

    res = asyncio.run(start())
    assert res.errors() == {}, res.nodes
    assert res.words() == dict.fromkeys(range(8), "STARTED"), res.nodes
    # no status call until it is over: the gang decides on its own nodes
    assert _wait_for(lambda: over(c, "job", RANKS), 15), records(c, "job", RANKS)
    ends = records(c, "job", RANKS)
    assert ends[5]["code"] == 3 and ends[5]["own"], ends[5]
    for r, rec in ends.items():
        if r != 5:
            assert rec["code"] == 143 and rec["why"] == "@rank-failed 5 3" and not rec["own"], (r, rec)
    other = [rec["end"] for r, rec in ends.items() if r // 2 != 2]
    gone = max(other) - ends[5]["end"]
    print(f"\nnode agent fail-fast: rank 5's exit -> last sibling on another node gone: {gone:.3f} s")
    # one round trip on loopback is well under 10 ms; the rest is the agents' 0.05 s scan and a fork of
    # the cancel script; 2 s is the margin for 2 cores shared with other test runs
    assert gone < 2.0, f"the last sibling on another node ended {gone:.2f} s after the failure"

    status = final_status(c, "job")
    assert (
        status.done
        and status.state == "failed"
        and status.reason == "rank 5 failed first: exited with code 3"
    ), status
    assert status.cause is not None and status.cause["rank"] == 5 and status.cause["code"] == 3
    assert status.by_rank(0).reason == "rank 5 failed first: exited with code 3"
    assert {r.node for r in status.ranks} == set(RANKS)
    # the head's one call reads every rank as the per-node path's status script does, rank for rank
    assert agent_view(status) == per_node_view(c, "job", RANKS)
    assert agent_view(status)[0] == ("cancelled", 143, "cancelled: rank 5 failed first: exited with code 3")


def test_a_ranks_end_wakes_its_agent_whatever_the_scan_interval(cluster_of: Any) -> None:
    """Each running rank's command is waited on (a pidfd): with the directories read only every 5 s,
    rank 3's failure still reaches every node at once; the scan is not what fail-fast waits for."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("this Python has no os.pidfd_open (3.9+ on Linux 5.3+): the agent reads every scan")
    c = cluster_of(2, scan=5.0)
    ranks = {"n0": [0, 1], "n1": [2, 3]}
    run = f'if [ "$SKYPILOT_NODE_RANK" = 3 ]; then sleep 2; exit 5; fi\n{SLEEP}'
    res = asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, run))))
    assert res.errors() == {}, res.nodes
    assert _wait_for(lambda: over(c, "job", ranks), 15), records(c, "job", ranks)
    ends = records(c, "job", ranks)
    assert ends[3]["code"] == 5 and ends[3]["own"], ends[3]
    gone = max(ends[r]["end"] for r in (0, 1)) - ends[3]["end"]
    print(f"\nscan 5 s: rank 3's exit -> last sibling on the head's node gone: {gone:.3f} s")
    # a scan would have taken up to 5 s; the wake is a millisecond, the rest the same as with a fast
    # scan (1.5 s of margin for 2 cores shared with other test runs)
    assert gone < 1.5, ends
    assert all(ends[r]["why"] == "@rank-failed 3 5" for r in (0, 1, 2)), ends


def test_a_rank_failing_at_once_during_the_start_stops_every_node(cluster_of: Any) -> None:
    """Rank 2 fails before the other nodes' launch scripts have run: the head's cancel comes right behind
    their ``run``; every other rank ends cancelled by rank 2 (started and stopped, or never started)."""
    c = cluster_of(4)
    run = f'[ "$SKYPILOT_NODE_RANK" = 2 ] && exit 1\n{SLEEP}'
    res = asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", RANKS, run))))
    assert res.errors() == {}, res.nodes
    assert _wait_for(lambda: over(c, "job", RANKS), 15), records(c, "job", RANKS)
    for r, rec in records(c, "job", RANKS).items():
        if r == 2:
            assert rec["code"] == 1 and rec["own"], rec
        else:
            assert rec["code"] == 143 and rec["why"] == "@rank-failed 2 1" and not rec["own"], (r, rec)
    status = final_status(c, "job")
    assert status.state == "failed" and status.cause is not None and status.cause["rank"] == 2, status
    assert agent_view(status) == per_node_view(c, "job", RANKS)


def test_every_sibling_on_every_node_gets_one_sigterm(cluster_of: Any) -> None:
    """A SIGTERM handler (a checkpoint save) runs once: the agent signals each group itself and the
    cancel script it runs after skips those groups; on the failing rank's node the machine's own cancel
    and the agent's do not both signal (whichever claims the node's cancel first does it)."""
    c = cluster_of(4)
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 5 ]; then sleep 1.5; exit 3; fi\n'
        "trap 'echo term >> \"${SKY_PROGRESS_FILE%/*}/terms\"' TERM\n"
        "while :; do sleep 0.05; done"
    )
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", RANKS, run), grace=1.5)))
    assert _wait_for(lambda: over(c, "job", RANKS), 15), records(c, "job", RANKS)
    for node, rs in RANKS.items():
        for r in rs:
            if r != 5:
                terms = Path(c.rank_dir(node, "job", r), "terms").read_text().split()
                assert terms == ["term"], (r, terms)


#: interpreters a node may have (the oldest the agent supports, the newest): found on this machine or skipped
NODE_PYTHONS = [f"/root/.pyenv/versions/{v}/bin/python3" for v in ("3.8.18", "3.13.0")] + [
    shutil.which(f"python3.{m}") or f"python3.{m}" for m in (8, 13)
]


@pytest.mark.parametrize("minor", [8, 13])
def test_the_agent_runs_on_the_pythons_nodes_have(cluster_of: Any, minor: int) -> None:
    """The shipped file on Python 3.8 (the oldest a node may have) and 3.13: a cross-node fail-fast."""
    found = [p for p in NODE_PYTHONS if f"3.{minor}" in p and shutil.which(p)]
    if not found:
        pytest.skip(f"no Python 3.{minor} on this machine")
    c = cluster_of(2, python=found[0])
    ranks = {"n0": [0], "n1": [1]}
    run = f'[ "$SKYPILOT_NODE_RANK" = 1 ] && {{ sleep 1; exit 4; }}\n{SLEEP}'
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, run))))
    assert _wait_for(lambda: over(c, "job", ranks), 15), (records(c, "job", ranks), c.log("n0"), c.log("n1"))
    assert records(c, "job", ranks)[0]["why"] == "@rank-failed 1 4"
    assert final_status(c, "job").state == "failed"


def test_cancel_from_the_control_plane_is_one_call(cluster_of: Any) -> None:
    c = cluster_of(3)
    ranks = {n: [i] for i, n in enumerate(c.roots)}

    async def go() -> tuple[str, float, AgentStatus]:
        client = c.client()
        try:
            await client.start("job", c.plan("job", ranks, SLEEP), grace=1.0)
            t0 = time.time()
            state = await client.cancel("job", "a user asked")
            return state, t0, await client.status("job")
        finally:
            await client.aclose()

    state, t0, _ = asyncio.run(go())
    assert state == "cancelled"
    assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
    ends = records(c, "job", ranks)
    assert all(rec["code"] == 143 and rec["why"] == "a user asked" for rec in ends.values()), ends
    print(
        f"\nnode agent cancel: one call -> last rank gone: {max(r['end'] for r in ends.values()) - t0:.3f} s"
    )
    status = final_status(c, "job")
    assert status.state == "cancelled" and status.done and status.reason == "a user asked", status
    assert agent_view(status) == per_node_view(c, "job", ranks)


def test_an_agents_cancel_spares_a_group_that_took_a_ranks_number(cluster_of: Any) -> None:
    """A rank whose group ended without an exit record (its wrapper died with it) leaves a number that a
    busy machine gives to another process group within minutes: the agent's SIGTERM goes to groups that
    are still their rank's. Rank 1 here names a stranger's group; the stranger lives, the ranks end."""
    c = cluster_of(2)
    ranks = {"n0": [0], "n1": [1]}
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)

    async def go() -> None:
        client = c.client()
        try:
            await client.start("job", c.plan("job", ranks, SLEEP), grace=1.0)
            d = Path(c.rank_dir("n1", "job", 1))
            assert _wait_for(lambda: (d / "pid").exists(), 10)
            (d / "pgid").write_text(f"{stranger.pid}\n")
            await client.cancel("job", "a user asked")
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
        assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
        time.sleep(1.5)  # past the grace: the cancel's SIGKILL too
        assert stranger.poll() is None, "the agent's cancel signalled a process group that is not the job's"
        assert all(rec["why"] == "a user asked" for rec in records(c, "job", ranks).values())
    finally:
        stranger.kill()
        stranger.wait()


def test_a_lost_worker_agent_fails_the_gang_after_lost_after(cluster_of: Any) -> None:
    """n2's agent is killed (its node, for the head): after ``lost_after`` the gang fails with the node
    named, and the ranks of every other node are stopped."""
    c = cluster_of(3, lost_after=2.0)
    ranks = {n: [i] for i, n in enumerate(c.roots)}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP), grace=1.0)))
    t0 = time.time()
    c.kill("n2")
    alive = {"n0": [0], "n1": [1]}
    assert _wait_for(lambda: over(c, "job", alive), 15), records(c, "job", alive)
    ends = records(c, "job", alive)
    took = max(r["end"] for r in ends.values()) - t0
    print(f"\nnode agent: worker agent killed -> siblings gone: {took:.3f} s (lost_after 2 s)")
    # not before lost_after counted from the last heartbeat heard (up to one beat, 0.2 s, before the
    # kill; 0.1 s more for clocks read apart), and within lost_after plus 3 s of margin
    assert 2.0 - 0.2 - 0.1 <= took < 5.0, took
    for rec in ends.values():
        assert rec["code"] == 143 and "node n2 (ranks 2) lost" in rec["why"], rec
    status = final_status(c, "job")
    assert status.state == "failed" and "node n2 (ranks 2) lost" in status.reason, status
    assert status.by_rank(2).state == "lost" and status.done, status
    assert status.nodes["n2"]["up"] is False


def test_a_lost_head_makes_every_worker_stop_its_ranks(cluster_of: Any) -> None:
    c = cluster_of(3, lost_after=2.0)
    ranks = {n: [i] for i, n in enumerate(c.roots)}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP), grace=1.0)))
    t0 = time.time()
    c.kill("n0")
    workers = {"n1": [1], "n2": [2]}
    assert _wait_for(lambda: over(c, "job", workers), 15), records(c, "job", workers)
    ends = records(c, "job", workers)
    took = max(r["end"] for r in ends.values()) - t0
    print(f"\nnode agent: head agent killed -> workers' ranks gone: {took:.3f} s (lost_after 2 s)")
    assert 2.0 - 0.2 - 0.1 <= took < 5.0, took  # lost_after, with the same margins as above
    for rec in ends.values():
        assert rec["code"] == 143 and "head node lost" in rec["why"], rec


def test_the_dead_mans_switch_stops_a_gang_nobody_polls(cluster_of: Any) -> None:
    c = cluster_of(2)
    ranks = {"n0": [0], "n1": [1]}
    asyncio.run(
        with_client(
            c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP), grace=1.0, orphan_timeout=1)
        )
    )
    assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
    for rec in records(c, "job", ranks).values():
        assert rec["orphaned"] and rec["code"] == 143 and rec["why"].startswith("orphaned: nothing polled"), (
            rec
        )


def test_a_peek_does_not_keep_a_gang_nobody_watches_alive_but_a_poll_does(cluster_of: Any) -> None:
    """The head's dead-man's switch counts a watcher's status call, not a one-off look (``peek``): the
    gang looked at every 0.3 s is still cancelled as orphaned; the one polled every 0.3 s runs on."""
    c = cluster_of(2)
    ranks = {"n0": [0], "n1": [1]}

    async def go() -> None:
        cl = c.client()
        try:
            for job in ("peeked", "polled"):
                await cl.start(job, c.plan(job, ranks, SLEEP), grace=1.0, orphan_timeout=2)
            for _ in range(12):
                await cl.status("peeked", touch=False)
                await cl.status("polled")
                await asyncio.sleep(0.3)
            assert (await cl.status("polled")).state == "running"
            await cl.cancel("polled", "done")
        finally:
            await cl.aclose()

    asyncio.run(go())
    assert _wait_for(lambda: over(c, "peeked", ranks), 10), records(c, "peeked", ranks)
    assert all(rec["orphaned"] for rec in records(c, "peeked", ranks).values())
    assert _wait_for(lambda: over(c, "polled", ranks), 10), records(c, "polled", ranks)
    assert not any(rec["orphaned"] for rec in records(c, "polled", ranks).values())


def test_the_status_carries_each_ranks_log_size_so_logs_are_read_only_when_they_grew(cluster_of: Any) -> None:
    """Running ranks' log sizes come with the agents' heartbeats (the head's own node's too), an ended
    rank's from its exit record: a status says which logs grew without a call to any node."""
    c = cluster_of(2)
    ranks = {"n0": [0], "n1": [1]}
    run = 'echo "line of rank $SKYPILOT_NODE_RANK"; sleep 2.5; echo more; sleep 1'

    async def go() -> tuple[AgentStatus, AgentStatus]:
        cl = c.client()
        try:
            await cl.start("job", c.plan("job", ranks, run), grace=1.0)
            await asyncio.sleep(1.8)  # past a heartbeat (1 s) after the first line
            first = await cl.status("job")
            while not (last := await cl.status("job")).done:
                await asyncio.sleep(0.2)
            return first, last
        finally:
            await cl.aclose()

    first, last = asyncio.run(go())
    for r in (0, 1):
        size = Path(c.rank_dir(f"n{r}", "job", r), "log").stat().st_size
        assert first.by_rank(r).log_size == len(f"line of rank {r}\n"), first.by_rank(r)
        assert last.by_rank(r).log_size == size == len(f"line of rank {r}\nmore\n"), last.by_rank(r)


def test_a_start_naming_a_node_the_head_does_not_hear_starts_nothing(cluster_of: Any) -> None:
    """Where the nodes cannot reach the head, the start says which: the control plane then uses the
    per-node path; nothing was started."""
    c = cluster_of(2)
    plan = c.plan("job", {"n0": [0], "n1": [1]}, SLEEP)
    plan["n9"] = plan.pop("n1")
    with pytest.raises(AgentUnreachable) as err:
        asyncio.run(with_client(c.client(), lambda cl: cl.start("job", plan)))
    assert err.value.nodes == ["n9"]
    assert not Path(c.rank_dir("n0", "job", 0)).exists()


# -- a hostile network -----------------------------------------------------------------------------


def _hostile(port: int, payload: bytes) -> bytes:
    """Connect from another address (127.0.0.5), send ``payload``, return what came back."""
    s = socket.create_connection((HEAD_IP, port), timeout=5, source_address=("127.0.0.5", 0))
    got = b""
    try:
        got = s.recv(64)
        s.sendall(payload)
        s.settimeout(6)
        while True:
            more = s.recv(4096)
            if not more:
                break
            got += more
    except OSError:
        pass
    finally:
        s.close()
    return got


def test_the_head_drops_wrong_tokens_and_garbage_and_answers_its_own(cluster_of: Any) -> None:
    c = cluster_of(2)
    ranks = {"n0": [0], "n1": [1]}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP))))

    # garbage, an HTTP request, a wrong token's proof: the greeting, then the connection is closed
    for payload in (os.urandom(100_000), b"GET / HTTP/1.0\r\n\r\n", os.urandom(48)):
        got = _hostile(c.port, payload)
        assert got[: len(MAGIC)] == MAGIC and len(got) == len(MAGIC) + 16, got[:100]

    # a client with the wrong token learns nothing (the head proves nothing to it) and is refused
    async def wrong() -> None:
        await AgentClient(HEAD_IP, c.port, b"not-the-cluster-token").status("job")

    with pytest.raises(AgentError):
        asyncio.run(wrong())

    # right token, forged frame (its MAC cannot be right): dropped
    async def forged() -> bytes:
        reader, writer = await asyncio.open_connection(HEAD_IP, c.port)
        await client_handshake(reader, writer, TOKEN, 5)
        writer.write(b"\x00\x00\x00\x40" + b"\x00" * 64)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return rest

    assert asyncio.run(forged()) == b""

    # a flood from one host while the control plane asks for the status: 600 connections held open
    # without a word, and connections pouring bytes; the head answers, every agent stays up, the ranks
    # run on, and the head holds only the newest 16 of that host's unproven connections (PEER_PENDING)
    held = []
    for _ in range(600):
        held.append(socket.create_connection((HEAD_IP, c.port), 5, ("127.0.0.5", 0)))
    stop = threading.Event()

    def pour() -> None:
        junk = os.urandom(65536)
        while not stop.is_set():
            try:
                with socket.create_connection((HEAD_IP, c.port), 2, ("127.0.0.5", 0)) as s:
                    for _ in range(100):
                        s.sendall(junk)
            except OSError:
                pass

    threads = [threading.Thread(target=pour, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(PEER_GRACE + 1.0)  # the flood's unproven connections are past their grace, and swept
        for _ in range(5):
            status = asyncio.run(with_client(c.client(), lambda cl: cl.status("job")))
            assert status.state == "running" and [r.state for r in status.ranks] == ["running"] * 2, status
            assert all(v["up"] for v in status.nodes.values()), status.nodes
            time.sleep(0.2)
        # 16 unproven connections of the flooding host, the two pouring ones, the agents' links and the
        # head's own files (~20): not one per connection the flood holds
        fds = len(os.listdir(f"/proc/{c.procs['n0'].pid}/fd"))
        assert fds < 60, f"the head holds {fds} descriptors for a flood of 600 silent connections"
        closed = 0
        for s in held:
            s.settimeout(0.01)
            try:
                closed += s.recv(64) == b"" or s.recv(64) == b""
            except OSError:
                pass
        assert closed >= 600 - 16 - 2, f"the head closed {closed} of the 600 silent connections"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for s in held:
            s.close()
    assert all(p.poll() is None for p in c.procs.values()), c.log("n0")
    # and the gang still obeys its own: one cancel stops it
    assert asyncio.run(with_client(c.client(), lambda cl: cl.cancel("job", "done"))) == "cancelled"
    assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)


def test_the_token_never_reaches_a_command_line_and_its_file_must_be_private(tmp_path: Path) -> None:
    """The agents' command lines hold no token; a token file others can read is refused at start."""
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    token.chmod(0o644)
    agent = [sys.executable, "-I", "-S", str(AGENT_FILE), "--node", "n0", "--token-file", str(token)]
    res = subprocess.run([*agent, "--listen", "127.0.0.2:0"], capture_output=True, timeout=30)
    assert res.returncode != 0 and b"readable by others: chmod 600" in res.stderr, res.stderr
    assert TOKEN not in res.stderr


def test_the_token_is_not_on_the_agents_command_lines(cluster_of: Any) -> None:
    c = cluster_of(2)
    for p in c.procs.values():
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        assert TOKEN not in cmdline and TOKEN not in environ


def _zombies_of(pid: int) -> list[int]:
    """Zombie children of ``pid`` (nothing waited for them)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] == "Z" and fields[1] == str(pid):
                out.append(int(entry))
    return out


def test_as_a_pods_own_process_the_agent_reaps_the_wrappers_and_ends_on_sigterm(cluster_of: Any) -> None:
    """On Kubernetes the agent is the pod's process, pid 1: every rank wrapper is reparented to it once
    its starter exits, and a pid 1 that does not wait for them fills the pod with zombies; the kubelet's
    SIGTERM, which a pid 1 ignores by default, must end it."""
    c = cluster_of(1, head_pid1=True)
    ranks = {"n0": [0, 1]}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, "sleep 1; exit 0"))))
    assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
    agent = c.agent_pid("n0")
    # the wrappers' ends are reaped within the reaper's 1 s round (3 s of margin)
    assert _wait_for(lambda: not _zombies_of(agent), 4), _zombies_of(agent)
    os.kill(agent, signal.SIGTERM)
    assert c.procs["n0"].wait(10) == 0, c.log("n0")


def test_a_start_carries_the_ranks_secrets_unreadable_on_the_wire(cluster_of: Any) -> None:
    """A gang start's launch scripts hold the ranks' secrets (as over SSH today): on the cluster's network
    a recording relay in front of the head sees neither them nor any message, and the ranks get them."""
    c = cluster_of(2)
    proxy = Proxy(HEAD_IP, c.port)
    secret = "s3cr3t-" + os.urandom(8).hex()
    ranks = {"n0": [0], "n1": [1]}
    run = f'[ "${{#MY_SECRET}}" = {len(secret)} ]'  # the secret's length: it arrived
    try:
        client = AgentClient(PROXY_IP, proxy.port, TOKEN)
        plan = c.plan("job", ranks, run, secrets={"MY_SECRET": secret})
        asyncio.run(with_client(client, lambda cl: cl.start("job", plan)))
        assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
    finally:
        proxy.close()
    assert {r: rec["code"] for r, rec in records(c, "job", ranks).items()} == {0: 0, 1: 0}
    captured = bytes(proxy.captured)
    assert len(captured) > 2000, len(captured)  # the launch scripts went through
    assert secret.encode() not in captured
    assert b'"op"' not in captured and b"rank.sh" not in captured


def test_a_network_blip_shorter_than_lost_after_changes_nothing(cluster_of: Any) -> None:
    """n1's link to the head is cut three times: its agent joins again at once with its ranks' state,
    and neither side counts it lost; the gang runs on and still obeys one cancel."""
    c = cluster_of(3, lost_after=3.0, via_proxy=("n1",))
    ranks = {n: [i] for i, n in enumerate(c.roots)}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP))))
    assert c.proxy is not None
    for _ in range(3):
        c.proxy.cut()
        time.sleep(0.5)
    time.sleep(3.5)  # past lost_after since the first cut
    assert c.proxy.connections >= 4, c.proxy.connections  # the first link and one after each cut
    status = asyncio.run(with_client(c.client(), lambda cl: cl.status("job")))
    assert status.state == "running" and [r.state for r in status.ranks] == ["running"] * 3, status
    assert all(v["up"] for v in status.nodes.values()), status.nodes
    assert asyncio.run(with_client(c.client(), lambda cl: cl.cancel("job", "done"))) == "cancelled"
    assert _wait_for(lambda: over(c, "job", ranks), 10), records(c, "job", ranks)
    assert all(rec["why"] == "done" for rec in records(c, "job", ranks).values())


def test_a_partition_between_a_worker_and_the_head_stops_the_gang_on_both_sides(cluster_of: Any) -> None:
    """n1 and the head stop hearing each other (every byte dropped, nothing reset: a lost route), while
    both agents live: after ``lost_after`` the head fails the gang naming n1 and stops the ranks of n0 and
    n2, and n1's agent, hearing nothing from the head, stops its own rank (all or nothing: no half of the
    gang runs on). Healed, n1 joins again and the head's verdict stands."""
    c = cluster_of(3, lost_after=2.0, via_proxy=("n1",))
    ranks = {n: [i] for i, n in enumerate(c.roots)}
    asyncio.run(with_client(c.client(), lambda cl: cl.start("job", c.plan("job", ranks, SLEEP), grace=1.0)))
    assert c.proxy is not None
    t0 = time.time()
    c.proxy.partition()
    assert _wait_for(lambda: over(c, "job", ranks), 15), records(c, "job", ranks)
    ends = records(c, "job", ranks)
    took = max(r["end"] for r in ends.values()) - t0
    print(f"\nnode agent: n1 partitioned from the head -> every rank gone: {took:.3f} s (lost_after 2 s)")
    assert 2.0 - 0.2 - 0.1 <= took < 5.0, took  # lost_after, with the margins of the lost-agent tests
    for r in (0, 2):
        assert ends[r]["code"] == 143 and "node n1 (ranks 1) lost" in ends[r]["why"], ends[r]
    assert ends[1]["code"] == 143 and "head node lost" in ends[1]["why"], ends[1]
    c.proxy.partition(False)
    status = final_status(c, "job")
    assert status.state == "failed" and "node n1 (ranks 1) lost" in status.reason, status
    assert [r.state for r in status.ranks if r.rank != 1] == ["exited", "exited"], status


def test_the_agents_command_line_is_checked_before_a_node_runs_it() -> None:
    with pytest.raises(ValueError, match="either listens"):
        agent_args("/a.py", "n0", "/t", listen="0.0.0.0:7000", head="10.0.0.1:7000")
    with pytest.raises(ValueError, match="node id 'n 0; rm' must match"):
        agent_args("/a.py", "n 0; rm", "/t", head="10.0.0.1:7000")
    with pytest.raises(ValueError, match="lost_after longer than beat"):
        agent_args("/a.py", "n0", "/t", head="10.0.0.1:7000", beat=5, lost_after=2)
    args = agent_args("/a.py", "n1", "/root/.sky/token", head="10.0.0.1:7000")
    assert args[:6] == ["python3", "/a.py", "--node", "n1", "--token-file", "/root/.sky/token"]


def test_many_peers_behind_one_address_joining_at_once_are_all_let_in(cluster_of: Any) -> None:
    """Nodes behind one address (one machine's nodes, a NAT) join together: 200 connections from one
    address that each prove the token at once all get in; only silent ones are dropped past 16."""
    c = cluster_of(1)

    async def one() -> int:
        return len(await with_client(AgentClient(HEAD_IP, c.port, TOKEN, timeout=30), lambda cl: cl.nodes()))

    async def many() -> list[Any]:
        return await asyncio.gather(*(one() for _ in range(200)), return_exceptions=True)

    got = asyncio.run(many())
    assert got == [1] * 200, [g for g in got if g != 1][:3]
