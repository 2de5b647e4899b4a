"""A cluster record kept on the cluster's own head node, changed by compare-and-swap over its runner.

Backends whose nodes outlive the Airflow worker and have a home (SSH hosts, Kubernetes pods) keep the
record (rank order, homes, leases: see ``backends.base``) on the head in
``~/.sky_airflow/.clusters/<name>.json``, so any worker that can reach the head finds it. One remote
script, under ``flock`` on the head (a ``mkdir`` lock where ``flock`` is missing), writes the new record
only if the file still holds what was read; otherwise it returns the current one and the change is made
again on that.

A node's runtime directory is ``~/.sky_airflow/<name>``: the records' directory (and its lock files)
start with a dot, which no cluster name can (``runtime.check_job_id``), so no cluster's directory is
ever the records' (a cluster named ``clusters`` once was, and its teardown removed every record).
A record whose ``name`` is not the one asked for is refused: nothing is done with it under that name.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.node import runtime
from airflow_provider_sky.node.scripts import load
from airflow_provider_sky.runners.base import CommandRunner

T = TypeVar("T")

_READ_SCRIPT = 'rec="$HOME/$1"; [ -f "$rec" ] && cat "$rec"; exit 0'
#: compare-and-swap of a cluster record on the head: $1 record path (relative to $HOME), $2 "1" if the
#: record was there when read, $3 "1" to write the new record ("0" deletes it), $4 lock kind (auto|mkdir),
#: $5 seconds to wait for the lock. Prints OK, or CONFLICT and the current record. __OLD__ / __NEW__ are quoted here-documents.
_CAS_SCRIPT = load("head_record_cas.sh")


def _cas_script(old: str | None, new: dict[str, Any] | None) -> str:
    """The compare-and-swap script with the expected and the new record inlined (never on a command line)."""
    new_text = json.dumps(new, indent=1) if new is not None else ""
    while True:  # a delimiter line that neither text holds
        tag = secrets.token_hex(6)
        if tag not in (old or "") and tag not in new_text:
            break
    parts = {
        "__OLD_EOF__": f"SKY_OLD_{tag}",
        "__NEW_EOF__": f"SKY_NEW_{tag}",
        "__OLD__": old or "",
        "__NEW__": new_text,
    }
    # one pass over the template: text put in (holder ids are user text) is never scanned again
    return re.sub(r"__(?:OLD|NEW)(?:_EOF)?__", lambda m: parts[m.group(0)], _CAS_SCRIPT)


#: the records' directory on a head, relative to its home: dot-prefixed, so no cluster name is it
RECORDS_DIR = ".sky_airflow/.clusters"


def record_path(name: str) -> str:
    """Where the record of cluster ``name`` is, relative to the head's home."""
    runtime.check_job_id(name)
    return f"{RECORDS_DIR}/{name}.json"


class HeadRecords:
    """The records of the clusters whose head ``head()`` reaches; ``where`` names it in errors."""

    def __init__(
        self, head: Callable[[], CommandRunner], where: str, lock: str = "auto", lock_wait: float = 60.0
    ) -> None:
        self.head = head
        self.where = where
        #: how the head's records are locked: ``auto`` (``flock`` if the head has it) or ``mkdir``
        self.lock = lock
        #: seconds a change waits for the head's record lock before it fails (changing nothing)
        self.lock_wait = lock_wait

    def _parse(self, name: str, text: str | None) -> dict[str, Any] | None:
        """The record in ``text``; one that names another cluster is an error (never acted on)."""
        if text is None:
            return None
        record: dict[str, Any] = json.loads(text)
        if record.get("name") != name:
            raise BackendError(
                f"the record ~/{record_path(name)} on the head {self.where} names cluster "
                f"{record.get('name')!r}, not {name!r}: nothing is done with it under this name. Move it "
                "back to the cluster it names, or remove it"
            )
        return record

    def read(self, name: str) -> str | None:
        """The record's text on the head (trailing newlines dropped, as the swap script compares it)."""
        res = self.head().run_script(_READ_SCRIPT, [record_path(name)], timeout=30)
        if res.returncode != 0:
            raise BackendError(
                f"reading the cluster record on the head {self.where} failed: {res.error_text}"
            )
        text = res.text.rstrip("\n")
        return text if text.strip() else None

    def load(self, name: str) -> dict[str, Any] | None:
        return self._parse(name, self.read(name))

    def update(
        self, name: str, change: Callable[[dict[str, Any] | None], tuple[dict[str, Any] | None, T]]
    ) -> T:
        """Apply ``change`` (record → new record, result) atomically on the head; return its result.

        Compare-and-swap: the new record is written only if the head still holds the record ``change``
        saw; otherwise ``change`` runs again on the current one. A new record of None deletes it.
        """
        text = self.read(name)
        for _ in range(100):
            current = self._parse(name, text)
            new, result = change(current)
            if new == current:
                return result
            script = _cas_script(text, new)
            args = [record_path(name), "1" if text is not None else "0", "1" if new else "0"]
            wait = max(1, round(self.lock_wait))
            res = self.head().run_script(script, [*args, self.lock, str(wait)], timeout=wait + 30)
            out = res.text
            if res.returncode != 0 or not out.startswith(("OK", "CONFLICT")):
                raise BackendError(
                    f"updating the cluster record {name!r} on the head {self.where} failed: "
                    f"{res.error_text or out.strip() or f'exit code {res.returncode}'}"
                )
            if out.startswith("OK"):
                return result
            text = out[len("CONFLICT") :].strip("\n") or None  # someone changed it: redo on theirs
            time.sleep(random.uniform(0, 0.05))
        raise BackendError(f"the cluster record {name!r} on {self.where} kept changing; retry")
