"""What every part of the task spec shares: the error type, the known keys and the value parsers."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.errors import SpecError as SpecError

#: Set by the provider per rank; a user value would silently break rank discovery, so it is an error.
RANK_VARIABLES: frozenset[str] = frozenset(
    {
        "SKYPILOT_NODE_RANK",
        "SKYPILOT_NODE_IPS",
        "SKYPILOT_NUM_NODES",
        "SKYPILOT_NUM_GPUS_PER_NODE",
        "SKYPILOT_SETUP_NUM_GPUS_PER_NODE",
        "SKYPILOT_SETUP_NODE_RANK",
        "SKYPILOT_SETUP_NODE_IPS",
        "SKYPILOT_TASK_ID",
        "SKYPILOT_CLUSTER_INFO",
        "MASTER_ADDR",
        "WORLD_SIZE",
        "NNODES",
        "NODE_RANK",
        "RANK",
        "SKY_PROGRESS_FILE",
        "SKY_ATTEMPT",
    }
)

TOP_LEVEL_KEYS: tuple[str, ...] = (
    "name",
    "num_nodes",
    "resources",
    "setup",
    "run",
    "envs",
    "secrets",
    "workdir",
    "file_mounts",
    "volumes",
    # not SkyPilot's: the file on each node whose content is the gang's result (``airflow_provider_sky.watch.result``)
    "result_file",
)
RESOURCE_KEYS: tuple[str, ...] = (
    "infra",
    "cloud",
    "region",
    "zone",
    "cpus",
    "memory",
    "accelerators",
    "instance_type",
    "use_spot",
    "image_id",
    "disk_size",
    "labels",
    "gpus",
    "disk_tier",
    "network_tier",
    "ports",
    "any_of",
    "ordered",
    # the cluster's idle time (``spec.autostop``): one per task, not per alternative
    "autostop",
)
#: the keys that list alternatives (each entry a resources mapping; the first the backend can satisfy wins)
ALTERNATIVE_KEYS: tuple[str, ...] = ("any_of", "ordered")
_ENTRY_KEYS: tuple[str, ...] = tuple(k for k in RESOURCE_KEYS if k not in (*ALTERNATIVE_KEYS, "autostop"))
# SkyPilot keys users may copy from existing YAML; named so the error says "unsupported", not "typo".
_SKYPILOT_ONLY_TOP = frozenset({"pool", "event_callback", "experimental"})
_SKYPILOT_ONLY_RESOURCES = frozenset(
    {
        "accelerator_args",
        "priority",
    }
)
#: why a SkyPilot key is refused, when there is more to say than "not supported"
_UNSUPPORTED_WHY = {
    "pool": "SkyPilot's managed-jobs worker pools",
}
#: SkyPilot keys accepted and left out of the spec, with why (each a warning at launch, as ``sky launch`` does)
IGNORED_TOP: dict[str, str] = {
    "service": "SkyServe (replicas, readiness probe, autoscaling) is not part of this provider; the task "
    "runs as `sky launch` runs it, without a service",
    "inputs": "SkyPilot's optimizer hint (where the task's input data is and its size, to weigh egress "
    "costs between clouds); each backend here runs on its own machines, so there is no cloud to pick",
    "outputs": "SkyPilot's optimizer hint (where the task's output goes and its size, to weigh egress costs "
    "between clouds); each backend here runs on its own machines, so there is no cloud to pick",
}
#: SkyPilot resources keys accepted and left out of the spec, with why (a warning at launch): the
#: managed-jobs controller's recovery strategy, which ``sky launch`` does not use either
IGNORED_RESOURCES: dict[str, str] = {
    "job_recovery": "SkyPilot's managed-jobs recovery (sky jobs launch; sky launch does not use it); here "
    "a failed gang is retried whole with sky_gang's retries= (gang_retries= on the job operator)",
    "spot_recovery": "the old name of SkyPilot's job_recovery, managed-jobs recovery (sky jobs launch; sky "
    "launch does not use it); here a failed gang is retried whole with sky_gang's retries= (gang_retries= "
    "on the job operator)",
}

# Every name pattern is used with ``fullmatch``: ``^...$`` with ``match`` also accepts a name ending in a
# newline ("HF_TOKEN\n"), which then breaks the line of the env file that sets it and the value is lost.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_CLOUD_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ACCEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: a label name: 1-128 printable characters (an EC2 tag key's limit), no space at either end; a backend
#: with stricter rules (Kubernetes' qualified names) checks its own
_LABEL_NAME = re.compile(r"[^\s\x00-\x1f\x7f](?:[^\x00-\x1f\x7f]{0,126}[^\s\x00-\x1f\x7f])?")
#: a Kubernetes label key: a qualified name, with an optional DNS-subdomain ``prefix/``
K8S_LABEL_KEY = re.compile(
    r"(?:[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_CPUS = re.compile(rf"{_NUMBER}(?P<plus>\+?)")
_MEMORY = re.compile(rf"{_NUMBER}\s*(?:(?P<unit>[KMGTP])(?:IB|I|B)?)?(?P<plus>\+?)", re.IGNORECASE)
#: control characters (newline, carriage return, NUL, ...): never part of a name, a path or a label value
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MEMORY_UNIT_GIB = {"K": 2.0**-20, "M": 2.0**-10, "G": 1.0, "T": 2.0**10, "P": 2.0**20}
_CLOUD_ALIASES = {"k8s": "kubernetes"}
# For these the part after the first '/' is one name (a kube context may itself contain '/').
_CONTEXT_CLOUDS = frozenset({"kubernetes", "ssh"})


def _fmt_number(value: float) -> str:
    """``8.0`` -> ``"8"``, ``0.5`` -> ``"0.5"``: show numbers the way a user writes them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


#: parts of a variable name whose value is hidden in errors like a secret's (Airflow's sensitive names)
_SENSITIVE_PARTS = (
    "access_token",
    "api_key",
    "apikey",
    "authorization",
    "passphrase",
    "passwd",
    "password",
    "private_key",
    "secret",
    "token",
    "keyfile_dict",
    "service_account",
    "credential",
)


def looks_secret(name: object) -> bool:
    """An env name Airflow would mask (``*_TOKEN``, ``*PASSWORD*`` ...): its value is shown nowhere."""
    return isinstance(name, str) and any(part in name.lower() for part in _SENSITIVE_PARTS)


def _kind(value: object) -> str:
    """What a value is, without the value: "a mapping", "a list", "null"."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple, set, frozenset)):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _shown(value: object, hidden: bool) -> str:
    """``value`` for an error message: its type and repr, or (a secret) its kind alone."""
    return f"{_kind(value)} (value hidden)" if hidden else f"{_type_name(value)} {value!r}"


def _unknown_key(prefix: str, key: str, valid: tuple[str, ...], unsupported: frozenset[str]) -> SpecError:
    where = f"{prefix}.{key}" if prefix else key
    scope = f"{prefix}:" if prefix else "the task"
    if key in unsupported:
        drop = (
            f" (or keep the YAML as is and pass resources={{{key!r}: None}})"
            if prefix.startswith("resources")
            else ""
        )
        why = f" ({_UNSUPPORTED_WHY[key]})" if key in _UNSUPPORTED_WHY else ""
        return SpecError(
            where, f"is a SkyPilot key this provider does not support{why}; remove it from {scope}{drop}"
        )
    if not prefix and key in RESOURCE_KEYS:
        return SpecError(where, f"belongs under resources:, e.g. 'resources: {{{key}: ...}}'")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "valid keys are: " + ", ".join(valid)
    return SpecError(where, f"unknown key in {scope}; {hint}")


def _check_keys(
    prefix: str, obj: Mapping[Any, Any], valid: tuple[str, ...], unsupported: frozenset[str]
) -> None:
    for key in obj:
        if not isinstance(key, str):
            where = prefix or "task"
            raise SpecError(where, f"keys must be strings, got {key!r} ({_type_name(key)})")
        if key not in valid:
            raise _unknown_key(prefix, key, valid, unsupported)


def _opt_str(value: object, where: str, what: str) -> str | None:
    """An optional non-empty string (YAML ``key:`` with nothing after it means not given)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(where, f"must be a non-empty string ({what}), got {value!r}")
    if _CONTROL.search(value.strip()):
        raise SpecError(where, f"{value!r} contains a control character (newline, NUL, ...); remove it")
    return value.strip()


def _coerce_value(raw: object, where: str, fix_none: str, hidden: bool = False) -> str:
    """YAML turns ``PORT: 29500`` into an int and ``DEBUG: true`` into a bool; the shell needs strings.

    ``hidden``: a secret's value, never shown in the error (it would land in Airflow's import errors).
    """
    if raw is None:
        raise SpecError(where, f"a value must be given (null is not allowed); {fix_none}")
    if isinstance(raw, bool):
        text = "true" if raw else "false"
    elif isinstance(raw, (int, float, str)):
        text = str(raw)
    elif hidden:
        raise SpecError(
            where,
            f"must be a string, got {_shown(raw, True)}; quote the value (YAML reads unquoted JSON as a "
            "mapping) or load it from a file",
        )
    else:
        raise SpecError(
            where, f"must be a string or number, got {_type_name(raw)} {raw!r}; quote it as a string"
        )
    if "\0" in text:
        raise SpecError(where, "contains a NUL byte, which no environment variable can hold; remove it")
    return text
