"""The node agent on the local backend (``node_agent: true``): an agent process per local node, started
through the local runner, the head on 127.0.0.1; the same code as the SSH hosts' (``backends/nodeagents.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from leaks import job_processes

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.backends.nodeagents import EXTRA_KEY, endpoint
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

N = 4
#: see tests/integration/test_ssh_agent.py
FAILFAST_MARGIN = 3.0


def _agents(state: Path) -> list[tuple[int, str]]:
    return [(pid, cmd) for pid, cmd in job_processes(state) if "agent.py --node " in cmd]


def test_agents_are_off_unless_the_connection_turns_them_on(sky_home: Path) -> None:
    assert not by_kind("local").make({"state_dir": str(sky_home)}).node_agent  # type: ignore[attr-defined]
    b = by_kind("local").make({"state_dir": str(sky_home), "node_agent": "true"})
    assert isinstance(b, LocalBackend) and b.node_agent
    h = LocalBackend(sky_home).provision("off", task_from_args(num_nodes=2, run="true"))
    assert EXTRA_KEY not in h.extra and _agents(sky_home) == []
    LocalBackend(sky_home).terminate("off")


def test_a_gang_with_agents_fails_fast_with_nothing_polling_and_teardown_leaves_nothing(
    sky_home: Path,
) -> None:
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("agt", task_from_args(num_nodes=N, run="true"))
    try:
        assert endpoint(h.extra) == ("127.0.0.1", h.extra[EXTRA_KEY]["port"])
        agents = _agents(sky_home)
        assert sorted(cmd.split("--node ")[1].split()[0] for _, cmd in agents) == [
            f"node-{i}" for i in range(N)
        ]
        token = Path(f"{h.nodes[0].root}/.agent/token").read_bytes().strip()
        assert oct(os.stat(f"{h.nodes[0].root}/.agent/token").st_mode & 0o777) == "0o600"
        for pid, _ in agents:  # the token is in its file only
            assert token not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert token not in Path(f"/proc/{pid}/environ").read_bytes()
        b.forget_agent(h)
        found = b.agent_endpoint(h)
        assert found is not None and found[2] == token

        run = f'if [ "$SKYPILOT_NODE_RANK" = "{N - 1}" ]; then sleep 2; exit 1; fi; sleep 10000'
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=N, run=run), "ff")
        assert (c.agent_calls, c.node_calls) == (1, 0)
        time.sleep(2 + FAILFAST_MARGIN)  # nothing polls meanwhile
        status = c.peek("ff")
        assert (c.agent_calls, c.node_calls) == (2, 0)
        states = {r.rank: r.state.value for r in status.ranks}
        assert states == {0: "cancelled", 1: "cancelled", 2: "cancelled", N - 1: "failed"}, status.ranks
        assert f"rank {N - 1} failed first" in status.by_rank(0).reason
    finally:
        assert b.terminate("agt").removed
    deadline = time.monotonic() + 5
    while job_processes(sky_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(sky_home) == []  # no agent, no rank left


def test_a_machine_without_python3_keeps_the_per_node_path(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"  # this machine's tools, without any python
    bin_dir.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in Path(d).iterdir() if Path(d).is_dir() else ():
            if not tool.name.startswith("python") and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("nopy", task_from_args(num_nodes=2, run="true"))
    try:
        assert EXTRA_KEY not in h.extra and b.agent_endpoint(h) is None
        assert _agents(sky_home) == []
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=2, run="true"), "j")
        assert c.agent_calls == 0
    finally:
        b.terminate("nopy")


def test_running_ranks_logs_come_from_the_head_in_the_one_status_call(sky_home: Path) -> None:
    """With agents, every rank printing: each poll is one call to the head, which carries the new log
    bytes its agents shipped with their heartbeats (every 1 s); no node is read while the ranks run, a
    line reaches the watcher within 5 s of being printed (expected ~1.5 s: a heartbeat plus a poll;
    the 5 s are the issue's bound, with room for a loaded machine), and the bytes streamed plus each
    ended rank's last bytes (read from its node once) are its whole log, in order, once."""
    from airflow_provider_sky.watch.loop import MonitorState

    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("logs", task_from_args(num_nodes=N, run="true"))
    run = (
        'for i in $(seq 1 25); do echo "rank $SKYPILOT_NODE_RANK line $i at $(date +%s.%N)"; sleep 0.2; done'
    )
    try:
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=N, run=run), "lg")
        st = MonitorState()
        got: dict[int, bytes] = {r: b"" for r in range(N)}
        late: list[float] = []
        polls = node_calls_running = 0
        deadline = time.monotonic() + 60
        while True:
            before = c.node_calls
            poll = c.poll("lg", st.offsets)
            polls += 1
            running = not any(r.terminal for r in poll.status.ranks)
            if running:
                node_calls_running += c.node_calls - before
            now = time.time()
            for rank, (off, data) in poll.chunks.items():
                assert off == st.offsets.get(rank, 0), (rank, off, st.offsets)
                st.offsets[rank] = off + len(data)
                got[rank] += data
                if running:
                    late += [now - float(line.split()[-1]) for line in data.decode().splitlines()]
            if all(r.terminal for r in poll.status.ranks):
                break
            assert time.monotonic() < deadline, poll.status.ranks
            time.sleep(0.5)
        assert node_calls_running == 0, f"{node_calls_running} node calls while the ranks ran ({polls} polls)"
        assert late and max(late) < 5.0, sorted(late)[-5:]
        for rank in range(N):
            want = Path(h.nodes[rank].root, "jobs", "lg", str(rank), "log").read_bytes()
            assert want.count(b"\n") == 25
            assert got[rank] == want, (rank, len(got[rank]), len(want))
        print(
            f"\n{polls} polls, {c.agent_calls} head calls, {c.node_calls} node calls; latest line {max(late):.2f} s"
        )
    finally:
        assert b.terminate("logs").removed


def test_a_status_right_after_the_start_sees_every_rank_running(sky_home: Path) -> None:
    """The start's answer comes after the head heard each node's ranks running: a peek right behind it
    never says ``pending`` for a rank the start reported ``STARTED`` (ten starts in a row)."""
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("order", task_from_args(num_nodes=N, run="true"))
    try:
        c = GangClient(b, h)
        for i in range(10):
            job = f"o{i}"
            assert c.launch(task_from_args(num_nodes=N, run="sleep 10000"), job) == dict.fromkeys(
                range(N), "STARTED"
            )
            states = {r.rank: r.state.value for r in c.peek(job).ranks}
            assert set(states.values()) == {"running"}, (i, states)
            c.cancel(job, grace=0.5)
    finally:
        assert b.terminate("order").removed
