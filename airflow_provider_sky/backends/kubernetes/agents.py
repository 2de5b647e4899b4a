"""Node agents on Kubernetes: the pod's own process becomes the agent when its image has ``python3``.

The pod's entrypoint (``manifest.ENTRYPOINT``) idles until ``$HOME/.sky_agent/run.sh`` exists and it is
woken (SIGUSR1), then ``exec``\\ s that script, which ``exec``\\ s ``python3 agent.py``: the agent is pid 1
(it reaps the ranks' orphans, and a SIGTERM, a pod deletion or the keeper's idle-down, ends the pod).
One exec per pod at provisioning (the one that reads the pod's home anyway) writes the agent's file, the
cluster's token and ``run.sh``; without ``python3`` it writes nothing and the pod idles as before: the
cluster then uses the per-node path (busybox images).

The token goes to the pod on that exec's stdin, into a 0600 file in a 0700 directory: never on a
command line (exec argv travels in the request URL), never in the pod spec, the handle or a log. A
Secret mounted 0400 would do the same for the pods, but needs RBAC on secrets (the connection's Role
grows, and a Secret is readable by everyone who may read the namespace's secrets) and an object to
clean up; the exec needs nothing the backend does not have already. The control plane reads it back
from the head pod once per process (:func:`token_of`), keyed by the head pod and the cluster's port
(random per provisioning, so a cluster made again under the same name is not mistaken for the old one).
"""

from __future__ import annotations

import logging
import shlex

from airflow_provider_sky.agent import agent_args, new_token
from airflow_provider_sky.backends import nodeagents
from airflow_provider_sky.backends.nodeagents import (
    EXTRA_KEY,
    agent_file_lines,
    endpoint,
    new_port,
    token_line,
)

log = logging.getLogger(__name__)

#: the agent's directory under the pod's home (0700): agent.py, token (0600), run.sh
AGENT_DIR = ".sky_agent"
#: how many times (0.1 s apart) the provisioning exec wakes the pod's entrypoint until it runs the agent
AGENT_WAKE_TRIES = 300


def start_script(pod: str, token: bytes, head_ip: str, port: int, head: bool) -> str:
    """The per-pod script of the provisioning exec: prints the pod's home, then ``AGENT`` after it set
    up and woke the agent, or ``NOPYTHON``. The token is in the script (on stdin), not on a command line."""
    d = '"$h"/' + AGENT_DIR
    if head:
        args = agent_args("AGENT_PY", pod, "TOKEN_FILE", listen=f"0.0.0.0:{port}")
    else:
        args = agent_args("AGENT_PY", pod, "TOKEN_FILE", head=f"{head_ip}:{port}")
    cmd = " ".join(shlex.quote(a) for a in args)
    cmd = cmd.replace("AGENT_PY", f"{d}/agent.py").replace("TOKEN_FILE", f"{d}/token")
    run = 'h="${HOME:-/root}"\nexec ' + cmd
    return "\n".join(
        [
            'h="${HOME:-/root}"; printf "%s\\n" "$h"',
            "command -v python3 >/dev/null 2>&1 || { echo NOPYTHON; exit 0; }",
            "umask 077",
            f"mkdir -p {d} && chmod 700 {d} || exit 1",
            *agent_file_lines(f"{d}/agent.py.tmp"),
            f"mv {d}/agent.py.tmp {d}/agent.py || exit 1",
            token_line(token, f"{d}/token"),
            f"printf '%s\\n' {shlex.quote(run)} > {d}/run.sh.tmp && mv {d}/run.sh.tmp {d}/run.sh",
            # pid 1 is the entrypoint idling: woken, it execs run.sh. A wake-up can be lost (a signal
            # before its trap is set, or between its look for run.sh and its wait): sent again while
            # pid 1 is still the idling entrypoint (its command line), for up to AGENT_WAKE_TRIES tenths of a second
            "i=0",
            f"while [ $i -lt {AGENT_WAKE_TRIES} ] && tr '\\0' ' ' < /proc/1/cmdline | grep -q 'trap : USR1'; do",
            "  kill -USR1 1 2>/dev/null; sleep 0.1; i=$((i + 1))",
            "done",
            "echo AGENT",
        ]
    )


def token_script() -> str:
    return f'cat "${{HOME:-/root}}/{AGENT_DIR}/token"'


def remember(namespace: str, head_pod: str, port: int, token: bytes) -> None:
    nodeagents.remember(("kubernetes", namespace, head_pod, port), token)


def cached(namespace: str, head_pod: str, port: int) -> bytes | None:
    return nodeagents.cached(("kubernetes", namespace, head_pod, port))


def forget(namespace: str, head_pod: str, port: int) -> None:
    nodeagents.forget(("kubernetes", namespace, head_pod, port))


__all__ = [
    "AGENT_DIR",
    "EXTRA_KEY",
    "cached",
    "endpoint",
    "forget",
    "new_port",
    "new_token",
    "remember",
    "start_script",
    "token_script",
]
