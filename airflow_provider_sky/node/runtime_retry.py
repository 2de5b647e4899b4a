"""Node scripts of a gang's later attempts: start attempt k from attempt 1's files, and stop retries.

Why from the nodes' own files: whoever drives the retry (the triggers' shared poll, or the launch-side
bridge) may be a triggerer that restarted and never saw the task spec or its secrets (they never travel
in trigger kwargs). Attempt 1's rank directory already holds what a rank needs (``cmd.sh``, ``env``,
``cwd``, ``rank.sh``, and with retries a 0600 copy of the secrets and of their output mask), so attempt k
is a copy of it under the job id ``<job>.a<k>`` with ``SKY_ATTEMPT=k``. ``mkdir`` of the new rank
directory is the claim, so two watchers retrying at once start each rank once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from airflow_provider_sky.node.runtime import check_job_id
from airflow_provider_sky.node.scripts import load

#: ``src new attempt now ips gf``, then ``root rank`` per rank. ``ips``: the cluster's addresses now, space
#: separated (a replaced node's is new): every rank's ``SKYPILOT_NODE_IPS`` and ``MASTER_ADDR``. ``gf``:
#: the machine's gang flag of the new attempt (``runtime.gang_flag``, empty for a single rank): its
#: ranks are listed there for the node's own fail-fast, as a gang start does. A rank
#: whose node was replaced starts from the seed a replacement wrote (``replace``), ``<src>.seed/<rank>``.
#: Prints per rank ``STARTED <rank> <pid>``,
#: ``EXISTS <rank>`` (this attempt's rank was started already), ``STOPPED <rank>`` (a user stopped the
#: gang: ``stop`` in attempt 1's directory) or ``NOSRC <rank>`` (attempt 1's files are gone).
RELAUNCH_SCRIPT = load("retry_relaunch.sh")

#: Before attempt k+1: SIGKILL whatever attempt k left (by its mark), then say what still runs.
#: ``root job rank`` triples; prints ``LEFT <pid>...`` when a process of those ranks is still alive.
CLEAN_SCRIPT = load("retry_clean.sh")

#: A user stopped the gang: ``stop`` (holding the reason) in each listed rank's attempt-1 directory,
#: so no watcher starts a further attempt. ``reason`` then ``root job rank`` triples.
STOP_SCRIPT = load("retry_stop.sh")


#: When the next attempt is due (the watcher's clock): ``attempt due`` then ``root job rank`` triples.
#: The first writer's time stays (``due.<attempt>`` in each rank's attempt-1 directory); prints it.
DUE_SCRIPT = load("retry_due.sh")


#: The gang's outcome is final: drop the kept secrets and masks (``root job rank`` triples).
FORGET_SCRIPT = load("retry_forget.sh")


def attempt_job_id(job_id: str, attempt: int) -> str:
    """Attempt 1 is the job id itself; attempt k its ``<job>.a<k>`` (the same ``SKYPILOT_TASK_ID``)."""
    return check_job_id(job_id if attempt <= 1 else f"{job_id}.a{int(attempt)}")


#: what an address of a node may be (it goes into rank env files inside single quotes)
IP_RE = re.compile(r"[A-Za-z0-9.:_%-]{1,255}")


def relaunch_args(
    job_id: str,
    attempt: int,
    now: float,
    targets: Sequence[tuple[str, int]],
    ips: Sequence[str] = (),
    flag: str = "",
) -> list[str]:
    """Arguments of :data:`RELAUNCH_SCRIPT`: ``(node root, rank)`` per rank of one machine; ``ips``: the
    cluster's addresses in rank order (empty: the env of attempt 1 keeps its own); ``flag``: the
    machine's gang flag of the new attempt (:func:`~airflow_provider_sky.node.runtime.gang_flag`)."""
    for ip in ips:
        if not IP_RE.fullmatch(ip):
            raise ValueError(f"node address {ip!r} is not a host name or IP address")
    args = [
        check_job_id(job_id),
        attempt_job_id(job_id, attempt),
        str(int(attempt)),
        f"{now:.3f}",
        " ".join(ips),
        flag,
    ]
    for root, rank in targets:
        if not root or "\n" in root:
            raise ValueError(f"node root {root!r} must be a non-empty path without a newline")
        args += [root, str(int(rank))]
    return args
