"""The node agent: the gang's fate decided on its own nodes (design: ``docs/node-agent.md``).

:mod:`.node` is the agent, one standard-library file a backend copies to each node as it is
(:data:`AGENT_FILE`); :mod:`.client` is the control plane's side (start, status, cancel: one call each).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from airflow_provider_sky.agent.node import NODE_RE

#: the agent's source: shipped to a node as one file and run there with ``python3``
AGENT_FILE = Path(__file__).with_name("node.py")


def agent_source() -> str:
    """The agent's whole program, as a backend writes it to a node."""
    return AGENT_FILE.read_text()


def new_token() -> bytes:
    """A cluster's token: 24 random bytes, hex (it goes to the nodes in a 0600 file or on stdin)."""
    return secrets.token_hex(24).encode()


def agent_args(
    path: str,
    node: str,
    token_file: str,
    *,
    listen: str | None = None,
    head: str | None = None,
    port_file: str | None = None,
    beat: float = 1.0,
    lost_after: float = 10.0,
    scan: float = 0.05,
    python: str = "python3",
) -> list[str]:
    """The agent's command line on a node: the head with ``listen`` (``HOST:PORT``), every other node
    with ``head``. Only ids, paths, addresses and numbers: the token stays in its file."""
    if (listen is None) == (head is None):
        raise ValueError("an agent either listens (the head) or reports to a head, not both or neither")
    if not NODE_RE.fullmatch(node):
        raise ValueError(f"node id {node!r} must match {NODE_RE.pattern}")
    if beat <= 0 or lost_after <= beat or scan <= 0:
        raise ValueError("beat and scan must be positive and lost_after longer than beat")
    args = [python, path, "--node", node, "--token-file", token_file]
    args += ["--listen", listen] if listen is not None else ["--head", str(head)]
    if port_file:
        args += ["--port-file", port_file]
    return args + ["--beat", str(beat), "--lost-after", str(lost_after), "--scan", str(scan)]
