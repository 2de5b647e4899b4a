"""EC2 for the AWS backend's tests: moto's server over real HTTP, a fault-injecting proxy in front of it,
and the fake network that stands in for booted machines.

* ``MotoEC2``: moto's ``ThreadedMotoServer`` on a free loopback port; the backend reaches it only through
  the connection's ``endpoint_url``, exactly as it would reach AWS. ``reset()`` empties it between tests.
* ``FaultProxy`` (a test fake of AWS's failures): forwards every request to moto, except that it answers
  chosen API actions with the error AWS would send (``InsufficientInstanceCapacity``,
  ``VcpuLimitExceeded``, ...), as AWS's XML error document; moto cannot run out of capacity or quota.
  It can also lose a reply after moto carried the call out, and it plays two parts of EC2 moto lacks:
  a RunInstances repeated with the same ``ClientToken`` (botocore's retry) gets the first one's reply
  instead of a second set of instances, and (:func:`case_blind_group_names`) security group names
  compared without case.
* ``FakeNetwork`` (a test fake): moto boots nothing and its instance addresses reach nothing, so no test
  connects to them. The backend's one address hook, ``AWSBackend.endpoint(instance)``, is replaced by one
  that gives each live moto instance a real sshd host of ``tests/support/sshd.py`` (its loopback address, port and
  user). Everything else (tags, waiters, teardown, SSH, the runtime) is the product's own code.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import os
import pwd
import shlex
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from moto.server import ThreadedMotoServer
from sshd import SSHDCluster, _kill, user_processes

from airflow_provider_sky.backends.aws.ec2 import LIVE_STATES

REGION = "us-east-1"
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
#: an AMI moto ships with (Ubuntu 16.04, Canonical's account)
IMAGE = "ami-785db401"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoEC2:
    """moto's server on 127.0.0.1; ``url`` is the endpoint URL a connection gives."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.url = f"http://127.0.0.1:{self.port}"
        #: the credentials the tests' own clients use (an admin's while IAM is enforced)
        self.keys = ("testing", "testing")

    @classmethod
    def at(cls, url: str, keys: tuple[str, str]) -> MotoEC2:
        """A handle on a server another process runs (nothing started here)."""
        this = cls.__new__(cls)
        this.url, this.keys = url, keys
        return this

    def start(self) -> MotoEC2:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")).read()

    def client(self, url: str | None = None, service: str = "ec2") -> Any:
        """A boto3 client of the tests' own (to look at moto, or to make foreign instances)."""
        return boto3.client(
            service,
            region_name=REGION,
            endpoint_url=url or self.url,
            aws_access_key_id=self.keys[0],
            aws_secret_access_key=self.keys[1],
        )

    def enforce_iam(self, on: bool) -> None:
        """moto checks every call against the caller's IAM policies (actions only: moto ignores a
        statement's Resource and Condition), or stops checking."""
        body = b"0" if on else b"inf"
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=body,
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request).read()
        if not on:
            self.keys = ("testing", "testing")


@dataclass
class Fault:
    """Answer ``action`` with AWS's error ``code`` (HTTP ``status``), from its ``after``-th call on.

    ``reach``: the call is carried out by moto first and only its reply is lost (replaced by the error,
    or, with ``status`` 0, by a connection closed without any reply), as when a reply times out."""

    action: str
    code: str
    message: str
    status: int = 400
    after: int = 0
    seen: int = 0
    reach: bool = False


class FaultProxy:
    """A test fake of AWS failing: forwards to moto, answers the faults' actions with their errors."""

    def __init__(self, target: str) -> None:
        self.target = urllib.parse.urlparse(target)
        self.faults: list[Fault] = []
        #: action -> a function run before that call is forwarded (to change moto's state meanwhile)
        self.before: dict[str, Callable[[], None]] = {}
        #: action -> a function of the call's parameters giving the fault to answer it with, or None (for
        #: AWS behaviour moto lacks, decided per call)
        self.answer: dict[str, Callable[[dict[str, str]], Fault | None]] = {}
        self.calls: list[str] = []
        #: the reply of each RunInstances by its client token
        self._launched: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                params = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode()).items()}
                action = params.get("Action", "")
                fault = proxy._fault(action)
                hook = proxy.before.pop(action, None)
                if hook is not None:
                    hook()
                decide = proxy.answer.get(action)
                if fault is None and decide is not None:
                    fault = decide(params)
                if fault is not None and fault.reach:
                    self._forward(body)  # moto carries the call out; its reply is lost
                if fault is not None and fault.status == 0:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None:
                    xml = (
                        f"<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error><Code>{fault.code}"
                        f"</Code><Message>{fault.message}</Message></Error></Errors>"
                        "<RequestID>fault-proxy</RequestID></Response>"
                    ).encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "text/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                status, reply_headers, data = self._forward(body)
                self.send_response(status)
                for k, v in reply_headers:
                    if k.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                params = urllib.parse.parse_qs(body.decode())
                token = params.get("ClientToken", [""])[0] if params.get("Action") == ["RunInstances"] else ""
                with proxy._lock:
                    if (
                        token in proxy._launched
                    ):  # EC2's idempotency, which moto lacks: same token, same reply
                        return proxy._launched[token]
                reply = self._send(body)
                if token and reply[0] == 200:
                    with proxy._lock:
                        proxy._launched[token] = reply
                return reply

            def _send(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(
                    proxy.target.hostname or "127.0.0.1", proxy.target.port, timeout=60
                )
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    conn.request("POST", self.path, body, headers)
                    resp = conn.getresponse()
                    return resp.status, resp.getheaders(), resp.read()
                finally:
                    conn.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _fault(self, action: str) -> Fault | None:
        with self._lock:
            self.calls.append(action)
            for fault in self.faults:
                if fault.action == action:
                    fault.seen += 1
                    if fault.seen > fault.after:
                        return fault
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def case_blind_group_names(moto: MotoEC2) -> Callable[[dict[str, str]], Fault | None]:
    """For ``FaultProxy.answer["CreateSecurityGroup"]``: EC2 compares a VPC's group names without case
    ("Names are case-insensitive and must be unique within the VPC", CreateSecurityGroup's reference);
    moto compares them exactly. A name equal but for case to an existing group's is a duplicate."""

    def decide(params: dict[str, str]) -> Fault | None:
        name, vpc = params.get("GroupName", ""), params.get("VpcId", "")
        groups = moto.client().describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]}])
        if any(g["GroupName"].lower() == name.lower() for g in groups["SecurityGroups"]):
            message = f"The security group '{name}' already exists for VPC '{vpc}'"
            return Fault("CreateSecurityGroup", "InvalidGroup.Duplicate", message)
        return None

    return decide


@dataclass
class FakeNetwork:
    """A test fake: each live moto instance is reached at one sshd host of ``hosts`` (first free one)."""

    hosts: SSHDCluster
    moto: MotoEC2
    assigned: dict[str, int] = field(default_factory=dict)
    #: instances whose SSH never answers (their address: a loopback port nothing listens on)
    dead: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: (instance, its shutdown behaviour) of each node powered off through :meth:`power_button`
    powered_off: list[tuple[str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None
    _button: Path | None = None

    #: shared mode (:meth:`share`): the assignments live in this JSON file, under an flock, so Airflow's
    #: own processes (scheduler's tasks, triggerer) see the same network (``tests/fake_ec2_site``)
    state: Path | None = None

    def share(self, path: Path) -> Path:
        """Write what another process needs to join this network; returns the file for
        ``SKY_TEST_FAKE_EC2_NET`` (set only by tests)."""
        hosts = [{"host": n.host, "port": n.port, "user": n.user, "home": n.home} for n in self.hosts.nodes]
        doc = {"moto": self.moto.url, "keys": list(self.moto.keys), "pubkey": self.hosts.client_pubkey}
        path.write_text(json.dumps({**doc, "hosts": hosts, "assigned": self.assigned}))
        self.state = path
        return path

    @classmethod
    def joined(cls, path: Path) -> FakeNetwork:
        """The network another process shared (:meth:`share`)."""
        doc = json.loads(path.read_text())
        hosts = _SharedHosts([_SharedNode(i, **h) for i, h in enumerate(doc["hosts"])], doc["pubkey"])
        return cls(hosts, MotoEC2.at(doc["moto"], tuple(doc["keys"])), state=path)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def _shared(self) -> Iterator[None]:
        """Under the lock (the file's too in shared mode), with ``assigned`` as the file has it."""
        with self._lock:
            if self.state is None:
                yield
                return
            with open(f"{self.state}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                doc = json.loads(self.state.read_text())
                self.assigned = doc["assigned"]
                yield
                doc["assigned"] = self.assigned
                tmp = self.state.with_suffix(".tmp")
                tmp.write_text(json.dumps(doc))
                tmp.replace(self.state)

    @staticmethod
    def agent_address(backend: Any, node: Any) -> str:
        """``AWSBackend.agent_address`` on this network: the instances' node agents reach their head at the
        head's sshd host (else they never join, and a provision waits the agents' join wait)."""
        return str(node.extra["host"])

    def endpoint(self, backend: Any, instance: Mapping[str, Any]) -> tuple[str, int, str]:
        iid = str(instance["InstanceId"])
        if iid in self.dead:
            return "127.0.0.1", _closed_port(), "nobody"
        with self._shared():
            if iid not in self.assigned:
                live = self._live()
                held = {i for inst, i in self.assigned.items() if inst in live}
                free = [i for i in range(len(self.hosts.nodes)) if i not in held]
                if not free:
                    raise AssertionError(
                        f"FakeNetwork: more live instances than the {len(self.hosts.nodes)} hosts"
                    )
                self.assigned[iid] = free[0]
                self._fresh_machine(free[0])
            node = self.hosts.nodes[self.assigned[iid]]
        return node.host, node.port, node.user

    def _live(self) -> set[str]:
        pages = (
            self.moto.client()
            .get_paginator("describe_instances")
            .paginate(Filters=[{"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
        )
        return {i["InstanceId"] for p in pages for r in p["Reservations"] for i in r["Instances"]}

    def _fresh_machine(self, index: int) -> None:
        """A new instance is a new machine: nothing of the host's last instance runs or stays on disk."""
        node = self.hosts.nodes[index]
        _kill(user_processes(node.user))
        self.hosts._reset_home(node, pwd.getpwnam(node.user))

    def power_off_gone(self) -> None:
        """Hosts whose instance moto no longer has live stop (their processes end), as EC2's would."""
        live = self._live()
        with self._shared():
            gone = [index for iid, index in self.assigned.items() if iid not in live]
        for index in gone:
            _kill(user_processes(self.hosts.nodes[index].user))

    def host_of(self, instance_id: str) -> int:
        return self.assigned[instance_id]

    def power_button(self) -> str:
        """The fake's power supply: returns a power-off command for the connection's
        ``poweroff_command``. A node that runs it (as its user, from the keeper) is powered off: its
        processes end, and EC2's part is played through moto's API, as EC2 applies an instance's
        ``InstanceInitiatedShutdownBehavior`` (read back from moto): ``terminate`` terminates it,
        anything else (EC2's default is ``stop``) stops it."""
        # under /tmp itself: pytest's tmp_path is not reachable by the hosts' users
        directory = Path(tempfile.mkdtemp(prefix="sky-fake-power-"))
        directory.chmod(0o1777)  # every host user may press its own button
        self._button = directory
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, args=(directory,), daemon=True)
        self._watcher.start()
        return f': > {shlex.quote(str(directory))}/"$(id -un)"'

    def _watch(self, directory: Path) -> None:
        while not self._stop.wait(0.2):
            for pressed in list(directory.iterdir()):
                try:
                    self._power_off(pressed.name)
                except Exception as exc:  # a test fake: say it, keep watching
                    logging.getLogger(__name__).warning("FakeNetwork power-off of %s: %s", pressed.name, exc)
                pressed.unlink()

    def _power_off(self, user: str) -> None:
        index = next(i for i, n in enumerate(self.hosts.nodes) if n.user == user)
        live = self._live()
        ec2 = self.moto.client()
        for iid in [i for i, at in self.assigned.items() if at == index and i in live]:
            attr = ec2.describe_instance_attribute(
                InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior"
            )
            behaviour = attr["InstanceInitiatedShutdownBehavior"]["Value"]
            self.powered_off.append((iid, behaviour))
            if behaviour == "terminate":
                ec2.terminate_instances(InstanceIds=[iid])
            else:
                ec2.stop_instances(InstanceIds=[iid])
        _kill(user_processes(user))

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
        if self._button is not None:
            shutil.rmtree(self._button, ignore_errors=True)


@dataclass
class _SharedNode:
    index: int
    host: str
    port: int
    user: str
    home: str


@dataclass
class _SharedHosts:
    """The sshd hosts as another process sees them (no daemons of its own): enough to give an instance
    a fresh machine, as ``SSHDCluster._reset_home`` does."""

    nodes: list[_SharedNode]
    client_pubkey: str

    def _reset_home(self, node: _SharedNode, pw: pwd.struct_passwd) -> None:
        home = Path(pw.pw_dir)
        SSHDCluster._clear_home(str(home))
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        (ssh_dir / "authorized_keys").write_text(self.client_pubkey + "\n")
        for path in (home, ssh_dir, ssh_dir / "authorized_keys"):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(ssh_dir / "authorized_keys", 0o600)


_CLOSED: list[int] = []


def _closed_port() -> int:
    if not _CLOSED:
        _CLOSED.append(_free_port())  # bound and released: nothing listens there
    return _CLOSED[0]


def ours_left(ec2: Any, name: str) -> dict[str, list[str]]:
    """Everything tagged for cluster ``name`` that still exists: live instances, groups, key pairs."""
    f = [{"Name": "tag:sky-airflow:cluster", "Values": [name]}]
    inst = [
        i["InstanceId"]
        for r in ec2.describe_instances(
            Filters=[*f, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
        )["Reservations"]
        for i in r["Instances"]
    ]
    groups = [g["GroupId"] for g in ec2.describe_security_groups(Filters=f)["SecurityGroups"]]
    keys = [k["KeyName"] for k in ec2.describe_key_pairs(Filters=f)["KeyPairs"]]
    return {k: v for k, v in {"instances": inst, "security_groups": groups, "key_pairs": keys}.items() if v}


def iter_instances(ec2: Any, **kw: Any) -> Iterator[dict[str, Any]]:
    for r in ec2.describe_instances(**kw)["Reservations"]:
        yield from r["Instances"]


@dataclass
class Lifecycle:
    """What one provision → find → terminate of N instances cost: seconds and EC2 API calls by action."""

    n: int
    provision_s: float
    find_s: float
    terminate_s: float
    provision_calls: dict[str, int]
    find_calls: dict[str, int]
    terminate_calls: dict[str, int]

    @property
    def calls(self) -> int:
        return (
            sum(self.provision_calls.values())
            + sum(self.find_calls.values())
            + sum(self.terminate_calls.values())
        )


def measure_lifecycle(moto: MotoEC2, config: Mapping[str, Any], n: int, name: str = "bench") -> Lifecycle:
    """Provision ``n`` nodes, find the cluster from a fresh backend, terminate it; every EC2 call goes
    through a counting ``FaultProxy`` (no faults). ``config``: the sky_aws connection's, endpoint aside.
    Used by the tests (calls must not grow per instance) and by ``make bench``'s AWS figure."""
    from collections import Counter

    from airflow_provider_sky.backends.aws import AWSBackend
    from airflow_provider_sky.spec import task_from_args

    moto.client().describe_vpcs()  # moto builds a region's EC2 on its first call (seconds): not timed
    proxy = FaultProxy(moto.url)
    try:
        cfg = {**config, "endpoint_url": proxy.url}

        def phase(fn: Any) -> tuple[float, dict[str, int]]:
            start, mark = time.monotonic(), len(proxy.calls)
            fn()
            return time.monotonic() - start, dict(Counter(proxy.calls[mark:]))

        spec = task_from_args(num_nodes=n, run="true")
        p_s, p_calls = phase(lambda: AWSBackend.from_config(cfg).provision(name, spec, holder="bench/run"))
        f_s, f_calls = phase(lambda: AWSBackend.from_config(cfg).find(name))
        t_s, t_calls = phase(lambda: AWSBackend.from_config(cfg).terminate(name, holder="bench/run"))
        return Lifecycle(n, p_s, f_s, t_s, p_calls, f_calls, t_calls)
    finally:
        proxy.stop()
