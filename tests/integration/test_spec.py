"""Tests for the task spec layer: every bad input is a SpecError naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_sky.backends.registry import conn_types
from airflow_provider_sky.spec import (
    BackendCapabilities,
    SpecError,
    task_from_args,
)

# ------------------------------------------------------------------------------------------- bad inputs


# ------------------------------------------------------------------------------------------- good inputs


# ------------------------------------------------------------------------------------------- secrets


# ------------------------------------------------------------------------------------------- overrides and args


# ------------------------------------------------------------------------------------------- YAML files


# ------------------------------------------------------------------------------------------- backends


# ------------------------------------------------------------------------------------------- paths


# ------------------------------------------------------------------------------------------- default cluster names


# ------------------------------------------------------------------------------------------- alternatives


SSH = BackendCapabilities(
    name="ssh",
    max_nodes=4,
    supported_resources=frozenset({"cpus", "memory", "accelerators", "labels"}),
    clouds=frozenset({"ssh"}),
)


# -------------------------------------------------- names match whole: no trailing newline, CR, space, NUL

#: what a copy-paste leaves at the end of a name; Python's ``$`` also matches before a final newline


# ------------------------------------------------------------------ no error message shows a secret's value

#: a secret's value; none of its parts may appear in an error


# ------------------------------------------------- timing and count arguments: refused when the DAG is parsed


#: argument -> values refused, each with a fragment of the message


# ---------------------------------------------- everything knowable is checked before the first backend call


def test_every_problem_of_a_spec_is_named_in_one_error_before_anything_is_provisioned(
    sky_home: Path, tmp_path: Path
) -> None:
    """Missing sources, the local backend's destination rule, a GPU the machine lacks and too many nodes:
    one error naming each, from the check the cluster task runs before "Provisioning cluster"."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.local import LocalBackend

    b = LocalBackend(sky_home)
    spec = task_from_args(
        num_nodes=2,
        run="true",
        workdir=str(tmp_path / "no-such-dir"),
        file_mounts={"/data": str(tmp_path / "no-such-file"), "~/ok": str(tmp_path)},
        resources={"accelerators": "A1000:8"},
    )
    with pytest.raises(SpecError) as err:
        choose_resources(b, spec, "c", conn_types())
    fields = err.value.field.split(", ")
    assert {"workdir", "file_mounts./data", "resources.accelerators"} <= set(fields), err.value
    assert fields.count("file_mounts./data") == 2  # outside the node's home, and its source is missing
    assert "no-such-dir does not exist" in err.value.message
    assert "no-such-file does not exist" in err.value.message
    assert "use a '~/...' destination" in err.value.message
    assert "A1000:8" in err.value.message
    assert not list(sky_home.rglob("*.json")) and not (sky_home / "local" / "c").exists()


# ----------------------------------------------------------------------------------- SkyPilot YAML as is
