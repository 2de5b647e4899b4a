"""A lost EC2 instance of a gang with retries replaced by a new one (``Backend.replace_nodes``).

Kept apart from ``backend.py`` (provision, find, terminate): the new instance copies a healthy one's
launch spec and carries the cluster's tags, so finding and teardown by tag cover it as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_provider_sky.backends.aws import ec2 as api
from airflow_provider_sky.backends.aws.launch import Launch
from airflow_provider_sky.backends.base import BackendError, ClusterHandle, Node

if TYPE_CHECKING:
    from airflow_provider_sky.backends.aws.backend import AWSBackend

log = logging.getLogger(__name__)
#: how long a failed replacement waits for the instances it made to be gone
TERMINATE_WAIT = 600.0


def make_replacements(
    self: AWSBackend, handle: ClusterHandle, ranks: Sequence[int], todo: list[int], made: list[Any]
) -> dict[int, Node]:
    """Each lost worker instance of ``todo`` is terminated and one new instance launched with a healthy
    instance's launch spec (image, type, key pair, security groups, subnet, spot, root disk) and the
    cluster's tags; its SSH is waited for and its host key pinned. ``made``: the launch, once made."""
    name = handle.name
    kept = [n for i, n in enumerate(handle.nodes) if i not in ranks]
    model = self._by_ids([str(kept[-1].extra.get("instance_id") or kept[-1].node_id)])
    if not model:
        raise BackendError(f"instance {kept[-1].node_id} of cluster {name!r} is not found in EC2")
    request = _relaunch_request(self, name, model[0], len(todo))  # before anything is ended
    lost_ids = [str(handle.nodes[r].extra.get("instance_id") or handle.nodes[r].node_id) for r in todo]
    try:
        self.ec2.terminate_instances(InstanceIds=lost_ids)
    except Exception as exc:
        if api.error_code(exc)[0] != "InvalidInstanceID.NotFound":  # gone already: fine
            raise api.client_error(f"terminating the lost instance(s) {', '.join(lost_ids)}", exc) from None
    launch = Launch(name, self.owner)
    made.append(launch)
    launched = launch.run(self.ec2, request, f"launching {len(todo)} x {request['InstanceType']}")
    nodes = self._reach(name, self._wait_running(name, [str(i["InstanceId"]) for i in launched]), {})
    return dict(zip(todo, nodes, strict=True))


def undo_replacements(
    self: AWSBackend, handle: ClusterHandle, todo: list[int], launch: Launch, exc: BaseException
) -> None:
    """Every instance of the replacement's launch goes (also those of a launch whose reply was lost)."""
    done, gone = launch.undo(self.ec2, TERMINATE_WAIT, self.lookup_delays)
    if isinstance(exc, BackendError):
        state = f"{done or 'nothing launched'}{'; nothing of it is left' if gone else ''}"
        raise BackendError(
            f"cluster {handle.name!r}: replacing rank(s) {todo} failed: {exc}; {state}"
        ) from None
    log.warning("cluster %s: after a failed replacement: %s", handle.name, done)


def _relaunch_request(self: AWSBackend, name: str, model: Mapping[str, Any], n: int) -> dict[str, Any]:
    """A RunInstances of ``n`` workers like ``model`` (a running instance of the cluster)."""
    root_device, disk = model.get("RootDeviceName"), None
    for bdm in model.get("BlockDeviceMappings") or ():
        volume = (bdm.get("Ebs") or {}).get("VolumeId")
        if bdm.get("DeviceName") == root_device and volume:
            # the new instance gets the same disk, or nothing is launched (never a quieter default disk)
            try:
                vols = self.ec2.describe_volumes(VolumeIds=[volume])["Volumes"]
            except Exception as exc:
                raise api.client_error(
                    f"reading the size of {model.get('InstanceId')}'s root volume {volume} (the new "
                    "instance gets the same disk)",
                    exc,
                ) from None
            if not vols:
                raise BackendError(
                    f"the root volume {volume} of {model.get('InstanceId')} is not found: its size is not "
                    "known, so no instance is launched in place of the lost one"
                )
            disk = int(vols[0]["Size"])
    return api.run_request(
        name,
        self.owner,
        n=n,
        image=str(model["ImageId"]),
        instance_type=str(model["InstanceType"]),
        key_name=str(model.get("KeyName") or self.settings.key_name or ""),
        groups=[str(g["GroupId"]) for g in model.get("SecurityGroups") or ()],
        subnet=str(model.get("SubnetId") or ""),
        public_ip=not self.settings.use_private_ips,
        root_device=str(root_device) if disk and root_device else None,
        disk_size=disk,
        spot=model.get("InstanceLifecycle") == "spot",
    )
