"""Node agents (``docs/node-agent.md``): what every backend's agents share, and the agents of the backends
that reach their machines through a runner (SSH, local, EC2).

Shared by all: the handle's ``extra["agent"]`` (the head's address and port, no secret), the token cache
of this process, and the check at provisioning that this control plane reaches the head and every node's
agent joined it (else the cluster keeps the per-node path).

On a runner's machine each node's agent lives in ``<node root>/.agent`` (0700): ``agent.py``, the
cluster's token (0600), ``pid``, ``port`` (the head's) and ``log``. One call per node writes them and
starts the agent detached (``setsid``: it outlives the call), the token inside the script, which the
runner sends on the shell's stdin: never on a command line, in the environment, a log or the handle.
The head (rank 0's node) listens on a free port (``--listen ADDR:0``, the port it got is read back from
its port file); every other node's agent is started afterwards and connects to it. A node without
``python3`` (or ``setsid``) starts nothing: the cluster keeps the per-node path.

Each agent carries ``SKY_PROVIDER_MARK=<node root>/jobs/`` in its initial environment, the mark the
teardown's and the keeper's idle-down kill everything of a node root by (``teardown.sh``, ``keeper.sh``):
so the agents go with their cluster on every path that ends one, and nothing of theirs is left. No rank's
own mark (``<root>/jobs/<job>/<rank>/``) matches it, so a job's cancel never touches the agent; and the
agent takes it out of the environment its children inherit (the launch scripts, the keeper they start),
so the keeper's idle-down does not end itself before it removed the node's files.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from airflow_provider_sky.agent import agent_args, agent_source, new_token
from airflow_provider_sky.backends.base import ClusterHandle, Node, RecordStore
from airflow_provider_sky.runners.base import CommandRunner

log = logging.getLogger(__name__)

#: the handle's ``extra`` key: ``{"host": the head's address, "port": P}`` (no secret)
EXTRA_KEY = "agent"
#: how long provisioning waits for every node's agent to join the head's (else: the per-node path)
AGENT_JOIN_WAIT = 60.0
#: and how long for the head's agent to answer this control plane at all (an unreachable address:
#: the per-node path at once, not after AGENT_JOIN_WAIT)
AGENT_REACH_WAIT = 10.0
#: random per-cluster ports (Kubernetes: pods have their own network namespace)
PORT_RANGE = (20000, 60000)
#: the agent's directory under a node's root on a runner's machine
HOST_AGENT_DIR = ".agent"
#: how long a head's start waits for its port file (tenths of a second)
_PORT_WAIT_TICKS = 150
_MARK = "SKY_AGENT_FILE_END_7f3c"
#: runs the agent's file (argv[1]) as __main__ after taking the mark out of the environment its children
#: inherit; the process's own initial environment (``/proc/<pid>/environ``, what the teardown's and the
#: keeper's scans read) keeps it
_UNMARKED = (
    "import os, runpy, sys; os.environ.pop('SKY_PROVIDER_MARK', None); sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)

_TOKENS: dict[tuple[Any, ...], bytes] = {}
_TOKENS_LOCK = threading.Lock()


def new_port() -> int:
    return PORT_RANGE[0] + secrets.randbelow(PORT_RANGE[1] - PORT_RANGE[0])


def remember(key: tuple[Any, ...], token: bytes) -> None:
    with _TOKENS_LOCK:
        _TOKENS[key] = token


def cached(key: tuple[Any, ...]) -> bytes | None:
    with _TOKENS_LOCK:
        return _TOKENS.get(key)


def forget(key: tuple[Any, ...]) -> None:
    with _TOKENS_LOCK:
        _TOKENS.pop(key, None)


def agents_on(config: Any, default: bool = True, key: str = "node_agent") -> bool:
    """A connection's ``node_agent`` setting (``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``),
    ``default`` when it is not set."""
    value = config.get(key) if hasattr(config, "get") else None
    if value in (None, ""):
        return default
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def endpoint(extra: Any) -> tuple[str, int] | None:
    """The head agent's address from a handle's ``extra`` (None: no agents on this cluster)."""
    info = extra.get(EXTRA_KEY) if hasattr(extra, "get") else None
    if not isinstance(info, dict):
        return None
    host, port = info.get("host"), info.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int):
        return None
    return host, port


def agent_file_lines(dest: str) -> list[str]:
    """Script lines writing the agent's file to ``dest`` (a shell word): a quoted heredoc, nothing in
    it is expanded."""
    source = agent_source()
    if _MARK in source:  # pragma: no cover - the heredoc's end marker must not occur in the file
        raise ValueError("the agent's source contains the heredoc marker")
    return [f"cat > {dest} <<'{_MARK}'", source.rstrip("\n"), _MARK]


def token_line(token: bytes, dest: str) -> str:
    """A script line writing ``token`` (hex, checked) to the 0600 file ``dest`` (a shell word)."""
    tok = token.decode()
    if not tok.isalnum():
        raise ValueError("the cluster token must be hex")
    return f"printf '%s\\n' '{tok}' > {dest}.tmp && chmod 600 {dest}.tmp && mv {dest}.tmp {dest} || exit 1"


def joined(
    name: str,
    host: str,
    port: int,
    token: bytes,
    nodes: Sequence[str],
    join_wait: float = AGENT_JOIN_WAIT,
    reach_wait: float = AGENT_REACH_WAIT,
) -> bool:
    """Whether this control plane reaches the head agent and every node's agent joined it (within
    ``join_wait``): else the cluster keeps the per-node path (said in the log, once)."""
    from airflow_provider_sky.agent.client import AgentClient, AgentError
    from airflow_provider_sky.aio import run_sync

    async def missing_nodes() -> list[str]:
        client = AgentClient(host, port, token, timeout=3.0)
        start = time.monotonic()
        deadline = start + join_wait
        missing = list(nodes)
        reached = False
        try:
            while time.monotonic() < deadline:
                try:
                    up = await client.nodes()
                    reached = True
                except AgentError:
                    up = {}
                    if not reached and time.monotonic() - start > reach_wait:
                        break  # this control plane does not reach the head: no use waiting
                missing = [p for p in nodes if not (up.get(p) or {}).get("up")]
                if not missing:
                    return []
                await asyncio.sleep(0.2)
        finally:
            await client.aclose()
        return missing

    t0 = time.monotonic()
    missing = run_sync(missing_nodes())
    if not missing:
        log.info(
            "cluster %s: %d node agents joined the head's in %.1fs", name, len(nodes), time.monotonic() - t0
        )
    else:
        log.warning(
            "cluster %s: the node agents of %s did not join the head agent at %s:%s within %ss "
            "(or this control plane cannot reach it): the cluster uses the per-node path",
            name,
            ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""),
            host,
            port,
            join_wait,
        )
    return not missing


# -- agents on a runner's machines (SSH, local, EC2) ----------------------------------------------------


def host_agent_dir(root: str) -> str:
    return f"{root.rstrip('/')}/{HOST_AGENT_DIR}"


def _stop_lines(d: str) -> list[str]:
    """Stop the agent of directory ``d`` (a shell word) if its pid file names a process running it."""
    return [
        f'if [ -f {d}/pid ] && read -r p < {d}/pid && [ -n "$p" ]; then',
        f"  case \"$(tr '\\000' ' ' < \"/proc/$p/cmdline\" 2>/dev/null)\" in *{d}/agent.py*) "
        'kill "$p" 2>/dev/null;; esac',
        "fi",
    ]


def host_start_script(
    root: str, node: str, token: bytes, *, listen: str | None = None, head: str | None = None
) -> str:
    """The script (sent on stdin) that sets up and starts node ``node``'s agent under ``root``, detached.
    Its last line: ``AGENT [port]`` (the head: the port it listens on), ``NOPYTHON`` or ``FAILED``."""
    d = host_agent_dir(root)
    qd = shlex.quote(d)
    args = agent_args(
        f"{d}/agent.py",
        node,
        f"{d}/token",
        listen=listen,
        head=head,
        port_file=f"{d}/port" if listen is not None else None,
    )
    # python3 -c _UNMARKED agent.py ...: the agent runs as its own __main__, without the mark in the
    # environment its children inherit (the keeper it starts must not carry it: idle_down kills by it)
    cmd = " ".join(shlex.quote(a) for a in [args[0], "-c", _UNMARKED, *args[1:]])
    mark = shlex.quote(f"{root.rstrip('/')}/jobs/")
    wait = (
        [
            "i=0",
            f'while [ ! -s {qd}/port ] && [ $i -lt {_PORT_WAIT_TICKS} ] && kill -0 "$pid" 2>/dev/null; do',
            "  sleep 0.1; i=$((i + 1))",
            "done",
            f'if [ -s {qd}/port ] && read -r port < {qd}/port; then echo "AGENT $port"; '
            f"else tail -n 5 {qd}/log >&2; echo FAILED; fi",
        ]
        if listen is not None
        else [
            # a worker that cannot even start (a bad python) is seen here, not only at the join check
            "sleep 0.2",
            f'if kill -0 "$pid" 2>/dev/null; then echo AGENT; else tail -n 5 {qd}/log >&2; echo FAILED; fi',
        ]
    )
    return "\n".join(
        [
            "command -v python3 >/dev/null 2>&1 && command -v setsid >/dev/null 2>&1 || { echo NOPYTHON; exit 0; }",
            "umask 077",
            f"mkdir -p {qd} && chmod 700 {qd} || exit 1",
            *_stop_lines(qd),
            *agent_file_lines(f"{qd}/agent.py.tmp"),
            f"mv {qd}/agent.py.tmp {qd}/agent.py || exit 1",
            token_line(token, f"{qd}/token"),
            f"rm -f {qd}/port",
            # SKY_PROVIDER_MARK: the teardown and the keeper's idle-down end the agent with the node root
            f"SKY_PROVIDER_MARK={mark} setsid {cmd} </dev/null >>{qd}/log 2>&1 &",
            "pid=$!",
            f'echo "$pid" > {qd}/pid',
            *wait,
        ]
    )


def host_stop_script(root: str) -> str:
    """Stops the agent under ``root`` (best effort; the teardown ends it anyway)."""
    return "\n".join(_stop_lines(shlex.quote(host_agent_dir(root)))) + "\n:"


def host_token_script(root: str) -> str:
    return f"cat {shlex.quote(host_agent_dir(root) + '/token')}"


def host_token_key(kind: str, head: Node, port: int) -> tuple[Any, ...]:
    """The token cache's key of a runner-based cluster: its head node's address and root, the port
    (new per provisioning: a cluster made again under the same name is not mistaken for the old one)."""
    return (kind, head.ip, head.root, port)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


class HostAgents:
    """Starting, checking and finding the agents of a cluster whose nodes a runner reaches."""

    def __init__(
        self,
        kind: str,
        runner_of: Callable[[Node], CommandRunner],
        map_fn: Callable[[Callable[[Node], Any], Sequence[Node]], list[Any]],
        *,
        listen: str = "0.0.0.0",
        head_address: Callable[[Node], str] | None = None,
        reach: Callable[[Node, int], tuple[str, int]] | None = None,
    ) -> None:
        #: ``kind``: the backend's (the token cache's key); ``map_fn``: the backend's bounded parallel map
        #: (exceptions returned); ``listen``: the head's bind address; ``head_address``: where the other
        #: nodes reach the head (default: its node's IP); ``reach``: where this control plane reaches the
        #: head's port (default: the same address; EC2: a relay over SSH)
        self.kind = kind
        self.runner_of = runner_of
        self.map_fn = map_fn
        self.listen = listen
        self.head_address = head_address or (lambda n: n.ip)
        self.reach = reach

    def start_recorded(self, handle: ClusterHandle, store: RecordStore) -> ClusterHandle:
        """A new cluster's node agents; once every one joined the head, its record says where the head
        listens (``extra["agent"]``) and so does the handle returned. Else the per-node path: ``handle``."""
        where = self.start(handle.name, handle.nodes)
        if where is None:
            return handle

        def note(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, ClusterHandle]:
            if record is None or record.get("down"):
                return record, handle  # torn down meanwhile: its teardown ends the agents
            record = {**record, "extra": {**(record.get("extra") or {}), EXTRA_KEY: where}}
            return record, ClusterHandle.from_dict(record)

        return store.update(handle.name, note)

    def start(self, name: str, nodes: Sequence[Node]) -> dict[str, Any] | None:
        """Start every node's agent and check they joined the head: the handle's ``extra["agent"]``, or
        None (the per-node path; anything started is stopped again). Logged once either way."""
        if not nodes:
            return None
        token = new_token()
        head = nodes[0]
        started: list[Node] = [head]
        try:
            res = self.runner_of(head).run_script(
                host_start_script(head.root, head.node_id, token, listen=f"{self.listen}:0"), timeout=60
            )
            word = _last_line(res.text)
            if word == "NOPYTHON":
                log.info("cluster %s: no python3 (or setsid) on the head host: the per-node path", name)
                return None
            if res.returncode != 0 or not word.startswith("AGENT ") or not word[6:].isdigit():
                log.warning(
                    "cluster %s: the head's node agent did not start (%s): the per-node path",
                    name,
                    res.error_text or word or f"exit code {res.returncode}",
                )
                return None
            port = int(word[6:])
            address = self.head_address(head)
            workers = list(nodes[1:])
            started += workers

            def one(node: Node) -> str:
                script = host_start_script(node.root, node.node_id, token, head=f"{address}:{port}")
                r = self.runner_of(node).run_script(script, timeout=60)
                w = _last_line(r.text)
                return w if r.returncode == 0 and w in ("AGENT", "NOPYTHON") else f"{w}: {r.error_text}"

            answers = self.map_fn(one, workers)
            bad = [(n, a) for n, a in zip(workers, answers, strict=True) if a != "AGENT"]
            if bad:
                n, a = bad[0]
                log.warning(
                    "cluster %s: the node agents of %d node(s) did not start (%s: %s): the per-node path",
                    name,
                    len(bad),
                    n.node_id,
                    "no python3" if a == "NOPYTHON" else a,
                )
                self.stop(started)
                return None
            here = self.reach(head, port) if self.reach is not None else (address, port)
            if not joined(name, here[0], here[1], token, [n.node_id for n in nodes]):
                self.stop(started)
                return None
        except Exception as exc:  # a host that did not answer: the per-node path, the cluster still works
            log.warning("cluster %s: the node agents could not be started (%s): the per-node path", name, exc)
            self.stop(started)
            return None
        remember(host_token_key(self.kind, head, port), token)
        return {"host": address, "port": port}

    def start_one(self, node: Node, head: Node, where: tuple[str, int], token: bytes) -> bool:
        """A new node of a running cluster (a replaced one): its agent joins the head."""
        script = host_start_script(node.root, node.node_id, token, head=f"{where[0]}:{where[1]}")
        try:
            res = self.runner_of(node).run_script(script, timeout=60)
        except Exception as exc:
            log.warning("node %s: its agent could not be started (%s)", node.node_id, exc)
            return False
        return _last_line(res.text) == "AGENT"

    def stop(self, nodes: Sequence[Node]) -> None:
        self.map_fn(lambda n: self.runner_of(n).run_script(host_stop_script(n.root), timeout=30), nodes)

    def endpoint(self, handle: Any) -> tuple[str, int, bytes] | None:
        """The head agent's address (the handle's) and the token: cached in this process, else read from
        the head node (one call)."""
        where = endpoint(handle.extra)
        if where is None or not handle.nodes:
            return None
        host, port = where
        head = handle.nodes[0]
        key = host_token_key(self.kind, head, port)
        token = cached(key)
        if token is None:
            res = self.runner_of(head).run_script(host_token_script(head.root), timeout=30)
            token = res.stdout.strip()
            if res.returncode != 0 or not token:
                log.info(
                    "cluster %s: the agent token could not be read from its head: %s",
                    handle.name,
                    res.error_text or f"exit code {res.returncode}",
                )
                return None
            remember(key, token)
        if self.reach is not None:
            host, port = self.reach(head, port)
        return host, port, token

    def forget(self, handle: Any) -> None:
        where = endpoint(handle.extra)
        if where is not None and handle.nodes:
            forget(host_token_key(self.kind, handle.nodes[0], where[1]))


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], most: int = 16) -> list[Any]:
    """``fn`` over ``items``, ``most`` at a time; exceptions are returned, not raised (reported per item
    by the caller)."""

    def safe(item: Any) -> Any:
        try:
            return fn(item)
        except Exception as exc:
            return exc

    if not items:
        return []
    with ThreadPoolExecutor(min(most, len(items))) as pool:
        return list(pool.map(safe, items))


__all__ = [
    "AGENT_JOIN_WAIT",
    "AGENT_REACH_WAIT",
    "EXTRA_KEY",
    "HOST_AGENT_DIR",
    "HostAgents",
    "cached",
    "endpoint",
    "forget",
    "agent_file_lines",
    "agents_on",
    "host_agent_dir",
    "host_start_script",
    "joined",
    "new_port",
    "parallel_map",
    "remember",
    "token_line",
]
