"""The task arguments every gang operator accepts: a SkyPilot YAML file, a dict, or the fields."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from typing import Any, cast

from airflow.sdk import Context
from airflow.sdk.log import mask_secret

from airflow_provider_sky.operators import _params
from airflow_provider_sky.spec import SpecError, TaskSpec, fill_at_launch, load_task_yaml, parse_task
from airflow_provider_sky.spec.common import TOP_LEVEL_KEYS

log = logging.getLogger(__name__)

#: Python keyword arguments that override the YAML's top-level fields: the same names
SPEC_FIELDS = TOP_LEVEL_KEYS


def pop_spec_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the spec fields (``num_nodes``, ``run``, ...) out of an operator's keyword arguments."""
    return {name: kwargs.pop(name) for name in SPEC_FIELDS if name in kwargs}


def build_spec(
    task_yaml: str | None, task_config: Mapping[str, Any] | None, overrides: Mapping[str, Any]
) -> TaskSpec:
    """Parse and validate now (DAG parse time, and again after templates are rendered)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if task_yaml:
        return load_task_yaml(task_yaml, overrides=given)
    return parse_task(dict(task_config or {}), overrides=given)


def _variable(name: str) -> object:
    """An Airflow Variable named like a secret (the metadata database, ``AIRFLOW_VAR_<NAME>`` or the
    configured secrets backend); None when there is none."""
    from airflow.sdk import Variable

    return Variable.get(name, default=None)


def fill_from_context(spec: TaskSpec, context: Context, logger: logging.Logger = log) -> TaskSpec:
    """The values the YAML left null (SkyPilot's "given at launch"), from the DAG's params and, for
    secrets, Airflow Variables; one SpecError names every one still missing. Logs names, never values."""
    if not spec.unset:
        return spec
    params = context.get("params") or {}
    filled, found = fill_at_launch(spec, params=params, variable=_variable)
    mask_spec_secrets(filled)
    if found:
        logger.info("Values given at launch: %s", ", ".join(found))
    return filled


def idle_down_for(given: float | None, spec: TaskSpec | None) -> float:
    """Seconds a kept cluster may sit idle before its nodes tear it down (0: never): the operator's
    ``idle_down`` when given (0 included: off), else the YAML's ``resources.autostop``. ``sky_gang``
    gives 0 with ``down=True``: that run's teardown removes the cluster, so autostop changes nothing."""
    if given is not None:
        return float(given)
    if spec is not None and spec.autostop is not None:
        return float(spec.autostop.idle_seconds)
    return 0.0


def log_autostop(given: float | None, spec: TaskSpec, logger: logging.Logger) -> None:
    """One line at launch about the YAML's ``resources.autostop``: a warning when the cluster is torn
    down where SkyPilot would have stopped it (no backend here can stop one and keep its disks)."""
    if spec.autostop is None:
        return
    if given is not None:
        logger.info(
            "resources.autostop (%s idle minutes) is not used: idle_down=%s given to the operator wins "
            "(sky_gang gives 0, off, with down=True: the run's teardown removes the cluster)",
            spec.autostop.idle_minutes,
            given,
        )
        return
    warn, note = spec.autostop.launch_note()
    logger.log(logging.WARNING if warn else logging.INFO, "%s", note)


def mask_spec_secrets(spec: TaskSpec) -> None:
    """Register every secret value with Airflow's masker, so no log line can show it."""
    for value in spec.secrets.values():
        if value:
            mask_secret(value)


#: hex digits of the (dag id, run id) hash in a default cluster name: 48 bits, no birthday collision in practice
_NAME_HASH_LEN = 12
#: longest slug so ``sky-<slug>-<hash>`` fits a DNS-1123 label (63 characters, Kubernetes' limit)
_NAME_SLUG_LEN = 63 - len("sky-") - 1 - _NAME_HASH_LEN


def default_cluster_name(dag_id: str, run_id: str) -> str:
    """One cluster per DAG run unless the user names one: ``sky-<dag slug>-<hash>``.

    The hash covers the full DAG id and the run id, because slugs collide (``a_B`` / ``a-b``, ids cut
    short) and scheduled runs of different DAGs share run ids. The name is a DNS-1123 label (lowercase
    letters, digits and '-', at most 63 characters, starting with a letter), valid on every backend.
    """
    digest = hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:_NAME_HASH_LEN]
    slug = re.sub(r"[^a-z0-9]+", "-", dag_id.lower()).strip("-")[:_NAME_SLUG_LEN].rstrip("-") or "dag"
    return f"sky-{slug}-{digest}"


def run_holder(context: Context) -> str:
    """The lease holder id of the running DAG run (``<dag_id>/<run_id>``): what a shared cluster names."""
    return f"{context['dag'].dag_id}/{context['run_id']}"


CLUSTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_cluster_name(name: str) -> str:
    """Cluster names become directory names on every node: a safe alphabet only."""
    if not isinstance(name, str) or not CLUSTER_NAME_RE.fullmatch(name) or ".." in name:
        raise SpecError(
            "cluster_name",
            f"{name!r} is not a valid cluster name: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )
    return name


def resolve_cluster_name(name: str | None, context: Context) -> str:
    if name:
        return check_cluster_name(name)
    return default_cluster_name(context["dag"].dag_id, context["run_id"])


class SkySpecMixin:
    """Holds the spec arguments, parses them at construction and re-parses after rendering."""

    task_yaml: str | None
    task_config: Mapping[str, Any] | None
    spec_overrides: dict[str, Any]
    _spec_templates: dict[str, str]

    def _init_spec(
        self, task_yaml: str | None, task_config: Mapping[str, Any] | None, overrides: dict[str, Any]
    ) -> None:
        self.task_yaml = task_yaml
        self.task_config = task_config
        self.spec_overrides = overrides
        # bad input fails at DAG parse time; a templated field (a Params form's value) once rendered
        build_spec(task_yaml, task_config, _params.parse_time(overrides))
        self._spec_templates = _params.templated(overrides)

    def rendered_spec(self, context: Context | None = None) -> TaskSpec:
        """The spec after templates were rendered; with the task's ``context``, the values the YAML left
        to launch time filled in (without it they stay unset, and provisioning refuses them)."""
        templates = getattr(self, "_spec_templates", {})
        overrides = _params.coerce_rendered(self.spec_overrides, templates)
        try:
            spec = build_spec(self.task_yaml, self.task_config, overrides)
        except SpecError as exc:
            raise _params.name_param(exc, templates) from None
        mask_spec_secrets(spec)
        if context is None:
            return spec
        return fill_from_context(spec, context, cast(logging.Logger, getattr(self, "log", log)))


def refuse_outlets(task: Any) -> None:
    """A cluster or job task ends before any rank ran: asset events from it would claim data no rank
    wrote. The gang sensor emits them, and only when every rank succeeded."""
    if task.outlets:
        raise ValueError(
            f"outlets: task {task.task_id} ends before the gang has run, so its asset events would not mean "
            "the training succeeded; give outlets to the gang sensor (SkyGangSensor(outlets=...), or "
            "sky_gang(outlets=...) / @task.sky(outlets=...)): it emits them only when every rank succeeded"
        )
