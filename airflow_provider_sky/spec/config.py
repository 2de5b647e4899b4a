"""SkyPilot's task-level ``config:``: ``kubernetes.pod_config`` and ``docker.run_options``, for the pods.

SkyPilot merges ``config.kubernetes.pod_config`` into every pod it makes (``merge_k8s_configs``: mappings
merged key by key, the first container merged into its own, other lists appended) and passes
``config.docker.run_options`` to ``docker run``. Here both become one patch for the kubernetes backend's
pods (the only backend that runs images); the other backends run no pods and no containers, so neither
applies there (as in SkyPilot, where each applies only to its own kind of node). Every other ``config``
key is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.spec.common import SpecError, _type_name

#: docker run options with a pod-spec equivalent, and what each becomes
RUN_OPTIONS_HELP = "--shm-size=SIZE, --ipc=host, --cap-add=CAP, --privileged"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([bkmgt]?)b?", re.IGNORECASE)
_K8S_UNIT = {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}


def _shm(value: str, where: str) -> dict[str, Any]:
    m = _SIZE.fullmatch(value.strip())
    if not m:
        raise SpecError(where, f"--shm-size takes a size such as 16g or 512m, got {value!r}")
    size = f"{m.group(1)}{_K8S_UNIT[m.group(2).lower()]}"
    return {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}]}}


#: why ``config.kubernetes.enable_docker`` is refused, and the nearest thing a task can do itself
ENABLE_DOCKER_WHY = (
    "is SkyPilot's Docker daemon in every pod (a privileged Docker-in-Docker sidecar, or BuildKit with "
    "BUILD), which the kubernetes backend does not set up yet; remove it (to run such a sidecar yourself, "
    "add it as a second container in config.kubernetes.pod_config, and a docker CLI to the task's image)"
)


def run_options_patch(options: object) -> dict[str, Any]:
    """``config.docker.run_options`` as a pod_config patch; an option with no pod equivalent is an error
    naming it."""
    field = "config.docker.run_options"
    if isinstance(options, str):
        options = [options]
    if not isinstance(options, list):
        raise SpecError(field, f"must be a list of docker run options, got {_type_name(options)}")
    words: list[str] = []
    for i, opt in enumerate(options):
        if not isinstance(opt, str):
            raise SpecError(f"{field}[{i}]", f"must be a string, got {_type_name(opt)} {opt!r}")
        words += opt.split()
    patch: dict[str, Any] = {}
    caps: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if not eq and name in ("--shm-size", "--ipc", "--cap-add") and i + 1 < len(words):
            value = words[i + 1]
            i += 1
        if name == "--shm-size":
            patch = merge_patch(patch, _shm(value, field))
        elif name == "--ipc" and value == "host":
            patch = merge_patch(patch, {"spec": {"hostIPC": True}})
        elif name == "--cap-add" and re.fullmatch(r"[A-Z_]+", value.upper()):
            caps.append(value.upper().removeprefix("CAP_"))
        elif name == "--privileged" and not eq:
            patch = merge_patch(patch, {"spec": {"containers": [{"securityContext": {"privileged": True}}]}})
        else:
            raise SpecError(
                field,
                f"{word!r} has no equivalent in a pod here (these do: {RUN_OPTIONS_HELP}); remove it, or "
                "write the pod's own field in config.kubernetes.pod_config",
            )
        i += 1
    if caps:
        add = {"spec": {"containers": [{"securityContext": {"capabilities": {"add": caps}}}]}}
        patch = merge_patch(patch, add)
    return patch


def merge_patch(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` merged into a copy of ``base`` as SkyPilot merges pod_config: mappings key by key, the
    first of ``containers`` into the first, a list item with the ``name`` of one already there into it,
    other list items appended; a scalar replaces."""
    out: dict[str, Any] = {k: _copy(v) for k, v in base.items()}
    for key, value in patch.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = merge_patch(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            out[key] = _merge_list(key, old, value)
        else:
            out[key] = _copy(value)
    return out


def _merge_list(key: str, old: list[Any], new: list[Any]) -> list[Any]:
    merged = list(old)
    if (
        key == "containers"
        and merged
        and new
        and isinstance(merged[0], Mapping)
        and isinstance(new[0], Mapping)
    ):
        merged[0] = merge_patch(merged[0], new[0])
        new = new[1:]
    for item in new:
        name = item.get("name") if isinstance(item, Mapping) else None
        same = next(
            (
                i
                for i, o in enumerate(merged)
                if name is not None and isinstance(o, Mapping) and o.get("name") == name
            ),
            None,
        )
        if same is None:
            merged.append(_copy(item))
        else:
            merged[same] = merge_patch(merged[same], item)
    return merged


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def parse_config(value: object) -> dict[str, Any]:
    """The pod patch a task's ``config:`` asks for ({} when none); any key but ``kubernetes.pod_config``
    and ``docker.run_options`` is an error naming it."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            "config", f"must be a mapping (kubernetes: {{pod_config: ...}}), got {_type_name(value)}"
        )
    patch: dict[str, Any] = {}
    for section, body in value.items():
        where = f"config.{section}"
        if section == "kubernetes" and isinstance(body, Mapping):
            for key, inner in body.items():
                if key == "enable_docker":
                    raise SpecError(f"{where}.{key}", ENABLE_DOCKER_WHY)
                if key != "pod_config":
                    raise SpecError(
                        f"{where}.{key}",
                        "is not supported here (only kubernetes.pod_config is: merged into every pod); "
                        "remove it",
                    )
                if not isinstance(inner, Mapping):
                    raise SpecError(
                        f"{where}.pod_config", f"must be a pod manifest mapping, got {_type_name(inner)}"
                    )
                patch = merge_patch(patch, inner)
        elif section == "docker" and isinstance(body, Mapping):
            for key, inner in body.items():
                if key != "run_options":
                    raise SpecError(
                        f"{where}.{key}", "is not supported here (only docker.run_options is); remove it"
                    )
                patch = merge_patch(patch, run_options_patch(inner))
        else:
            raise SpecError(
                where,
                "is a SkyPilot setting this provider does not support (a task's config: may hold "
                "kubernetes.pod_config and docker.run_options); remove it"
                + (
                    f" ({section} is a cloud no backend here runs on)"
                    if section in ("gcp", "azure", "oci", "nebius")
                    else ""
                ),
            )
    return patch
