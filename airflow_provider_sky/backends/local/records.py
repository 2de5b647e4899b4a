"""The local backend's record store: one JSON file per cluster, changed only under an ``fcntl`` lock.

``<state>/local/.clusters/<name>.json``, locked by ``<state>/local/.lock`` (one lock for every record:
a new cluster's address block and GPUs are chosen from all of them). A record is written to
``<name>.tmp`` first and renamed over the old one, so a reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from airflow_provider_sky.backends.base import BackendError, Change
from airflow_provider_sky.node import runtime

_T = TypeVar("_T")


class FileRecords:
    """The records under ``directory``, locked by the file ``lock`` (a :class:`base.RecordStore`)."""

    def __init__(self, directory: Path, lock: Path) -> None:
        self.directory = directory
        self.lock = lock

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.lock, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def path(self, name: str) -> Path:
        runtime.check_job_id(name)
        return self.directory / f"{name}.json"

    def load(self, name: str) -> dict[str, Any] | None:
        """The raw record (handle, leases, unclean nodes); callers that change it hold the lock.

        A record that names another cluster is refused: nothing is ever done with its nodes under
        this name."""
        path = self.path(name)
        if not path.exists():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("name") != name:
            raise BackendError(
                f"the record {path} names cluster {data.get('name')!r}, not {name!r}: nothing is done "
                "with it under this name. Move it back to the cluster it names, or remove it"
            )
        return data

    def update(self, name: str, change: Change[_T]) -> _T:
        """``change`` applied under the lock; a record of None is removed, one unchanged not written."""
        with self.locked():
            current = self.load(name)
            new, result = change(current)
            if new != current:
                if new is None:
                    self.path(name).unlink(missing_ok=True)
                else:
                    tmp = self.path(name).with_suffix(".tmp")
                    tmp.write_text(json.dumps(new, indent=1))
                    tmp.replace(self.path(name))
            return result
