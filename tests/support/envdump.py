"""What a rank sees: a shell command that prints its env as one JSON line, and the parser for it."""

from __future__ import annotations

import json

#: the variables a gang's contract covers (``SKYPILOT_*``, torch's names, ``CUDA_VISIBLE_DEVICES``)
PREFIXES = ("SKYPILOT_", "CUDA_VISIBLE_DEVICES", "MASTER_", "WORLD_SIZE", "NNODES", "NODE_RANK", "RANK")

_PREFIXES_PY = "(" + ", ".join(f'"{p}"' for p in PREFIXES) + ")"
DUMP = (
    'python3 -c \'import json, os; print("ENVDUMP " + json.dumps({k: v for k, v in os.environ.items() '
    f"if k.startswith({_PREFIXES_PY})}}, sort_keys=True))'"
)


def parse(text: str) -> dict[str, str]:
    """The env a rank's output (``DUMP``'s line) shows."""
    for line in text.splitlines():
        if line.startswith("ENVDUMP "):
            out: dict[str, str] = json.loads(line[len("ENVDUMP ") :])
            return out
    raise AssertionError(f"no env dump in the rank's output: {text[-2000:]!r}")
