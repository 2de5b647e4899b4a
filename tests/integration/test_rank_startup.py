"""A rank task's start-up costs one remote call, to its own rank's node (the per-node path: with node
agents it is one call to the head, tests/integration/test_ssh_agent.py).

Each rank task used to poll the whole gang to read its own rank: N rank tasks starting together made N²
calls, which queued past the status timeout on 2 cores and hung a 64-rank run. Real SSH hosts, so the
call count is per host.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.operators.rank import SkyRankOperator
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.runners.base import CALLS
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

pytestmark = needs_sshd


def test_a_rank_task_looks_at_its_own_rank_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with SSHDCluster(3, tmp_path) as c:
        monkeypatch.setenv("AIRFLOW_CONN_SKY_STARTUP", c.sky_ssh_connection(node_agent=False))
        hook_conf = {
            "key_file": c.client_key_path,
            "known_hosts": c.known_hosts_path,
            "connect_timeout": 5.0,
            "ready_timeout": 5.0,
            "node_agent": False,
        }
        b = SSHBackend(c.host_list(), user="", **hook_conf)  # type: ignore[arg-type]
        spec = task_from_args(num_nodes=3, run='if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 0; fi; sleep 600')
        handle = b.provision("startup", spec)
        client = GangClient(b, handle)
        try:
            client.launch(spec, "job", orphan_timeout=0)
            ops = {
                r: SkyRankOperator(
                    task_id=f"rank{r}",
                    cluster=handle.to_dict(),
                    rank=r,
                    job_id="job",
                    sky_conn_id="sky_startup",
                )
                for r in range(3)
            }
            deadline_ok = False
            for _ in range(100):
                CALLS.reset()
                if ops[1]._already_over():
                    deadline_ok = True
                    break
            assert deadline_ok, "rank 1 exited at once and must read as over"
            assert dict(CALLS.counts) == {handle.nodes[1].ip: 1}, CALLS.counts
            CALLS.reset()
            assert not ops[2]._already_over()
            assert dict(CALLS.counts) == {handle.nodes[2].ip: 1}, CALLS.counts
        finally:
            client.cancel("job", grace=0.5)
            client.close()
            b.terminate("startup", grace=0.5)
            ssh.close_all()
