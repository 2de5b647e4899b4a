"""A watcher of a local gang's attempts in a process of its own (``python tests/support/retry_watcher.py``), so a
test can SIGKILL it between attempts, as a worker or triggerer dies: ``STATE_DIR CLUSTER JOB RETRIES DELAY``.
Prints one line per poll (``attempt <k> final <0|1> <status>``), flushed."""

from __future__ import annotations

import asyncio
import sys

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.retry import RetryPolicy, watch_attempts


async def main(state: str, cluster: str, job: str, retries: int, delay: float) -> None:
    backend = LocalBackend(state)
    handle = backend.find(cluster)
    assert handle is not None, cluster
    client = GangClient(backend, handle)
    policy = RetryPolicy.build(retries=retries, retry_delay=delay, retry_on_exit_codes=[1])
    async for poll in watch_attempts(client, job, policy=policy, poll_interval=0.1, grace=1.0):
        state_ = "succeeded" if poll.status.succeeded else ("done" if poll.status.done else "running")
        print(f"attempt {poll.attempt} final {int(poll.final)} {state_}", flush=True)


if __name__ == "__main__":
    state, cluster, job, retries, delay = sys.argv[1:6]
    asyncio.run(main(state, cluster, job, int(retries), float(delay)))
