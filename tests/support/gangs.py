"""Gangs on the local backend for tests: start one, watch it to its end, the trigger kwargs for it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import TaskSpec, task_from_args
from airflow_provider_sky.watch.jobs import GangClient, Poll
from airflow_provider_sky.watch.loop import watch


def local_gang(
    sky_home: Path, n: int, run: str, name: str = "c", **spec: Any
) -> tuple[LocalBackend, GangClient, TaskSpec]:
    """A provisioned local cluster of ``n`` nodes and a client for it (nothing launched yet)."""
    b = LocalBackend(sky_home)
    task = task_from_args(num_nodes=n, run=run, **spec)
    return b, GangClient(b, b.provision(name, task)), task


def launched(sky_home: Path, n: int, run: str, **spec: Any) -> tuple[LocalBackend, dict[str, Any]]:
    """A local gang already launched as job ``job``; returns the backend and the cluster handle dict."""
    b, client, task = local_gang(sky_home, n, run, **spec)
    client.launch(task, "job")
    return b, client.handle.to_dict()


def wait_done(client: GangClient, job_id: str = "job", timeout: float = 30.0, **kw: Any) -> Poll:
    """Watch the job (fail-fast included, 0.1 s polls) until every rank is over; the last poll."""

    async def go() -> Poll | None:
        last = None
        async for poll in watch(client, job_id, poll_interval=0.1, **kw):
            last = poll
        return last

    last = asyncio.run(asyncio.wait_for(go(), timeout))
    assert last is not None
    return last


def trigger_kwargs(handle: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The kwargs of a rank trigger or gang trigger watching job ``job`` with quick settings."""
    return {
        "cluster": handle,
        "job_id": "job",
        "sky_conn_id": None,
        "poll_interval": 0.2,
        "grace": 1.0,
        **extra,
    }


def rank_exit(d: Path) -> tuple[str, float] | None:
    """A rank directory's exit code and end time as its wrapper wrote them ("code", "end" lines of
    ``exit``; a record written by another writer has its end in ``end``), or None before it exited."""
    try:
        lines = (d / "exit").read_text().splitlines()
    except FileNotFoundError:
        return None
    if not lines or not lines[0]:
        return None  # written in place: empty a moment before its code is in
    end = lines[1] if len(lines) > 1 and lines[1] else (d / "end").read_text().strip()
    return lines[0], float(end)
