"""A real Kubernetes cluster for the tests: the local one ``tests/k8s/k8s-local.sh`` runs, or yours.

Session fixture ``k8s`` (a pytest plugin, loaded by ``tests/conftest.py``), started only when a collected test
asks for it:

- ``SKY_TEST_KUBECONFIG`` set: the suite uses that kubeconfig (context ``SKY_TEST_KUBE_CONTEXT``, else its
  current context) and starts or stops nothing (when it is the local cluster's admin kubeconfig, the session
  holds a share of that cluster so another session's end does not stop it). ``KUBECONFIG`` alone is
  deliberately ignored: the suite creates pods and patches a fake GPU onto a node, so it runs on a cluster
  only when you name it for that.
- otherwise the local cluster in ``SKY_TEST_K8S_DIR`` (default ``/var/cache/k8s-local``, built by ``make k8s``):
  started (``start`` + ``addnode 2``, about 45 s) unless it is already up, and stopped when the last pytest
  session using it ends (a shared lock counts the sessions), on failure and Ctrl-C too. Needs root.

Every session gets a fresh namespace ``sky-test-<random>``, deleted at its end. Test modules that use
``k8s`` run at the end of the session, so the local cluster (about 8 % of a core when idle) is up only
for them.

Helpers: :func:`busybox_pod` (a pod spec), :func:`wait_for`, :func:`wait_running`, :func:`exec_script` (a
script on stdin behind a length prefix, see ``tests/k8s/NOTES.md``; a missing exit status is an error,
never success).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api, V1Pod

#: the busybox image k8s-local.sh builds from Debian's busybox-static and imports on every node
#: (no registry is reachable: pods use imagePullPolicy Never)
BUSYBOX_IMAGE = "docker.io/library/busybox:local"
#: the image used on your own cluster (``SKY_TEST_KUBECONFIG``); pulled if not present
USER_CLUSTER_IMAGE = os.environ.get("SKY_TEST_K8S_IMAGE", "docker.io/library/busybox:1.36")
#: busybox plus this machine's own python3 (k8s-local.sh ``images`` builds and imports it): pods that
#: run the node agent
PYTHON_IMAGE = "docker.io/library/busybox-python:local"
#: and on your own cluster
USER_PYTHON_IMAGE = os.environ.get("SKY_TEST_K8S_PYTHON_IMAGE", "docker.io/library/python:3.12-slim")

SCRIPT = Path(__file__).resolve().parents[1] / "k8s" / "k8s-local.sh"
LOCAL_DIR = Path(os.environ.get("SKY_TEST_K8S_DIR", "/var/cache/k8s-local"))
LOCAL_NODES = ("localhost", "127.0.0.2")  # k8s-local.sh's first node and `addnode 2`
FIX = "run `make k8s` as root (installs the Debian packages and builds the cluster into {dir}, ~6.5 min once)"

T = TypeVar("T")


@dataclass
class Image:
    """An image the test pods run, and the pull policy that goes with it."""

    name: str
    pull_policy: str


@dataclass
class K8sCluster:
    """What a test needs to reach the cluster. :meth:`api` gives a client of its own every call."""

    kubeconfig: str
    context: str | None
    namespace: str
    nodes: list[str]  # Ready, schedulable nodes
    local: bool  # the k8s-local.sh cluster (else the user's, from SKY_TEST_KUBECONFIG)
    server_version: tuple[int, int] = (0, 0)
    hostnames: dict[str, str] = field(default_factory=dict)  # node name -> kubernetes.io/hostname label

    def api(self) -> CoreV1Api:
        """A fresh ``CoreV1Api`` on an isolated ``ApiClient`` (never the global default configuration);
        ``stream()`` rewires the client it is given, so use a new one for every exec."""
        from kubernetes import client, config

        api_client = config.new_client_from_config(
            config_file=self.kubeconfig, context=self.context, persist_config=False
        )
        return client.CoreV1Api(api_client)


# ---------------------------------------------------------------------------------------------- local cluster
def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run k8s-local.sh in its own session (a Ctrl-C in the terminal does not cut a start or stop short)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKY_", "AIRFLOW", "KUBECONFIG"))}
    env["L"] = str(LOCAL_DIR)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd="/",
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout + proc.stderr).strip()


class LocalCluster:
    """The k8s-local.sh cluster, shared by the pytest sessions of this machine.

    Two lock files in the cluster directory: ``pytest-start.lock`` (exclusive, held while a session starts
    or stops the cluster) and ``pytest-users.lock`` (shared, held by every session using it). A session
    leaving takes the start lock, drops its shared lock and stops the cluster only if it then gets the users
    lock exclusively, i.e. no other session still uses it. A crashed session's locks go with its process.
    ``manage=False`` (``SKY_TEST_KUBECONFIG`` naming this cluster's admin kubeconfig): hold a share, so that
    no other session stops the cluster under us, but never start or stop it.
    """

    def __init__(self, directory: Path = LOCAL_DIR, manage: bool = True) -> None:
        self.dir = directory
        self.manage = manage
        self.kubeconfig = str(directory / "pki" / "admin.kubeconfig")
        self._users: IO[bytes] | None = None
        self._old_sigterm: Any = None

    # locks
    def _lock(self, name: str) -> IO[bytes]:
        return open(self.dir / name, "ab")

    @staticmethod
    def _flock(f: IO[bytes], how: int, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, how | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: another pytest session holds {f.name}") from None
                time.sleep(0.5)

    def _only_user(self) -> bool:
        """True when no other session holds the users lock (takes it exclusively; we must hold none)."""
        probe = self._lock("pytest-users.lock")
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            probe.close()

    def check(self) -> None:
        """Fail (never skip) with what to do when this machine cannot run the local cluster."""
        if os.geteuid() != 0:
            pytest.fail(
                "the local Kubernetes cluster needs root (it runs containerd and kubelets): run the tests as "
                "root (`sudo make test`), or point SKY_TEST_KUBECONFIG at a cluster (docs/development.md: "
                "Kubernetes test cluster)",
                pytrace=False,
            )
        proc = _script("check", timeout=60)
        if proc.returncode != 0:
            pytest.fail(
                f"the local Kubernetes cluster is not installed: {_output(proc)}\n{FIX.format(dir=self.dir)}",
                pytrace=False,
            )

    def acquire(self) -> None:
        """Start the cluster unless it is up (two Ready nodes), then hold a share of it."""
        if self.manage:
            self.check()
        # `kill <pytest>` (SIGTERM), even while starting: tear down as Ctrl-C does, instead of dying at once
        if self.manage and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        start_lock = self._lock("pytest-start.lock")
        try:
            self._flock(start_lock, fcntl.LOCK_EX, 900, "starting the local Kubernetes cluster")
            status = _script("status", timeout=120) if self.manage else None
            up = status is None or (
                status.returncode == 0
                and all(re.search(rf"^{re.escape(n)}\s+Ready\s", status.stdout, re.M) for n in LOCAL_NODES)
            )
            if not up:
                assert status is not None
                if not self._only_user():
                    raise RuntimeError(
                        "the local Kubernetes cluster is unhealthy while another pytest session uses it "
                        f"(not restarting it under that session):\n{_output(status)}"
                    )
                self._start()
            self._users = self._lock("pytest-users.lock")
            fcntl.flock(self._users, fcntl.LOCK_SH)
        finally:
            start_lock.close()
        atexit.register(self.release)  # backstop: also when pytest exits without running session teardown

    def _start(self) -> None:
        try:
            for args in (("start",), ("addnode", "2")):
                proc = _script(*args)
                if proc.returncode != 0:
                    raise RuntimeError(f"k8s-local.sh {' '.join(args)} failed:\n{_output(proc)}")
        except BaseException:  # a failed or interrupted start leaves nothing running
            _script("stop", timeout=300)
            raise

    def release(self) -> None:
        """Give back our share; the last session out stops the cluster. Idempotent."""
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if self._users is None:
            return
        start_lock = self._lock("pytest-start.lock")
        try:
            self._flock(start_lock, fcntl.LOCK_EX, 900, "stopping the local Kubernetes cluster")
            self._users.close()  # drops our shared lock
            self._users = None
            if self.manage and self._only_user():
                for _ in range(2):  # a second Ctrl-C while stopping: keep stopping
                    try:
                        proc = _script("stop", timeout=300)
                        if proc.returncode != 0:
                            raise RuntimeError(f"k8s-local.sh stop failed:\n{_output(proc)}")
                        break
                    except KeyboardInterrupt:
                        continue
        finally:
            start_lock.close()


def _sigterm_to_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------------------------------------------- fixtures
def _cluster_info(kubeconfig: str, context: str | None, local: bool) -> K8sCluster:
    from kubernetes import client

    probe = K8sCluster(kubeconfig=kubeconfig, context=context, namespace="", nodes=[], local=local)
    api = probe.api()
    try:
        for node in api.list_node().items:
            ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
            if ready and not node.spec.unschedulable:
                probe.nodes.append(node.metadata.name)
                labels = node.metadata.labels or {}
                probe.hostnames[node.metadata.name] = labels.get("kubernetes.io/hostname", node.metadata.name)
        info = client.VersionApi(api.api_client).get_code()
        minor = "".join(ch for ch in info.minor if ch.isdigit())
        probe.server_version = (int(info.major), int(minor or 0))
    finally:
        api.api_client.close()
    probe.nodes.sort()
    return probe


@pytest.fixture(scope="session")
def k8s(request: pytest.FixtureRequest) -> Iterator[K8sCluster]:
    """The cluster (yours with ``SKY_TEST_KUBECONFIG``, else the local one) and a fresh namespace."""
    from kubernetes import config

    user_kubeconfig = os.environ.get("SKY_TEST_KUBECONFIG")
    if user_kubeconfig:
        context = os.environ.get("SKY_TEST_KUBE_CONTEXT") or None
        if context is None:
            context = config.list_kube_config_contexts(config_file=user_kubeconfig)[1]["name"]
        if Path(user_kubeconfig).resolve() == (LOCAL_DIR / "pki" / "admin.kubeconfig").resolve():
            share = LocalCluster(
                manage=False
            )  # the local cluster, started by you: keep others from stopping it
            request.addfinalizer(share.release)
            share.acquire()
        cluster = _cluster_info(user_kubeconfig, context, local=False)
    else:
        local = LocalCluster()
        request.addfinalizer(local.release)  # registered first: runs after the namespace is deleted
        local.acquire()
        cluster = _cluster_info(local.kubeconfig, "local", local=True)
        assert sorted(LOCAL_NODES) == cluster.nodes, f"local cluster nodes: {cluster.nodes}"
    cluster.namespace = _create_namespace(cluster)
    request.addfinalizer(lambda: _delete_namespace(cluster))
    yield cluster


def _create_namespace(cluster: K8sCluster) -> str:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    name = f"sky-test-{secrets.token_hex(4)}"
    api = cluster.api()
    try:
        api.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"sky-test": "1"}))
        )

        # pods are refused until the service-account controller has made the namespace's "default" account
        def has_default_sa() -> bool:
            try:
                api.read_namespaced_service_account("default", name)
                return True
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return False

        wait_for(has_default_sa, 60, f"service account default in namespace {name}")
    finally:
        api.api_client.close()
    return name


def _delete_namespace(cluster: K8sCluster) -> None:
    from kubernetes.client.rest import ApiException

    api = cluster.api()
    try:
        api.delete_namespace(cluster.namespace, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:
            raise
    finally:
        api.api_client.close()


def connection_extras(k8s: K8sCluster, image: Image) -> dict[str, Any]:
    """A ``sky_kubernetes`` connection's extras for the test cluster."""
    return {
        "kube_config_path": k8s.kubeconfig,
        "context": k8s.context,
        "namespace": k8s.namespace,
        "image": image.name,
        "image_pull_policy": image.pull_policy,
        "provision_timeout": 120,
    }


@pytest.fixture(scope="session")
def k8s_image(k8s: K8sCluster) -> Image:
    """The busybox image, present on every node: the local cluster's own (``k8s-local.sh images`` builds
    and imports it; checked in the nodes' image lists; also when ``SKY_TEST_KUBECONFIG`` is the local
    cluster's admin kubeconfig), or ``SKY_TEST_K8S_IMAGE`` on your cluster."""
    local_kubeconfig = Path(k8s.kubeconfig).resolve() == (LOCAL_DIR / "pki" / "admin.kubeconfig").resolve()
    if not k8s.local and not (local_kubeconfig and "SKY_TEST_K8S_IMAGE" not in os.environ):
        return Image(USER_CLUSTER_IMAGE, "IfNotPresent")
    proc = _script("images", timeout=300)  # builds the tarballs if missing; nothing to do when present
    assert proc.returncode == 0, _output(proc)
    return _on_every_node(k8s, BUSYBOX_IMAGE, 30)


def _on_every_node(k8s: K8sCluster, image: str, timeout: float) -> Image:
    """``image`` once every node of the local cluster lists it (``k8s-local.sh images`` imports it)."""

    def missing() -> list[str]:
        api = k8s.api()
        try:
            return [
                n.metadata.name
                for n in api.list_node().items
                if n.metadata.name in k8s.nodes
                and not any(image in (i.names or []) for i in n.status.images or [])
            ]
        finally:
            api.api_client.close()

    try:
        wait_for(lambda: not missing(), timeout, f"{image} listed on every node")
    except TimeoutError:
        pytest.fail(f"{image} is missing on nodes {missing()} (k8s-local.sh images imports it)")
    return Image(image, "Never")


@pytest.fixture(scope="session")
def k8s_python_image(k8s: K8sCluster, k8s_image: Image) -> Image:
    """An image with python3 (the node agent runs in its pods): the local cluster's busybox-python,
    built from this machine's python3 and imported on every node by ``k8s-local.sh images`` (nothing
    is downloaded), or ``SKY_TEST_K8S_PYTHON_IMAGE`` on your cluster."""
    if k8s_image.name != BUSYBOX_IMAGE:
        return Image(USER_PYTHON_IMAGE, "IfNotPresent")
    return _on_every_node(k8s, PYTHON_IMAGE, 60)


@pytest.fixture
def k8s_pods(k8s: K8sCluster) -> Iterator[list[str]]:
    """Names of the pods a test creates (append them): deleted after the test, whatever happened."""
    from kubernetes.client.rest import ApiException

    names: list[str] = []
    yield names
    api = k8s.api()
    try:
        for name in names:
            try:
                api.delete_namespaced_pod(name, k8s.namespace, grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise
    finally:
        api.api_client.close()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Run the test modules that use the cluster last, in their order: the local cluster is then up only
    for them (started by the first, stopped at the session's end). The tests that use it are marked
    ``k8s`` (``make integration`` runs them apart from the rest, one at a time: a 64-pod gang's execs need
    the machine's cores); the other tests of such a module (its SSH or local cases) are not, so they run
    with the rest, on the xdist workers.

    Among them, the tests that hold the cluster's CPUs (:func:`cluster_cpus`, fixture ``held_cpus``)
    run first: ``make test``'s e2e lane takes the CPUs for its Kubernetes stack some minutes in, and
    while the two met in the middle each lane waited for the other (1.5-2.5 min)."""
    uses = {item.path for item in items if "k8s" in getattr(item, "fixturenames", ())}
    for item in items:
        if "k8s" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)
    if uses:
        cluster = [i for i in items if i.path in uses]
        cluster.sort(key=lambda i: "held_cpus" not in getattr(i, "fixturenames", ()))  # stable
        items[:] = [i for i in items if i.path not in uses] + cluster


# ----------------------------------------------------------------------------------------------------- helpers
#: the file lock of the test cluster's CPUs (:func:`cluster_cpus`), shared by every pytest process here
CPUS_LOCK = Path(tempfile.gettempdir()) / "sky-test-k8s-cpus.lock"


@contextlib.contextmanager
def cluster_cpus() -> Iterator[None]:
    """Hold the test cluster's CPUs while gangs that request them run: one holder at a time, across
    processes. The local cluster's two nodes are this machine's 2 cores each (4 CPUs), and examples ask
    for a CPU per node (``cpus: 1+``: ``sky_yaml`` 2, ``sky_pipeline`` 3, ``sky_taskflow`` 4). ``make
    test`` runs the ``k8s`` integration tests beside the e2e tier: two such runs at once left a pod
    unschedulable ("0/2 nodes are available: 2 Insufficient cpu"), which fails its provisioning."""
    with open(CPUS_LOCK, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def wait_for(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll ``pred`` until it returns something truthy (returned); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = pred()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def busybox_pod(
    name: str,
    image: Image,
    command: list[str] | None = None,
    labels: dict[str, str] | None = None,
    anti_affinity: str | None = None,
    gpus: int = 0,
    node_names: list[str] | None = None,
) -> V1Pod:
    """A pod running ``command`` (default: sleep an hour). ``anti_affinity``: soft (weight 100) anti-affinity
    on ``kubernetes.io/hostname`` to pods labelled ``app=<value>``; ``node_names``: only on those hostnames."""
    from kubernetes import client

    affinity = None
    if anti_affinity or node_names:
        affinity = client.V1Affinity()
    if anti_affinity:
        assert affinity is not None
        affinity.pod_anti_affinity = client.V1PodAntiAffinity(
            preferred_during_scheduling_ignored_during_execution=[
                client.V1WeightedPodAffinityTerm(
                    weight=100,
                    pod_affinity_term=client.V1PodAffinityTerm(
                        topology_key="kubernetes.io/hostname",
                        label_selector=client.V1LabelSelector(match_labels={"app": anti_affinity}),
                    ),
                )
            ]
        )
    if node_names:
        assert affinity is not None
        affinity.node_affinity = client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                node_selector_terms=[
                    client.V1NodeSelectorTerm(
                        match_expressions=[
                            client.V1NodeSelectorRequirement(
                                key="kubernetes.io/hostname", operator="In", values=node_names
                            )
                        ]
                    )
                ]
            )
        )
    resources = client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)} if gpus else None)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels or {}),
        spec=client.V1PodSpec(
            affinity=affinity,
            restart_policy="Never",
            termination_grace_period_seconds=1,
            automount_service_account_token=False,
            containers=[
                client.V1Container(
                    name="main",
                    image=image.name,
                    image_pull_policy=image.pull_policy,
                    command=command or ["sleep", "3600"],
                    resources=resources,
                )
            ],
        ),
    )


def describe_pod(api: CoreV1Api, namespace: str, name: str) -> str:
    """Phase, conditions, container states and events of a pod: what a timeout message should show."""
    pod = api.read_namespaced_pod(name, namespace)
    lines = [f"pod {name}: phase {pod.status.phase} node {pod.spec.node_name}"]
    for c in pod.status.conditions or []:
        lines.append(f"  condition {c.type}={c.status} {c.reason or ''} {c.message or ''}".rstrip())
    for s in pod.status.container_statuses or []:
        lines.append(f"  container {s.name}: {s.state}")
    events = api.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    for e in events:
        lines.append(f"  event {e.type} {e.reason}: {e.message}")
    return "\n".join(lines)


def wait_running(api: CoreV1Api, namespace: str, name: str, timeout: float = 120) -> V1Pod:
    """The pod once Running; on Failed/Succeeded or timeout an AssertionError describing it."""

    def phase() -> Any:
        pod = api.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase in ("Running", "Failed", "Succeeded") else None

    try:
        pod = wait_for(phase, timeout, f"pod {name} Running")
    except TimeoutError:
        raise AssertionError(f"not Running after {timeout} s\n{describe_pod(api, namespace, name)}") from None
    assert pod.status.phase == "Running", describe_pod(api, namespace, name)
    return pod


class ExecError(RuntimeError):
    """The exec ended without an exit status: a transport error or a timeout, never a success."""


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    returncode: int


def exit_status(error_channel: str) -> int | None:
    """The exit code in an exec's error-channel status (``None`` when there is none: empty or unreadable).

    The kubernetes client's own ``WSClient.returncode`` raises TypeError on an empty channel
    (kubernetes-client/python#2156) and is ``None`` while the stream is open.
    """
    import yaml

    try:
        status = yaml.safe_load(error_channel) if error_channel.strip() else None
    except yaml.YAMLError:
        return None
    if not isinstance(status, dict):
        return None
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            with contextlib.suppress(TypeError, ValueError):
                return int(cause.get("message"))
    return None


def exec_script(
    k8s: K8sCluster,
    pod: str,
    script: str,
    args: tuple[str, ...] = (),
    timeout: float = 30,
    length_prefix: bool = True,
) -> ExecResult:
    """Run ``script`` in the pod's first container, sent on stdin (never in the argv, which travels in the
    request URL). ``length_prefix`` (the default): ``sh -c 'head -c <N> | sh -s -- ARGS'``, which ends on
    every API server version; without it, plain ``sh -s``, whose stdin never reaches EOF before 1.30
    (NOTES.md). Raises :class:`ExecError` when no exit status arrives within ``timeout``."""
    from kubernetes.stream import stream
    from kubernetes.stream.ws_client import ERROR_CHANNEL, STDERR_CHANNEL, STDOUT_CHANNEL

    data = script.encode()
    quoted = " ".join(shlex.quote(a) for a in args)
    if length_prefix:
        command = ["sh", "-c", f"head -c {len(data)} | sh -s -- {quoted}".rstrip()]
    else:
        command = ["sh", "-s", "--", *args]
    api = k8s.api()  # a fresh ApiClient: stream() swaps call_api on the client it is given
    out: list[str] = []
    err: list[str] = []
    status: list[str] = []
    try:
        ws = stream(
            api.connect_get_namespaced_pod_exec,
            pod,
            k8s.namespace,
            command=command,
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            _preload_content=False,
        )
        try:
            ws.write_stdin(data)
            deadline = time.monotonic() + timeout
            while ws.is_open() and time.monotonic() < deadline:
                ws.update(timeout=1)
                out.append(ws.read_channel(STDOUT_CHANNEL))
                err.append(ws.read_channel(STDERR_CHANNEL))
                status.append(ws.read_channel(ERROR_CHANNEL))
            still_open = ws.is_open()
            out.append(ws.read_channel(STDOUT_CHANNEL))
            err.append(ws.read_channel(STDERR_CHANNEL))
            status.append(ws.read_channel(ERROR_CHANNEL))
        finally:
            ws.close()
    finally:
        api.api_client.close()
    code = None if still_open else exit_status("".join(status))
    if code is None:
        why = f"still running after {timeout} s" if still_open else "closed without an exit status"
        raise ExecError(f"exec {command!r} in {pod}: {why}; stdout so far {''.join(out)!r}")
    return ExecResult("".join(out), "".join(err), code)
