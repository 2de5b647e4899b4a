"""Which cluster a node's runtime directory belongs to: one name on one host is one cluster.

A node's runtime directory is ``~/.sky_airflow/<cluster>`` and the cluster's record is on the head of
the connection that made it. Two connections that share a host but not their head keep their records
apart, so both could make a cluster of one name whose nodes share that directory: the teardown of
either then killed the other's ranks. A new cluster therefore claims each node's directory first, by
linking ``.owner`` (its head and name) into it; the link is atomic and fails where another owner is
there, and the provision is refused naming the host. The owner goes with the directory (teardown,
``idle_down``), and a teardown leaves alone a directory another owner holds.
"""

from __future__ import annotations

from airflow_provider_sky.node.scripts import load

#: claim ``~/.sky_airflow/$1`` for owner ``$2``: ``CLAIMED`` (new), ``OURS`` (held already) or
#: ``TAKEN <owner>``. A directory without an owner (made by an older version) is claimed.
CLAIM_SCRIPT = load("ssh_claim.sh")

#: give back a claim made by this provision (``$1``/``$2`` as above): the owner goes, and the
#: directory too when nothing else is in it
RELEASE_SCRIPT = load("ssh_release.sh")

#: put before the teardown script (``sh -s -- OWNER GRACE ROOT``): a root another owner holds is not
#: this cluster's, and is left alone (``NOT_OURS <owner>``)
TEARDOWN_GUARD = load("ssh_teardown_guard.sh")


def owner_of(head: str, name: str) -> str:
    """The owner a cluster's node directories carry: the head keeping its record, and its name."""
    return f"{head} {name}"
