"""EC2 calls the backend makes, one place: the client, tags, errors in plain words, the cluster's
security group and key pair. Every call names what it was doing when it fails; no secret is logged.

The tags are the only truth: a cluster's instances, security group and key pair are found, reused and
removed by ``sky-airflow:cluster`` = name and ``sky-airflow:owner`` = owner, never by a name alone.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from airflow_provider_sky.backends.aws.config import AWSSettings
from airflow_provider_sky.backends.base import BackendError

log = logging.getLogger(__name__)

TAG_CLUSTER = "sky-airflow:cluster"
TAG_ROLE = "sky-airflow:role"
TAG_OWNER = "sky-airflow:owner"
#: the SSH host key first seen on the instance, pinned for its life
TAG_HOST_KEY = "sky-airflow:host-key"
#: when the cluster's security group / key pair was made (epoch seconds): tells a leftover from a mutex
TAG_CREATED = "sky-airflow:created"
#: states of an instance that still belongs to a cluster (terminated ones linger in listings for an hour)
LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
#: Canonical's account and the image name the default AMI is taken from (newest first)
UBUNTU_OWNER = "099720109477"
UBUNTU_NAME = "ubuntu/images/hvm-ssd*/ubuntu-jammy-22.04-amd64-server-*"

#: error codes → the cause, in the words the error leads with
CAUSES = {
    "InsufficientInstanceCapacity": "insufficient capacity",
    "InsufficientCapacity": "insufficient capacity",
    "InsufficientHostCapacity": "insufficient capacity",
    "InsufficientSpotCapacity": "insufficient spot capacity",
    "Server.InsufficientInstanceCapacity": "insufficient capacity",
    "InstanceLimitExceeded": "quota",
    "VcpuLimitExceeded": "quota",
    "MaxSpotInstanceCountExceeded": "quota",
    "SpotMaxPriceTooLow": "spot price",
    "Server.SpotInstanceTermination": "spot interruption",
    "Server.SpotInstanceShutdown": "spot interruption",
    "UnauthorizedOperation": "permission denied",
    "AccessDenied": "permission denied",
    "AuthFailure": "credentials refused",
    "InvalidClientTokenId": "credentials refused",
    "SignatureDoesNotMatch": "credentials refused",
    "InvalidAMIID.NotFound": "bad image",
    "InvalidAMIID.Malformed": "bad image",
    "InvalidKeyPair.NotFound": "bad key pair",
    "InvalidSubnetID.NotFound": "bad subnet",
    "InvalidGroup.NotFound": "bad security group",
}
#: what to do about a cause
FIXES = {
    "insufficient capacity": "try another zone or instance type, or later",
    "insufficient spot capacity": "retry later, another zone, or without use_spot",
    "quota": "ask AWS for a higher quota (Service Quotas: EC2 vCPUs / instances) or ask for fewer nodes",
    "spot interruption": "retry, or run without use_spot",
    "permission denied": "grant the IAM permissions in docs/backends/aws.md (iam.policy() gives them)",
    "credentials refused": "fix the connection's access key (login/password) or its aws connection",
    "bad image": "fix resources.image_id or the connection's image_id (an AMI of this region)",
    "bad key pair": "fix key_name, or leave it empty to import the private key's public half",
}


class Duplicate(Exception):
    """The cluster's security group or key pair exists already: its name is the provision's mutex (EC2
    creates a name once), so another provision of the cluster is under way, or a teardown left it."""


def client_error(what: str, exc: BaseException) -> BackendError:
    """``exc`` (botocore's) as a BackendError that leads with the cause and says the fix."""
    code, message = error_code(exc)
    cause = CAUSES.get(code, "")
    fix = FIXES.get(cause, "")
    head = f"{cause} ({code})" if cause else code or type(exc).__name__
    return BackendError(f"{what}: {head}: {message}" + (f"; {fix}" if fix else ""))


def error_code(exc: BaseException) -> tuple[str, str]:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        err = response.get("Error") or {}
        return str(err.get("Code") or ""), str(err.get("Message") or exc)
    return "", str(exc)


#: clients of connections with keys of their own, by service, region, endpoint and keys (hashed):
#: building one loads EC2's service model and builds ~700 methods (0.2-0.35 s of CPU), which a process
#: that makes a backend per task, trigger or poll paid every time. boto3's clients are thread-safe.
_CLIENTS: dict[tuple[str, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def make_client(settings: AWSSettings, service: str = "ec2") -> Any:
    """A boto3 client of this connection's own session (credentials in memory, never the global default).

    A connection with keys of its own shares one client per process; one whose session comes from the
    Amazon provider (role assumption, profiles) gets a new client each time, as that session decides."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise BackendError("the aws backend needs boto3: pip install 'airflow-provider-sky[aws]'") from None
    key: tuple[str, ...] | None = None
    if settings.session_factory is not None:  # the Amazon provider's (hooks/aws.py): may assume a role
        try:
            session = settings.session_factory(settings.region)
        except Exception as exc:
            raise client_error(
                "getting credentials from the aws connection (role_arn, profile)", exc
            ) from None
    else:
        if settings.access_key_id and settings.secret_access_key and settings.region:
            secret = f"{settings.secret_access_key}\0{settings.session_token or ''}"
            key = (
                service,
                settings.region,
                settings.endpoint_url or "",
                settings.access_key_id,
                hashlib.sha256(secret.encode()).hexdigest(),
            )
            with _CLIENTS_LOCK:
                if key in _CLIENTS:
                    return _CLIENTS[key]
        session = boto3.session.Session(
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            aws_session_token=settings.session_token,
            region_name=settings.region,
        )
    region = settings.region or session.region_name
    if not region:
        raise BackendError(
            "region_name: no region; set it in the connection (or its aws connection), e.g. us-east-1"
        )
    config = Config(retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=10, read_timeout=60)
    client = session.client(service, region_name=region, endpoint_url=settings.endpoint_url, config=config)
    if key is not None:
        with _CLIENTS_LOCK:
            client = _CLIENTS.setdefault(key, client)
    return client


def tag_filters(name: str, owner: str) -> list[dict[str, Any]]:
    return [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [name]},
        {"Name": f"tag:{TAG_OWNER}", "Values": [owner]},
    ]


def tags_of(resource: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags") or ()}


def ours(resource: Mapping[str, Any], name: str, owner: str) -> bool:
    """Both of our tags, for this cluster: the check made again before anything is removed."""
    tags = tags_of(resource)
    return tags.get(TAG_CLUSTER) == name and tags.get(TAG_OWNER) == owner


def tag_spec(kind: str, name: str, owner: str, role: str | None = None, **more: str) -> dict[str, Any]:
    tags = {TAG_CLUSTER: name, TAG_OWNER: owner, "Name": f"sky-{name}" + (f"-{role}" if role else "")}
    if role:
        tags[TAG_ROLE] = role
    tags.update(more)
    return {"ResourceType": kind, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}


def describe_instances(ec2: Any, name: str, owner: str) -> list[dict[str, Any]]:
    """The cluster's instances not yet terminated (paginated: one call per 1,000)."""
    filters = [*tag_filters(name, owner), {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
    out: list[dict[str, Any]] = []
    try:
        for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page.get("Reservations") or ():
                out.extend(i for i in reservation.get("Instances") or () if ours(i, name, owner))
    except Exception as exc:
        raise client_error(f"listing the instances of cluster {name!r}", exc) from None
    return out


def default_image(ec2: Any) -> str:
    """The newest Ubuntu 22.04 (amd64) AMI Canonical publishes in the region."""
    try:
        images = ec2.describe_images(
            Owners=[UBUNTU_OWNER],
            Filters=[{"Name": "name", "Values": [UBUNTU_NAME]}, {"Name": "state", "Values": ["available"]}],
        ).get("Images", [])
    except Exception as exc:
        raise client_error("finding the default image (Ubuntu 22.04)", exc) from None
    if not images:
        raise BackendError(
            "image_id: no Ubuntu 22.04 image found in the region to default to; give resources.image_id "
            "or the connection's image_id"
        )
    return str(max(images, key=lambda i: (i.get("CreationDate") or "", i.get("Name") or ""))["ImageId"])


def root_device(ec2: Any, image_id: str) -> str:
    try:
        images = ec2.describe_images(ImageIds=[image_id]).get("Images", [])
    except Exception as exc:
        raise client_error(f"image {image_id}", exc) from None
    if not images:
        raise BackendError(f"image_id: {image_id} does not exist in this region; give an AMI of the region")
    return str(images[0].get("RootDeviceName") or "/dev/sda1")


def subnet_vpc(ec2: Any, subnet_id: str | None, zone: str | None) -> tuple[str, str]:
    """(subnet, VPC): the given subnet, else a default subnet of the default VPC (in ``zone`` if asked;
    else the first by zone name): the network interface the instances get names its subnet."""
    try:
        if subnet_id:
            subnets = ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"]
            return subnet_id, str(subnets[0]["VpcId"])
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    except Exception as exc:
        raise client_error(f"subnet {subnet_id}" if subnet_id else "finding the default VPC", exc) from None
    if not vpcs:
        raise BackendError("subnet_id: the region has no default VPC; give the connection's subnet_id")
    vpc = str(vpcs[0]["VpcId"])
    filters = [{"Name": "vpc-id", "Values": [vpc]}, {"Name": "default-for-az", "Values": ["true"]}]
    if zone:
        filters.append({"Name": "availability-zone", "Values": [zone]})
    try:
        subnets = ec2.describe_subnets(Filters=filters)["Subnets"]
    except Exception as exc:
        raise client_error(f"finding a subnet{f' in zone {zone}' if zone else ''}", exc) from None
    if not subnets:
        where = (
            f"in {zone!r}; give another zone or subnet_id" if zone else "; give the connection's subnet_id"
        )
        raise BackendError(
            f"{'zone' if zone else 'subnet_id'}: the default VPC has no default subnet {where}"
        )
    return str(min(subnets, key=lambda n: str(n.get("AvailabilityZone")))["SubnetId"]), vpc


def run_request(
    name: str,
    owner: str,
    *,
    n: int,
    image: str,
    instance_type: str,
    key_name: str,
    groups: list[str],
    subnet: str,
    public_ip: bool,
    root_device: str | None,
    disk_size: int | None,
    spot: bool,
) -> dict[str, Any]:
    """The one RunInstances of a cluster: MinCount = MaxCount = N (EC2 gives all or none), every instance
    and volume tagged at creation, the instance terminated (not stopped) when it shuts itself down."""
    interface: dict[str, Any] = {"DeviceIndex": 0, "Groups": groups, "SubnetId": subnet}
    if public_ip:
        interface["AssociatePublicIpAddress"] = True
    request: dict[str, Any] = {
        "ImageId": image,
        "InstanceType": instance_type,
        "MinCount": n,
        "MaxCount": n,
        "KeyName": key_name,
        "NetworkInterfaces": [interface],
        "TagSpecifications": [tag_spec("instance", name, owner, "worker"), tag_spec("volume", name, owner)],
        "InstanceInitiatedShutdownBehavior": "terminate",
    }
    if disk_size and root_device:
        ebs = {"VolumeSize": int(disk_size), "VolumeType": "gp3", "DeleteOnTermination": True}
        request["BlockDeviceMappings"] = [{"DeviceName": root_device, "Ebs": ebs}]
    if spot:
        request["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
        }
    return request


def resource_name(name: str) -> str:
    """The name of cluster ``name``'s own security group and key pair: ``sky-airflow-<name>-<digest>``.

    The digest is of the exact name: EC2 compares security group names without case (``Train`` and
    ``train`` would share one), so the name alone would make two clusters one mutex; with the digest two
    names never map to one group or key pair. (Instances are found by the cluster tag, compared
    exactly.)"""
    return f"sky-airflow-{name}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def port_permissions(ports: Iterable[str]) -> list[dict[str, Any]]:
    """Ingress from anywhere to each of SkyPilot's ``ports`` (``"8080"``, ``"10000-10010"``), as SkyPilot
    opens them on its cluster's security group."""
    out = []
    for port in ports:
        low, _, high = str(port).partition("-")
        out.append(
            {
                "IpProtocol": "tcp",
                "FromPort": int(low),
                "ToPort": int(high or low),
                "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "resources.ports"}],
            }
        )
    return out


def create_security_group(
    ec2: Any, name: str, owner: str, vpc: str, ssh_cidr: str, ports: Iterable[str] = ()
) -> str:
    """The cluster's own group: SSH from ``ssh_cidr``, everything between the cluster's nodes, and the
    task's ``resources.ports`` from anywhere (deleted with the group at teardown)."""
    group_name = resource_name(name)
    try:
        group = ec2.create_security_group(
            GroupName=group_name,
            Description=f"airflow-provider-sky cluster {name}",
            VpcId=vpc,
            TagSpecifications=[tag_spec("security-group", name, owner, **_created())],
        )["GroupId"]
    except Exception as exc:
        if error_code(exc)[0] == "InvalidGroup.Duplicate":
            raise Duplicate(f"security group {group_name}") from None
        raise client_error(f"creating the security group of cluster {name!r}", exc) from None
    try:
        ec2.authorize_security_group_ingress(
            GroupId=group,
            IpPermissions=[
                {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": ssh_cidr}]},
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group}]},
                *port_permissions(ports),
            ],
        )
    except Exception as exc:
        delete_security_groups(ec2, [group])
        raise client_error(f"opening SSH in security group {group}", exc) from None
    return str(group)


def import_key_pair(ec2: Any, name: str, owner: str, public_key: str) -> str:
    key_name = resource_name(name)
    try:
        ec2.import_key_pair(
            KeyName=key_name,
            PublicKeyMaterial=public_key.encode(),
            TagSpecifications=[tag_spec("key-pair", name, owner, **_created())],
        )
    except Exception as exc:
        if error_code(exc)[0] == "InvalidKeyPair.Duplicate":
            raise Duplicate(f"key pair {key_name}") from None
        raise client_error(f"importing the key pair of cluster {name!r}", exc) from None
    return key_name


def _created() -> dict[str, str]:
    return {TAG_CREATED: str(int(time.time()))}


def remove_leftovers(ec2: Any, name: str, owner: str, older_than: float, keep: Iterable[str] = ()) -> bool:
    """Delete the cluster's own security group and key pair when every one of them (but ``keep``, made
    by the caller) was made over ``older_than`` seconds ago; call only when no instance of the cluster
    lives. They are the provisions' mutex for the seconds between their making and the launch, so old
    ones are left over: by nodes that powered themselves off at ``idle_down`` (EC2 terminated the
    instances, nothing deleted these), or by a provision killed before it launched. True if any went."""
    kept = set(keep)
    try:
        groups = ec2.describe_security_groups(Filters=tag_filters(name, owner))["SecurityGroups"]
        pairs = ec2.describe_key_pairs(Filters=tag_filters(name, owner))["KeyPairs"]
    except Exception as exc:
        raise client_error(f"listing what cluster {name!r} left", exc) from None
    found = [
        (str(r.get("GroupId") or r.get("KeyName")), tags_of(r))
        for r in [*groups, *pairs]
        if ours(r, name, owner) and str(r.get("GroupId") or r.get("KeyName")) not in kept
    ]
    now = time.time()
    ages = [now - float(t[TAG_CREATED]) if t.get(TAG_CREATED, "").isdigit() else -1.0 for _, t in found]
    if not found or min(ages) < older_than:
        return False
    group_ids = [str(g["GroupId"]) for g in groups if ours(g, name, owner) and g["GroupId"] not in kept]
    key_names = [str(p["KeyName"]) for p in pairs if ours(p, name, owner) and p["KeyName"] not in kept]
    log.warning(
        "cluster %s: deleting its security group / key pair left over (%s; made %.0fs ago, no instance)",
        name,
        ", ".join(group_ids + key_names),
        min(ages),
    )
    left = delete_security_groups(ec2, group_ids) + delete_key_pairs(ec2, key_names)
    return not left


def cluster_groups(ec2: Any, name: str, owner: str) -> list[str]:
    try:
        groups = ec2.describe_security_groups(Filters=tag_filters(name, owner))["SecurityGroups"]
    except Exception as exc:
        raise client_error(f"listing the security groups of cluster {name!r}", exc) from None
    return [str(g["GroupId"]) for g in groups if ours(g, name, owner)]


def cluster_key_pairs(ec2: Any, name: str, owner: str) -> list[str]:
    try:
        pairs = ec2.describe_key_pairs(Filters=tag_filters(name, owner))["KeyPairs"]
    except Exception as exc:
        raise client_error(f"listing the key pairs of cluster {name!r}", exc) from None
    return [str(p["KeyName"]) for p in pairs if ours(p, name, owner)]


def delete_security_groups(ec2: Any, groups: Iterable[str]) -> list[str]:
    """Delete; return what could not be (logged)."""
    left = []
    for group in groups:
        try:
            ec2.delete_security_group(GroupId=group)
        except Exception as exc:
            code, _ = error_code(exc)
            if code != "InvalidGroup.NotFound":
                log.warning("security group %s could not be deleted: %s", group, client_error("delete", exc))
                left.append(group)
    return left


def delete_key_pairs(ec2: Any, names: Iterable[str]) -> list[str]:
    left = []
    for key in names:
        try:
            ec2.delete_key_pair(KeyName=key)
        except Exception as exc:
            log.warning("key pair %s could not be deleted: %s", key, client_error("delete", exc))
            left.append(key)
    return left


def terminate_and_wait(ec2: Any, ids: list[str], timeout: float) -> None:
    """Terminate ``ids`` (one call per 1,000) and wait until they are gone (the security group can be
    deleted only then)."""
    if not ids:
        return
    try:
        for start in range(0, len(ids), 1000):
            ec2.terminate_instances(InstanceIds=ids[start : start + 1000])
        delay = 2 if timeout < 120 else 5
        ec2.get_waiter("instance_terminated").wait(
            InstanceIds=ids, WaiterConfig={"Delay": delay, "MaxAttempts": max(1, int(timeout // delay))}
        )
    except Exception as exc:
        raise client_error(f"terminating {len(ids)} instances ({', '.join(ids[:4])}...)", exc) from None
