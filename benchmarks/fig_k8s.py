"""Figure 6: the Kubernetes backend on the local test cluster, beside a ``kubectl exec`` fan-out.

The cluster is ``tests/k8s/k8s-local.sh``'s (Kubernetes 1.20, two real kubelets on this machine), reached
through :class:`tests.k8s_cluster.LocalCluster`: started unless another session runs it, shared with
concurrent pytest sessions (a shared lock), stopped after the figure when no one else uses it. The
figure works in a fresh namespace ``sky-bench-<hex>``, deleted at its end.

Per gang size N, on pods provisioned by the backend (``registry.by_kind("kubernetes").make(extras)``,
image ``docker.io/library/busybox:local``, pull policy ``Never``), interleaved in one invocation:

* provision: ``backend.provision`` called → every pod Running (the backend's own wait, which lists the
  pods every 0.5 s), and → the handle returned (each pod's home read over exec, the cluster record
  written on the head);
* gang start: ``GangClient.launch`` of ``sleep 10000`` on every rank (the call's duration, the
  first → last rank start spread from the status) vs a ``kubectl exec`` fan-out (one ``kubectl``
  process per pod, all at once) starting a detached ``sleep 10000`` in every pod;
* fail-fast: rank N-1 runs ``sleep 2; exit 1``, the others ``sleep 10000``, watched by ``watch.watch``
  (the poll loop the triggers share, poll 0.5 s, grace 3 s) vs a kubectl script that waits on the
  failing rank's attached ``kubectl exec`` and then fans out ``kubectl exec <pod> -- kill <pid>``;
* teardown: ``backend.terminate`` (grace 3 s, the down task's default) → every pod gone.

Processes are timed from this machine's /proc: a container's processes are processes of this machine
(in their own pid namespace), so the ``sleep``s of a job are found by their command line and the
``SKYPILOT_TASK_ID`` in their environment (the kubectl runs set the same variable), their start times
read from ``/proc/<pid>/stat`` (clock ticks since boot: 10 ms) and their ends seen through a pidfd each
(``epoll``: the moment the process exits, with no polling). The rank timestamps in the status are whole
seconds in this image (busybox ``date`` has no ``%N``, so the node runtime falls back to ``date +%s``):
the status-based spread and fail-fast rows are shown, but the figures use /proc.

N: 4, and the largest N the cluster holds, found first (``--quick``: N = 4 only): 4, 8, 16, ... pods
(requesting nothing), doubling up to the pod capacity of the nodes (the last step is that capacity),
until provisioning fails or takes over :data:`PROBE_LIMIT` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import TESTS, Row, _stat, kill_job_processes

IMAGE = "docker.io/library/busybox:local"
CONTEXT = "local"
#: the probe stops once provisioning N pods takes longer than this (or fails)
PROBE_LIMIT = 120.0
#: the fail-fast grace (``watch.watch``'s default) and the teardown grace (the down task's default)
GRACE = 3.0
POLL = 0.5
FAIL_AFTER = 2
SLEEP_CMD = b"sleep\x0010000\x00"
FAIL_CMD = f"sleep\x00{FAIL_AFTER}\x00".encode()
FAIL_RUN = 'if [ "$SKYPILOT_NODE_RANK" = "{rank}" ]; then sleep {after}; exit 1; fi; sleep 10000'
#: what the kubectl fan-out runs in a pod: a detached sleep, its pid kept for the kill
DETACHED = "sleep 10000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/{id}.pid"
KILL = "kill $(cat /tmp/{id}.pid)"
HZ = os.sysconf("SC_CLK_TCK")
_ids = itertools.count()

Log = Callable[..., None]


def boottime() -> float:
    """CLOCK_BOOTTIME: the clock of ``/proc/<pid>/stat``'s start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _job(kind: str, n: int) -> str:
    return f"{kind}{n}-{next(_ids)}-{int(time.time() * 1000) % 10**8}"


def _k8s_module() -> Any:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import k8s_cluster

    return k8s_cluster


# ------------------------------------------------------------------------------------------- cluster


@dataclass
class TestCluster:
    kubeconfig: str
    namespace: str
    kubectl: str
    info: dict[str, Any] = field(default_factory=dict)

    def api(self) -> Any:
        from kubernetes import client, config

        return client.CoreV1Api(
            config.new_client_from_config(config_file=self.kubeconfig, context=CONTEXT, persist_config=False)
        )


def _kubectl() -> str:
    """Kubernetes' own 1.20.2 kubectl that ``make k8s`` builds (the PATH one may be any version)."""
    built = _k8s_module().LOCAL_DIR / "bin" / "kubectl"
    if built.exists():
        return str(built)
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError(f"no kubectl: neither {built} (make k8s) nor one on PATH")
    return found


def _version(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return (res.stdout + res.stderr).strip().splitlines()[0] if (res.stdout + res.stderr).strip() else "?"


def pod_capacity(api: Any) -> tuple[int, int]:
    """(pods the Ready schedulable nodes allow, pods not yet ended in the whole cluster)."""
    alloc = 0
    for node in api.list_node().items:
        ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        if ready and not node.spec.unschedulable:
            alloc += int((node.status.allocatable or {}).get("pods", "0"))
    pods = api.list_pod_for_all_namespaces().items
    return alloc, sum(1 for p in pods if p.status.phase not in ("Succeeded", "Failed"))


def other_pods(cl: TestCluster) -> dict[str, int]:
    """Pods of other namespaces (another session using the cluster while we measure)."""
    api = cl.api()
    try:
        pods = api.list_pod_for_all_namespaces().items
    finally:
        api.api_client.close()
    return dict(Counter(p.metadata.namespace for p in pods if p.metadata.namespace != cl.namespace))


@contextlib.contextmanager
def test_cluster(log: Log) -> Iterator[TestCluster]:
    """The local cluster (a share of it, started when needed, stopped after if no one else uses it) and a
    fresh namespace, deleted at the end; also on errors and Ctrl-C."""
    kc = _k8s_module()
    local = kc.LocalCluster()
    t = time.monotonic()
    log("acquiring the local Kubernetes cluster (tests/k8s; started unless another session runs it) ...")
    try:
        local.acquire()
    except kc.pytest.fail.Exception as exc:  # LocalCluster.check: not root, or not built (make k8s)
        raise RuntimeError(str(exc)) from None
    try:
        log(f"  cluster ready after {time.monotonic() - t:.1f}s")
        cl = TestCluster(local.kubeconfig, f"sky-bench-{secrets.token_hex(4)}", _kubectl())
        api = cl.api()
        try:
            _check_image(api)
            from kubernetes import client

            version = client.VersionApi(api.api_client).get_code()
            alloc, used = pod_capacity(api)
            cl.info = {
                "server": version.git_version,
                "kubectl": cl.kubectl,
                "kubectl_version": _version([cl.kubectl, "version", "--client", "--short"]),
                "nodes": sorted(n.metadata.name for n in api.list_node().items),
                "allocatable_pods": alloc,
                "pods_at_start": used,
            }
            _create_namespace(api, cl.namespace)
        finally:
            api.api_client.close()
        try:
            yield cl
        finally:
            _delete_namespace(cl, log)
    finally:
        t = time.monotonic()
        local.release()
        log(f"  released the local cluster share ({time.monotonic() - t:.1f}s; stopped unless in use)")


def _check_image(api: Any) -> None:
    missing = [
        n.metadata.name
        for n in api.list_node().items
        if not any(IMAGE in (i.names or []) for i in n.status.images or [])
    ]
    if missing:
        raise RuntimeError(f"{IMAGE} is missing on nodes {missing} (tests/k8s/k8s-local.sh start imports it)")


def _create_namespace(api: Any, name: str) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"sky-bench": "1"}))
    )

    def has_default_sa() -> bool:  # pods are refused until the namespace has its default account
        try:
            api.read_namespaced_service_account("default", name)
            return True
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False

    _k8s_module().wait_for(has_default_sa, 60, f"service account default in namespace {name}")


def _delete_namespace(cl: TestCluster, log: Log, wait: float = 180.0) -> None:
    from kubernetes.client.rest import ApiException

    api = cl.api()
    try:
        try:
            api.delete_namespace(cl.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                api.read_namespace(cl.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise
            time.sleep(1)
        log(f"  namespace {cl.namespace} still terminating after {wait:g}s (left to the cluster)")
    finally:
        api.api_client.close()


def backend_for(cl: TestCluster, provision_timeout: float) -> Any:
    from airflow_provider_sky.backends.registry import by_kind

    return by_kind("kubernetes").make(
        {
            "kube_config_path": cl.kubeconfig,
            "context": CONTEXT,
            "namespace": cl.namespace,
            "image": IMAGE,
            "image_pull_policy": "Never",
            "provision_timeout": provision_timeout,
        }
    )


# -------------------------------------------------------------------------------- provision, teardown


@dataclass
class Provisioned:
    handle: Any
    created: float  # call -> the last pod create answered
    running: float  # call -> every pod Running (the backend's wait, which lists the pods every 0.5 s)
    total: float  # call -> handle (+ each pod's home read over exec, the cluster record on the head)


def provision(backend: Any, name: str, n: int) -> Provisioned:
    from airflow_provider_sky.spec import task_from_args

    marks: dict[str, float] = {}
    original = backend._wait_running

    def wait_running(*args: Any, **kwargs: Any) -> Any:  # called right after the last pod create
        marks["created"] = time.monotonic()
        out = original(*args, **kwargs)
        marks["running"] = time.monotonic()
        return out

    backend._wait_running = wait_running
    t0 = time.monotonic()
    try:
        handle = backend.provision(name, task_from_args(num_nodes=n, run="true"))
    finally:
        del backend._wait_running
    total = time.monotonic() - t0
    return Provisioned(handle, marks["created"] - t0, marks["running"] - t0, total)


def teardown(backend: Any, name: str) -> tuple[float, list[str]]:
    """``terminate`` → every pod gone (its own wait lists them every 0.5 s); the pods left, if any."""
    t = time.monotonic()
    td = backend.terminate(name, grace=GRACE)
    return time.monotonic() - t, list(td.unclean)


def wait_pods_gone(cl: TestCluster, name: str, timeout: float = 300.0) -> list[str]:
    from airflow_provider_sky.backends.kubernetes.manifest import cluster_selector

    api = cl.api()
    try:
        deadline = time.monotonic() + timeout
        while True:
            left = [
                p.metadata.name
                for p in api.list_namespaced_pod(cl.namespace, label_selector=cluster_selector(name)).items
            ]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1)
    finally:
        api.api_client.close()


# ------------------------------------------------------------------------------ the pods' processes


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    rank: int
    cmd: bytes


class Scanner:
    """A job's ``sleep`` processes in the pods, from this machine's /proc.

    Repeated scans read only processes not ruled out before: one without the job's marker in its
    environment, once it is older than :attr:`SETTLE` seconds (a process can still exec into something
    else before that; on this overloaded machine a fork may wait that long for its exec), is not read
    again. Processes with the marker (the job's shells) are read on every scan until they run a ``sleep``.
    """

    WANTED = (SLEEP_CMD, FAIL_CMD)
    SETTLE = 5.0

    def __init__(self, job_id: str, fail_cmd: bytes = FAIL_CMD) -> None:
        self.marker = f"SKYPILOT_TASK_ID={job_id}".encode()
        self.boring: set[int] = set()
        self.wanted = (SLEEP_CMD, fail_cmd)

    def scan(self) -> dict[int, Proc]:
        now = boottime()
        found: dict[int, Proc] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid in self.boring:
                continue
            st = _stat(pid)
            if st is None:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = fh.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read()
            except OSError:
                continue
            if self.marker not in env:
                if now - st[1] / HZ > self.SETTLE:
                    self.boring.add(pid)
                continue
            if cmd not in self.wanted or st[0] == "Z":
                continue
            rank = next((int(e[19:]) for e in env if e.startswith(b"SKYPILOT_NODE_RANK=")), -1)
            found[pid] = Proc(pid, st[1], rank, cmd)
        return found


def wait_sleeps(job_id: str, n: int, timeout: float = 60.0) -> list[Proc]:
    """The job's ``sleep 10000`` of every rank (scans every 20 ms until all N run)."""
    scanner = Scanner(job_id)
    found: dict[int, Proc] = {}
    deadline = time.monotonic() + timeout
    while True:
        found.update({p.rank: p for p in scanner.scan().values() if p.cmd == SLEEP_CMD})
        if len(found) >= n:
            return sorted(found.values(), key=lambda p: p.rank)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job_id}: {len(found)} of {n} ranks' sleep 10000 found after {timeout:g}s")
        time.sleep(0.02)


class GoneClock(threading.Thread):
    """When the last of ``procs`` exited: one pidfd each in an ``epoll``, so every exit is timed as it
    happens (a zombie counts as gone). Start it before the kill, :meth:`result` after."""

    def __init__(self, procs: list[Proc], timeout: float = 60.0) -> None:
        super().__init__(daemon=True, name="gone-clock")
        self.timeout = timeout
        self.last: float | None = None
        self.left = 0
        self._ep = select.epoll()
        self._fds: list[int] = []
        for p in procs:
            try:
                fd = os.pidfd_open(p.pid)
            except OSError:
                self.last = time.time()
                continue
            st = _stat(p.pid)
            if st is None or st[0] in ("Z", "X") or st[1] != p.start:
                os.close(fd)
                self.last = time.time()
                continue
            self._fds.append(fd)
            self._ep.register(fd, select.EPOLLIN)
        self.left = len(self._fds)

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            while self.left and time.monotonic() < deadline:
                for fd, _ in self._ep.poll(0.2):
                    self.last = time.time()
                    self._ep.unregister(fd)
                    self.left -= 1
        finally:
            for fd in self._fds:
                os.close(fd)
            self._ep.close()

    def result(self) -> float:
        self.join(self.timeout + 5)
        if self.left or self.last is None:
            raise RuntimeError(f"{self.left} sleep processes still alive after {self.timeout:g}s")
        return self.last


class ExitTracker(threading.Thread):
    """The fail-fast clock: when the failing rank's ``sleep 2`` exited, and when the last sibling
    ``sleep 10000`` did.

    Scans /proc every 100 ms until every sibling and the failing rank's process were found (only new
    processes are read, see :class:`Scanner`), then waits on a pidfd per process in one ``epoll``: each
    exit is timed when it happens, at no cost while nothing happens. A sibling already gone when found
    counts as gone then. ``last_gone``: the latest sibling exit.
    """

    def __init__(
        self, job_id: str, n: int, fail_rank: int, limit: float = 300.0, fail_cmd: bytes = FAIL_CMD
    ) -> None:
        super().__init__(daemon=True, name=f"exit-tracker-{job_id}")
        self.fail_cmd = fail_cmd
        self.job_id = job_id
        self.n = n
        self.fail_rank = fail_rank
        self.limit = limit
        self.scanner = Scanner(job_id, fail_cmd)
        self.stop_flag = threading.Event()
        #: every process tracked was seen, and each has ended
        self.done = threading.Event()
        self.known: set[int] = set()
        self.sibling_ranks: set[int] = set()
        self.fail_seen = False
        self.fail_gone: float | None = None
        self.last_gone: float | None = None
        self.gone_count = 0
        self.error: str | None = None
        self._fds: dict[int, Proc] = {}
        self._ep = select.epoll()

    def _gone(self, proc: Proc, at: float) -> None:
        if proc.cmd == self.fail_cmd:
            self.fail_gone = at
        else:
            self.gone_count += 1
            self.last_gone = at if self.last_gone is None else max(self.last_gone, at)

    def _watch(self, proc: Proc) -> None:
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:
            self._gone(proc, time.time())
            return
        st = _stat(proc.pid)
        if st is None or st[1] != proc.start:  # gone (or the pid reused) before the pidfd was open
            os.close(fd)
            self._gone(proc, time.time())
            return
        self._fds[fd] = proc
        self._ep.register(fd, select.EPOLLIN)

    def _complete(self) -> bool:
        return len(self.sibling_ranks) >= self.n - 1 and self.fail_seen

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        try:
            while not self.stop_flag.is_set():
                if not self._complete():
                    for pid, proc in self.scanner.scan().items():
                        if pid in self.known:
                            continue
                        if proc.cmd == self.fail_cmd and proc.rank == self.fail_rank:
                            self.fail_seen = True
                        elif proc.cmd == SLEEP_CMD and proc.rank != self.fail_rank:
                            self.sibling_ranks.add(proc.rank)
                        else:
                            continue
                        self.known.add(pid)
                        self._watch(proc)
                for fd, _ in self._ep.poll(0.1 if not self._complete() else 0.2):
                    at = time.time()
                    proc = self._fds.pop(fd)
                    self._ep.unregister(fd)
                    os.close(fd)
                    self._gone(proc, at)
                if self._complete() and not self._fds:
                    self.done.set()
                if time.monotonic() > deadline:
                    self.error = f"still tracking after {self.limit:g}s"
                    return
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            self._ep.close()

    def finish(self) -> None:
        """Stop; a sibling seen alive at the end, or one never seen, makes the sample invalid."""
        self.stop_flag.set()
        self.join(10)
        left = [p for p in Scanner(self.job_id).scan().values() if p.cmd == SLEEP_CMD]
        if left and not self.error:
            self.error = f"{len(left)} sibling sleeps still running at the end"
        elif len(self.sibling_ranks) < self.n - 1 and not self.error:
            self.error = f"saw {len(self.sibling_ranks)} of {self.n - 1} siblings running"
        elif not self.fail_seen and not self.error:
            self.error = f"never saw rank {self.fail_rank}'s sleep {FAIL_AFTER}"


def _cleanup(job_id: str, log: Log) -> None:
    killed = kill_job_processes(job_id)  # host-side SIGKILL of anything of the job still running
    if killed:
        log(f"  (killed {killed} leftover processes of {job_id})")


# ----------------------------------------------------------------------------------------- kubectl


def kubectl_exec(cl: TestCluster, pod: str, job_id: str, rank: int, script: str) -> list[str]:
    from airflow_provider_sky.backends.kubernetes.manifest import CONTAINER

    return [
        cl.kubectl,
        f"--kubeconfig={cl.kubeconfig}",
        f"--context={CONTEXT}",
        "-n",
        cl.namespace,
        "exec",
        pod,
        "-c",
        CONTAINER,
        "--",
        "env",
        f"SKYPILOT_TASK_ID={job_id}",
        f"SKYPILOT_NODE_RANK={rank}",
        "sh",
        "-c",
        script,
    ]


def spawn(argvs: list[list[str]]) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for a in argvs
    ]


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float = 180.0) -> list[str]:
    """Wait for every process (killed after ``timeout``); the errors of those that failed."""
    deadline = time.monotonic() + timeout
    errors = []
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        err = p.stderr.read().decode(errors="replace").strip() if p.stderr else ""
        if p.stderr:
            p.stderr.close()
        if p.returncode != 0:
            errors.append(f"exit {p.returncode}: {err[-300:]}")
    return errors


# ----------------------------------------------------------------------------------------- samples


def ours_start(client: Any, n: int, log: Log) -> dict[str, Any]:
    """``launch`` of ``sleep 10000`` on every rank; then ``GangClient.cancel`` (which waits)."""
    from airflow_provider_sky.spec import task_from_args

    job = _job("start", n)
    spec = task_from_args(num_nodes=n, run="sleep 10000")
    try:
        b0, t0 = boottime(), time.monotonic()
        words = client.launch(spec, job)
        returned = time.monotonic() - t0
        procs = wait_sleeps(job, n)
        starts = [p.start / HZ - b0 for p in procs]
        status = client.poll(job, max_log=0).status
        st = [r.start for r in status.ranks]
        clock = GoneClock(procs)
        clock.start()
        t1 = time.monotonic()
        c0 = time.time()
        client.cancel(job, grace=GRACE)
        cancel = time.monotonic() - t1
        gone = clock.result() - c0
        out = {
            "returned": returned,
            "last_start": max(starts),
            "spread": max(starts) - min(starts),
            "status_spread": (max(st) - min(st)) if all(s is not None for s in st) else None,
            "status_without_start": sum(1 for s in st if s is None),
            "cancel_returned": cancel,
            "cancel_gone": gone,
            "not_started": sorted(r for r, w in words.items() if w != "STARTED"),
        }
        log(
            f"  fig6 N={n} ours start: launch() {returned:.3f}s, last sleep +{max(starts):.3f}s, spread "
            f"{out['spread']:.3f}s (status {out['status_spread']}s); cancel {cancel:.3f}s, gone +{gone:.3f}s"
        )
        return out
    finally:
        _cleanup(job, log)


def kubectl_start(cl: TestCluster, pods: list[str], n: int, log: Log) -> dict[str, Any]:
    """One ``kubectl exec`` per pod at once, each starting a detached ``sleep 10000``; then the kill fan-out."""
    job = _job("kstart", n)
    try:
        argvs = [kubectl_exec(cl, pods[r], job, r, DETACHED.format(id=job)) for r in range(n)]
        b0, t0 = boottime(), time.monotonic()
        errors = wait_all(spawn(argvs))
        returned = time.monotonic() - t0
        if errors:
            raise RuntimeError(f"{len(errors)} kubectl exec failed: {errors[0]}")
        procs = wait_sleeps(job, n)
        starts = [p.start / HZ - b0 for p in procs]
        kills = [kubectl_exec(cl, pods[r], job, r, KILL.format(id=job)) for r in range(n)]
        clock = GoneClock(procs)
        clock.start()
        c0, t1 = time.time(), time.monotonic()
        errors = wait_all(spawn(kills))
        kill = time.monotonic() - t1
        gone = clock.result() - c0
        if errors:
            raise RuntimeError(f"{len(errors)} kubectl exec kill failed: {errors[0]}")
        out = {
            "returned": returned,
            "last_start": max(starts),
            "spread": max(starts) - min(starts),
            "kill_returned": kill,
            "kill_gone": gone,
        }
        log(
            f"  fig6 N={n} kubectl start: all returned {returned:.3f}s, last sleep +{max(starts):.3f}s, "
            f"spread {out['spread']:.3f}s; kill fan-out {kill:.3f}s, gone +{gone:.3f}s"
        )
        return out
    finally:
        _cleanup(job, log)


#: fail-fast: how long ``watch.watch`` may take to end the gang (a few seconds when it works)
WATCH_LIMIT = 120.0


async def _to_end(client: Any, job_id: str, polls: list[Any]) -> None:
    """``watch.watch`` until every rank is terminal; every poll kept in ``polls`` (the caller bounds it)."""
    from airflow_provider_sky.watch.loop import watch

    async for poll in watch(client, job_id, poll_interval=POLL, grace=GRACE):
        polls.append(poll)


async def _unwatched(client: Any, job_id: str, tracker: Any, polls: list[Any]) -> None:
    """Nothing polls (Airflow away: on the agent path the head alone stops the siblings) until the
    tracker saw every process of the gang end; then one look at a time until every rank is terminal."""
    while not tracker.done.is_set():
        await asyncio.sleep(0.1)
    while True:
        poll = await client.apoll(job_id, max_log=0)
        polls.append(poll)
        if all(r.terminal for r in poll.status.ranks):
            return
        await asyncio.sleep(0.5)


def ours_failfast(
    client: Any, n: int, log: Log, after: int = FAIL_AFTER, watched: bool = True
) -> dict[str, Any]:
    """Rank N-1 ``sleep 2; exit 1`` (``after`` seconds), the others ``sleep 10000``: launch, then
    ``watch.watch`` to the end (given up after :data:`WATCH_LIMIT`: an invalid sample saying what the
    watch saw). ``watched`` False: nothing polls until the siblings are gone (Airflow away)."""
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.jobs import GangClient

    job = _job("ff", n)
    fail = n - 1
    spec = task_from_args(num_nodes=n, run=FAIL_RUN.format(rank=fail, after=after))
    tracker = ExitTracker(job, n, fail, fail_cmd=f"sleep\x00{after}\x00".encode())
    cancels: list[tuple[float, int, str]] = []
    polls: list[Any] = []
    original = GangClient.acancel

    async def timed_acancel(self: Any, job_id: str, ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        count = self.num_ranks if ranks is None else len(ranks)
        cancels.append((time.time(), count, str(kwargs.get("reason", ""))))
        return await original(self, job_id, ranks, *args, **kwargs)

    tracker.start()
    GangClient.acancel = timed_acancel  # type: ignore[method-assign]
    ended = True
    try:
        t0 = time.time()
        words = client.launch(spec, job)
        launch_end = time.time()
        try:
            until = _to_end(client, job, polls) if watched else _unwatched(client, job, tracker, polls)
            asyncio.run(asyncio.wait_for(until, WATCH_LIMIT))
        except asyncio.TimeoutError:
            ended = False
    finally:
        GangClient.acancel = original  # type: ignore[method-assign]
        tracker.finish()
        _cleanup(job, log)
    if not polls:
        raise RuntimeError(f"watch.watch made no poll in {WATCH_LIMIT:g}s")
    ranks = polls[-1].status.ranks
    states = [r.state.value for r in ranks]
    error = None
    if not ended:
        error = f"watch.watch did not end within {WATCH_LIMIT:g}s; last poll {dict(Counter(states))}"
    elif states[fail] != "failed" or states.count("cancelled") != n - 1:
        error = f"rank states {dict(Counter(states))}"
    if tracker.error:
        error = f"{error}; {tracker.error}" if error else tracker.error
    exit_at = tracker.fail_gone
    gone = tracker.last_gone - exit_at if exit_at is not None and tracker.last_gone is not None else None
    sent = cancels[0][0] - exit_at if cancels and exit_at is not None else None
    ends = [r.end for r in ranks]
    status_gone = None
    if ended and all(e is not None for e in ends):
        status_gone = max(e for i, e in enumerate(ends) if i != fail) - ends[fail]
    out: dict[str, Any] = {
        "gone": gone if ended else None,
        "cancel_sent": sent,
        "sent_to_gone": gone - sent if ended and gone is not None and sent is not None else None,
        "status_gone": status_gone,
        "launch": launch_end - t0,
        "exit_before_launch_returned": exit_at is not None and exit_at < launch_end,
        "launch_words": dict(Counter(words.values())),
        "status_fail_end_minus_exit": ends[fail] - exit_at if exit_at and ends[fail] else None,
        "ended": ended,
        "polls": len(polls),
        "poll_states": [dict(Counter(r.state.value for r in p.status.ranks)) for p in polls[:40]],
        "poll_unreachable": [len(p.unreachable) for p in polls],
        "first_unreachable": next((list(p.unreachable.values())[:3] for p in polls if p.unreachable), []),
        "cancels": [(t - exit_at if exit_at else None, k, why) for t, k, why in cancels],
        "siblings_gone": tracker.gone_count,
        "error": error,
    }
    flag = f"  ERROR {error}" if error else ""
    log(
        f"  fig6 N={n} ours fail-fast: exit -> last sibling gone {_f(out['gone'])} (cancel sent {_f(sent)}; "
        f"status end times {_f(status_gone)}), launch {out['launch']:.3f}s, {len(polls)} polls{flag}"
    )
    return out


def kubectl_failfast(cl: TestCluster, pods: list[str], n: int, log: Log) -> dict[str, Any]:
    """The same gang by ``kubectl exec`` fan-out: the failing rank's exec attached (its return is the
    detection, no polling), then ``kubectl exec <pod> -- kill <pid>`` to every sibling at once."""
    job = _job("kff", n)
    fail = n - 1
    tracker = ExitTracker(job, n, fail)
    tracker.start()
    try:
        argvs = [kubectl_exec(cl, pods[r], job, r, DETACHED.format(id=job)) for r in range(fail)]
        argvs.append(kubectl_exec(cl, pods[fail], job, fail, f"sleep {FAIL_AFTER}; exit 1"))
        procs = spawn(argvs)
        try:
            procs[-1].wait(180)
        except subprocess.TimeoutExpired:
            procs[-1].kill()
            procs[-1].wait()
        fail_returned = time.time()
        errors = wait_all(procs[:-1])
        if errors:
            raise RuntimeError(f"{len(errors)} kubectl exec failed: {errors[0]}")
        rc = procs[-1].returncode
        if procs[-1].stderr:
            procs[-1].stderr.close()
        kill_sent = time.time()
        errors = wait_all(
            spawn([kubectl_exec(cl, pods[r], job, r, KILL.format(id=job)) for r in range(fail)])
        )
        kill_returned = time.time()
        deadline = time.monotonic() + 30
        while tracker.gone_count < n - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tracker.finish()
        _cleanup(job, log)
    error = tracker.error or (f"{len(errors)} kubectl kill failed: {errors[0]}" if errors else None)
    if rc != 1:
        error = error or f"the failing rank's kubectl exec returned {rc}, not 1"
    exit_at = tracker.fail_gone
    gone = tracker.last_gone - exit_at if exit_at is not None and tracker.last_gone is not None else None
    out: dict[str, Any] = {
        "gone": gone,
        "detected": fail_returned - exit_at if exit_at is not None else None,
        "kill_sent": kill_sent - exit_at if exit_at is not None else None,
        "sent_to_gone": tracker.last_gone - kill_sent if tracker.last_gone is not None else None,
        "kill_returned": kill_returned - kill_sent,
        "error": error,
    }
    flag = f"  ERROR {error}" if error else ""
    log(
        f"  fig6 N={n} kubectl fail-fast: exit -> last sibling gone {_f(gone)} (exec returned "
        f"{_f(out['detected'])}, kill sent {_f(out['kill_sent'])}){flag}"
    )
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


# ------------------------------------------------------------------------- stuck exec threads (workaround)


def _in_poll(t: threading.Thread) -> bool:
    try:
        with open(f"/proc/self/task/{t.native_id}/wchan") as fh:
            return "poll" in fh.read()
    except OSError:
        return False


def unstick_exec_threads(log: Log) -> dict[str, int]:
    """Workaround, after measuring: free the runner's exec threads that wait forever.

    ``KubernetesRunner._call`` reads ``ws.read_stdout()`` / ``read_stderr()`` with the client's default
    ``timeout=None``, i.e. ``poll()`` without a limit whenever the channel is empty. A call abandoned after the
    status timeout has its websocket closed from another thread (``_Cancel.set``), which does not wake a
    ``poll()`` already waiting on it: the thread stays there for good, and the process never exits (Python
    joins the executor's threads at exit). A thread still in ``poll()`` 2 s after the figure ended, with no
    call in flight, is one of those; a no-op SIGUSR1 to it interrupts the ``poll()``, whose retry sees the closed
    descriptor (POLLNVAL), and the call ends with an error. Returns how many were stuck and how many still are.
    """
    execs = [t for t in threading.enumerate() if t.name.startswith("sky-kube-exec") and t.native_id]
    first = [t for t in execs if _in_poll(t)]
    if not first:
        return {"exec_threads": len(execs), "stuck": 0, "still_stuck": 0}
    time.sleep(2.0)
    stuck = [t for t in first if t.is_alive() and _in_poll(t)]
    if stuck:
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # left installed: a late one stays harmless
        for t in stuck:
            with contextlib.suppress(ProcessLookupError):
                signal.pthread_kill(t.ident or 0, signal.SIGUSR1)
        time.sleep(1.0)
    left = [t for t in stuck if t.is_alive() and _in_poll(t)]
    log(
        f"  {len(stuck)} of {len(execs)} exec threads were stuck in poll() on a closed websocket "
        f"(product bug, see benchmarks/README.md); {len(left)} still are"
    )
    return {"exec_threads": len(execs), "stuck": len(stuck), "still_stuck": len(left)}


# ------------------------------------------------------------------------------------------- probe


def probe(cl: TestCluster, log: Log) -> tuple[int, list[dict[str, Any]]]:
    """The largest N (4, 8, 16, ... then the pod capacity) provisioned within :data:`PROBE_LIMIT`."""
    from airflow_provider_sky.backends.base import BackendError

    api = cl.api()
    try:
        alloc, used = pod_capacity(api)
    finally:
        api.api_client.close()
    cap = alloc - used
    log(f"  probe: the nodes allow {alloc} pods, {used} exist: up to {cap} pods")
    backend = backend_for(cl, PROBE_LIMIT)
    tried: list[dict[str, Any]] = []
    best, n = 0, 4
    try:
        while n <= cap:
            name = f"bench-probe{n}"
            try:
                p = provision(backend, name, n)
            except BackendError as exc:
                left = wait_pods_gone(cl, name)
                tried.append({"n": n, "held": False, "error": str(exc)[:500], "left": left})
                log(f"  probe N={n}: does not hold: {str(exc)[:300]}")
                break
            td, unclean = teardown(backend, name)
            left = wait_pods_gone(cl, name) if unclean else []
            held = p.total <= PROBE_LIMIT
            tried.append(
                {
                    "n": n,
                    "held": held,
                    "created": p.created,
                    "running": p.running,
                    "total": p.total,
                    "teardown": td,
                    "unclean": unclean,
                    "left": left,
                }
            )
            log(
                f"  probe N={n}: all running {p.running:.1f}s, ready {p.total:.1f}s, teardown {td:.1f}s"
                + ("" if held else f" (over {PROBE_LIMIT:g}s)")
            )
            if not held:
                break
            best = n
            if n >= cap:
                break
            n = min(2 * n, cap)
    finally:
        backend.close()
    return best, tried


# -------------------------------------------------------------------------------------------- run


def run(plan: Any, log: Log, ns: tuple[int, ...] = ()) -> list[Row]:
    """Figure 6's rows. ``ns``: gang sizes to use instead of 4 + the probed largest."""
    from airflow_provider_sky.watch.jobs import GangClient

    reps = 1 if plan.quick else 3
    rows: list[Row] = []
    info: dict[str, Any] = {}
    try:
        with test_cluster(log) as cl:
            info.update(cl.info, namespace=cl.namespace, other_pods_at_start=other_pods(cl))
            log(f"  {info['server']} nodes {info['nodes']}, namespace {cl.namespace}, kubectl {cl.kubectl}")
            tried: list[dict[str, Any]] = []
            if ns:
                sizes = ns
            elif plan.quick:
                sizes = (4,)
            else:
                best, tried = probe(cl, log)
                if not best:
                    raise RuntimeError(f"the cluster did not hold even 4 pods: {tried}")
                sizes = (4, best) if best > 4 else (4,)
                for t in tried:
                    note = (
                        "" if t["held"] else (f"over {PROBE_LIMIT:g} s" if "total" in t else "did not hold")
                    )
                    samples = [t["running"]] if "running" in t else []
                    rows.append(
                        Row("6 probe: provision -> all pods running", t["n"], samples, note=note, extra=t)
                    )
            info["probe"] = tried
            info["sizes"] = list(sizes)
            log(f"  fig6 gang sizes: {', '.join(map(str, sizes))} ({reps} run(s) each)")
            for n in sizes:
                rows += _one_size(cl, n, reps, info if n == sizes[0] else {}, log, GangClient)
            info["other_pods_at_end"] = other_pods(cl)  # the dict is in the first size's first row
    finally:  # also after an error: a stuck exec thread would keep the process from exiting
        info["exec_threads_at_end"] = unstick_exec_threads(log)
    return rows


def _one_size(cl: TestCluster, n: int, reps: int, info: dict[str, Any], log: Log, gang: Any) -> list[Row]:
    keys = ("provision", "start", "kstart", "ff", "kff", "teardown")
    got: dict[str, list[Any]] = {k: [] for k in keys}
    failures: list[str] = []
    backend = backend_for(cl, 300.0)
    try:
        for i in range(reps):
            name = f"bench-k8s{n}-{i}"
            p = provision(backend, name, n)
            got["provision"].append(p)
            log(f"  fig6 N={n} #{i + 1}: provisioned: all running {p.running:.2f}s, ready {p.total:.2f}s")
            client = gang(backend, p.handle)
            pods = [node.extra["pod"] for node in p.handle.nodes]
            steps: list[tuple[str, Callable[..., dict[str, Any]], tuple[Any, ...]]] = [
                ("start", ours_start, (client, n, log)),
                ("kstart", kubectl_start, (cl, pods, n, log)),
                ("ff", ours_failfast, (client, n, log)),
                ("kff", kubectl_failfast, (cl, pods, n, log)),
            ]
            if i % 2:  # alternate who goes first
                steps = [steps[1], steps[0], steps[3], steps[2]]
            try:
                for key, fn, args in steps:
                    try:
                        got[key].append({**fn(*args), "rep": i})
                    except Exception as exc:  # an invalid sample of this repetition, with its reason
                        why = f"{type(exc).__name__}: {exc}"
                        got[key].append({"rep": i, "error": why})
                        failures.append(f"N={n} #{i + 1} {key}: {why}")
                        log(f"  fig6 N={n} #{i + 1} {key} FAILED: {why}")
            finally:
                client.close()
                td, unclean = teardown(backend, name)
                if unclean:
                    wait_pods_gone(cl, name)
                got["teardown"].append((td, unclean))
                log(f"  fig6 N={n} #{i + 1}: teardown {td:.2f}s" + (f" (left {unclean})" if unclean else ""))
    finally:
        backend.close()
    return _rows(n, got, failures, info)


def _invalid(samples: list[dict[str, Any]], bad: int) -> str:
    if not bad:
        return ""
    why = Counter(str(s["error"]).split(";")[0].split(" last poll")[0] for s in samples if s.get("error"))
    return f"{bad} of {len(samples)} samples invalid: " + ", ".join(f"{k} ({v}x)" for k, v in why.items())


def _rows(n: int, got: dict[str, list[Any]], failures: list[str], info: dict[str, Any]) -> list[Row]:
    prov: list[Provisioned] = got["provision"]
    start = [s for s in got["start"] if not s.get("error")]
    kstart = [s for s in got["kstart"] if not s.get("error")]
    ff = [s for s in got["ff"] if not s.get("error") and s.get("gone") is not None]
    kff = [s for s in got["kff"] if not s.get("error") and s.get("gone") is not None]
    bad_ff, bad_kff = len(got["ff"]) - len(ff), len(got["kff"]) - len(kff)
    not_ended = [s for s in got["ff"] if s.get("ended") is False]
    missing = sum(1 for s in start if s.get("status_without_start"))

    def col(samples: list[dict[str, Any]], key: str) -> list[float]:
        return [s[key] for s in samples if s.get(key) is not None]

    by_rep = {k["rep"]: k for k in kstart}
    pairs = [(o, by_rep[o["rep"]]) for o in start if o["rep"] in by_rep]  # same repetition, same pods
    ratio_start = [o["last_start"] / k["last_start"] for o, k in pairs]
    ratio_call = [o["returned"] / k["returned"] for o, k in pairs]
    ff_gone = col(ff, "gone")
    ratio_met = bool(ratio_start) and statistics.median(ratio_start) <= 1.0
    extra_first: dict[str, Any] = {"cluster": info} if info else {}
    if failures:
        extra_first["failures"] = failures
    rows = [
        Row(
            "6 provision: call -> all pods running",
            n,
            [p.running for p in prov],
            extra={**extra_first, "created": [p.created for p in prov]},
        ),
        Row("6 provision: call -> ready (+homes, record)", n, [p.total for p in prov]),
        Row(
            "6 start: launch() call",
            n,
            col(start, "returned"),
            note=_invalid(got["start"], len(got["start"]) - len(start)),
            extra={"samples": got["start"]},
        ),
        Row("6 start: launch -> last rank's sleep (/proc)", n, col(start, "last_start")),
        Row("6 start spread first->last (/proc)", n, col(start, "spread")),
        Row(
            "6 start spread first->last (status)",
            n,
            col(start, "status_spread"),
            note="status clock: whole seconds"
            + (f"; {missing} of {len(start)} polls had ranks without a start" if missing else ""),
        ),
        Row(
            "6 kubectl exec fan-out: all returned",
            n,
            col(kstart, "returned"),
            note=_invalid(got["kstart"], len(got["kstart"]) - len(kstart)),
            extra={"samples": got["kstart"]},
        ),
        Row("6 kubectl exec fan-out -> last sleep (/proc)", n, col(kstart, "last_start")),
        Row("6 kubectl spread first->last (/proc)", n, col(kstart, "spread")),
        Row(
            "6 ratio start ours/kubectl (-> last sleep)", n, ratio_start, "x", "<= 1x (no slower)", ratio_met
        ),
        Row("6 ratio start ours/kubectl (call durations)", n, ratio_call, "x"),
        Row(
            "6 fail-fast: exit -> last sibling gone (/proc)",
            n,
            ff_gone,
            "s",
            "< 1 s median",
            bool(ff_gone) and statistics.median(ff_gone) < 1.0,
            _invalid(got["ff"], bad_ff),
            text=None if ff_gone or not not_ended else f"not ended ({WATCH_LIMIT:g} s cap)",
            extra={"samples": got["ff"]},
        ),
        Row("6 ..exit -> cancel sent", n, col(ff, "cancel_sent")),
        Row("6 ..cancel sent -> last gone", n, col(ff, "sent_to_gone")),
        Row(
            "6 fail-fast from the status end times",
            n,
            col(ff, "status_gone"),
            note="status clock: whole seconds",
        ),
        Row(
            "6 kubectl fail-fast: exit -> last sibling gone",
            n,
            col(kff, "gone"),
            note=_invalid(got["kff"], bad_kff),
            extra={"samples": got["kff"]},
        ),
        Row("6 ..exit -> failing kubectl exec returned", n, col(kff, "detected")),
        Row("6 ..kill fan-out sent -> last gone", n, col(kff, "sent_to_gone")),
        Row("6 stop N sleeps: GangClient.cancel -> gone", n, col(start, "cancel_gone")),
        Row("6 stop N sleeps: kubectl kill fan-out -> gone", n, col(kstart, "kill_gone")),
        Row(
            "6 teardown: terminate -> pods gone",
            n,
            [t for t, _ in got["teardown"]],
            extra={"unclean": [u for _, u in got["teardown"]]},
        ),
    ]
    return rows


# ---------------------------------------------------------------------------------- the node agents

#: the image of the agent figures: busybox + this machine's python3 (k8s-local.sh ``images``)
PYTHON_IMAGE = "docker.io/library/busybox-python:local"
#: steady state: how long a running gang is watched while the client's calls are counted
STEADY = 10.0


def _steady_calls(client: Any, n: int, log: Log) -> dict[str, Any]:
    """Control-plane calls per second while ``watch.watch`` (poll 0.5 s) watches a running gang whose
    every rank prints a line a second (a training loop's progress), counted on the client: calls to the
    head agent and per-node (exec) calls; and the log bytes the watcher got."""
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.loop import watch

    job = _job("steady", n)
    run = 'i=0; while :; do i=$((i+1)); echo "rank $SKYPILOT_NODE_RANK step $i"; sleep 1; done'
    spec = task_from_args(num_nodes=n, run=run)
    try:
        client.launch(spec, job)
        counts: dict[str, float] = {}

        async def go() -> None:
            polls = 0
            a0 = n0 = t0 = None
            got = 0
            async for poll in watch(client, job, poll_interval=POLL, grace=GRACE):
                polls += 1
                if t0 is not None:
                    got += sum(len(data) for _, data in poll.chunks.values())
                if polls == 3:  # past the first polls (the logs' first lines)
                    a0, n0, t0 = client.agent_calls, client.node_calls, time.monotonic()
                elif t0 is not None and time.monotonic() - t0 >= STEADY:
                    dt = time.monotonic() - t0
                    counts.update(
                        agent=(client.agent_calls - a0) / dt,
                        node=(client.node_calls - (n0 or 0)) / dt,
                        polls=polls,
                        log_bytes_per_s=got / dt,
                    )
                    return

        asyncio.run(asyncio.wait_for(go(), STEADY + 60))
        client.cancel(job, grace=1.0)
        log(
            f"  fig6-agent N={n} steady state: {counts['agent']:.2f} head-agent calls/s, "
            f"{counts['node']:.2f} per-node calls/s, {counts['log_bytes_per_s']:.0f} log bytes/s read"
        )
        return {
            "agent_per_s": counts["agent"],
            "node_per_s": counts["node"],
            "total_per_s": counts["agent"] + counts["node"],
            "log_bytes_per_s": counts["log_bytes_per_s"],
        }
    finally:
        _cleanup(job, log)


def _after_start(n: int) -> int:
    """When the failing rank fails in the "every rank running" sample: well after the whole gang started
    on this 2-core machine (128 pods: ~5-20 s under load), so the figure is the cross-pod cancel alone."""
    return max(FAIL_AFTER, 5 + n // 4)


def run_agent(plan: Any, log: Log, ns: tuple[int, ...] = ()) -> list[Row]:
    """Figure 6 on the agent path: pods of an image with python3 run the node agent (the pod's own
    process); the gang's start, status and cancel are calls to the head agent. Per N (default 4, 32,
    128): the gang start vs the ``kubectl exec`` fan-out, fail-fast (exit -> last sibling gone, /proc),
    and calls per second at steady state, counted on the client."""
    from airflow_provider_sky.backends.kubernetes import agents
    from airflow_provider_sky.backends.registry import by_kind
    from airflow_provider_sky.watch.jobs import GangClient

    sizes = ns or (4, 32, 128)
    reps = 1 if plan.quick else 2
    rows: list[Row] = []
    info: dict[str, Any] = {}
    try:
        with test_cluster(log) as cl:
            # the python image on every node, and pod routes across the nodes (k8s-local.sh images)
            proc = _k8s_module()._script("images", timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"k8s-local.sh images: {(proc.stdout + proc.stderr)[-500:]}")
            info.update(cl.info, namespace=cl.namespace, sizes=list(sizes), image=PYTHON_IMAGE)
            backend = by_kind("kubernetes").make(
                {
                    "kube_config_path": cl.kubeconfig,
                    "context": CONTEXT,
                    "namespace": cl.namespace,
                    "image": PYTHON_IMAGE,
                    "image_pull_policy": "Never",
                    "provision_timeout": 600,
                }
            )
            try:
                for n in sizes:
                    got: dict[str, list[Any]] = {
                        k: [] for k in ("prov", "start", "kstart", "ff", "ffr", "ffq", "steady")
                    }
                    for i in range(reps):
                        name = f"bench-agt{n}-{i}"
                        p = provision(backend, name, n)
                        got["prov"].append(p.total)
                        has = agents.endpoint(p.handle.extra) is not None
                        log(f"  fig6-agent N={n} #{i + 1}: provisioned in {p.total:.1f}s, agents: {has}")
                        client = GangClient(backend, p.handle)
                        pods = [node.extra["pod"] for node in p.handle.nodes]
                        try:
                            if not has:
                                raise RuntimeError("the cluster has no agents (see the log)")
                            for key, fn, args in (
                                ("start", ours_start, (client, n, log)),
                                ("kstart", kubectl_start, (cl, pods, n, log)),
                                ("ff", ours_failfast, (client, n, log)),
                                ("ffr", ours_failfast, (client, n, log, _after_start(n))),
                                ("ffq", ours_failfast, (client, n, log, _after_start(n), False)),
                                ("steady", _steady_calls, (client, n, log)),
                            ):
                                try:
                                    got[key].append({**fn(*args), "rep": i})
                                except Exception as exc:
                                    got[key].append({"rep": i, "error": f"{type(exc).__name__}: {exc}"})
                                    log(f"  fig6-agent N={n} #{i + 1} {key} FAILED: {exc}")
                        finally:
                            client.close()
                            td, unclean = teardown(backend, name)
                            if unclean:
                                wait_pods_gone(cl, name)
                    rows += _agent_rows(n, got, info if n == sizes[0] else {})
            finally:
                backend.close()
    finally:
        info["exec_threads_at_end"] = unstick_exec_threads(log)
    return rows


def _agent_rows(n: int, got: dict[str, list[Any]], info: dict[str, Any]) -> list[Row]:
    def col(key: str, field: str) -> list[float]:
        return [s[field] for s in got[key] if not s.get("error") and s.get(field) is not None]

    by_rep = {k["rep"]: k for k in got["kstart"] if not k.get("error")}
    ratio = [
        o["last_start"] / by_rep[o["rep"]]["last_start"]
        for o in got["start"]
        if not o.get("error") and o["rep"] in by_rep
    ]
    gone = col("ff", "gone")
    gone_running = col("ffr", "gone")
    gone_alone = col("ffq", "gone")
    calls = col("steady", "total_per_s")
    return [
        Row(
            "6a provision (python image, agents joined)",
            n,
            got["prov"],
            extra={"cluster": info} if info else {},
        ),
        Row(
            "6a start: launch -> last rank's sleep (/proc)",
            n,
            col("start", "last_start"),
            extra={"samples": got["start"]},
        ),
        Row(
            "6a kubectl exec fan-out -> last sleep (/proc)",
            n,
            col("kstart", "last_start"),
            extra={"samples": got["kstart"]},
        ),
        Row(
            "6a ratio start agent/kubectl (-> last sleep)",
            n,
            ratio,
            "x",
            "<= 0.5x",
            bool(ratio) and statistics.median(ratio) <= 0.5,
        ),
        Row(
            "6a fail-fast: exit -> last sibling gone (/proc)",
            n,
            gone,
            "s",
            "< 0.5 s" if n >= 128 else "",
            (bool(gone) and statistics.median(gone) < 0.5) if n >= 128 else None,
            extra={"samples": got["ff"]},
        ),
        Row(
            "6a fail-fast, every rank running: exit -> last sibling gone (/proc)",
            n,
            gone_running,
            "s",
            "< 0.5 s" if n >= 128 else "",
            (bool(gone_running) and statistics.median(gone_running) < 0.5) if n >= 128 else None,
            note=f"rank N-1 fails {_after_start(n)} s after its start",
            extra={"samples": got["ffr"]},
        ),
        Row(
            "6a fail-fast, every rank running, nothing polling (Airflow away): exit -> last sibling gone",
            n,
            gone_alone,
            "s",
            "< 1 s",
            bool(gone_alone) and statistics.median(gone_alone) < 1.0,
            note="no status call until the siblings are gone: the head's agent alone stops them",
            extra={"samples": got["ffq"]},
        ),
        Row("6a stop N sleeps: cancel (one call) -> gone", n, col("start", "cancel_gone")),
        Row(
            "6a calls per gang per second, steady state (client)",
            n,
            calls,
            "/s",
            "independent of N",
            note="every rank printing a line a second",
            extra={"samples": got["steady"]},
        ),
    ]
