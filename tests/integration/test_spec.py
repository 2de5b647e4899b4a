"""Tests for the task spec layer: every bad input is a SpecError naming the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import pytest

from airflow_provider_sky.backends.registry import conn_types
from airflow_provider_sky.spec import (
    BackendCapabilities,
    SpecError,
    task_from_args,
)

SEED_YAML = """\
num_nodes: 4

run: |
  if [ "$SKYPILOT_NODE_RANK" == "2" ]; then
      exit 1
  fi
  sleep 10000
"""


def _task(**extra: object) -> dict[str, object]:
    return {"run": "echo hi", **extra}


def _res(**resources: object) -> dict[str, object]:
    return _task(resources=resources)


# ------------------------------------------------------------------------------------------- bad inputs

BAD_INPUTS: list[tuple[str, dict[str, object], str, str]] = [
    # id, task mapping, expected field, substring of the message
    ("num_nodes zero", _task(num_nodes=0), "num_nodes", "at least 1"),
    ("num_nodes negative", _task(num_nodes=-3), "num_nodes", "at least 1"),
    ("num_nodes float", _task(num_nodes=1.5), "num_nodes", "whole number"),
    ("num_nodes whole float", _task(num_nodes=2.0), "num_nodes", "whole number"),
    ("num_nodes string", _task(num_nodes="2"), "num_nodes", "unquoted"),
    ("num_nodes true", _task(num_nodes=True), "num_nodes", "whole number"),
    ("num_nodes false", _task(num_nodes=False), "num_nodes", "whole number"),
    ("num_nodes none", _task(num_nodes=None), "num_nodes", "whole number"),
    ("run missing", {"num_nodes": 2}, "run", "required"),
    ("run empty", {"run": ""}, "run", "required"),
    ("run whitespace", {"run": "  \n\t"}, "run", "required"),
    ("run none", {"run": None}, "run", "required"),
    ("run list", {"run": ["echo a", "echo b"]}, "run", "must be a string"),
    ("run nul", {"run": "echo a\0b"}, "run", "NUL"),
    ("setup list", _task(setup=["pip install x"]), "setup", "must be a string"),
    ("setup int", _task(setup=3), "setup", "must be a string"),
    ("unknown top key", _task(num_node=2), "num_node", "did you mean 'num_nodes'?"),
    ("unknown top key env", _task(env={"A": "1"}), "env", "did you mean 'envs'?"),
    ("unknown top key far", _task(zzzz=1), "zzzz", "valid keys are"),
    ("resources key at top", _task(accelerators="V100"), "accelerators", "belongs under resources"),
    ("skypilot-only top key", _task(pool={"workers": 2}), "pool", "does not support"),
    (
        "skypilot inputs",
        _task(inputs={"gs://b": 70}),
        "inputs",
        "SkyPilot key this provider does not support",
    ),
    ("skypilot outputs", _task(outputs={"gs://b": 7}), "outputs", "optimizer hint"),
    ("non-string top key", cast("dict[str, object]", {"run": "x", 3: "y"}), "task", "keys must be strings"),
    (
        "unknown resources key",
        _res(accelerator="V100"),
        "resources.accelerator",
        "did you mean 'accelerators'?",
    ),
    ("unknown resources key cpu", _res(cpu=4), "resources.cpu", "did you mean 'cpus'?"),
    ("skypilot-only resources key", _res(autostop=10), "resources.autostop", "does not support"),
    ("job_recovery", _res(job_recovery="failover"), "resources.job_recovery", "retries="),
    ("spot_recovery", _res(spot_recovery="FAILOVER"), "resources.spot_recovery", "old name of SkyPilot's"),
    (
        "spot_recovery in any_of",
        _res(any_of=[{"cpus": 2, "spot_recovery": "x"}]),
        "resources.any_of[0].spot_recovery",
        "does not support",
    ),
    ("gpus and accelerators", _res(gpus="H100:8", accelerators="A100:8"), "resources.gpus", "keep one"),
    ("gpus bad", _res(gpus="H100:0"), "resources.accelerators", "greater than 0"),
    ("disk_tier bad", _res(disk_tier="fast"), "resources.disk_tier", "one of low, medium, high, ultra, best"),
    ("network_tier bad", _res(network_tier=1), "resources.network_tier", "one of standard, best"),
    ("ports zero", _res(ports=0), "resources.ports", "each 1-65535"),
    ("ports too big", _res(ports="65536"), "resources.ports", "each 1-65535"),
    ("ports range backwards", _res(ports="9000-8000"), "resources.ports", "a range"),
    ("ports word", _res(ports=["http"]), "resources.ports", "got 'http'"),
    ("ports mapping", _res(ports={"a": 1}), "resources.ports", "got dict"),
    (
        "storage mount",
        _task(file_mounts={"/data": {"name": "bkt", "mode": "MOUNT"}}),
        "file_mounts./data",
        "SkyPilot storage mount ({name, source, store, mode}); storage mounts are not supported yet",
    ),
    ("mount source a list", _task(file_mounts={"/data": ["a"]}), "file_mounts./data", "got list"),
    ("resources not mapping", _task(resources="V100"), "resources", "must be a mapping"),
    ("accel count zero", _res(accelerators="V100:0"), "resources.accelerators", "greater than 0"),
    ("accel count negative", _res(accelerators="V100:-1"), "resources.accelerators", "NAME[:COUNT]"),
    ("accel count non-numeric", _res(accelerators="V100:abc"), "resources.accelerators", "NAME[:COUNT]"),
    ("accel missing count", _res(accelerators="V100:"), "resources.accelerators", "V100:1"),
    ("accel missing name", _res(accelerators=":2"), "resources.accelerators", "H100:8"),
    ("accel three parts", _res(accelerators="V100:1:2"), "resources.accelerators", "NAME[:COUNT]"),
    ("accel empty", _res(accelerators=""), "resources.accelerators", "NAME[:COUNT]"),
    ("accel dict empty", _res(accelerators={}), "resources.accelerators", "at least one"),
    ("accel list empty", _res(accelerators=[]), "resources.accelerators", "empty list"),
    (
        "accel list of pairs",
        _res(accelerators=[{"V100": 1, "A100": 1}]),
        "resources.accelerators",
        "one accelerator",
    ),
    ("accel set", _res(accelerators={"V100"}), "resources.accelerators", "as a list or a mapping"),
    ("any_of not a list", _res(any_of={"accelerators": "A100"}), "resources.any_of", "non-empty list"),
    ("any_of empty", _res(any_of=[]), "resources.any_of", "non-empty list"),
    ("any_of entry str", _res(any_of=["A100:8"]), "resources.any_of[0]", "must be a mapping"),
    ("any_of nested", _res(any_of=[{"ordered": [{}]}]), "resources.any_of[0].ordered", "nested"),
    (
        "any_of typo",
        _res(any_of=[{"accelerator": "A100"}]),
        "resources.any_of[0].accelerator",
        "accelerators",
    ),
    (
        "any_of bad value",
        _res(ordered=[{}, {"accelerators": "A100:0"}]),
        "resources.ordered[1].accelerators",
        "greater than 0",
    ),
    ("any_of and ordered", _res(any_of=[{}], ordered=[{}]), "resources.ordered", "not both"),
    ("accel dict zero", _res(accelerators={"V100": 0}), "resources.accelerators", "greater than 0"),
    ("accel dict bool", _res(accelerators={"V100": True}), "resources.accelerators", "must be a number"),
    ("accel int", _res(accelerators=8), "resources.accelerators", "NAME[:COUNT]"),
    ("accel bad name", _res(accelerators="V 100:1"), "resources.accelerators", "bad accelerator name"),
    ("cpus zero", _res(cpus="0"), "resources.cpus", "greater than 0"),
    ("cpus zero int", _res(cpus=0), "resources.cpus", "greater than 0"),
    ("cpus negative", _res(cpus="-1"), "resources.cpus", "positive number"),
    ("cpus negative int", _res(cpus=-1), "resources.cpus", "greater than 0"),
    ("cpus word", _res(cpus="abc"), "resources.cpus", "4+"),
    ("cpus double plus", _res(cpus="4++"), "resources.cpus", "4+"),
    ("cpus bool", _res(cpus=True), "resources.cpus", "positive number"),
    ("cpus nan", _res(cpus=float("nan")), "resources.cpus", "greater than 0"),
    ("memory zero", _res(memory="0"), "resources.memory", "greater than 0"),
    ("memory negative", _res(memory="-1"), "resources.memory", "positive number"),
    ("memory word", _res(memory="abc"), "resources.memory", "16GB"),
    ("memory double plus", _res(memory="4++"), "resources.memory", "4+"),
    ("memory bytes unit", _res(memory="16B"), "resources.memory", "positive number"),
    ("disk_size zero", _res(disk_size=0), "resources.disk_size", "positive whole number"),
    ("disk_size string", _res(disk_size="100 apples"), "resources.disk_size", "positive whole number"),
    ("disk_size MB", _res(disk_size="512MB"), "resources.disk_size", "1024GB or 1TB"),
    ("disk_size float", _res(disk_size=10.5), "resources.disk_size", "positive whole number"),
    ("disk_size bool", _res(disk_size=True), "resources.disk_size", "positive whole number"),
    ("use_spot string", _res(use_spot="yes"), "resources.use_spot", "true or false"),
    ("use_spot int", _res(use_spot=1), "resources.use_spot", "true or false"),
    ("labels list", _res(labels=["a"]), "resources.labels", "must be a mapping"),
    ("labels none value", _res(labels={"team": None}), "resources.labels.team", "value must be given"),
    ("labels int key", _res(labels={1: "a"}), "resources.labels", "non-empty strings"),
    ("instance_type int", _res(instance_type=5), "resources.instance_type", "non-empty string"),
    ("image_id dict", _res(image_id={"us-east-1": "ami-1"}), "resources.image_id", "non-empty string"),
    ("infra and cloud disagree", _res(infra="aws/us-east-1", cloud="gcp"), "resources.cloud", "disagrees"),
    (
        "infra and region disagree",
        _res(infra="aws/us-east-1", region="eu-west-1"),
        "resources.region",
        "disagrees",
    ),
    ("infra k8s and cloud aws", _res(infra="k8s", cloud="aws"), "resources.cloud", "give only infra"),
    ("infra too many parts", _res(infra="aws/a/b/c"), "resources.infra", "too many parts"),
    ("infra empty part", _res(infra="aws//zone"), "resources.infra", "empty part"),
    ("infra no cloud", _res(infra="/us-east-1"), "resources.infra", "missing cloud"),
    ("infra not string", _res(infra=3), "resources.infra", "CLOUD[/REGION[/ZONE]]"),
    ("cloud bad chars", _res(cloud="my cloud"), "resources.cloud", "bad cloud name"),
    ("envs list", _task(envs=["A=1"]), "envs", "must be a mapping"),
    ("envs bad name space", _task(envs={"MY VAR": "1"}), "envs.MY VAR", "not a valid environment variable"),
    ("envs bad name digit", _task(envs={"1A": "1"}), "envs.1A", "not starting with a digit"),
    ("envs bad name dash", _task(envs={"A-B": "1"}), "envs.A-B", "not a valid environment variable"),
    ("envs nul value", _task(envs={"A": "x\0y"}), "envs.A", "NUL"),
    ("envs list value", _task(envs={"A": [1, 2]}), "envs.A", "must be a string or number"),
    ("envs rank var", _task(envs={"SKYPILOT_NODE_RANK": "0"}), "envs.SKYPILOT_NODE_RANK", "rename"),
    ("envs master addr", _task(envs={"MASTER_ADDR": "1.2.3.4"}), "envs.MASTER_ADDR", "set by the provider"),
    ("envs world size", _task(envs={"WORLD_SIZE": 8}), "envs.WORLD_SIZE", "set by the provider"),
    ("secrets rank var", _task(secrets={"RANK": "0"}), "secrets.RANK", "set by the provider"),
    ("secrets not mapping", _task(secrets="x"), "secrets", "must be a mapping"),
    ("env and secret clash", _task(envs={"K": "a"}, secrets={"K": "b"}), "secrets.K", "also set in envs"),
    ("workdir int", _task(workdir=3), "workdir", "non-empty string"),
    ("workdir dict", _task(workdir={"url": "https://x"}), "workdir", "non-empty string"),
    ("file_mounts list", _task(file_mounts=["/a"]), "file_mounts", "must be a mapping"),
    ("file_mounts relative dest", _task(file_mounts={"data": "./d"}), "file_mounts.data", "absolute path"),
    ("file_mounts tilde dest", _task(file_mounts={"~data": "./d"}), "file_mounts.~data", "'~/'"),
    (
        "file_mounts dict source",
        _task(file_mounts={"/d": {"source": "s3://b"}}),
        "file_mounts./d",
        "not supported",
    ),
    ("file_mounts empty source", _task(file_mounts={"/d": ""}), "file_mounts./d", "local path or a URL"),
    ("name bad chars", _task(name="my job"), "name", "not a valid task name"),
    ("name leading dash", _task(name="-job"), "name", "starting with a letter or digit"),
    ("name too long", _task(name="a" * 64), "name", "1-63"),
    ("name int", _task(name=5), "name", "not a valid task name"),
]


# ------------------------------------------------------------------------------------------- good inputs


# ------------------------------------------------------------------------------------------- secrets


# ------------------------------------------------------------------------------------------- overrides and args


# ------------------------------------------------------------------------------------------- YAML files


# ------------------------------------------------------------------------------------------- backends

LOCAL = BackendCapabilities(
    name="local",
    max_nodes=8,
    supported_resources=frozenset({"cpus", "memory", "labels"}),
    clouds=frozenset({"local"}),
)
K8S = BackendCapabilities(
    name="kubernetes",
    max_nodes=64,
    supported_resources=frozenset({"cpus", "memory", "accelerators", "labels", "image_id", "region"}),
    clouds=frozenset({"kubernetes"}),
    supports_bucket_mounts=True,
)


# ------------------------------------------------------------------------------------------- paths (issue 8.6)


# ------------------------------------------------------------------------------------------- default cluster names (issue 8.5)

_DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")


# ------------------------------------------------------------------------------------------- alternatives (issue 10)


SSH = BackendCapabilities(
    name="ssh",
    max_nodes=4,
    supported_resources=frozenset({"cpus", "memory", "accelerators", "labels"}),
    clouds=frozenset({"ssh"}),
)
KINDS = conn_types()  # what the errors name: the connection types users create


# -------------------------------------------------- names match whole: no trailing newline, CR, space, NUL

#: what a copy-paste leaves at the end of a name; Python's ``$`` also matches before a final newline
BAD_ENDINGS = ["\n", "\r", " ", "\0", "\r\n"]


# ------------------------------------------------------------------ no error message shows a secret's value

#: a secret's value; none of its parts may appear in an error
SECRET = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANs3cr3tPART\n-----END PRIVATE KEY-----"
SECRET_PARTS = ("MIIEvQ", "s3cr3tPART")

SECRET_BEARING: list[tuple[str, dict[str, object], str, str]] = [
    # id, task mapping, expected field, substring of the message
    (
        "service-account JSON pasted unquoted (a mapping)",
        _task(secrets={"SA_JSON": {"type": "service_account", "private_key": SECRET}}),
        "secrets.SA_JSON",
        "must be a string, got a mapping (value hidden); quote the value",
    ),
    ("a list", _task(secrets={"SA_JSON": [SECRET]}), "secrets.SA_JSON", "got a list (value hidden)"),
    ("bytes", _task(secrets={"SA_JSON": SECRET.encode()}), "secrets.SA_JSON", "(value hidden)"),
    ("a NUL byte", _task(secrets={"SA_JSON": SECRET + "\0"}), "secrets.SA_JSON", "NUL byte"),
    ("secrets a string", _task(secrets=f"SA_JSON={SECRET}"), "secrets", "got a string (value hidden)"),
    ("secrets a list", _task(secrets=[f"SA_JSON={SECRET}"]), "secrets", "got a list (value hidden)"),
    ("a key that is no name", _task(secrets={(SECRET,): "x"}), "secrets.<a list>", "not a valid"),
    ("a name with a newline", _task(secrets={"SA_JSON\n": SECRET}), "secrets.SA_JSON", "not a valid"),
    ("also in envs", _task(secrets={"SA": SECRET}, envs={"SA": SECRET}), "secrets.SA", "also set in envs"),
    ("a secret-like env", _task(envs={"HF_TOKEN": {"t": SECRET}}), "envs.HF_TOKEN", "(value hidden)"),
    ("a password env", _task(envs={"DB_PASSWORD": [SECRET]}), "envs.DB_PASSWORD", "(value hidden)"),
    ("another field's error", _task(secrets={"SA": SECRET}, num_nodes=0), "num_nodes", "at least 1"),
]


# ------------------------------------------------- timing and count arguments: refused when the DAG is parsed


#: argument -> values refused, each with a fragment of the message
BAD_TIMING: dict[str, list[tuple[object, str]]] = {
    "poll_interval": [
        (0, "from 0.05 to 300"),
        (-1, "from 0.05 to 300"),
        (0.01, "from 0.05 to 300"),
        (301, "from 0.05 to 300"),
        (float("nan"), "from 0.05 to 300"),
        ("0.5", "expected seconds as a number"),
        (None, "expected seconds as a number"),
        (True, "expected seconds as a number"),
    ],
    "grace": [(-5, "from 0 to 3600"), (float("inf"), "from 0 to 3600"), ("3", "expected seconds")],
    "lost_after": [(0, "from 1 to 86400"), (-1, "from 1 to 86400"), (None, "expected seconds")],
    "hang_timeout": [(-1, "(0 or None: off)"), (0.5, "from 1 to"), ("600", "or None for off")],
    "orphan_timeout": [(-1, "(0 or None: off)"), (0.5, "from 1 to")],
    "idle_down": [(-1, "(0 or None: off)"), ("600", "expected seconds")],
    "bridge_timeout": [(0, "from 1 to"), (-1, "from 1 to")],
    "triggerers": [(0, "whole number from 1 to 1000"), (1.5, "expected a whole number"), (None, "whole")],
}

TIMING_CASES = [
    pytest.param(entry, arg, value, fragment, id=f"{entry}-{arg}={value!r}")
    for entry, args in {
        "SkyClusterOperator": ("poll_interval", "grace", "orphan_timeout", "idle_down", "triggerers"),
        "SkyJobOperator": (
            "poll_interval",
            "grace",
            "lost_after",
            "hang_timeout",
            "orphan_timeout",
            "idle_down",
            "bridge_timeout",
        ),
        "SkyRankOperator": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyRankOperator.partial": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyRankOperator.partial_in_triggerer": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyGangSensor": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyGangSensor.in_triggerer": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyDownOperator": ("grace",),
        "sky_gang": (
            "poll_interval",
            "grace",
            "lost_after",
            "hang_timeout",
            "orphan_timeout",
            "idle_down",
            "triggerers",
        ),
        "@task.sky": (
            "poll_interval",
            "grace",
            "lost_after",
            "hang_timeout",
            "orphan_timeout",
            "idle_down",
            "triggerers",
        ),
        "SkyRankTrigger": ("poll_interval", "grace", "lost_after", "hang_timeout"),
        "SkyGangTrigger": ("poll_interval", "grace", "lost_after", "hang_timeout"),
    }.items()
    for arg in args
    for value, fragment in BAD_TIMING[arg]
]


# ---------------------------------------------- everything knowable is checked before the first backend call


def test_every_problem_of_a_spec_is_named_in_one_error_before_anything_is_provisioned(
    sky_home: Path, tmp_path: Path
) -> None:
    """Missing sources, the local backend's destination rule, a GPU the machine lacks and too many nodes:
    one error naming each, from the check the cluster task runs before "Provisioning cluster"."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.local import LocalBackend
    from airflow_provider_sky.backends.registry import conn_types

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

SERVICE_YAML = """\
service:
  readiness_probe: /health
  replicas: 2
resources:
  ports: 8080
  gpus: L4:1
  disk_tier: best
  network_tier: best
envs:
  MODEL: llama
  WANDB_PROJECT:
secrets:
  HF_TOKEN:
run: python serve.py --port 8080
"""

SSH = BackendCapabilities(
    name="ssh",
    max_nodes=8,
    supported_resources=frozenset({"cpus", "accelerators", "ports"}),
    clouds=frozenset({"ssh"}),
)
