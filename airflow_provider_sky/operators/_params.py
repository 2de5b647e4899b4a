"""Task fields given as Jinja templates, e.g. from a Params form: ``num_nodes="{{ params.num_nodes }}"``.

At DAG parse time such a field cannot be checked (it is text until the run renders it), so it is left
out of the parse-time check. Rendered, it is text too (unless the DAG renders native objects): a whole
number for ``num_nodes``, a mapping (JSON or Python literal) for ``envs`` and ``resources``. A value that
is not is refused before anything is provisioned, naming the param it came from.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.spec import SpecError

#: fields a template may give, and what the rendered text must be
TEMPLATABLE = {"num_nodes": "a whole number >= 1", "envs": "a mapping", "resources": "a mapping"}
_PARAM_RE = re.compile(r"""params\s*(?:\.\s*(\w+)|\[\s*['"]([^'"]+)['"]\s*\])""")


def is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def templated(overrides: Mapping[str, Any]) -> dict[str, str]:
    """The templatable fields given as templates (name → template)."""
    return {k: v for k, v in overrides.items() if k in TEMPLATABLE and is_template(v)}


def _has_template(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_has_template(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_template(v) for v in value)
    return is_template(value)


def _file_mounts_parse_time(value: Any) -> Any:
    """``file_mounts`` as checked at parse time: a bucket ``name`` given as a template (``{"name": "{{
    params.bucket }}"}``) counts as given at launch (null until rendered); a destination with any other
    template is left to the YAML's value until the run renders it."""
    if not isinstance(value, Mapping):
        return value
    out: dict[Any, Any] = {}
    for dest, src in value.items():
        if not _has_template(src):
            out[dest] = src
        elif isinstance(src, Mapping) and not _has_template({k: v for k, v in src.items() if k != "name"}):
            out[dest] = {**src, "name": None}
    return out


def parse_time(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` without its templated fields: what can be checked before the run renders them."""
    skip = templated(overrides)
    out = {k: v for k, v in overrides.items() if k not in skip}
    if "file_mounts" in out:
        out["file_mounts"] = _file_mounts_parse_time(out["file_mounts"])
    return out


def source(template: str) -> str:
    """Where a templated value came from, for an error: ``params.num_nodes`` or the template itself."""
    names = [a or b for a, b in _PARAM_RE.findall(template)]
    return ", ".join(f"params.{n}" for n in names) if names else repr(template)


def coerce_rendered(overrides: Mapping[str, Any], templates: Mapping[str, str]) -> dict[str, Any]:
    """The rendered ``overrides`` with each templated field turned from text into its value.

    Raises :class:`SpecError` naming the field and the param when the text is not what the field takes.
    """
    out = dict(overrides)
    for name, template in templates.items():
        value = out.get(name)
        if not isinstance(value, str):
            continue  # a native-object DAG rendered the value itself
        text = value.strip()
        try:
            if name == "num_nodes":
                if not re.fullmatch(r"[+]?\d+", text):
                    raise ValueError
                out[name] = int(text)
            else:
                try:
                    parsed = json.loads(text)
                except ValueError:
                    parsed = ast.literal_eval(text)
                if not isinstance(parsed, Mapping):
                    raise ValueError
                out[name] = dict(parsed)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise SpecError(
                name,
                f"{source(template)} gave {value[:200]!r}, not {TEMPLATABLE[name]}; nothing was "
                f"provisioned. Trigger the run again with a valid value",
            ) from None
    return out


def name_param(exc: SpecError, templates: Mapping[str, str]) -> SpecError:
    """``exc`` (a rendered value's check failed) saying which param the bad value came from."""
    top = exc.field.split(".", 1)[0].split("[", 1)[0]
    if top not in templates:
        return exc
    return SpecError(
        exc.field, f"{exc.message} (the value came from {source(templates[top])}; nothing was provisioned)"
    )
