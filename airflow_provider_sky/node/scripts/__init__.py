"""The scripts the provider runs on nodes, as files: POSIX ``sh`` (``*.sh``), the mask filter's Python
(``mask_filter.py``) and awk (``mask.awk``). ``make lint`` checks every ``.sh`` with shellcheck and with
``sh -n`` under dash and busybox.

:func:`load` gives a script as it travels to a node (on stdin, or written into a rank's directory):

- ``. "$SKY_SCRIPTS/NAME.sh"`` on a line of its own is replaced by that file (shared functions such as
  ``marked``); the ``# shellcheck source=NAME.sh`` line before it lets shellcheck follow it;
- ``@sky:NAME@`` is replaced by that file, which may hold no single quote: it sits inside single quotes
  (a script passed to ``sh -c`` or ``python3 -c``); ``@sky-quoted:NAME@`` by that file as one
  :func:`shlex.quote`-d word (a script another script writes to a file with ``printf``);
- ``# shellcheck ...`` lines are left out.

The scripts hold no values: the Python builders pass ids, integers and paths as positional arguments
or environment variables, or quote them with :func:`shlex.quote`.
"""

from __future__ import annotations

import functools
import re
import shlex
from importlib import resources

_INCLUDE = re.compile(r'^[ \t]*\. "\$SKY_SCRIPTS/([a-z_]+\.sh)"\n', re.MULTILINE)
_EMBED = re.compile(r"@sky(-quoted)?:([a-z_]+\.(?:sh|py|awk))@")
_DIRECTIVE = re.compile(r"^[ \t]*# shellcheck .*\n", re.MULTILINE)


@functools.cache
def load(name: str) -> str:
    """The script ``name`` with its includes and embeds filled in (see the module docstring)."""
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    text = _DIRECTIVE.sub("", text)
    text = _INCLUDE.sub(lambda m: load(m.group(1)), text)
    return _EMBED.sub(lambda m: shlex.quote(load(m[2])) if m[1] else _quotable(m[2]), text)


def _quotable(name: str) -> str:
    text = load(name)
    if "'" in text:
        raise ValueError(f"scripts/{name} holds a single quote: it is embedded inside single quotes")
    return text


def names() -> list[str]:
    """Every script file of the package."""
    return sorted(
        p.name
        for p in resources.files(__name__).iterdir()
        if p.name.endswith((".sh", ".py", ".awk")) and not p.name.startswith("_")
    )
