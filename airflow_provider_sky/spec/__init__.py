"""The task spec: a SkyPilot-style task YAML (or the same fields as Python arguments), validated up front.

Everything a gang job needs is checked here, before any node is touched, so a typo or an impossible request
fails at parse time with a message naming the field and the fix, instead of half a gang starting. This module
imports neither Airflow nor any backend: operators, triggers and backends all build on it.
"""

from __future__ import annotations

from airflow_provider_sky.spec.capabilities import (
    BackendCapabilities,
    check_backend,
    describe_resources,
    ignored_resources,
    problems_error,
    resource_problems,
    spec_problems,
)
from airflow_provider_sky.spec.common import RANK_VARIABLES, SpecError
from airflow_provider_sky.spec.resources import Accelerator, Resources
from airflow_provider_sky.spec.task import (
    TaskSpec,
    fill_at_launch,
    is_bucket_source,
    parse_task,
    source_problems,
    task_from_args,
    unset_error,
)
from airflow_provider_sky.spec.yamlfile import load_task_yaml

__all__ = [
    "RANK_VARIABLES",
    "Accelerator",
    "BackendCapabilities",
    "Resources",
    "SpecError",
    "TaskSpec",
    "check_backend",
    "describe_resources",
    "fill_at_launch",
    "ignored_resources",
    "is_bucket_source",
    "load_task_yaml",
    "parse_task",
    "problems_error",
    "resource_problems",
    "source_problems",
    "spec_problems",
    "task_from_args",
    "unset_error",
]
