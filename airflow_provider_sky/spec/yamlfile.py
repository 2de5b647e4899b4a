"""SkyPilot task YAML files, loaded strictly (duplicate keys are errors) with paths resolved beside the file."""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import yaml

from airflow_provider_sky.spec.common import (
    SpecError,
    _type_name,
)
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


def _resolve_local(path: str, base_dir: str) -> str:
    if is_bucket_source(path) or os.path.isabs(path) or path.startswith("~"):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


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
            doc = yaml.load(fh, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
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
    except yaml.YAMLError as err:
        raise SpecError(where, f"invalid YAML: {err}; fix the syntax at the position shown") from None
    if not isinstance(doc, Mapping):
        raise SpecError(
            where,
            f"the YAML document must be a mapping of task keys (run, num_nodes, ...), got {_type_name(doc)}",
        )

    base_dir = os.path.dirname(os.path.abspath(where))
    data: dict[str, object] = dict(doc)
    if isinstance(data.get("workdir"), str) and str(data["workdir"]).strip():
        data["workdir"] = _resolve_local(str(data["workdir"]).strip(), base_dir)
    mounts = data.get("file_mounts")
    if isinstance(mounts, Mapping):
        data["file_mounts"] = {
            dest: _resolve_local(src.strip(), base_dir) if isinstance(src, str) and src.strip() else src
            for dest, src in mounts.items()
        }
    try:
        return parse_task(data, overrides=overrides)
    except SpecError as err:
        raise SpecError(err.field, f"{err.message} (in {where})") from None
