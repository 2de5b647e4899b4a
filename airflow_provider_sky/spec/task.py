"""The task itself: num_nodes, setup, run, envs, secrets, workdir, file mounts, and the merge of overrides."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from airflow_provider_sky.spec.autostop import Autostop, parse_autostop
from airflow_provider_sky.spec.common import (
    _CONTROL,
    _ENV_NAME,
    _SKYPILOT_ONLY_TOP,
    _TASK_NAME,
    _URL,
    ALTERNATIVE_KEYS,
    IGNORED_RESOURCES,
    IGNORED_TOP,
    RANK_VARIABLES,
    TOP_LEVEL_KEYS,
    SpecError,
    _check_keys,
    _coerce_value,
    _kind,
    _opt_str,
    _shown,
    _type_name,
    looks_secret,
)
from airflow_provider_sky.spec.config import parse_config
from airflow_provider_sky.spec.resources import (
    Resources,
    _alias_gpus,
    _overlay,
    _parse_resource_options,
    _resources_to_dict,
)
from airflow_provider_sky.spec.storage import (
    _ENV_REF,
    StorageMount,
    bucket_url_problem,
    env_refs,
    fill_env_refs,
    is_storage_dict,
    parse_storage,
)

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------------------------
# envs, secrets, file mounts


#: the three ways to give a value a SkyPilot YAML leaves null (SkyPilot asks for it at launch: --env / --secret)
GIVE_AT_LAUNCH = (
    "SkyPilot asks for these at launch (sky launch --env / --secret); here give each one (1) as an "
    "argument: envs={{'NAME': ...}} / secrets={{'NAME': ...}} to sky_gang, @task.sky or the operators, (2) as "
    "a DAG param of the same name (params={{'NAME': ...}} on the DAG, or the run's conf), or (3) for a secret, "
    "as an Airflow Variable of the same name (Variable.get('NAME'): the metadata database, "
    "AIRFLOW_VAR_NAME or the configured secrets backend){example}"
)


def _parse_env_mapping(value: object, section: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The values given, and the names left null (SkyPilot's "given at launch")."""
    if value is None:
        return {}, ()
    secret = section == "secrets"
    if not isinstance(value, Mapping):
        raise SpecError(
            section,
            f"must be a mapping of NAME: value, got {_shown(value, secret)}; e.g. {section}: {{MY_VAR: ...}}",
        )
    out: dict[str, str] = {}
    unset: list[str] = []
    for key, raw in value.items():
        # a key that is no string may be a secret pasted one level too high: only its type is named
        where = f"{section}.{key}" if isinstance(key, str) or not secret else f"{section}.<{_kind(key)}>"
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise SpecError(
                where,
                "is not a valid environment variable name; use letters, digits and '_', "
                "not starting with a digit (e.g. MY_VAR)",
            )
        if key in RANK_VARIABLES:
            raise SpecError(
                where,
                "is set by the provider for each rank (node rank, IPs, world size) and cannot be overridden; "
                "rename your variable",
            )
        if raw is None:
            unset.append(key)
            continue
        out[key] = _coerce_value(raw, where, "give it a value", hidden=secret or looks_secret(key))
    return out, tuple(unset)


def is_bucket_source(source: str) -> bool:
    """A URL source (``s3://``, ``gs://``, ``r2://``, ``https://`` ...) is a remote store, not a local path."""
    return bool(_URL.match(source))


def storage_copy_source(src: object) -> str | None:
    """A SkyPilot storage mount that is a COPY (``{source: s3://b/x, mode: COPY}``, ``{name: b, mode:
    COPY}``, a local source in COPY mode): the source the node gets the files of, as a string. None: any
    other mapping (or one that is not valid)."""
    if not is_storage_dict(src):
        return None
    assert isinstance(src, Mapping)
    try:
        parsed = parse_storage("file_mounts", src)
    except SpecError:
        return None
    return parsed if isinstance(parsed, str) else None


#: a valid bucket name standing for one left null, to check the rest of such a mount when it is loaded
_NAME_LATER = "bucket-name-given-at-launch"


def _name_left_null(src: Mapping[str, Any]) -> bool:
    """``name:`` written with no value (``name: # Set unique bucket name here!``): given at launch."""
    name = src.get("name", 0)
    return name is None or (isinstance(name, str) and not name.strip())


def _parse_file_mounts(
    value: object,
    envs: Mapping[str, str] | None = None,
    workdir: bool = False,
    later: frozenset[str] = frozenset(),
) -> tuple[dict[str, str], dict[str, StorageMount], dict[str, object], tuple[str, ...]]:
    """(copies: destination -> local path or bucket URL, mounts: destination -> bucket mounted, the mounts
    left to launch time, the destinations whose bucket name is left null).
    ``$VAR`` / ``${VAR}`` anywhere in it are the task's ``envs`` (SkyPilot fills them at parse time); a
    relative destination is under the directory run starts in (``~/sky_workdir`` with a ``workdir``).
    A mount that names an env in ``later`` (left null: given at launch) is returned as written, third, and
    parsed by :func:`fill_at_launch` once the value is there. So is a storage mount whose bucket ``name``
    is left null (SkyPilot's examples leave it to their user) and needs one: checked but for the name, and
    named fourth; nothing is provisioned until the name is given (:func:`unset_error`)."""
    section = "file_mounts"
    if value is None:
        return {}, {}, {}, ()
    if not isinstance(value, Mapping):
        raise SpecError(
            section, f"must be a mapping of REMOTE_PATH: LOCAL_PATH_OR_URL, got {_type_name(value)} {value!r}"
        )
    pending = {d: v for d, v in value.items() if env_refs({d: v}) & later}
    filled = fill_env_refs({d: v for d, v in value.items() if d not in pending}, envs or {})
    assert isinstance(filled, Mapping)
    out: dict[str, str] = {}
    mounts: dict[str, StorageMount] = {}
    no_name: list[str] = []
    for dest, src in filled.items():
        where = f"{section}.{dest}"
        if isinstance(dest, str) and (_CONTROL.search(dest) or dest != dest.strip()):
            raise SpecError(
                where,
                f"the destination {dest!r} has a control character (newline, NUL, ...) or spaces at an "
                "end; write the path alone, e.g. /data or ~/data",
            )
        if isinstance(dest, str) and (ref := _ENV_REF.search(dest)):
            name = ref.group(1) or ref.group(2)
            raise SpecError(
                where,
                f"the destination uses ${name}, which envs does not give a value here; set envs: "
                f"{{{name}: ...}} in the task or pass envs={{'{name}': ...}} (file_mounts are filled when "
                "the task is loaded)",
            )
        if isinstance(dest, str) and dest and not dest.startswith(("/", "~")) and "://" not in dest:
            # relative: where run starts (SkyPilot's remote workdir, else the home)
            rel = dest[2:] if dest.startswith("./") else dest
            if rel and rel not in (".", "./"):
                dest = ("~/sky_workdir/" if workdir else "~/") + rel
                where = f"{section}.{dest}"
        if not isinstance(dest, str) or not (dest.startswith("/") or dest.startswith("~/")):
            raise SpecError(
                where,
                "the key is the destination on the node and must be an absolute path, start with '~/' or "
                "be relative to where run starts (e.g. /data, ~/data or data); the value is the local path "
                "or URL",
            )
        if ".." in dest.split("/"):
            raise SpecError(
                where,
                "a '..' segment may not be in a destination: it could leave the node's home (or the "
                "directory named); write the path without '..', e.g. ~/data or /data",
            )
        if is_storage_dict(src):
            assert isinstance(src, Mapping)
            if _name_left_null(src):
                # the rest is checked now, with a stand-in name; a mount that needs the name waits for it
                parsed = parse_storage(where, {**src, "name": _NAME_LATER})
                needs = parsed == f"s3://{_NAME_LATER}" or (
                    isinstance(parsed, StorageMount) and parsed.bucket == _NAME_LATER
                )
                if needs:
                    pending[dest] = dict(src)
                    no_name.append(dest)
                    continue
            parsed = parse_storage(where, src)
            if isinstance(parsed, StorageMount):
                mounts[dest] = parsed
                continue
            src = parsed
        if not isinstance(src, str) or not src.strip():
            raise SpecError(
                where,
                f"source must be a local path or a URL string such as s3://bucket/path, got "
                f"{_type_name(src)} {src!r}",
            )
        if _CONTROL.search(src.strip()):
            raise SpecError(
                where, f"source {src!r} contains a control character (newline, NUL, ...); remove it"
            )
        if is_bucket_source(src.strip()) and (problem := bucket_url_problem(src.strip())):
            raise SpecError(where, problem)
        out[dest] = src.strip()
    return out, mounts, pending, tuple(no_name)


def source_problems(spec: TaskSpec) -> list[tuple[str, str]]:
    """(field, why) for each local ``workdir`` / ``file_mounts`` source that is not there (a workdir must
    be a directory): found before provisioning, not when the files are copied to provisioned nodes."""
    problems: list[tuple[str, str]] = []
    if spec.workdir and spec.workdir_git is None and not is_bucket_source(spec.workdir):
        path = os.path.expanduser(spec.workdir)
        if not os.path.exists(path):
            problems.append(("workdir", f"{spec.workdir} does not exist; fix the path"))
        elif not os.path.isdir(path):
            problems.append(("workdir", f"{spec.workdir} is not a directory; give the directory to sync"))
    for dest, src in spec.file_mounts.items():
        if not is_bucket_source(src) and not os.path.exists(os.path.expanduser(src)):
            problems.append((f"file_mounts.{dest}", f"{src} does not exist; fix the path"))
    return problems


# ---------------------------------------------------------------------------------------------------------
# workdir: a local directory, or SkyPilot's git repository


@dataclass(frozen=True)
class GitWorkdir:
    """SkyPilot's ``workdir: {url, ref}``: every node checks the repository out into ``~/sky_workdir``
    (``ref``: a branch, tag or commit; None: the remote's default branch), where setup and run start."""

    url: str
    ref: str | None = None

    def to_dict(self) -> dict[str, str]:
        return {"url": self.url, **({"ref": self.ref} if self.ref else {})}


#: a git URL a node can fetch: ``https://``, ``http://``, ``ssh://``, ``git://``, ``file://`` or scp-like
#: ``user@host:path``; never one git would read as an option or a transport helper (``ext::``)
_GIT_URL = re.compile(r"(?:(?:https?|ssh|git|file)://[^\s]+|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^\s]+)")
_GIT_REF = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/+-]*")
_GIT_FIX = "e.g. workdir: {url: https://github.com/org/repo.git, ref: main}"


def _parse_workdir(value: object) -> tuple[str | None, GitWorkdir | None]:
    """(local directory, None) or (the URL, the repository): a string is a local directory synced to every
    node; a mapping is a git repository every node checks out (SkyPilot's ``{url, ref}``)."""
    where = "workdir"
    if not isinstance(value, Mapping):
        path = _opt_str(value, where, "a local directory synced to every node, or {url: ..., ref: ...}")
        if path is not None and (_URL.match(path) or _GIT_URL.fullmatch(path)):
            raise SpecError(
                where,
                f"{path!r} is a URL; a string workdir is a local directory. For a git repository every "
                f"node checks out, write it as a mapping: {_GIT_FIX}",
            )
        return path, None
    unknown = sorted(str(k) for k in value if k not in ("url", "ref"))
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", f"is not a key of a git workdir (url, ref); {_GIT_FIX}")
    url = value.get("url")
    if not isinstance(url, str) or not _GIT_URL.fullmatch(url.strip()):
        raise SpecError(
            f"{where}.url",
            f"must be a git URL (https://, ssh://, git://, file:// or user@host:path), got {url!r}; {_GIT_FIX}",
        )
    url = url.strip()
    if re.match(r"[a-z]+://[^/@]*:[^/@]*@", url):
        raise SpecError(
            f"{where}.url",
            "has a password or token in it, which would reach the nodes' command lines and logs; give a URL "
            "without it (a public repository, or one the nodes reach with their own credentials)",
        )
    ref = value.get("ref")
    if ref is not None:
        if isinstance(ref, (int, float)) and not isinstance(ref, bool):
            ref = str(ref)  # a numeric tag or commit YAML read as a number
        if not isinstance(ref, str) or not _GIT_REF.fullmatch(ref.strip()) or ".." in ref:
            raise SpecError(
                f"{where}.ref",
                f"must be a branch, tag or commit (letters, digits, '.', '_', '/', '+', '-'; not starting "
                f"with '-' or '.'), got {ref!r}",
            )
        ref = ref.strip()
    return url, GitWorkdir(url, ref)


# ---------------------------------------------------------------------------------------------------------
# volumes

#: a Kubernetes PersistentVolumeClaim name (a DNS-1123 subdomain)
_PVC_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?")


def _parse_volumes(value: object) -> dict[str, str]:
    """SkyPilot's ``volumes: {/mnt/data: NAME}``: the volume ``NAME`` mounted at that path on every node.
    A SkyPilot volume is a PersistentVolumeClaim on Kubernetes (``sky volumes apply``); here ``NAME`` is
    the claim of that name in the backend's namespace, which only the kubernetes backend can mount."""
    where = "volumes"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            where,
            f"must be a mapping of MOUNT_PATH: VOLUME_NAME, got {_type_name(value)}; e.g. /data: my-pvc",
        )
    out: dict[str, str] = {}
    for path, name in value.items():
        at = f"{where}.{path}"
        if (
            not isinstance(path, str)
            or not path.startswith("/")
            or _CONTROL.search(path)
            or ".." in path.split("/")
        ):
            raise SpecError(at, "the key is where the volume is mounted: an absolute path such as /data")
        if not isinstance(name, str) or not _PVC_NAME.fullmatch(name):
            raise SpecError(
                at,
                f"must be the volume's name (a PersistentVolumeClaim of the kubernetes backend's namespace: "
                f"lower-case letters, digits, '-' and '.'), got {_type_name(name)} {name!r}",
            )
        out[path.rstrip("/") or "/"] = name
    return out


# ---------------------------------------------------------------------------------------------------------
# the task


@dataclass(frozen=True)
class TaskSpec:
    """One validated gang task. Build it with :func:`parse_task`, :func:`load_task_yaml` or :func:`task_from_args`."""

    run: str
    num_nodes: int = 1
    name: str | None = None
    resources: Resources = field(default_factory=Resources)
    setup: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    #: the local directory synced to every node's ``~/sky_workdir``, or the URL of ``workdir_git``
    workdir: str | None = None
    #: SkyPilot's ``workdir: {url, ref}``: the repository every node checks out into ``~/sky_workdir``
    workdir_git: GitWorkdir | None = None
    #: destination -> what every node gets a copy of before setup: a local path or an ``s3://`` URL
    file_mounts: dict[str, str] = field(default_factory=dict)
    #: destination -> the S3 bucket mounted there on every node (SkyPilot's ``mode: MOUNT`` /
    #: ``MOUNT_CACHED`` storage); kept in ``file_mounts`` in :meth:`to_dict`
    storage: dict[str, StorageMount] = field(default_factory=dict)
    #: file mounts as written that use an env left null (``name: ${BUCKET}``), or whose bucket ``name`` is
    #: left null: parsed by :func:`fill_at_launch` once the value is given (nothing is provisioned before)
    mounts_at_launch: dict[str, object] = field(default_factory=dict)
    #: destinations of ``mounts_at_launch`` whose bucket ``name`` is left null (given by the ``file_mounts``
    #: argument, which is merged into the YAML's mount)
    unset_buckets: tuple[str, ...] = ()
    #: SkyPilot's ``resources.autostop``: the idle time after which a kept cluster is torn down (None: off)
    autostop: Autostop | None = None
    #: mount path -> SkyPilot volume (a PersistentVolumeClaim of that name), mounted on every node
    volumes: dict[str, str] = field(default_factory=dict)
    #: what SkyPilot's ``config: {kubernetes: {pod_config}, docker: {run_options}}`` merges into every pod
    #: (the kubernetes backend's; the other backends make no pods)
    pod_config: dict[str, Any] = field(default_factory=dict)
    #: SkyPilot's alternatives (``any_of`` / ``ordered`` / several accelerators), in the order written, when
    #: there are two or more; ``resources`` is then the first. Empty: ``resources`` is the only choice.
    alternatives: tuple[Resources, ...] = ()
    #: the file each rank's node keeps as its result once the rank succeeded (masked like the log);
    #: ``~/`` is the rank's home, a relative path is under its working directory. None: the last line
    result_file: str | None = None
    #: names the YAML leaves null (SkyPilot's "given at launch"): in neither ``envs`` nor ``secrets`` yet;
    #: :func:`fill_at_launch` gives them their values, and nothing is provisioned while one is left
    unset_envs: tuple[str, ...] = ()
    unset_secrets: tuple[str, ...] = ()
    #: (field, why) for each SkyPilot key accepted and left out (``service``): a warning at launch
    ignored: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def unset(self) -> tuple[str, ...]:
        """Every value still to be given, as fields: ``envs.WANDB_PROJECT``, ``secrets.HF_TOKEN``,
        ``file_mounts./outputs.name``."""
        return (
            tuple(f"envs.{k}" for k in self.unset_envs)
            + tuple(f"secrets.{k}" for k in self.unset_secrets)
            + tuple(f"file_mounts.{d}.name" for d in self.unset_buckets)
        )

    @property
    def resource_choices(self) -> tuple[Resources, ...]:
        """Every acceptable ``resources``, in order of preference (one when there are no alternatives)."""
        return self.alternatives or (self.resources,)

    def with_resources(self, resources: Resources) -> TaskSpec:
        """This task with one of its alternatives chosen (what a backend provisions)."""
        return replace(self, resources=resources, alternatives=())

    def __repr__(self) -> str:
        # Secret names help debugging; their values must never reach a log through repr() or str().
        secrets = {k: "<redacted>" for k in self.secrets}
        return (
            f"TaskSpec(run={self.run!r}, num_nodes={self.num_nodes!r}, name={self.name!r}, "
            f"resources={self.resources!r}, setup={self.setup!r}, envs={self.envs!r}, secrets={secrets!r}, "
            f"workdir={self.workdir!r}, file_mounts={self.file_mounts!r}, "
            + (f"storage={self.storage!r}, " if self.storage else "")
            + f"alternatives={self.alternatives!r}, "
            + (f"autostop={self.autostop!r}, " if self.autostop else "")
            + f"unset_envs={self.unset_envs!r}, unset_secrets={self.unset_secrets!r}"
            + (f", result_file={self.result_file!r})" if self.result_file else ")")
        )

    __str__ = __repr__

    def to_dict(self, include_secrets: bool = False) -> dict[str, Any]:
        """A SkyPilot-YAML-shaped dict (only what is set); it parses back to an equal spec."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        out["num_nodes"] = self.num_nodes
        if self.alternatives:
            out["resources"] = {"ordered": [_resources_to_dict(r) for r in self.alternatives]}
        elif resources := _resources_to_dict(self.resources):
            out["resources"] = resources
        if self.autostop is not None:
            out.setdefault("resources", {})["autostop"] = self.autostop.to_yaml()
        if self.workdir_git is not None:
            out["workdir"] = self.workdir_git.to_dict()
        elif self.workdir is not None:
            out["workdir"] = self.workdir
        if self.file_mounts or self.storage or self.mounts_at_launch:
            out["file_mounts"] = {
                **self.file_mounts,
                **{k: m.to_dict() for k, m in self.storage.items()},
                **self.mounts_at_launch,
            }
        if self.volumes:
            out["volumes"] = dict(self.volumes)
        if self.setup is not None:
            out["setup"] = self.setup
        if self.run:
            out["run"] = self.run
        envs: dict[str, str | None] = {**self.envs, **dict.fromkeys(self.unset_envs)}
        if envs:
            out["envs"] = envs
        secrets: dict[str, str | None] = {
            k: (v if include_secrets else "<redacted>") for k, v in self.secrets.items()
        }
        secrets.update(dict.fromkeys(self.unset_secrets))
        if secrets:
            out["secrets"] = secrets
        if self.result_file is not None:
            out["result_file"] = self.result_file
        if self.pod_config:
            out["config"] = {"kubernetes": {"pod_config": self.pod_config}}
        return out

    def redacted(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``, for logs and error messages."""
        values = sorted({v for v in self.secrets.values() if v}, key=len, reverse=True)
        if not values:
            return text
        # One alternation, longest first, so a secret that contains another is hidden whole.
        return re.sub("|".join(re.escape(v) for v in values), "***", text)


#: the warning for a task without ``run`` (SkyPilot's cluster YAML: ``sky launch`` provisions and sets up)
NO_RUN = (
    "not given: the task runs setup only, as `sky launch` of such a YAML does, and each rank runs nothing; "
    "to keep the cluster up for later gangs that name it, give it a cluster_name and no teardown "
    "(SkyClusterOperator(cluster_name=...), or sky_gang(cluster_name=..., down=False))"
)


def _parse_script(value: object, where: str) -> str | None:
    """Shell commands; None when not given (or blank)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise SpecError(
            where,
            f"must be a string of shell commands, got {_type_name(value)}; "
            "join several commands with newlines using a YAML block ('|')",
        )
    if "\0" in value:
        raise SpecError(where, "contains a NUL byte, which a shell script cannot hold; remove it")
    return value


def _parse_num_nodes(value: object) -> int:
    where = "num_nodes"
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str):
            hint = (
                f"write it unquoted, e.g. num_nodes: {value.strip()}" if value.strip().isdigit() else "e.g. 4"
            )
        else:
            hint = "e.g. num_nodes: 4"
        raise SpecError(where, f"must be a whole number >= 1, got {_type_name(value)} {value!r}; {hint}")
    if value < 1:
        raise SpecError(where, f"must be at least 1, got {value}; a gang needs one or more nodes")
    return value


def _merge(base: Mapping[str, object], overrides: Mapping[str, object] | None) -> dict[str, object]:
    merged = dict(base)
    for key, value in (overrides or {}).items():
        if value is None:  # an argument left at its default: keep what the YAML says
            continue
        old = merged.get(key)
        if key == "resources" and isinstance(old, Mapping) and isinstance(value, (Mapping, Resources)):
            merged[key] = _merge_resources(old, value)
        elif key in ("envs", "secrets") and isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = {**old, **value}
        elif key in ("envs", "secrets") and old is not None and not isinstance(old, Mapping):
            continue  # keep the bad base value so its own error is reported
        elif key == "file_mounts" and isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = _merge_file_mounts(old, value)
        else:
            merged[key] = value
    return merged


def _merge_file_mounts(base: Mapping[Any, object], override: Mapping[Any, object]) -> dict[Any, object]:
    """``file_mounts`` given as an argument over the YAML's, destination by destination (as written): a
    storage mapping over the YAML's mapping key by key (``{"/outputs": {"name": "my-bucket"}}`` names the
    bucket the YAML left null), any other value replaces the YAML's, ``None`` removes it; the YAML's other
    destinations stay."""
    merged = dict(base)
    for dest, src in override.items():
        old = merged.get(dest)
        if src is None:
            merged.pop(dest, None)
        elif isinstance(old, Mapping) and isinstance(src, Mapping):
            merged[dest] = {**old, **src}
        else:
            merged[dest] = src
    return merged


def _merge_resources(
    base: Mapping[str, object], override: Mapping[str, object] | Resources
) -> dict[str, object]:
    """``resources`` given as an argument over the YAML's, key by key: the argument's keys win (also inside
    the YAML's ``any_of`` / ``ordered`` entries), the YAML's other keys stay; a key given as ``None``
    removes the YAML's."""
    if isinstance(override, Resources):
        override = _resources_to_dict(override)
    base, override = _alias_gpus(base, "resources"), _alias_gpus(override, "resources")
    removed = {k for k, v in override.items() if v is None}
    given = {k: v for k, v in override.items() if v is not None}
    merged = _overlay({k: v for k, v in base.items() if k not in removed}, given)
    if any(k in given for k in ALTERNATIVE_KEYS):
        for key in ALTERNATIVE_KEYS:
            if key not in given:
                merged.pop(key, None)  # the argument's alternatives replace the YAML's
    # autostop is the task's, given once beside the alternatives (never copied into them)
    per_entry = {k: v for k, v in given.items() if k != "autostop"}
    for key in ALTERNATIVE_KEYS:
        entries = merged.get(key)
        if key in given or not isinstance(entries, (list, tuple)):
            continue
        merged[key] = [
            _overlay({k: v for k, v in e.items() if k not in removed}, per_entry)
            if isinstance(e, Mapping)
            else e
            for e in entries
        ]
    return merged


def _drop_ignored_resources(value: object) -> tuple[object, tuple[tuple[str, str], ...]]:
    """``resources`` without the SkyPilot keys accepted and left out (``job_recovery``), also inside its
    ``any_of`` / ``ordered`` entries, and (field, why) for each one given."""
    if not isinstance(value, Mapping):
        return value, ()
    found: dict[str, str] = {}
    out = {k: v for k, v in value.items() if k not in IGNORED_RESOURCES}
    found.update({f"resources.{k}": IGNORED_RESOURCES[k] for k in value if k in IGNORED_RESOURCES})
    for key in ALTERNATIVE_KEYS:
        entries = out.get(key)
        if isinstance(entries, (list, tuple)):
            kept: list[object] = []
            for i, entry in enumerate(entries):
                if isinstance(entry, Mapping):
                    for k in entry:
                        if k in IGNORED_RESOURCES:
                            found[f"resources.{key}[{i}].{k}"] = IGNORED_RESOURCES[k]
                    entry = {k: v for k, v in entry.items() if k not in IGNORED_RESOURCES}
                kept.append(entry)
            out[key] = kept
    return out, tuple(found.items())


#: where autostop goes when an alternative gives it
_AUTOSTOP_ONCE = (
    "autostop is the cluster's idle time, whichever alternative is chosen: give it once, in resources: "
    "itself (e.g. resources: {autostop: 10m, any_of: [...]})"
)


def _take_autostop(value: object) -> tuple[object, object]:
    """(``resources.autostop`` as written, or a SpecError for one given inside an alternative; the
    resources without it)."""
    if not isinstance(value, Mapping):
        return None, value
    raw: object = value.get("autostop")
    out = {k: v for k, v in value.items() if k != "autostop"}
    for key in ALTERNATIVE_KEYS:
        entries = out.get(key)
        if not isinstance(entries, (list, tuple)):
            continue
        for i, entry in enumerate(entries):
            if isinstance(entry, Mapping) and "autostop" in entry and not isinstance(raw, SpecError):
                raw = SpecError(f"resources.{key}[{i}].autostop", _AUTOSTOP_ONCE)
        out[key] = [
            {k: v for k, v in e.items() if k != "autostop"} if isinstance(e, Mapping) else e for e in entries
        ]
    return raw, out


def _autostop_of(raw: object) -> Autostop | None:
    if isinstance(raw, SpecError):
        raise raw
    return parse_autostop(raw)


def parse_task(obj: Mapping[str, object], *, overrides: Mapping[str, object] | None = None) -> TaskSpec:
    """Parse a SkyPilot task YAML mapping as is.

    ``overrides`` (Python arguments) replace top-level keys; ``envs``/``secrets`` are merged (override wins),
    and so is ``resources``, key by key (see :func:`_merge_resources`). A ``None`` override means "not
    given" and leaves the YAML value alone.
    """
    if not isinstance(obj, Mapping):
        raise SpecError(
            "task", f"must be a mapping of task keys (run, num_nodes, ...), got {_type_name(obj)}"
        )
    if overrides is not None and not isinstance(overrides, Mapping):
        raise SpecError("overrides", f"must be a mapping of task keys, got {_type_name(overrides)}")
    ignored = tuple((key, why) for key, why in IGNORED_TOP.items() if obj.get(key) is not None)
    config = obj.get("config")  # SkyPilot's task-level config: the YAML's only, no override
    obj = {k: v for k, v in obj.items() if k not in IGNORED_TOP and k != "config"}  # nothing of it is kept
    _check_keys("", obj, TOP_LEVEL_KEYS, _SKYPILOT_ONLY_TOP)
    if overrides:
        _check_keys("", overrides, TOP_LEVEL_KEYS, _SKYPILOT_ONLY_TOP)
    data = _merge(obj, overrides)
    data["resources"], dropped = _drop_ignored_resources(data.get("resources"))
    ignored += dropped
    raw_autostop, data["resources"] = _take_autostop(data.get("resources"))

    # Each field is parsed even when another failed: one error names every problem of the task.
    problems: list[SpecError] = []

    def attempt(parse: Callable[[], _T], default: _T) -> _T:
        try:
            return parse()
        except SpecError as err:
            problems.append(err)
            return default

    run = attempt(lambda: _parse_script(data.get("run"), "run"), None) or ""
    if not run:
        ignored += (("run", NO_RUN),)
    name = data.get("name")
    if name is not None and (not isinstance(name, str) or not _TASK_NAME.fullmatch(name)):
        problems.append(
            SpecError(
                "name",
                f"{name!r} is not a valid task name; use 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit (e.g. train-llm)",
            )
        )
    no_values: tuple[dict[str, str], tuple[str, ...]] = ({}, ())
    envs, unset_envs = attempt(lambda: _parse_env_mapping(data.get("envs"), "envs"), no_values)
    secrets, unset_secrets = attempt(lambda: _parse_env_mapping(data.get("secrets"), "secrets"), no_values)
    # a null env given as a secret (or left null there too) is that secret: its value stays redacted
    unset_envs = tuple(k for k in unset_envs if k not in secrets and k not in unset_secrets)
    clash = sorted(envs.keys() & (secrets.keys() | set(unset_secrets)))
    if clash:
        problems.append(
            SpecError(
                f"secrets.{clash[0]}",
                "is also set in envs; keep it in secrets only (values there are redacted)",
            )
        )
    options: tuple[Resources, ...] = attempt(
        lambda: _parse_resource_options(data.get("resources")), (Resources(),)
    )
    autostop = attempt(lambda: _autostop_of(raw_autostop), None)
    num_nodes = attempt(lambda: _parse_num_nodes(data.get("num_nodes", 1)), 1)
    setup = attempt(lambda: _parse_script(data.get("setup"), "setup"), None)
    no_workdir: tuple[str | None, GitWorkdir | None] = (None, None)
    workdir, workdir_git = attempt(lambda: _parse_workdir(data.get("workdir")), no_workdir)
    no_mounts: tuple[dict[str, str], dict[str, StorageMount], dict[str, object], tuple[str, ...]] = (
        {},
        {},
        {},
        (),
    )
    file_mounts, storage, mounts_at_launch, unset_buckets = attempt(
        lambda: _parse_file_mounts(data.get("file_mounts"), envs, bool(workdir), frozenset(unset_envs)),
        no_mounts,
    )
    result_file = attempt(lambda: _parse_result_file(data.get("result_file")), None)
    no_volumes: dict[str, str] = {}
    volumes = attempt(lambda: _parse_volumes(data.get("volumes")), no_volumes)
    pod_config: dict[str, Any] = attempt(lambda: parse_config(config), {})
    if problems:
        raise _all_of(problems)
    return TaskSpec(
        run=run,
        num_nodes=num_nodes,
        name=name if isinstance(name, str) else None,
        resources=options[0],
        alternatives=options if len(options) > 1 else (),
        setup=setup,
        envs=envs,
        secrets=secrets,
        workdir=workdir,
        workdir_git=workdir_git,
        file_mounts=file_mounts,
        storage=storage,
        mounts_at_launch=mounts_at_launch,
        unset_buckets=unset_buckets,
        autostop=autostop,
        pod_config=pod_config,
        volumes=volumes,
        unset_envs=unset_envs,
        unset_secrets=unset_secrets,
        ignored=ignored,
        result_file=result_file,
    )


def _give_bucket(dest: str) -> str:
    """How to give a bucket name the YAML left null (the argument is merged into the YAML's mount)."""
    return (
        f"The YAML leaves the bucket name of file_mounts.{dest} for its user to write (name: with no value, "
        "as SkyPilot's examples do; SkyPilot needs it too). Give it (1) as an argument: "
        f"file_mounts={{'{dest}': {{'name': 'my-bucket'}}}} to sky_gang, @task.sky or the operators, merged "
        "into the YAML's mount (a template, {'name': '{{ params.bucket }}'}, takes it from a DAG param when "
        "the run starts), or (2) in the YAML: name: my-bucket, or name: ${BUCKET} with envs: {BUCKET: } "
        "given at launch like any env"
    )


def unset_error(spec: TaskSpec) -> SpecError | None:
    """One error naming every value still to be given and the ways to give it; None: all given."""
    if not spec.unset:
        return None
    ways = []
    if spec.unset_envs or spec.unset_secrets:
        first = (spec.unset_secrets or spec.unset_envs)[0]
        kind = "secrets" if spec.unset_secrets else "envs"
        ways.append(GIVE_AT_LAUNCH.format(example=f", e.g. {kind}={{'{first}': ...}}"))
    if spec.unset_buckets:
        ways.append(_give_bucket(spec.unset_buckets[0]))
    return SpecError(", ".join(spec.unset), "no value given. " + ". ".join(ways))


def fill_at_launch(
    spec: TaskSpec,
    params: Mapping[str, object] | None = None,
    variable: Callable[[str], object] | None = None,
) -> tuple[TaskSpec, list[str]]:
    """The values the YAML left null, from the DAG's ``params`` (envs and secrets) and then, for secrets,
    ``variable(NAME)`` (Airflow's ``Variable.get``; None: not there). The arguments' ``envs=`` /
    ``secrets=`` were merged when the spec was built, so they come first.

    Returns the filled spec and where each value came from (``"secrets.HF_TOKEN from an Airflow Variable"``);
    raises one SpecError naming every value still missing. A value is never part of an error.
    """
    if not spec.unset:
        return spec, []
    params = params or {}
    envs, secrets = dict(spec.envs), dict(spec.secrets)
    left_envs: list[str] = []
    left_secrets: list[str] = []
    found: list[str] = []
    for section, names, values, left in (
        ("envs", spec.unset_envs, envs, left_envs),
        ("secrets", spec.unset_secrets, secrets, left_secrets),
    ):
        hidden = section == "secrets"
        for name in names:
            raw, source = params.get(name), "a DAG param"
            if raw is None and hidden and variable is not None:
                raw, source = variable(name), "an Airflow Variable"
            if raw is None:
                left.append(name)
                continue
            values[name] = _coerce_value(
                raw, f"{section}.{name}", "give it a value", hidden=hidden or looks_secret(name)
            )
            found.append(f"{section}.{name} from {source}")
    filled = replace(
        spec, envs=envs, secrets=secrets, unset_envs=tuple(left_envs), unset_secrets=tuple(left_secrets)
    )
    err = unset_error(filled)
    if err is not None:
        raise err
    if spec.mounts_at_launch:  # SkyPilot fills file_mounts from envs (the values given now included)
        copies, mounts, _, _ = _parse_file_mounts(spec.mounts_at_launch, envs, bool(spec.workdir))
        filled = replace(
            filled,
            file_mounts={**filled.file_mounts, **copies},
            storage={**filled.storage, **mounts},
            mounts_at_launch={},
        )
    return filled, found


def _parse_result_file(value: object) -> str | None:
    """A path on the node: one line, no NUL (the node reads it from a file, never from a command line)."""
    path = _opt_str(value, "result_file", "a path on the node, e.g. ~/out/result.json")
    if path is not None and ("\n" in path or "\r" in path or "\0" in path):
        raise SpecError("result_file", f"must be one line with no NUL character, got {path!r}")
    return path


def _all_of(problems: list[SpecError]) -> SpecError:
    """One error for the task's problems: a single one as it is, several listed with their fields."""
    if len(problems) == 1:
        return problems[0]
    listed = "; ".join(str(p) for p in problems)
    return SpecError(", ".join(p.field for p in problems), f"{len(problems)} problems in this task: {listed}")


def task_from_args(**kwargs: object) -> TaskSpec:
    """The YAML fields as Python keyword arguments (``resources`` may be a dict or a :class:`Resources`)."""
    return parse_task(kwargs)
