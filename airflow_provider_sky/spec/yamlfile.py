"""SkyPilot task YAML files, loaded strictly (duplicate keys are errors) with paths resolved beside the file."""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from airflow_provider_sky.spec.common import (
    SpecError,
    _type_name,
)
from airflow_provider_sky.spec.storage import is_storage_dict
from airflow_provider_sky.spec.task import (
    TaskSpec,
    is_bucket_source,
    parse_task,
)

# ---------------------------------------------------------------------------------------------------------
# YAML files


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML keeps the last silently, hiding e.g. a second ``run:``."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _resolve_mount(src: object, base_dir: str) -> object:
    """A mount with its local source resolved beside the file: a string, or a storage mapping's
    ``source`` (one path, or a list of them)."""
    if isinstance(src, str) and src.strip():
        return _resolve_local(src.strip(), base_dir)
    if not is_storage_dict(src):
        return src
    assert isinstance(src, Mapping)
    source = src.get("source")
    if isinstance(source, str) and source.strip():
        return {**src, "source": _resolve_local(source.strip(), base_dir)}
    if isinstance(source, list):
        return {
            **src,
            "source": [
                _resolve_local(s.strip(), base_dir) if isinstance(s, str) and s.strip() else s for s in source
            ],
        }
    return src


def _resolve_local(path: str, base_dir: str) -> str:
    # ``$BUCKET``: the task's envs fill it later (often with a bucket URL), so it is not a path beside the file
    if is_bucket_source(path) or os.path.isabs(path) or path.startswith(("~", "$")):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def _resolved(doc: Mapping[str, object], base_dir: str) -> dict[str, object]:
    """A task mapping with its relative ``workdir`` and local ``file_mounts`` sources made absolute."""
    data: dict[str, object] = dict(doc)
    if isinstance(data.get("workdir"), str) and str(data["workdir"]).strip():
        data["workdir"] = _resolve_local(str(data["workdir"]).strip(), base_dir)
    mounts = data.get("file_mounts")
    if isinstance(mounts, Mapping):
        data["file_mounts"] = {dest: _resolve_mount(src, base_dir) for dest, src in mounts.items()}
    return data


def load_pipeline_yaml(path: str | os.PathLike[str]) -> tuple[str | None, list[dict[str, object]]]:
    """A SkyPilot pipeline file (its optional header ``name:``, then one task per document): the name
    and each task as a mapping with its local paths resolved beside the file, each checked with
    :func:`parse_task` (an error names the file and the task). A job group (``execution: parallel``) is
    refused: its tasks run at the same time, not one after another."""
    where = os.fspath(path)
    docs = _documents(where, "pipeline")
    head = docs[0]
    name = None
    if set(head) <= _GROUP_HEADER_KEYS and "run" not in head:
        if "execution" in head and str(head.get("execution")).lower() != "serial":
            raise SpecError(
                f"{where}: execution",
                f"is {head.get('execution')!r}: a SkyPilot job group, whose tasks run at the same time; "
                f"sky_pipeline runs tasks one after another: load it with sky_job_group({where!r})",
            )
        name = str(head["name"]) if head.get("name") is not None else None
        docs = docs[1:]
    if not docs:
        raise SpecError(where, "the pipeline has no task; add one task mapping per YAML document")
    base_dir = os.path.dirname(os.path.abspath(where))
    tasks = []
    for i, doc in enumerate(docs):
        assert isinstance(doc, Mapping)
        data = _resolved(doc, base_dir)
        try:
            parse_task(data)
        except SpecError as err:
            label = doc.get("name") or f"#{i + 1}"
            raise SpecError(err.field, f"{err.message} (task {label} of {where})") from None
        tasks.append(data)
    return name, tasks


#: a job group's ``termination_delay``: ``30s``, ``5m``, ``1h`` or a number of seconds
_DELAY = re.compile(r"(\d+(?:\.\d+)?)\s*([smh]?)")
_DELAY_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class JobGroup:
    """A SkyPilot job group file: its name, its tasks (mappings, paths resolved beside the file), the
    primary tasks' names (all when the header names none) and, per auxiliary task, the seconds it is
    given to finish after the primary tasks are done before it is stopped."""

    name: str
    tasks: list[dict[str, object]]
    primary: tuple[str, ...]
    delays: dict[str, float]


def _delay(value: object, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    m = _DELAY.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if m is None:
        raise SpecError(where, f"must be a duration such as 30s, 5m or 1h, got {value!r}")
    return float(m.group(1)) * _DELAY_UNIT[m.group(2)]


def _group_options(
    where: str, head: Mapping[str, object], names: list[str]
) -> tuple[tuple[str, ...], dict[str, float]]:
    """(primary task names, seconds per auxiliary task) from the header's ``primary_tasks`` and
    ``termination_delay`` (a duration, or ``{default: ..., TASK: ...}``)."""
    raw = head.get("primary_tasks")
    if raw is None:
        primary = tuple(names)
    else:
        if not isinstance(raw, list) or not raw or not all(isinstance(n, str) for n in raw):
            raise SpecError(f"{where}: primary_tasks", f"must be a list of task names, got {raw!r}")
        unknown = [n for n in raw if n not in names]
        if unknown:
            raise SpecError(
                f"{where}: primary_tasks",
                f"names {', '.join(map(repr, unknown))}, which is no task of the group (its tasks: "
                f"{', '.join(names)})",
            )
        primary = tuple(n for n in names if n in raw)
    delay = head.get("termination_delay")
    field = f"{where}: termination_delay"
    if isinstance(delay, Mapping):
        unknown = [str(k) for k in delay if k != "default" and k not in names]
        if unknown:
            raise SpecError(field, f"names {', '.join(map(repr, unknown))}, which is no task of the group")
        default = _delay(delay["default"], field) if delay.get("default") is not None else 0.0
        per = {str(k): _delay(v, f"{field}.{k}") for k, v in delay.items() if k != "default"}
    else:
        default, per = (_delay(delay, field) if delay is not None else 0.0), {}
    return primary, {n: per.get(n, default) for n in names if n not in primary}


def load_job_group_yaml(path: str | os.PathLike[str]) -> JobGroup:
    """A SkyPilot job group file (a header ``name:`` and ``execution: parallel``, then one task per
    document): the group's name and each task as a mapping with its local paths resolved beside the
    file, each checked with :func:`parse_task`. Task names must be given and differ (SkyPilot's rule: a
    task is found by its name); ``primary_tasks`` name tasks of the group."""
    where = os.fspath(path)
    docs = _documents(where, "job group")
    head = docs[0]
    if not (set(head) <= _GROUP_HEADER_KEYS and "run" not in head) or str(head.get("execution")).lower() != (
        "parallel"
    ):
        raise SpecError(
            where,
            "is not a SkyPilot job group: its first document must be the header (name: ..., execution: "
            "parallel); a pipeline (tasks one after another) is loaded with sky_pipeline",
        )
    name = head.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}: name", "a job group needs a name in its header (name: my-group)")
    docs = docs[1:]
    if not docs:
        raise SpecError(where, "the job group has no task; add one task mapping per YAML document")
    base_dir = os.path.dirname(os.path.abspath(where))
    tasks: list[dict[str, object]] = []
    seen: set[str] = set()
    for i, doc in enumerate(docs):
        assert isinstance(doc, Mapping)
        label = doc.get("name")
        if not isinstance(label, str) or not label or label in seen:
            raise SpecError(
                f"{where}: task #{i + 1}",
                "every task of a job group needs a name of its own (name: trainer); "
                + (f"{label!r} is given twice" if label in seen else "this one has none"),
            )
        seen.add(label)
        data = _resolved(doc, base_dir)
        try:
            parse_task(data)
        except SpecError as err:
            raise SpecError(err.field, f"{err.message} (task {label} of {where})") from None
        tasks.append(data)
    primary, delays = _group_options(where, head, [str(t["name"]) for t in tasks])
    return JobGroup(name.strip(), tasks, primary, delays)


def _documents(where: str, what: str) -> list[Mapping[str, object]]:
    """The non-empty YAML documents of a multi-document file, each a mapping."""
    try:
        with open(where, encoding="utf-8") as fh:
            docs = [d for d in yaml.load_all(fh.read(), Loader=_StrictLoader) if d is not None]
    except FileNotFoundError:
        raise SpecError(where, f"{what} YAML file not found; check the path") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(where, f"cannot read the {what} YAML file ({err})") from None
    except yaml.YAMLError as err:
        raise SpecError(where, f"invalid YAML: {err}; fix the syntax at the position shown") from None
    if not docs or not all(isinstance(d, Mapping) for d in docs):
        raise SpecError(where, f"a {what} is one task mapping per YAML document ('---' between them)")
    return docs


def _one_document(where: str, text: str, err: yaml.YAMLError) -> object:
    """A file of several YAML documents: its one task when the others are empty, else an error saying
    what it is (a SkyPilot pipeline or job group) instead of a YAML syntax error."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as inner:
        raise SpecError(where, f"invalid YAML: {inner}; fix the syntax at the position shown") from None
    if len(docs) == 1:
        return docs[0]
    if not docs or not all(isinstance(d, Mapping) for d in docs):
        raise SpecError(where, f"invalid YAML: {err}; give one task mapping per file") from None
    head = docs[0]
    tasks = docs[1:] if set(head) <= _GROUP_HEADER_KEYS and "run" not in head else docs
    names = ", ".join(str(d.get("name", f"#{i + 1}")) for i, d in enumerate(tasks))
    count = f"{len(tasks)} task" + ("" if len(tasks) == 1 else "s")
    if "execution" in head and str(head.get("execution")).lower() != "serial":
        what = (
            f"a SkyPilot job group ({count}, run at the same time: {names}); load it with "
            f"sky_job_group({where!r}) (one gang per task, started together, failing together)"
        )
    else:
        what = (
            f"a SkyPilot pipeline ({count}, run one after another: {names}); load it with "
            f"sky_pipeline({where!r}) (one gang per task, each after the one before succeeded)"
        )
    raise SpecError(where, f"has {len(docs)} YAML documents: it is {what}")


#: keys of the first document of a SkyPilot pipeline or job group (the group's header, not a task)
_GROUP_HEADER_KEYS = frozenset({"name", "execution", "primary_tasks", "termination_delay"})


def load_task_yaml(
    path: str | os.PathLike[str], *, overrides: Mapping[str, object] | None = None
) -> TaskSpec:
    """Read a task YAML file; relative ``workdir`` and local ``file_mounts`` sources resolve against its directory.

    File problems (missing, unreadable, invalid YAML, not a mapping) are a SpecError whose field is the path;
    spec errors inside the file name the path at the end of the message.
    """
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as fh:
            text = fh.read()
        doc = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except FileNotFoundError:
        raise SpecError(
            where, "task YAML file not found; check the path (relative paths use the current directory)"
        ) from None
    except IsADirectoryError:
        raise SpecError(where, "is a directory; give the path of the task YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(
            where, f"cannot read the task YAML file ({err}); check permissions and that it is UTF-8"
        ) from None
    except yaml.composer.ComposerError as err:
        if "single document" not in str(err):
            raise SpecError(where, f"invalid YAML: {err}; fix the syntax at the position shown") from None
        doc = _one_document(where, text, err)
    except yaml.YAMLError as err:
        raise SpecError(where, f"invalid YAML: {err}; fix the syntax at the position shown") from None
    if not isinstance(doc, Mapping):
        raise SpecError(
            where,
            f"the YAML document must be a mapping of task keys (run, num_nodes, ...), got {_type_name(doc)}",
        )

    data = _resolved(doc, os.path.dirname(os.path.abspath(where)))
    try:
        return parse_task(data, overrides=overrides)
    except SpecError as err:
        raise SpecError(err.field, f"{err.message} (in {where})") from None
