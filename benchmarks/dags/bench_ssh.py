"""Figure 4, the baseline: the SSH provider's ``SSHOperator`` mapped over the same 8 hosts.

One ``ssh`` connection per host (``ssh_bench_0`` .. ``ssh_bench_7``, from ``AIRFLOW_CONN_SSH_BENCH_<i>``
set by ``benchmarks.run``: user, port, the client key file and the pinned host key).
``bench_ssh_true``: ``true`` on every host. ``bench_ssh_fail_fast``: the same commands as the sky
version; nothing stops the sleeping siblings, so the run only ends when they do (the benchmark gives up
after a cap). ``cmd_timeout=None``: a long command is a training job, not a hang.
"""

from __future__ import annotations

import pendulum
from airflow.providers.ssh.operators.ssh import SSHOperator
from airflow.sdk import DAG

RANKS = 8
CONNS = [f"ssh_bench_{i}" for i in range(RANKS)]

#: dag id -> the command of each rank
COMMANDS = {
    "bench_ssh_true": ["true"] * RANKS,
    "bench_ssh_fail_fast": ["sleep 2; exit 1" if i == 2 else "sleep 10000" for i in range(RANKS)],
}

for dag_id, commands in COMMANDS.items():
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["bench"],
    ):
        SSHOperator.partial(task_id="rank", cmd_timeout=None).expand_kwargs(
            [{"ssh_conn_id": conn, "command": cmd} for conn, cmd in zip(CONNS, commands, strict=True)]
        )
