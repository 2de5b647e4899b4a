"""Gangs on Kubernetes: one pod per node, commands through the exec API, teardown by label and name.

Provisioning is all or nothing: every pod is created, then waited for until it runs (a pod that cannot
start fails with its own reason: the scheduler's message, the image error); on any failure every pod
created is deleted. The cluster record (rank order, leases) lives on the head pod (``headrecord``), so a
cluster shared by two runs is kept until the last lease is released; then its pods are deleted, which
ends every process the job started (a container's processes die with it).

Only pods of ours are ever deleted: with the cluster's label, its full name in the annotation and our
role label. A user's pod with our label, a pod that has the name ours would have, and the pods of another
cluster whose name maps to the same pods are left as they are; a name that clashes is an error naming
the pod.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from airflow_provider_sky.backends import nodeagents
from airflow_provider_sky.backends.base import (
    Backend,
    BackendError,
    ClusterBusy,
    ClusterHandle,
    Node,
    Provisioning,
    Teardown,
    check_reusable,
)
from airflow_provider_sky.backends.headrecord import HeadRecords, record_path
from airflow_provider_sky.backends.kubernetes import agents
from airflow_provider_sky.backends.kubernetes.config import KubeSettings, parse_kube_config
from airflow_provider_sky.backends.kubernetes.manifest import (
    CLUSTER_LABEL,
    CONTAINER,
    MAX_SERVICE_PORTS,
    ROLE_LABEL,
    cluster_selector,
    dns_name,
    head_name,
    owned_problems,
    pod_manifest,
    port_numbers,
    service_manifest,
)
from airflow_provider_sky.backends.kubernetes.pods import ROLES, UNSCHEDULABLE_GRACE, PodState, pod_state
from airflow_provider_sky.errors import CommandTimeout
from airflow_provider_sky.model.gang import rank_order
from airflow_provider_sky.node.accelerators import close_names, known_name
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.kubernetes import KubernetesRunner
from airflow_provider_sky.spec import BackendCapabilities, Resources, TaskSpec
from airflow_provider_sky.spec.common import K8S_LABEL_KEY

log = logging.getLogger(__name__)

_HOME_SCRIPT = 'printf "%s\\n" "${HOME:-/root}"'
#: exec calls of one pod's provisioning probe at most: its script can run twice (it writes files whole
#: and wakes the agent only while pid 1 still idles), so an exec stream the API server drops mid-call
#: (``socket is already closed``, seen on a loaded test cluster) is asked again
PROBE_TRIES = 3
#: how long a teardown waits for deleted pods to be gone
DELETE_WAIT = 60.0
#: and this much longer per pod: kubelets end a wide gang's containers a few per second (128 pods on the
#: 2-core test machine: 65 s were not enough, 44 still terminating)
DELETE_WAIT_PER_POD = 0.5
#: pod phases in which no container runs any more
_STOPPED = frozenset({"Failed", "Succeeded"})
#: (verb, resource, subresource): every call the backend makes in its namespace, and no more. Pods are
#: listed (by the cluster label), created, read (the worker a replacement is copied from, the owner of a
#: name that clashes) and deleted; commands are execs, a websocket upgrade of a GET, which the API server
#: authorizes as ``get`` and, on servers that check websocket upgrades as creates (1.35+), as ``create``.
#: The Role in docs/backends/kubernetes.md and the Test button's check are made from it (:func:`role_rules`).
NEEDED_PERMISSIONS = (
    ("create", "pods", None),
    ("get", "pods", None),
    ("list", "pods", None),
    ("delete", "pods", None),
    ("create", "pods", "exec"),
    ("get", "pods", "exec"),
)
#: what only some tasks need, granted by docs/kubernetes-rbac.yaml but not asked by the Test button:
#: the head pod's Service for ``resources.ports`` (a refusal then names the rule)
OPTIONAL_PERMISSIONS = (("create", "services", None),)
#: how long provisioning waits for every pod's agent to join the head's (else: the per-node path)
AGENT_JOIN_WAIT = nodeagents.AGENT_JOIN_WAIT
#: and how long for the head's agent to answer this control plane at all (pod IPs may be unreachable
#: from outside the cluster: then the per-node path at once, not after AGENT_JOIN_WAIT)
AGENT_REACH_WAIT = nodeagents.AGENT_REACH_WAIT
#: a pod create answered 429 or 5xx is tried this often in all
CREATE_TRIES = 4
_POLL = 0.5
#: a Kubernetes label value (empty, or 1-63 characters)
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")


def role_rules() -> list[dict[str, Any]]:
    """The rules of the namespace Role the connection's identity needs: :data:`NEEDED_PERMISSIONS`."""
    verbs: dict[str, list[str]] = {}
    for verb, resource, sub in NEEDED_PERMISSIONS:
        verbs.setdefault(f"{resource}/{sub}" if sub else resource, []).append(verb)
    return [{"apiGroups": [""], "resources": [res], "verbs": v} for res, v in verbs.items()]


def api_configuration(settings: KubeSettings) -> Any:
    """A ``kubernetes.client.Configuration`` of this connection's own: the global default is never set
    (one triggerer serves many connections)."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise BackendError(
            "the kubernetes backend needs the kubernetes client: pip install 'airflow-provider-sky[kubernetes]'"
        ) from None
    cfg = client.Configuration()
    try:
        if settings.source == "in_cluster":
            config.load_incluster_config(client_configuration=cfg)
        elif settings.source == "content":
            config.load_kube_config_from_dict(
                dict(settings.kube_config or {}),
                context=settings.context,
                client_configuration=cfg,
                persist_config=False,
            )
        else:
            config.load_kube_config(
                config_file=settings.kube_config_path,
                context=settings.context,
                client_configuration=cfg,
                persist_config=False,
            )
    except (ConfigException, OSError, TypeError, ValueError) as exc:
        where = {
            "in_cluster": "in_cluster",
            "content": "kube_config",
            "path": f"kube_config_path {settings.kube_config_path!r}",
        }.get(settings.source, "the default kubeconfig ($KUBECONFIG or ~/.kube/config)")
        raise BackendError(f"{where}: cannot load the cluster credentials: {exc}") from None
    if not settings.verify_ssl:
        cfg.verify_ssl = False
    return cfg


def _api_error(exc: Exception) -> str:
    """An ApiException's own message (``pods is forbidden: User ... cannot create ...``)."""
    import json

    body = getattr(exc, "body", None)
    if body:
        try:
            return str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            return str(body)
    return str(getattr(exc, "reason", None) or exc)


class KubernetesBackend(Backend):
    """Pods in one namespace of a cluster the connection reaches."""

    kind = "kubernetes"
    #: the pod's entrypoint: when the cluster goes down idle it exits, the pod completes and its
    #: CPU, memory and GPUs go back (the completed pod is deleted by the next teardown or provision)
    idle_down_kill = 1
    #: each exec is a runc exec on the node (~0.1 s of its CPU): past a few in flight they only queue
    call_limit = 16

    def __init__(self, settings: KubeSettings) -> None:
        self.settings = settings
        self.namespace = settings.namespace
        self.capabilities = BackendCapabilities(
            name="kubernetes",
            max_nodes=1000,
            supported_resources=frozenset(
                {"cpus", "memory", "accelerators", "labels", "image_id", "cloud", "ports"}
            ),
            clouds=frozenset({"kubernetes", "k8s"}),
            supports_fuse_mounts=False,
            no_fuse_why="its pods are not privileged and have no /dev/fuse for a FUSE mount",
            supports_volumes=True,
        )
        self._cfg: Any = None
        self._rest: Any = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KubernetesBackend:
        return cls(parse_kube_config(config))

    # -- API clients ---------------------------------------------------------------------------------

    def new_client(self) -> Any:
        """A fresh ``ApiClient`` on this connection's configuration (one per exec stream)."""
        from kubernetes import client

        if self._cfg is None:
            self._cfg = api_configuration(self.settings)
        return client.ApiClient(self._cfg)

    @property
    def core(self) -> Any:
        """The ``CoreV1Api`` for REST calls (never handed to ``stream()``)."""
        if self._rest is None:
            from kubernetes import client

            self._rest = client.CoreV1Api(self.new_client())
        return self._rest

    def close(self) -> None:
        if self._rest is not None:
            self._rest.api_client.close()
            self._rest = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.rest import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise BackendError(f"{what} in namespace {self.namespace!r}: {_api_error(exc)}") from None
        except Exception as exc:  # unreachable API server, TLS
            raise BackendError(f"{what}: the API server did not answer ({exc})") from None

    # -- nodes -----------------------------------------------------------------------------------------

    def _pod_runner(self, pod: str, ip: str) -> KubernetesRunner:
        return KubernetesRunner(self.new_client, self.namespace, pod, CONTAINER, ip or pod)

    def runner(self, node: Node) -> KubernetesRunner:
        return self._pod_runner(node.extra["pod"], node.ip)

    def records(self, name: str, head: Node | None = None) -> HeadRecords:
        """The cluster's record, on its head pod."""
        pod = head_name(name)
        return HeadRecords(lambda: self._pod_runner(pod, pod), f"pod {self.namespace}/{pod}")

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        return [f"{handle.nodes[0].home}/{record_path(handle.name)}"] if rank == 0 else []

    def _pods(self, name: str) -> list[Any]:
        listed = self._call(
            "listing the cluster's pods",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=cluster_selector(name),
        )
        return list(listed.items)

    def _listed(self, name: str) -> tuple[list[PodState], list[PodState]]:
        """The pods with the cluster's label: (ours, the others). Ours carry the cluster's full name in
        their annotation and our role label; the label alone is not ownership (a user's pod may carry it,
        and two cluster names may map to one label). Nothing is ever done to the others."""
        ours: list[PodState] = []
        others: list[PodState] = []
        for pod in self._pods(name):
            state = pod_state(pod)
            (ours if state.ours(name) else others).append(state)
        return ours, others

    def _leave(self, name: str, others: list[PodState]) -> None:
        for p in others:
            log.warning(
                "pod %s/%s carries the label %s=%s of cluster %s, but %s: left as it is",
                self.namespace,
                p.name,
                CLUSTER_LABEL,
                dns_name(name),
                name,
                p.whose(),
            )

    def find(self, name: str) -> ClusterHandle | None:
        states, _ = self._listed(name)
        if not any(s.running and s.name == head_name(name) for s in states):
            return None
        try:
            record = self.records(name).load(name)
        except (BackendError, RunnerError):
            return None
        return ClusterHandle.from_dict(record) if record is not None else None

    # -- choosing ------------------------------------------------------------------------------------------

    def spec_problems(self, spec: TaskSpec) -> list[tuple[str, str]]:
        """Labels become pod labels: a value Kubernetes refuses is named here, not by the API server after
        'Provisioning cluster'."""
        problems: dict[str, str] = {}
        for res in spec.resource_choices:
            for key, value in res.labels.items():
                if not K8S_LABEL_KEY.fullmatch(key):
                    problems[f"resources.labels.{key}"] = (
                        "the kubernetes backend makes it a pod label, whose name is at most 63 letters, "
                        "digits, '.', '_' or '-', starting and ending with a letter or digit, optionally "
                        "after a 'domain/' prefix (e.g. team or example.com/team)"
                    )
                elif not _LABEL_VALUE.fullmatch(value):
                    problems[f"resources.labels.{key}"] = (
                        f"the kubernetes backend makes it a pod label, whose value is at most 63 letters, "
                        f"digits, '.', '_' or '-', starting and ending with a letter or digit; got {value!r}"
                    )
        problems.update(owned_problems(spec.pod_config))
        for res in spec.resource_choices:
            if len(port_numbers(res.ports)) > MAX_SERVICE_PORTS:
                problems["resources.ports"] = (
                    f"the kubernetes backend opens each port in the cluster's Service, at most "
                    f"{MAX_SERVICE_PORTS}; got {len(port_numbers(res.ports))}: narrow the ranges"
                )
        return list(problems.items())

    def _gpu_labels(self) -> set[str] | None:
        """The values of the accelerator label over the cluster's nodes (lowercase); None when the
        connection may not list nodes (a namespace-only role) or the API did not answer."""
        label = self.settings.pods.accelerator_label
        try:
            nodes = self.core.list_node(label_selector=label, _request_timeout=10)
        except Exception as exc:  # forbidden (RBAC), unreachable: provisioning says what is wrong
            log.debug("cannot list nodes to check GPU names: %s", exc)
            return None
        return {str((n.metadata.labels or {}).get(label, "")).lower() for n in nodes.items} - {""}

    def fit(self, resources: Resources, num_nodes: int, name: str | None = None) -> list[tuple[str, str]]:
        """A GPU name no node carries would leave the pods unschedulable: refused before any pod exists.
        Checked against the nodes' accelerator labels when the connection may list nodes, else only a
        likely typo of a known name (``A1000`` for ``A100``) is refused."""
        acc = resources.accelerators
        if acc is None:
            return []
        label = self.settings.pods.accelerator_label
        have = self._gpu_labels()
        if have is not None and acc.name.lower() in have:
            return []
        close = close_names(acc.name, have or ())
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        if have is not None:
            listed = ", ".join(sorted(have)) or "none"
            why = f"no node of the cluster has {acc.name} GPUs (nodes labelled {label}: {listed})"
        elif not known_name(acc.name) and close:
            why = f"{acc.name} is not a GPU name SkyPilot knows"
        else:
            return []  # nothing to check it against
        return [
            ("resources.accelerators", f"the kubernetes backend: {why}; {hint}ask for a GPU the nodes have")
        ]

    # -- provisioning ------------------------------------------------------------------------------------

    busy_pause = 1.0

    def prepare_provision(self, p: Provisioning) -> HeadRecords:
        """The record is on the head pod: the cluster's pods are found (reused when they run and carry a
        record) or made first, every one running (``p.made``: the pods this call created)."""
        name, spec = p.name, p.spec
        pods, others = self._listed(name)
        clash = next((s for s in others if s.owner and s.role in ROLES), None)
        if clash is not None:  # another cluster name that maps to the same label (and pod names)
            raise BackendError(
                f"cluster {name!r}: pod {self.namespace}/{clash.name} has this cluster's label "
                f"{CLUSTER_LABEL}={dns_name(name)}, but {clash.whose()}, whose name maps to the same pods; "
                "nothing was created or deleted. Give this cluster another name"
            )
        self._leave(name, others)
        if pods:
            if any(s.deleting for s in pods):
                raise ClusterBusy(f"cluster {name!r}: its pods are being deleted")
            if all(s.fatal for s in pods):  # left over from an earlier cluster: start afresh
                self._delete([s.name for s in pods], grace=0)
                self._wait_gone(name, DELETE_WAIT)
            else:
                return self._joinable(p, pods)
        p.made = []  # only what this call made is ever deleted on failure
        for index in range(spec.num_nodes):
            manifest = pod_manifest(name, index, spec, self.settings.pods)
            self._create(name, manifest)
            p.made.append(manifest["metadata"]["name"])
        states = self._wait_running(name, p.made, spec)
        handle = self._handle(name, states)
        if spec.resources.ports:
            handle = self._open_ports(name, spec, handle)
        p.handle = handle
        return self.records(name)

    def _joinable(self, p: Provisioning, pods: list[PodState]) -> HeadRecords:
        """Pods of this name exist: reused when they run and carry a record, else waited for."""
        name = p.name
        if not all(s.running for s in pods):
            raise ClusterBusy(f"cluster {name!r}: its pods are starting (another run is provisioning it)")
        try:
            record = self.records(name).load(name)
        except RunnerError as exc:
            raise ClusterBusy(f"cluster {name!r}: its head does not answer ({exc})") from None
        if record is None:
            raise ClusterBusy(f"cluster {name!r}: its pods run but it has no record yet")
        check_reusable(record, name, p.spec.num_nodes)
        p.handle = ClusterHandle.from_dict(record)
        return self.records(name)

    def undo_provision(self, p: Provisioning, exc: BaseException) -> None:
        if p.made:
            self._delete(p.made, grace=0)

    def _create(self, cluster: str, manifest: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        name = manifest["metadata"]["name"]
        for attempt in range(CREATE_TRIES):
            try:
                self.core.create_namespaced_pod(self.namespace, manifest)
                return
            except ApiException as exc:
                # transient: throttled, or the API server asks to retry (a new namespace's token)
                if (exc.status == 429 or (exc.status or 0) >= 500) and attempt < CREATE_TRIES - 1:
                    time.sleep(1.0 + attempt)
                    continue
                self._refused(cluster, name, exc)
            except Exception as exc:
                raise BackendError(f"creating pod {name}: the API server did not answer ({exc})") from None

    def _refused(self, cluster: str, name: str, exc: Any) -> NoReturn:
        if exc.status == 409:
            raise self._existing(cluster, name)
        raise BackendError(
            f"creating pod {self.namespace}/{name} was refused ({exc.status}): {_api_error(exc)}; "
            "nothing was started"
        ) from None

    def _existing(self, cluster: str, pod: str) -> BackendError:
        """Creating ``pod`` met a pod of that name: ours (another run is making this cluster: wait), or
        not (an error naming it; it is left as it is)."""
        from kubernetes.client.rest import ApiException

        try:
            state = pod_state(self.core.read_namespaced_pod(pod, self.namespace))
        except ApiException as exc:
            if exc.status == 404:
                return ClusterBusy(f"pod {pod} was being deleted (another run is tearing the cluster down)")
            return BackendError(
                f"creating pod {self.namespace}/{pod}: a pod of that name exists and reading it failed: "
                f"{_api_error(exc)}"
            )
        except Exception as exc:
            return BackendError(f"reading pod {pod}: the API server did not answer ({exc})")
        if state.ours(cluster):
            return ClusterBusy(f"pod {pod} already exists (another run is provisioning cluster {cluster!r})")
        return BackendError(
            f"cluster {cluster!r}: pod {self.namespace}/{pod} already exists and {state.whose()}; it was left "
            "as it is and nothing of this cluster was kept. Delete or rename that pod, or give this cluster "
            "another name"
        )

    def _wait_running(self, name: str, pods: list[str], spec: TaskSpec | None = None) -> list[PodState]:
        """Until every pod runs; a pod that cannot start is the error (all or nothing)."""
        deadline = time.monotonic() + self.settings.provision_timeout
        unschedulable_since: dict[str, float] = {}
        while True:
            by_name = {s.name: s for s in self._listed(name)[0]}
            states = [by_name.get(p) for p in pods]
            missing = [p for p, s in zip(pods, states, strict=True) if s is None]
            if missing:
                raise BackendError(f"pod {missing[0]} disappeared while starting (deleted or evicted)")
            ready = [s for s in states if s is not None]
            if all(s.running for s in ready):
                return ready
            now = time.monotonic()
            for s in ready:
                if s.fatal:
                    raise BackendError(f"pod {s.name} cannot start: {s.reason}")
                if s.unschedulable:
                    since = unschedulable_since.setdefault(s.name, now)
                    if now - since >= UNSCHEDULABLE_GRACE:
                        raise BackendError(f"pod {s.name} cannot be scheduled: {s.reason}")
                else:
                    unschedulable_since.pop(s.name, None)
            if now > deadline:
                waiting = "; ".join(f"{s.name}: {s.reason}" for s in ready if not s.running)
                raise BackendError(
                    f"pods not running after provision_timeout={self.settings.provision_timeout:g}s: {waiting}"
                )
            time.sleep(_POLL)

    def _open_ports(self, name: str, spec: TaskSpec, handle: ClusterHandle) -> ClusterHandle:
        """``resources.ports``: a ClusterIP Service for the head pod, owned by it (deleted with it); its
        address is in the handle (``extra["service"]``, pushed as XCom with it) and in the log."""
        from kubernetes.client.rest import ApiException

        ports = port_numbers(spec.resources.ports)
        head = head_name(name)
        try:
            uid = self.core.read_namespaced_pod(head, self.namespace).metadata.uid
            self.core.create_namespaced_service(self.namespace, service_manifest(name, ports, uid))
        except ApiException as exc:
            if exc.status != 409:  # 409: there already (a provision racing this one made it)
                raise BackendError(
                    f"resources.ports: creating Service {self.namespace}/{head} was refused ({exc.status}): "
                    f"{_api_error(exc)}"
                    + (
                        "; the connection's Role needs create on services (docs/kubernetes-rbac.yaml)"
                        if exc.status == 403
                        else ""
                    )
                ) from None
        address = f"{head}.{self.namespace}.svc"
        log.info("cluster %s: ports %s open at %s (a ClusterIP Service)", name, ports, address)
        return dataclasses.replace(handle, extra={**handle.extra, "service": address, "ports": ports})

    def _handle(self, name: str, states: list[PodState]) -> ClusterHandle:
        """Head rank 0, workers by IP; each node's home read from its pod, and its agent started (in
        the same exec) where the image has python3."""
        head = head_name(name)
        by_ip = {s.ip: s for s in states if s.ip}
        head_ip = next(s.ip for s in states if s.name == head)
        order = rank_order(list(by_ip), head_ip)
        agent = (agents.new_token(), head_ip or "", agents.new_port()) if self.settings.node_agent else None
        nodes, started = self._handle_nodes(name, [by_ip[ip] for ip in order], agent)
        extra: dict[str, Any] = {}
        if agent is not None and started:
            token, _, port = agent
            if self._agents_joined(name, head_ip or "", port, token, [n.node_id for n in nodes]):
                extra[agents.EXTRA_KEY] = {"host": head_ip, "port": port}
                agents.remember(self.namespace, head, port, token)
        return ClusterHandle(name=name, backend=self.kind, nodes=nodes, cloud="kubernetes", extra=extra)

    def _agents_joined(self, name: str, host: str, port: int, token: bytes, pods: list[str]) -> bool:
        """Whether this control plane reaches the head agent and every pod's agent joined it (within
        ``AGENT_JOIN_WAIT``): else the cluster keeps the per-node path (found at start, said in the log)."""
        return nodeagents.joined(name, host, port, token, pods, AGENT_JOIN_WAIT, AGENT_REACH_WAIT)

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """The head agent's address (the handle's) and the cluster's token: cached in this process,
        else read from the head pod (one exec)."""
        where = agents.endpoint(handle.extra)
        if where is None or not handle.nodes:
            return None
        host, port = where
        head = handle.nodes[0].extra.get("pod") or head_name(handle.name)
        token = agents.cached(self.namespace, head, port)
        if token is None:
            res = self._pod_runner(head, head).run_script(agents.token_script(), timeout=30)
            if res.returncode != 0 or not res.stdout.strip():
                log.info(
                    "cluster %s: the agent token could not be read from %s: %s",
                    handle.name,
                    head,
                    res.error_text,
                )
                return None
            token = res.stdout.strip()
            agents.remember(self.namespace, head, port, token)
        return host, port, token

    def forget_agent(self, handle: ClusterHandle) -> None:
        where = agents.endpoint(handle.extra)
        if where is not None and handle.nodes:
            agents.forget(
                self.namespace, handle.nodes[0].extra.get("pod") or head_name(handle.name), where[1]
            )

    def _handle_nodes(
        self, name: str, ordered: list[PodState], agent: tuple[bytes, str, int] | None = None
    ) -> tuple[tuple[Node, ...], bool]:
        """The nodes of running pods, in the order given; each node's home read from its pod. With
        ``agent`` (token, head IP, port) the same exec starts the pod's agent where python3 is: the
        second value says whether every pod's did."""
        head = head_name(name)

        def probe(state: PodState) -> tuple[str, bool]:
            script = _HOME_SCRIPT
            if agent is not None:
                token, head_ip, port = agent
                script = agents.start_script(state.name, token, head_ip, port, state.name == head)
            runner = self._pod_runner(state.name, state.ip or "")
            for attempt in range(1, PROBE_TRIES + 1):
                try:
                    res = runner.run_script(script, timeout=60)
                    break
                except RunnerError as exc:  # a dropped stream is asked again; a timeout is not
                    if attempt == PROBE_TRIES or isinstance(exc, CommandTimeout):
                        raise
                    log.info("pod %s: provisioning probe failed (%s); asking again", state.name, exc)
                    time.sleep(0.5 * attempt)
            if res.returncode != 0:
                raise BackendError(f"pod {state.name}: probe failed: {res.error_text}")
            lines = res.text.strip().splitlines() or ["/root"]
            return lines[0].strip() or "/root", lines[-1].strip() == "AGENT"

        with ThreadPoolExecutor(min(16, len(ordered))) as pool:
            probed = list(pool.map(probe, ordered))
        homes = [h for h, _ in probed]
        if agent is not None and not all(a for _, a in probed):
            log.info("cluster %s: no python3 in the image: no node agents, the per-node path", name)
        nodes = tuple(
            Node(
                ip=s.ip or "",
                node_id=s.name,
                root=f"{h}/.sky_airflow/{name}",
                home=h,
                extra={"pod": s.name, "namespace": self.namespace, "k8s_node": s.node or ""},
            )
            for s, h in zip(ordered, homes, strict=True)
        )
        return nodes, agent is not None and all(a for _, a in probed)

    # -- replacing a lost pod ------------------------------------------------------------------------------

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """A lost worker pod is deleted (if still there) and a new one made from a healthy worker's (same
        labels, image, resources, affinity; a new name ``<cluster>-worker<n>``), waited for until it runs;
        the record on the head names it, so the teardown (by label) and a restarted watcher see it.
        The head cannot be replaced: it keeps the record."""
        head = head_name(handle.name)
        if any(handle.nodes[r].extra.get("pod") == head for r in ranks):
            raise BackendError(
                f"the head pod {head} keeps the cluster record: a lost head cannot be replaced"
            )
        return self._replace_made(handle, [r for r in ranks if handle.nodes[r].extra.get("pod")])

    def make_replacements(
        self,
        handle: ClusterHandle,
        record: dict[str, Any],
        ranks: Sequence[int],
        todo: list[int],
        made: list[Any],
    ) -> dict[int, Node]:
        name = handle.name
        head = head_name(name)
        keep = [n for i, n in enumerate(handle.nodes) if i not in ranks and n.extra.get("pod") != head]
        model = self._model(name, keep[0].extra["pod"] if keep else head)
        ours, others = self._listed(name)
        gone = {handle.nodes[r].extra["pod"] for r in todo}
        self._leave(name, [s for s in others if s.name in gone])
        self._delete([s.name for s in ours if s.name in gone], grace=0)
        taken = {n.extra.get("pod") for n in handle.nodes} | {
            str(r.get("old_node_id")) for r in (record.get("extra") or {}).get("replaced", [])
        }
        base = dns_name(name, 63 - len("-worker9999"))
        numbers = [int(s.rsplit("worker", 1)[1]) for s in taken if s and s.rsplit("worker", 1)[-1].isdigit()]
        nxt = max(numbers, default=0) + 1
        for _ in todo:
            pod = f"{base}-worker{nxt}"
            nxt += 1
            manifest = copy.deepcopy(model)
            manifest["metadata"]["name"] = pod
            self._create(name, manifest)
            made.append(pod)
        states = {s.name: s for s in self._wait_running(name, list(made))}
        new, _ = self._handle_nodes(name, [states[pod] for pod in made], self._agent_of(handle))
        return dict(zip(todo, new, strict=True))

    def undo_replacements(
        self, handle: ClusterHandle, todo: list[int], made: list[Any], exc: BaseException
    ) -> None:
        self._delete(list(made), grace=0)

    def delete_spare(self, node_ids: list[str]) -> None:
        self._delete(node_ids, grace=0)

    def _agent_of(self, handle: ClusterHandle) -> tuple[bytes, str, int] | None:
        """(token, head IP, port) for a new pod of a cluster that runs agents: its agent joins the head."""
        found = self.agent_endpoint(handle)
        return (found[2], found[0], found[1]) if found is not None else None

    def _model(self, name: str, pod: str) -> dict[str, Any]:
        """The manifest of a new worker, from a running worker pod of ours: its labels, annotations and
        spec, without what the API server or the scheduler filled in (node, status, the token volume)."""
        obj = self._call(f"reading pod {pod}", self.core.read_namespaced_pod, pod, self.namespace)
        state = pod_state(obj)
        if not state.ours(name):
            raise BackendError(
                f"cluster {name!r}: pod {self.namespace}/{pod} is not one of its pods: {state.whose()}"
            )
        data = self.core.api_client.sanitize_for_serialization(obj)
        meta = data.get("metadata") or {}
        spec = data.get("spec") or {}
        for key in ("nodeName", "hostname", "subdomain"):
            spec.pop(key, None)
        injected = {
            v["name"]
            for v in spec.get("volumes") or []
            if v.get("name", "").startswith(("kube-api-access-", "default-token-"))
        }
        spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") not in injected]
        for c in spec.get("containers") or []:
            c["volumeMounts"] = [m for m in c.get("volumeMounts") or [] if m.get("name") not in injected]
        labels = dict(meta.get("labels") or {})
        labels[ROLE_LABEL] = "worker"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "labels": labels, "annotations": dict(meta.get("annotations") or {})},
            "spec": spec,
        }

    # -- teardown ----------------------------------------------------------------------------------------

    def _delete(self, pods: list[str], grace: int) -> None:
        from kubernetes.client.rest import ApiException

        for pod in pods:
            try:
                self.core.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=grace)
            except ApiException as exc:
                if exc.status != 404:  # already gone is success
                    log.warning("deleting pod %s/%s failed: %s", self.namespace, pod, _api_error(exc))
            except Exception as exc:
                log.warning("deleting pod %s/%s failed: %s", self.namespace, pod, exc)

    def _wait_gone(self, name: str, timeout: float) -> list[str]:
        """Wait for the cluster's pods to leave the API; the names still there at ``timeout``.

        A deleted pod whose phase is Failed or Succeeded has no container left running: the kubelet said so.
        Its object can still stay for minutes while a slow or loaded kubelet reclaims volumes and cgroups
        (62 s seen on the test machine): it is removed at once (grace 0, what ``kubectl delete --force``
        does), and the kubelet cleans up after it. A pod still Running (an unreachable node, a kubelet
        that has not killed it) is waited for and then reported, never forced: its processes may live.
        """
        deadline = time.monotonic() + timeout
        forced: set[str] = set()
        while True:
            states, _ = self._listed(name)
            if not states:
                return []
            stopped = [s.name for s in states if s.deleting and s.phase in _STOPPED and s.name not in forced]
            if stopped:
                log.info("cluster %s: %s stopped; removing the pod objects the kubelet keeps", name, stopped)
                self._delete(stopped, grace=0)
                forced.update(stopped)
            if time.monotonic() > deadline:
                return [s.name for s in states if s.name not in stopped]
            time.sleep(_POLL)

    # Teardown: the sequence is Backend's. Leases live in the record on the head: a running head whose
    # record cannot be updated keeps the whole cluster (another run may hold it) unless the teardown is
    # forced (``holder`` None). A head that does not run (ended idle, failed, gone) holds no lease any
    # more: its pods go. Only pods of ours are deleted.

    record_errors = (BackendError, RunnerError)

    def teardown_scope(self, name: str) -> list[PodState] | None:
        pods, others = self._listed(name)
        self._leave(name, others)
        return pods or None

    def teardown_records(self, name: str, scope: Any) -> HeadRecords | None:
        head = next((s for s in scope if s.name == head_name(name)), None)
        return self.records(name) if head is not None and head.running else None

    def begin_unrecorded(self, name: str, holder: str | None) -> tuple[dict[str, Any] | None, Any]:
        return None, (None, ())  # a running head without a record holds no lease: its pods go

    def teardown_refused(
        self,
        name: str,
        holder: str | None,
        read: bool,
        idle_only: bool,
        record: Mapping[str, Any] | None,
        exc: Exception,
    ) -> BackendError | None:
        if holder is not None:
            return BackendError(
                f"cluster {name!r} kept, nothing deleted: the record on its head pod "
                f"{self.namespace}/{head_name(name)} could not be updated ({exc}), so other runs' leases "
                "cannot be checked. Tear it down again once the head answers (a cluster left idle "
                "ends its pods itself after idle_down, and the next teardown removes them); a forced "
                "teardown (SkyHook(conn).teardown(name, force=True)) removes it whoever holds it"
            )
        log.warning(
            "cluster %s: the record on its head could not be updated (%s); forced: deleting its pods",
            name,
            exc,
        )
        return None

    def delete_cluster(self, name: str, scope: Any, record: dict[str, Any] | None, grace: float) -> Teardown:
        """Every pod of ours (the record went with the head); those still there after the wait are named."""
        pods: list[PodState] = scope
        self._delete([s.name for s in pods], grace=max(0, int(grace)))
        wait = DELETE_WAIT + DELETE_WAIT_PER_POD * len(pods)
        left = self._wait_gone(name, wait)
        if left:
            log.warning("cluster %s: pods still there %ss after deletion: %s", name, wait, left)
        return Teardown(removed=True, unclean=tuple(left))

    # -- the Test button -----------------------------------------------------------------------------------

    def test_connection(self) -> str:
        """The API server answers, the credentials work, and they may create pods and exec into them."""
        from kubernetes import client

        version = self._call("reading the server version", client.VersionApi(self.new_client()).get_code)
        authz = client.AuthorizationV1Api(self.new_client())
        missing = []
        for verb, resource, sub in NEEDED_PERMISSIONS:
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(
                        namespace=self.namespace, verb=verb, resource=resource, subresource=sub
                    )
                )
            )
            answer = self._call("checking permissions", authz.create_self_subject_access_review, review)
            if not answer.status.allowed:
                missing.append(f"{verb} {resource}{'/' + sub if sub else ''}")
        if missing:
            raise BackendError(
                f"namespace {self.namespace!r}: the credentials may not {', '.join(missing)}; "
                "grant them in a Role (docs/kubernetes-rbac.yaml; docs/backends/kubernetes.md)"
            )
        self._call("listing pods", self.core.list_namespaced_pod, self.namespace, limit=1)
        return f"Kubernetes {version.git_version}: namespace {self.namespace!r}, pods and exec allowed"
