"""Gangs on AWS EC2: N instances made with boto3 in one request, reached over SSH, all or nothing.

A cluster is the set of instances tagged ``sky-airflow:cluster`` = name and ``sky-airflow:owner`` = the
connection's owner; the head carries ``sky-airflow:role`` = head. Finding, reusing and terminating go by
these tags alone (``ec2.py``); the cluster record (leases, homes, pinned host keys) lives on the head
like on SSH hosts (``headrecord``). Provisioning makes every instance in one ``RunInstances`` (MinCount =
N, so EC2 gives all or none), waits until they run and their SSH answers, and on any failure terminates
what it made and removes the security group and key pair it made for the cluster.

Commands reach the nodes through the SSH runner (``runners/ssh``): one paramiko transport per node.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from airflow_provider_sky.backends.aws import catalog
from airflow_provider_sky.backends.aws import ec2 as api
from airflow_provider_sky.backends.aws.catalog import NoInstanceType, choose
from airflow_provider_sky.backends.aws.config import AWSSettings, parse_aws_config
from airflow_provider_sky.backends.aws.launch import Launch
from airflow_provider_sky.backends.base import (
    Backend,
    BackendError,
    ClusterBusy,
    ClusterHandle,
    Node,
    Provisioning,
    Teardown,
    add_lease,
    begin_teardown,
    check_reusable,
    new_record,
)
from airflow_provider_sky.backends.headrecord import HeadRecords, record_path
from airflow_provider_sky.backends.nodeagents import EXTRA_KEY, HostAgents, parallel_map
from airflow_provider_sky.model.gang import rank_order
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.ssh import SSHNodeConfig, SSHRunner, wait_for_ssh
from airflow_provider_sky.runners.ssh.keys import load_private_key
from airflow_provider_sky.runners.ssh.relay import Relay
from airflow_provider_sky.spec import BackendCapabilities, Resources, TaskSpec
from airflow_provider_sky.spec.nodes import existing_cluster, num_nodes_problem

log = logging.getLogger(__name__)

_HOME_SCRIPT = 'printf "%s\\n" "$HOME"'
#: nodes probed (SSH banner, login, home) at once
PROBE_PARALLEL = 16
#: how long a teardown waits for terminated instances to be gone
TERMINATE_WAIT = 600.0


@dataclass
class _Made:
    """What a provision made, noted as it is made (undone if it fails)."""

    launch: Launch
    groups: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


class AWSBackend(Backend):
    """EC2 instances of one region, one rank per instance."""

    kind = "aws"

    #: a security group / key pair of ours with no instance, made over this many seconds ago, is left over
    leftover_age = 900.0
    #: after a launch whose reply was lost found nothing, look for its instances again after these many
    #: seconds (EC2's listings are eventually consistent)
    lookup_delays: tuple[float, ...] = (2.0, 5.0)

    def __init__(self, settings: AWSSettings) -> None:
        self.settings = settings
        self.owner = settings.owner
        self.idle_down_poweroff = settings.poweroff_command
        self.capabilities = BackendCapabilities(
            name="aws",
            max_nodes=1000,
            supported_resources=frozenset(
                {
                    "cpus",
                    "memory",
                    "accelerators",
                    "instance_type",
                    "use_spot",
                    "image_id",
                    "disk_size",
                    "labels",
                    "cloud",
                    "region",
                    "zone",
                    "ports",
                }
            ),
            clouds=frozenset({"aws"}),
        )
        self._client: Any = None
        self._runners: dict[tuple[str, int], SSHRunner] = {}
        #: the node agents: the head listens on its instance's every address; the others reach it at its
        #: private IP (the cluster's own group lets its members reach each other, nothing else in);
        #: this control plane, outside the group, through a relay over the head's SSH connection
        self.agents = HostAgents(
            self.kind,
            self.runner,
            lambda fn, nodes: parallel_map(fn, nodes, PROBE_PARALLEL),
            listen="0.0.0.0",
            head_address=self.agent_address,
            reach=self._agent_relay,
        )
        self._relays: dict[tuple[str, int, int], Relay] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AWSBackend:
        return cls(parse_aws_config(config))

    @property
    def ec2(self) -> Any:
        if self._client is None:
            self._client = api.make_client(self.settings)
        return self._client

    @property
    def region(self) -> str:
        return str(self.ec2.meta.region_name)

    def close(self) -> None:
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.close()
        for r in self._runners.values():
            r.close()
        self._runners.clear()

    # -- node agents ---------------------------------------------------------------------------------

    def agent_address(self, node: Node) -> str:
        """Where the other instances reach the head's agent: its private IP (traffic within the
        cluster's own security group). Tests replace this with their fake network's address."""
        return node.ip

    def _agent_relay(self, head: Node, port: int) -> tuple[str, int]:
        """This control plane's way to the head's agent port: a local port relayed over the head's SSH
        connection (one per head and port in this process)."""
        key = (str(head.extra["host"]), int(head.extra["port"]), port)
        runner = self.runner(head)  # takes the lock itself
        with self._lock:
            relay = self._relays.get(key)
            if relay is None:
                relay = self._relays[key] = Relay(runner, port)
            return relay.address

    def _start_agents(self, handle: ClusterHandle, own_group: bool) -> ClusterHandle:
        """A new cluster's node agents (only in its own security group: groups the connection names may
        not let the instances reach each other); once every one joined, the record says where the head
        listens. Else the per-node path."""
        if not self.settings.node_agent:
            return handle
        if not own_group:
            log.info("cluster %s: security_group_ids given: no node agents (the per-node path)", handle.name)
            return handle
        return self.agents.start_recorded(handle, self.records(handle.name, handle.nodes[0]))

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """A relay to the head agent's port and the token: cached in this process, else read from the
        head instance (one SSH call)."""
        return self.agents.endpoint(handle)

    def forget_agent(self, handle: ClusterHandle) -> None:
        self.agents.forget(handle)

    # -- reaching a node ---------------------------------------------------------------------------

    def endpoint(self, instance: Mapping[str, Any]) -> tuple[str, int, str]:
        """(host, port, user) Airflow reaches ``instance`` at: its public IP, or its private IP with
        ``use_private_ips`` (or when it has no public one). Tests replace this with a fake network."""
        private = instance.get("PrivateIpAddress")
        public = instance.get("PublicIpAddress")
        host = private if self.settings.use_private_ips or not public else public
        if not host:
            raise BackendError(f"instance {instance.get('InstanceId')} has no IP address yet")
        return str(host), self.settings.ssh_port, self.settings.ssh_user

    def _ssh_config(self, host: str, port: int, user: str, **more: Any) -> SSHNodeConfig:
        s = self.settings
        kwargs: dict[str, Any] = {
            "user": user,
            "port": port,
            "private_key": s.private_key,
            "key_file": s.key_file,
            "passphrase": s.passphrase,
            "connect_timeout": 10.0,
            "host_key_policy": "skip" if s.host_key_policy == "skip" else "verify",
        }
        kwargs.update(more)
        return SSHNodeConfig(host, **kwargs)

    def runner(self, node: Node) -> SSHRunner:
        """The node's SSH runner; its host key is the one pinned when the instance was first reached."""
        host, port = str(node.extra["host"]), int(node.extra["port"])
        with self._lock:
            if (host, port) not in self._runners:
                key = node.extra.get("host_key")
                cfg = self._ssh_config(
                    host, port, str(node.extra["user"]), pinned_host_keys=(key,) if key else ()
                )
                self._runners[(host, port)] = SSHRunner(cfg)
            return self._runners[(host, port)]

    def public_key(self) -> str:
        """The connection's private key's public half (``ssh-ed25519 AAAA...``), for the key pair."""
        try:
            pkey = load_private_key(self._ssh_config("key", 22, self.settings.ssh_user))
        except RunnerError as exc:
            raise BackendError(f"private_key: {exc}") from None
        return f"{pkey.get_name()} {pkey.get_base64()}"

    # -- records -------------------------------------------------------------------------------------

    def records(self, name: str, head: Node | None = None) -> HeadRecords:
        """The cluster's record, on its head instance (found by its tags when ``head`` is not given)."""
        if head is None:
            head = self._node(
                name, self._ordered(name, api.describe_instances(self.ec2, name, self.owner))[0], None
            )
        node = head
        return HeadRecords(lambda: self.runner(node), f"instance {node.node_id} ({node.extra['host']})")

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        return [f"{handle.nodes[0].home}/{record_path(handle.name)}"] if rank == 0 else []

    # -- finding -------------------------------------------------------------------------------------

    def _ordered(self, name: str, instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Head first (the instance tagged head), workers by private IP: the rank order."""
        heads = [i for i in instances if api.tags_of(i).get(api.TAG_ROLE) == "head"]
        if len(heads) != 1:
            raise ClusterBusy(f"cluster {name!r}: {len(heads)} instances are tagged head (it is being made)")
        by_ip = {str(i.get("PrivateIpAddress") or i["InstanceId"]): i for i in instances}
        head_ip = str(heads[0].get("PrivateIpAddress") or heads[0]["InstanceId"])
        return [by_ip[ip] for ip in rank_order(list(by_ip), head_ip)]

    def _node(self, name: str, instance: Mapping[str, Any], known: Mapping[str, Any] | None) -> Node:
        """A node from an instance; its home and host key from ``known`` (the record) when there."""
        host, port, user = self.endpoint(instance)
        extra = dict((known or {}).get("extra") or {})
        extra.update(
            host=host,
            port=port,
            user=user,
            instance_id=instance["InstanceId"],
            instance_type=instance.get("InstanceType"),
            zone=(instance.get("Placement") or {}).get("AvailabilityZone"),
            role=api.tags_of(instance).get(api.TAG_ROLE, "worker"),
        )
        pinned = api.tags_of(instance).get(api.TAG_HOST_KEY)
        if pinned and not extra.get("host_key"):
            extra["host_key"] = pinned
        home = str((known or {}).get("home") or "~")
        return Node(
            ip=str(instance.get("PrivateIpAddress") or host),
            node_id=str(instance["InstanceId"]),
            root=f"{home}/.sky_airflow/{name}",
            home=home,
            extra=extra,
        )

    def _handle(self, name: str, nodes: list[Node]) -> ClusterHandle:
        return ClusterHandle(
            name=name,
            backend=self.kind,
            nodes=tuple(nodes),
            cloud="aws",
            region=self.region,
            zone=str(nodes[0].extra.get("zone") or "") or None,
            extra={
                "instance_type": nodes[0].extra.get("instance_type"),
                # SKYPILOT_NUM_GPUS_PER_NODE when the task names an instance type but no accelerators
                "node_gpus": catalog.gpus_of(str(nodes[0].extra.get("instance_type") or "")),
            },
        )

    def find(self, name: str) -> ClusterHandle | None:
        """The cluster when every instance of it runs, addresses as they are now."""
        instances = api.describe_instances(self.ec2, name, self.owner)
        if not instances or any(i["State"]["Name"] != "running" for i in instances):
            return None
        try:
            ordered = self._ordered(name, instances)
        except ClusterBusy:
            return None
        head = self._node(name, ordered[0], None)
        try:
            record = self.records(name, head).load(name)
        except (BackendError, RunnerError):
            return None
        if record is None:
            return None
        known = {n["node_id"]: n for n in record.get("nodes") or ()}
        if sorted(known) == sorted(str(i["InstanceId"]) for i in ordered):  # the record's rank order (a
            by_id = {str(i["InstanceId"]): i for i in ordered}  # replacement keeps the ranks it had)
            ordered = [by_id[str(n["node_id"])] for n in record.get("nodes") or ()]
        return _with_agent(
            self._handle(name, [self._node(name, i, known.get(i["InstanceId"])) for i in ordered]), record
        )

    # -- choosing ------------------------------------------------------------------------------------

    def spec_problems(self, spec: TaskSpec) -> list[tuple[str, str]]:
        """Ports are opened in the cluster's own security group; groups the connection names are the
        user's, left as they are."""
        if self.settings.security_group_ids and any(r.ports for r in spec.resource_choices):
            return [
                (
                    "resources.ports",
                    "the connection's security_group_ids are used as they are, so the aws backend opens no "
                    "port in them: open the ports in those groups yourself and remove ports, or leave "
                    "security_group_ids empty (the cluster then gets its own group with the ports open)",
                )
            ]
        return []

    def fit(self, resources: Resources, num_nodes: int, name: str | None = None) -> list[tuple[str, str]]:
        """An instance type of the catalog has what is asked; the region is the connection's."""
        problems: list[tuple[str, str]] = []
        if resources.region and self.settings.region and resources.region != self.settings.region:
            problems.append(
                (
                    "resources.region",
                    f"the connection works in {self.settings.region}, the task asks for {resources.region}; "
                    "use a skyaws connection of that region (region_name)",
                )
            )
        try:
            choose(resources)
        except NoInstanceType as exc:
            problems.append((exc.field, exc.message))
        return problems

    # -- provisioning --------------------------------------------------------------------------------

    busy_pause = 2.0

    def check_provision(self, name: str, spec: TaskSpec) -> None:
        super().check_provision(name, spec)
        problems = self.fit(spec.resources, spec.num_nodes, name)
        if problems:
            raise BackendError("; ".join(f"{f}: {m}" for f, m in problems) + "; nothing was created")

    def prepare_provision(self, p: Provisioning) -> HeadRecords:
        """The record is on the head instance: the cluster's instances are found (started when stopped)
        or launched first, every one reached over SSH (``p.made``: what this call made)."""
        instances = api.describe_instances(self.ec2, p.name, self.owner)
        if instances:
            p.handle = self._reuse(p.name, p.spec, instances)
        else:
            p.made = _Made(Launch(p.name, self.owner))
            instances = self._create(p.name, p.spec, p.made)
            p.handle = self._handle(p.name, self._reach(p.name, self._ordered(p.name, instances), {}))
        return self.records(p.name, p.handle.nodes[0])

    def join(self, p: Provisioning, record: dict[str, Any]) -> tuple[dict[str, Any], ClusterHandle]:
        assert p.handle is not None
        if p.made is not None:  # a new instance's disk is new: a record there is not this cluster's
            return new_record(p.handle, p.holder), p.handle
        check_reusable(record, p.name, p.spec.num_nodes)
        new = add_lease(record, p.holder)
        new["nodes"] = [n for n in p.handle.to_dict()["nodes"]]  # addresses may change across stop/start
        return new, _with_agent(p.handle, record)

    def undo_provision(self, p: Provisioning, exc: BaseException) -> None:
        """Every instance of this call's launch, its group and key pair go; the error says what was left."""
        if p.made is None:
            return
        done, gone, left = self._undo(p.name, p.made)
        if isinstance(exc, BackendError) and not isinstance(exc, ClusterBusy):
            said = [done or "nothing launched"]
            if left:
                said.append(f"also left: {', '.join(left)}")
            elif gone:
                said.append("nothing of it is left")
            raise BackendError(f"cluster {p.name!r} not provisioned: {exc}; {'; '.join(said)}") from None
        if done:
            log.warning("cluster %s: after a failed provision: %s", p.name, done)

    def provisioned(self, p: Provisioning, handle: ClusterHandle) -> ClusterHandle:
        return self._start_agents(handle, own_group=bool(p.made.groups)) if p.made is not None else handle

    def _create(self, name: str, spec: TaskSpec, made: _Made) -> list[dict[str, Any]]:
        """One RunInstances for all N (MinCount = N: EC2 gives every instance or none), then the head
        tag on the first; what was made is noted in ``made`` as it is made."""
        s, res, ec2 = self.settings, spec.resources, self.ec2
        itype = choose(res)
        image = res.image_id or s.image_id or api.default_image(ec2)
        if image.startswith("docker:"):
            raise BackendError(
                f"resources.image_id: {image!r} is a container image; give an AMI id (ami-...)"
            )
        zone = res.zone or s.zone
        subnet, vpc = api.subnet_vpc(ec2, s.subnet_id, zone)
        # the cluster's own group and key pair are made first: EC2 makes a name once, so they also keep a
        # concurrent provision of the same cluster out (it waits, then joins what this one makes)
        groups, key_name = list(s.security_group_ids), s.key_name
        for attempt in (1, 2):
            try:
                if not groups:
                    groups = made.groups = [
                        api.create_security_group(ec2, name, self.owner, vpc, s.ssh_cidr, res.ports)
                    ]
                if not key_name:
                    key_name = api.import_key_pair(ec2, name, self.owner, self.public_key())
                    made.keys = [key_name]
                break
            except api.Duplicate as dup:
                mine = made.groups + made.keys
                if attempt == 1 and api.remove_leftovers(ec2, name, self.owner, self.leftover_age, mine):
                    continue  # left over (idle_down, a killed provision): gone, made afresh
                raise ClusterBusy(
                    f"cluster {name!r}: its {dup} exists: another provision of it is under way, or a teardown "
                    "could not delete it (tear the cluster down again: that deletes it)"
                ) from None
        request = api.run_request(
            name,
            self.owner,
            n=spec.num_nodes,
            image=image,
            instance_type=itype.name,
            key_name=str(key_name),
            groups=groups,
            subnet=subnet,
            public_ip=not s.use_private_ips,
            root_device=api.root_device(ec2, image) if res.disk_size else None,
            disk_size=res.disk_size,
            spot=res.use_spot,
        )
        log.info(
            "cluster %s: launching %s x %s (%s%s) in %s",
            name,
            spec.num_nodes,
            itype.name,
            image,
            ", spot" if res.use_spot else "",
            zone or self.region,
        )
        launched = made.launch.run(ec2, request, f"launching {spec.num_nodes} x {itype.name}")
        head = launched[0]["InstanceId"]
        try:
            ec2.create_tags(
                Resources=[head],
                Tags=[{"Key": api.TAG_ROLE, "Value": "head"}, {"Key": "Name", "Value": f"sky-{name}-head"}],
            )
        except Exception as exc:
            raise api.client_error(f"tagging the head {head}", exc) from None
        return self._wait_running(name, made.launch.ids)

    def _wait_running(self, name: str, ids: list[str]) -> list[dict[str, Any]]:
        """Until every instance runs (a waiter: one DescribeInstances per poll for all of them); an
        instance that ends instead is the error, with EC2's reason (capacity, spot interruption)."""
        timeout = self.settings.provision_timeout
        delay = 2 if timeout < 120 else 5
        try:
            self.ec2.get_waiter("instance_running").wait(
                InstanceIds=ids, WaiterConfig={"Delay": delay, "MaxAttempts": max(1, int(timeout // delay))}
            )
        except Exception as exc:
            instances = api.describe_instances(self.ec2, name, self.owner)
            gone = [i for i in self._by_ids(ids) if i["State"]["Name"] in ("shutting-down", "terminated")]
            if gone:
                reason = gone[0].get("StateReason") or {}
                code = str(reason.get("Code") or "")
                cause = api.CAUSES.get(code, "ended while starting")
                raise BackendError(
                    f"instance {gone[0]['InstanceId']} {cause} ({code}): {reason.get('Message', '')}"
                ) from None
            waiting = [i["InstanceId"] for i in instances if i["State"]["Name"] != "running"]
            raise BackendError(
                f"instances not running after provision_timeout={timeout:g}s: {', '.join(waiting) or exc}"
            ) from None
        return self._by_ids(ids)

    def _by_ids(self, ids: list[str]) -> list[dict[str, Any]]:
        try:
            pages = self.ec2.get_paginator("describe_instances").paginate(InstanceIds=ids)
            return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
        except Exception as exc:
            raise api.client_error("describing the new instances", exc) from None

    def _reach(self, name: str, ordered: list[dict[str, Any]], known: Mapping[str, Any]) -> list[Node]:
        """Wait until each instance's SSH answers (banner probe, within what is left of the provision
        timeout), log in, read its home and pin its host key (the first one seen, on first contact)."""
        deadline = time.monotonic() + self.settings.provision_timeout
        nodes = [self._node(name, i, known.get(i["InstanceId"])) for i in ordered]
        trust = Path(tempfile.mkdtemp(prefix="sky-aws-hostkeys-"))

        def one(node: Node) -> Node:
            host, port = str(node.extra["host"]), int(node.extra["port"])
            try:
                wait_for_ssh(host, port, max(1.0, deadline - time.monotonic()))
            except RunnerError as exc:
                raise BackendError(
                    f"instance {node.node_id}: SSH did not answer at {host}:{port} within "
                    f"provision_timeout={self.settings.provision_timeout:g}s ({exc})"
                ) from None
            pinned = node.extra.get("host_key")
            if pinned or self.settings.host_key_policy == "skip":
                runner = self.runner(node)
            else:  # first contact: accept the key the instance shows and pin it for its life
                known_hosts = str(trust / node.node_id)
                cfg = self._ssh_config(host, port, str(node.extra["user"]), known_hosts=known_hosts)
                runner = SSHRunner(replace(cfg, host_key_policy="accept-new"))
            res = runner.run_script(_HOME_SCRIPT, timeout=60)
            if res.returncode != 0:
                raise BackendError(f"instance {node.node_id}: probe failed: {res.error_text}")
            home = res.text.strip() or "~"
            extra = dict(node.extra)
            if not pinned and self.settings.host_key_policy != "skip":
                line = (trust / node.node_id).read_text().split("\n")[0].split()
                extra["host_key"] = " ".join(line[1:3])
                self._tag_host_key(node.node_id, extra["host_key"])
                with self._lock:
                    self._runners.pop((host, port), None)
            return Node(node.ip, node.node_id, f"{home}/.sky_airflow/{name}", home, extra)

        try:
            with ThreadPoolExecutor(min(PROBE_PARALLEL, len(nodes))) as pool:
                return list(pool.map(one, nodes))
        finally:
            shutil.rmtree(trust, ignore_errors=True)

    def _tag_host_key(self, instance_id: str, key: str) -> None:
        """Pin the host key on the instance itself (a tag lives as long as the instance), so any worker
        verifies the head before it reads the record there. A key too long for a tag (RSA) is pinned in
        the record only, and such a head is verified after the first contact by the record's key."""
        if len(key) > 256:
            return
        try:
            self.ec2.create_tags(Resources=[instance_id], Tags=[{"Key": api.TAG_HOST_KEY, "Value": key}])
        except Exception as exc:
            raise api.client_error(f"tagging {instance_id} with its host key", exc) from None

    def _reuse(self, name: str, spec: TaskSpec, instances: list[dict[str, Any]]) -> ClusterHandle:
        """Instances of this name exist: started if stopped, reached; joined (a lease) by the head's record."""
        states = {i["State"]["Name"] for i in instances}
        if states & {"shutting-down", "stopping"}:
            raise ClusterBusy(f"cluster {name!r}: its instances are {', '.join(sorted(states))}")
        bound = existing_cluster(name, len(instances), "instances")
        if (problem := num_nodes_problem(spec.num_nodes, bound)) is not None:
            raise BackendError(problem)
        ids = [str(i["InstanceId"]) for i in instances]
        stopped = [str(i["InstanceId"]) for i in instances if i["State"]["Name"] == "stopped"]
        if stopped:
            log.info("cluster %s: starting %s stopped instance(s)", name, len(stopped))
            try:
                self.ec2.start_instances(InstanceIds=stopped)
            except Exception as exc:
                raise api.client_error(f"starting the stopped instances of cluster {name!r}", exc) from None
        if states != {"running"}:
            instances = self._wait_running(name, ids)
        ordered = self._ordered(name, instances)
        head = self._node(name, ordered[0], None)
        recent = (
            time.time() - max(i["LaunchTime"].timestamp() for i in instances)
            < self.settings.provision_timeout
        )
        if recent and not head.extra.get("host_key") and self.settings.host_key_policy != "skip":
            raise ClusterBusy(f"cluster {name!r}: being made (its head's host key is not pinned yet)")
        wait_for_ssh(str(head.extra["host"]), int(head.extra["port"]), self.settings.provision_timeout)
        record = self.records(name, head).load(name)
        if record is None and recent:
            raise ClusterBusy(f"cluster {name!r}: its instances run but it has no record yet")
        if record is not None:  # else: gone idle (idle_down removed it), adopted with a new record
            check_reusable(record, name, spec.num_nodes)
        known = {n["node_id"]: n for n in (record or {}).get("nodes") or ()}
        return self._handle(name, self._reach(name, ordered, known))

    def _undo(self, name: str, made: _Made) -> tuple[str, bool, list[str]]:
        """Remove what a failed provision made: every instance of its launch (also those of a launch
        whose reply was lost: looked up by its client token), then its group and key pair. Returns what
        was found and done, in words, whether no instance of it is left, and the group / key pair that
        could not be removed."""
        done, gone = made.launch.undo(self.ec2, TERMINATE_WAIT, self.lookup_delays)
        if not gone:
            log.warning("cluster %s: after a failed provision: %s", name, done)
        left = api.delete_security_groups(self.ec2, made.groups)
        left += api.delete_key_pairs(self.ec2, made.keys)
        return done, gone, left

    # -- replacing a lost instance -----------------------------------------------------------------------

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """A new instance for each lost worker (``replacing``); the head cannot be replaced: it keeps the
        record."""
        if 0 in ranks:
            raise BackendError("the head instance keeps the cluster record: a lost head cannot be replaced")
        return self._replace_made(handle, ranks)

    def make_replacements(
        self,
        handle: ClusterHandle,
        record: dict[str, Any],
        ranks: Sequence[int],
        todo: list[int],
        made: list[Any],
    ) -> dict[int, Node]:
        from airflow_provider_sky.backends.aws import replacing

        return replacing.make_replacements(self, handle, ranks, todo, made)

    def undo_replacements(
        self, handle: ClusterHandle, todo: list[int], made: list[Any], exc: BaseException
    ) -> None:
        from airflow_provider_sky.backends.aws import replacing

        if made:  # nothing launched (the lost instances could not be ended): the error as it is
            replacing.undo_replacements(self, handle, todo, made[0], exc)

    def delete_spare(self, node_ids: list[str]) -> None:
        try:
            self.ec2.terminate_instances(InstanceIds=node_ids)
        except Exception as exc:
            raise api.client_error(f"terminating the spare instance(s) {', '.join(node_ids)}", exc) from None

    # Teardown: the sequence is Backend's. ``holder``'s lease is released on the head; when none remains
    # every instance tagged for this cluster and owner is terminated and the cluster's own security
    # group and key pair removed. A record that was read but could not be written back (the head's lock
    # held, its disk full) keeps the cluster: nothing is terminated and the error says so, since the
    # leases it holds cannot be released or honoured (``holder=None``, forced, terminates anyway). A
    # head that does not answer at all (stopped, broken) is terminated without reading the record. With
    # ``idle_only`` (the reaper) only a cluster whose head holds no record goes: a head with no record
    # gets one marked down, under the record's lock, before anything is terminated, so a run that
    # adopted the cluster since it was looked at keeps it, and a provision that comes after waits.

    record_errors = (BackendError, RunnerError)

    def teardown_scope(self, name: str) -> list[dict[str, Any]]:
        return api.describe_instances(self.ec2, name, self.owner)

    def teardown_records(self, name: str, scope: Any) -> HeadRecords | None:
        running = [i for i in scope if i["State"]["Name"] == "running"]
        if not running or len(running) != len(scope):
            return None
        # no head (a provision killed before it tagged one): no record to honour
        return self.records(name, self._node(name, self._ordered(name, scope)[0], None))

    def begin_unrecorded(self, name: str, holder: str | None) -> tuple[dict[str, Any] | None, Any]:
        """Nobody holds it: marked down, so a run adopting it meanwhile waits."""
        new, kept_for = begin_teardown({"name": name, "nodes": [], "leases": {}}, holder)
        return new, (new, kept_for)

    def teardown_refused(
        self,
        name: str,
        holder: str | None,
        read: bool,
        idle_only: bool,
        record: Mapping[str, Any] | None,
        exc: Exception,
    ) -> BackendError | None:
        if idle_only or (read and holder is not None):
            held = ", ".join((record or {}).get("leases") or {})
            log.warning("cluster %s kept: its record could not be updated (%s)", name, exc)
            how = f"was read{f' (held by {held})' if held else ''} but could not be updated"
            return BackendError(
                f"cluster {name!r} kept, nothing terminated: its record on the head "
                f"{how if read else 'could not be read'}: {exc}; tear it down again once the "
                "head's record can be written (clear the down task), or reap() removes it once "
                "no run holds it"
            )
        # the head does not answer (or forced): the instances go anyway
        log.warning("cluster %s: the record on its head could not be read (%s)", name, exc)
        return None

    def delete_cluster(self, name: str, scope: Any, record: dict[str, Any] | None, grace: float) -> Teardown:
        ids = [str(i["InstanceId"]) for i in scope if api.ours(i, name, self.owner)]
        if ids:
            log.info("cluster %s: terminating %s instance(s)", name, len(ids))
        self.close()
        api.terminate_and_wait(self.ec2, ids, TERMINATE_WAIT)
        left = api.delete_security_groups(self.ec2, api.cluster_groups(self.ec2, name, self.owner))
        left += api.delete_key_pairs(self.ec2, api.cluster_key_pairs(self.ec2, name, self.owner))
        return Teardown(removed=bool(ids) and not left, unclean=tuple(left))

    def lost_reason(self, node: Node) -> str | None:
        """EC2's word on a node that stopped answering: its instance's state and reason when it no longer
        runs (``spot interruption: instance i-... is terminated (Server.SpotInstanceTermination: ...)``)."""
        iid = str(node.extra.get("instance_id") or node.node_id)
        try:
            found = self._by_ids([iid])
        except BackendError:
            return None
        if not found or found[0]["State"]["Name"] in ("pending", "running"):
            return None
        state = found[0]["State"]["Name"]
        reason = found[0].get("StateReason") or {}
        code = str(reason.get("Code") or "")
        cause = api.CAUSES.get(code)
        return (
            f"{cause + ': ' if cause else ''}instance {iid} is {state} ({code}: {reason.get('Message', '')})"
        )

    # -- orphans -------------------------------------------------------------------------------------

    def reap(self, min_age: float = 900.0) -> list[str]:
        """Terminate this owner's clusters nobody uses any more, found by their tags alone (``reap.py``)."""
        from airflow_provider_sky.backends.aws.reap import reap

        return reap(self, min_age)

    # -- the Test button -----------------------------------------------------------------------------

    def test_connection(self) -> str:
        """The credentials work in the region and may launch instances (a dry run), running nothing."""
        try:
            zones = self.ec2.describe_availability_zones()["AvailabilityZones"]
        except Exception as exc:
            raise api.client_error(f"reaching EC2 in {self.settings.region or 'the region'}", exc) from None
        self.public_key()
        return f"EC2 {self.region}: {len(zones)} zones; credentials accepted; SSH key loads"


def _with_agent(handle: ClusterHandle, record: Mapping[str, Any]) -> ClusterHandle:
    """The handle with the record's ``extra["agent"]`` (where the head agent listens), if it has one."""
    agent = (record.get("extra") or {}).get(EXTRA_KEY)
    return replace(handle, extra={**handle.extra, EXTRA_KEY: agent}) if agent else handle
