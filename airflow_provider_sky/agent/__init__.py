"""The node agent: the gang's fate decided on its own nodes (design: ``docs/node-agent.md``).

:mod:`.node` is the agent, one standard-library file a backend copies to each node as it is
(:data:`AGENT_FILE`); :mod:`.client` is the control plane's side (start, status, cancel: one call each).
"""

from __future__ import annotations

from pathlib import Path

#: the agent's source: shipped to a node as one file and run there with ``python3``
AGENT_FILE = Path(__file__).with_name("node.py")


def agent_source() -> str:
    """The agent's whole program, as a backend writes it to a node."""
    return AGENT_FILE.read_text()
