"""The embedded default: N "nodes" on this machine, each with its own loopback IP and home.

Node i of a cluster gets ``127.0.<block>.<i+1>`` (Linux routes all of 127/8 to ``lo``, so a rank can
bind its own address) and the directory ``<state>/local/<cluster>/node-<i>`` as its home. Cluster
records (with the rank order) live in ``<state>/local/clusters/<name>.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from airflow_provider_sky import runtime
from airflow_provider_sky.backends.base import Backend, BackendError, ClusterHandle, Node
from airflow_provider_sky.gang import rank_order
from airflow_provider_sky.runners.local import LocalRunner
from airflow_provider_sky.spec import BackendCapabilities, SpecError, TaskSpec

LOCAL_MAX_NODES = 128


def default_state_dir() -> Path:
    """``$SKY_PROVIDER_HOME``, else ``$AIRFLOW_HOME/sky``, else ``~/.airflow-provider-sky``."""
    if os.environ.get("SKY_PROVIDER_HOME"):
        return Path(os.environ["SKY_PROVIDER_HOME"])
    if os.environ.get("AIRFLOW_HOME"):
        return Path(os.environ["AIRFLOW_HOME"]) / "sky"
    return Path.home() / ".airflow-provider-sky"


class LocalBackend(Backend):
    """Processes on this machine stand in for nodes; nothing to install."""

    kind = "local"
    capabilities = BackendCapabilities(
        name="local",
        max_nodes=LOCAL_MAX_NODES,
        supported_resources=frozenset({"cpus", "memory", "labels", "cloud"}),
        clouds=frozenset({"local"}),
    )

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.base = self.state_dir / "local"
        self.records = self.base / "clusters"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalBackend:
        return cls(config.get("state_dir"))

    def config(self) -> dict[str, Any]:
        return {"state_dir": str(self.state_dir)}

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.records.mkdir(parents=True, exist_ok=True)
        with open(self.base / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _record(self, name: str) -> Path:
        runtime.check_job_id(name)
        return self.records / f"{name}.json"

    def _read(self, name: str) -> ClusterHandle | None:
        path = self._record(name)
        if not path.exists():
            return None
        return ClusterHandle.from_dict(json.loads(path.read_text()))

    def _free_block(self) -> int:
        used = set()
        for path in self.records.glob("*.json"):
            with contextlib.suppress(ValueError, KeyError, OSError):
                used.add(int(json.loads(path.read_text())["extra"]["block"]))
        for block in range(1, 255):
            if block not in used:
                return block
        raise BackendError("local backend: all 254 address blocks (127.0.1-254.x) are in use; down a cluster")

    def provision(self, name: str, spec: TaskSpec) -> ClusterHandle:
        for key, _path in spec.file_mounts.items():
            if not key.startswith("~/"):
                raise SpecError(
                    f"file_mounts.{key}",
                    "the local backend puts file mounts in each node's own home; use a '~/...' destination",
                )
        with self._lock():
            existing = self._read(name)
            if existing is not None:
                if len(existing.nodes) != spec.num_nodes:
                    raise BackendError(
                        f"cluster {name!r} exists with {len(existing.nodes)} nodes but the task asks for "
                        f"{spec.num_nodes}: tear it down first or use another cluster name"
                    )
                return existing
            block = self._free_block()
            cluster_dir = self.base / name
            ips = [f"127.0.{block}.{i + 1}" for i in range(spec.num_nodes)]
            nodes = []
            for i, ip in enumerate(rank_order(ips, head=ips[0])):
                home = cluster_dir / f"node-{i}"
                home.mkdir(parents=True, exist_ok=True)
                nodes.append(Node(ip=ip, node_id=f"node-{i}", root=str(home / ".sky"), home=str(home)))
            handle = ClusterHandle(
                name=name,
                backend=self.kind,
                nodes=tuple(nodes),
                cloud="local",
                extra={"block": block, "dir": str(cluster_dir)},
            )
            tmp = self._record(name).with_suffix(".tmp")
            tmp.write_text(json.dumps(handle.to_dict(), indent=1))
            tmp.replace(self._record(name))
            return handle

    def find(self, name: str) -> ClusterHandle | None:
        return self._read(name)

    def runner(self, node: Node) -> LocalRunner:
        return LocalRunner(node.ip, node.home)

    def workdir(self, node: Node, spec: TaskSpec) -> str:
        return f"{node.home}/sky_workdir" if spec.workdir else node.home

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:
        for node in handle.nodes:
            if spec.workdir:
                _copy(Path(spec.workdir), Path(node.home) / "sky_workdir")
            for dest, src in spec.file_mounts.items():
                _copy(Path(src), Path(node.home) / dest[2:])

    def terminate(self, name: str, grace: float = 2.0) -> bool:
        handle = self._read(name)
        if handle is None:
            return False
        script = runtime.teardown_script()
        for node in handle.nodes:
            res = self.runner(node).run_script(script, [node.root, f"{grace:.3f}"], timeout=grace + 30)
            if res.returncode != 0:
                raise BackendError(f"teardown of {node.ip} failed: {res.error_text}")
        with self._lock():
            shutil.rmtree(handle.extra.get("dir", self.base / name), ignore_errors=True)
            self._record(name).unlink(missing_ok=True)
        return True


def _copy(src: Path, dest: Path) -> None:
    if not src.exists():
        raise BackendError(f"{src} does not exist: fix the task's workdir or file_mounts")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=False)
    else:
        shutil.copy2(src, dest)
