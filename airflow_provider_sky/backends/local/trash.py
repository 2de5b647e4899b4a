"""Remove a torn-down local cluster's files after the teardown returns, not during it.

A local cluster of 1,024 nodes is ~20,000 small files; deleting them was most of its teardown (0.85 s of
1.2 s on an idle machine, three seconds beside a busy Airflow), and the DAG run waited for it. By the
time its tree is discarded here every process of the cluster is dead (the teardown script saw to it).
The tree is renamed into the backend's ``.trash`` at once (the cluster is gone from its path) and a
detached ``rm`` deletes everything in ``.trash``, so a tree left by a machine that stopped mid-delete
goes with the next teardown.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

TRASH = ".trash"


def discard(path: Path, base: Path) -> None:
    """Take ``path`` (a directory under ``base``) away now and delete it in the background.

    Where it cannot be renamed (another filesystem, no permission) it is deleted here, as before.
    """
    trash = base / TRASH
    try:
        trash.mkdir(exist_ok=True)
        os.rename(path, trash / f"{path.name}.{uuid.uuid4().hex[:12]}")
    except FileNotFoundError:
        if not path.exists():
            return
        shutil.rmtree(path, ignore_errors=True)
        return
    except OSError as exc:
        log.info("Could not move %s aside (%s): deleting it now", path, exc)
        shutil.rmtree(path, ignore_errors=True)
        return
    entries = [str(p) for p in trash.iterdir()]
    try:
        # the shell exits at once and its rm lives on detached: nothing waits for it, nothing reaps it
        subprocess.run(
            ["sh", "-c", 'rm -rf -- "$@" </dev/null >/dev/null 2>&1 &', "sh", *entries],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("Could not delete %s in the background (%s): deleting it now", trash, exc)
        for entry in entries:
            shutil.rmtree(entry, ignore_errors=True)
