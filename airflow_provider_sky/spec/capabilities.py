"""What a backend can do, and the problems a spec has on it, named before anything is provisioned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_provider_sky.spec.common import (
    SpecError,
)
from airflow_provider_sky.spec.nodes import FIELD, backend_max, num_nodes_problem
from airflow_provider_sky.spec.resources import (
    Resources,
)
from airflow_provider_sky.spec.task import (
    TaskSpec,
    is_bucket_source,
)

# ---------------------------------------------------------------------------------------------------------
# backends


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can honour, so a request it would silently drop is refused before launch."""

    name: str
    max_nodes: int
    supported_resources: frozenset[str]
    clouds: frozenset[str]
    #: ``s3://`` sources copied to the nodes (presigned URLs fetched by each node)
    supports_bucket_mounts: bool = True
    #: buckets mounted on the nodes (rclone and FUSE, ``mode: MOUNT`` / ``MOUNT_CACHED``)
    supports_fuse_mounts: bool = True
    #: why not, when ``supports_fuse_mounts`` is False
    no_fuse_why: str = ""
    #: SkyPilot ``volumes`` (PersistentVolumeClaims) mounted on every node
    supports_volumes: bool = False


#: why a backend that runs on machines it does not choose cannot honour a field (shown with "remove it")
_WHY_NOT = {
    "use_spot": "its machines are not bought, so there are no spot instances to ask for",
    "instance_type": "it does not choose machines, so there is no instance type to pick",
    "disk_size": "it does not create disks",
    "region": "it does not choose where machines are",
    "zone": "it does not choose where machines are",
    "image_id": "it runs commands on the machines as they are; images are run by the kubernetes backend "
    "(a skykubernetes connection)",
    "ports": "it opens no ports; reach the port from inside the cluster or open it yourself",
}

#: fields a backend that cannot give them ignores with a warning at launch (SkyPilot treats them as
#: preferences), instead of refusing the task
SOFT_RESOURCES: dict[str, str] = {
    "disk_tier": "it gives the nodes the disks it has (no backend sets a disk tier yet)",
    "network_tier": "it gives the nodes the network they have (no backend sets up a faster network, such as "
    "EFA or InfiniBand, yet)",
}


def describe_resources(res: Resources) -> str:
    """One alternative in a line: ``H100:8, cpus 8+, infra k8s`` (``no particular resources`` if empty)."""
    parts = []
    if res.accelerators is not None:
        parts.append(str(res.accelerators))
    for key, value in res.requested().items():
        if key != "accelerators":
            parts.append(f"{key} {value}")
    return ", ".join(parts) or "no particular resources"


def resource_problems(
    res: Resources, caps: BackendCapabilities, backends: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """(field, why) for every field of ``res`` the backend cannot honour; empty: it can.

    ``backends``: the backends this provider has (kind -> connection type), so an error names one only
    when it exists.
    """
    problems: list[tuple[str, str]] = []
    requested = res.requested()
    cloud = requested.pop("cloud", None)
    if isinstance(cloud, str) and cloud not in caps.clouds:
        accepted = ", ".join(sorted(caps.clouds)) or "none"
        if backends and cloud in backends and cloud != caps.name:
            hint = f"remove cloud/infra, or run it with a {backends[cloud]} connection (the {cloud} backend)"
        else:
            hint = (
                f"remove cloud/infra to run on the {caps.name} backend's machines; no backend of this "
                f"provider runs on {cloud!r}"
            )
        problems.append(
            (
                "resources.cloud",
                f"the {caps.name} backend cannot run on cloud {cloud!r} (it accepts: {accepted}); {hint}",
            )
        )
    for key, value in requested.items():
        if problems and key in ("region", "zone"):
            continue  # parts of the refused cloud's infra: removing cloud/infra removes them too
        if key in SOFT_RESOURCES:
            continue  # see ignored_resources
        if key not in caps.supported_resources:
            why = _WHY_NOT.get(key)
            drop = f"remove it (or pass resources={{{key!r}: None}} to keep the YAML as is)"
            reason = f"{why}; {drop}" if why else drop
            problems.append(
                (f"resources.{key}", f"the {caps.name} backend cannot honour {key} ({value}); {reason}")
            )
    return problems


def ignored_resources(res: Resources, caps: BackendCapabilities) -> list[tuple[str, str]]:
    """(field, why) for each field of ``res`` the backend accepts without giving it (``disk_tier``,
    ``network_tier``): one warning at launch names each."""
    return [
        (f"resources.{key}", f"the {caps.name} backend ignores {key} ({value}): {SOFT_RESOURCES[key]}")
        for key, value in res.requested().items()
        if key in SOFT_RESOURCES and key not in caps.supported_resources
    ]


def spec_problems(spec: TaskSpec, caps: BackendCapabilities) -> list[tuple[str, str]]:
    """(field, why) for what of ``spec`` beyond its resources ``caps`` cannot honour (node count, bucket
    mounts): what no resources alternative changes."""
    problems: list[tuple[str, str]] = []
    if (problem := num_nodes_problem(spec.num_nodes, backend_max(caps.name, caps.max_nodes))) is not None:
        problems.append((FIELD, problem))
    if not caps.supports_bucket_mounts:
        for dest, src in spec.file_mounts.items():
            if is_bucket_source(src):
                problems.append(
                    (
                        f"file_mounts.{dest}",
                        f"the {caps.name} backend cannot copy bucket {src!r}; copy it in setup "
                        "(e.g. with aws s3 cp) or pick another backend",
                    )
                )
    if not caps.supports_volumes:
        for path, name in spec.volumes.items():
            problems.append(
                (
                    f"volumes.{path}",
                    f"the {caps.name} backend cannot mount volume {name!r}: a SkyPilot volume is a "
                    "Kubernetes PersistentVolumeClaim, which only the kubernetes backend mounts; run the task "
                    "there, or give the data as file_mounts (a local path or an S3 bucket)",
                )
            )
    if not caps.supports_fuse_mounts:
        mounts = [(dest, f"bucket {mount.url} ({mount.mode})") for dest, mount in spec.storage.items()]
        for dest in spec.unset_buckets:  # its name is given at launch; its mode is known now
            written = spec.mounts_at_launch.get(dest)
            raw = written.get("mode") if isinstance(written, Mapping) else None
            mode = (raw if isinstance(raw, str) else "").strip().upper() or "MOUNT"
            if mode != "COPY":
                mounts.append((dest, f"a bucket ({mode})"))
        for dest, what in mounts:
            problems.append(
                (
                    f"file_mounts.{dest}",
                    f"the {caps.name} backend cannot mount {what}: {caps.no_fuse_why}; "
                    "use mode: COPY (the node gets a copy before setup), or mount it in your image's "
                    "entrypoint",
                )
            )
    return problems


def problems_error(backend: str, problems: Sequence[tuple[str, str]]) -> SpecError:
    """One error for every problem at once: a single one as it is, several listed with their fields."""
    if len(problems) == 1:
        return SpecError(*problems[0])
    fields_text = ", ".join(f for f, _ in problems)
    listed = "; ".join(f"{f}: {m}" for f, m in problems)
    return SpecError(
        fields_text, f"the {backend} backend cannot run this task, {len(problems)} problems: {listed}"
    )


def check_backend(
    spec: TaskSpec, caps: BackendCapabilities, backends: Mapping[str, str] | None = None
) -> None:
    """Raise one SpecError naming everything ``caps`` cannot honour (nothing the user asked for is dropped).

    ``cloud`` is checked against ``caps.clouds`` (not ``supported_resources``); every other requested
    resources field must be in ``supported_resources``. With alternatives (``any_of``, ``ordered``, several
    accelerators) one that the backend can honour is enough; none is an error listing each one's problems.
    """
    problems = spec_problems(spec, caps)
    choices = spec.resource_choices
    per_choice = [resource_problems(r, caps, backends) for r in choices]
    if len(choices) == 1:
        problems += per_choice[0]
    elif all(per_choice):
        problems.append(
            (
                "resources",
                f"none of the {len(choices)} alternatives can run on the {caps.name} backend: "
                + " | ".join(
                    f"#{i + 1} ({describe_resources(r)}): " + "; ".join(m for _, m in p)
                    for i, (r, p) in enumerate(zip(choices, per_choice, strict=True))
                ),
            )
        )
    if problems:
        raise problems_error(caps.name, problems)
