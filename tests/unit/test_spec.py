"""Tests for the task spec layer: every bad input is a SpecError naming the field and the fix."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from airflow_provider_sky.backends.registry import conn_types
from airflow_provider_sky.spec import (
    RANK_VARIABLES,
    Accelerator,
    BackendCapabilities,
    Resources,
    SpecError,
    TaskSpec,
    check_backend,
    is_bucket_source,
    load_task_yaml,
    parse_task,
    source_problems,
    task_from_args,
)
from airflow_provider_sky.spec.task import GitWorkdir

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
    ("run list", {"run": ["echo a", "echo b"]}, "run", "must be a string"),
    ("run nul", {"run": "echo a\0b"}, "run", "NUL"),
    ("setup list", _task(setup=["pip install x"]), "setup", "must be a string"),
    ("setup int", _task(setup=3), "setup", "must be a string"),
    ("unknown top key", _task(num_node=2), "num_node", "did you mean 'num_nodes'?"),
    ("unknown top key env", _task(env={"A": "1"}), "env", "did you mean 'envs'?"),
    ("unknown top key far", _task(zzzz=1), "zzzz", "valid keys are"),
    ("resources key at top", _task(accelerators="V100"), "accelerators", "belongs under resources"),
    ("skypilot-only top key", _task(pool={"workers": 2}), "pool", "does not support"),
    ("non-string top key", cast("dict[str, object]", {"run": "x", 3: "y"}), "task", "keys must be strings"),
    (
        "unknown resources key",
        _res(accelerator="V100"),
        "resources.accelerator",
        "did you mean 'accelerators'?",
    ),
    ("unknown resources key cpu", _res(cpu=4), "resources.cpu", "did you mean 'cpus'?"),
    ("skypilot-only resources key", _res(priority=10), "resources.priority", "does not support"),
    ("autostop negative", _res(autostop=-1), "resources.autostop", "must be 0 or more idle minutes"),
    ("autostop seconds", _res(autostop="30s"), "resources.autostop", "SkyPilot's units are m (minutes), h"),
    ("autostop fraction", _res(autostop="1.5h"), "resources.autostop", "not a whole number"),
    (
        "autostop unknown key",
        _res(autostop={"idle_minute": 3}),
        "resources.autostop.idle_minute",
        "did you mean 'idle_minutes'?",
    ),
    ("autostop hook", _res(autostop={"hook": "git push"}), "resources.autostop.hook", "no backend here runs"),
    ("autostop wait_for", _res(autostop={"wait_for": "ssh"}), "resources.autostop.wait_for", "jobs_and_ssh"),
    ("autostop down", _res(autostop={"down": "yes"}), "resources.autostop.down", "true or false"),
    (
        "autostop in an alternative",
        _res(any_of=[{"cpus": 2, "autostop": 5}]),
        "resources.any_of[0].autostop",
        "give it once, in resources: itself",
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
        "storage mount on another store",
        _task(file_mounts={"/data": {"name": "bkt", "store": "gcs", "mode": "MOUNT"}}),
        "file_mounts./data.store",
        "is 'gcs' (Google Cloud Storage); this provider fetches and mounts S3 buckets only",
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
    ("image_id empty mapping", _res(image_id={}), "resources.image_id", "empty mapping"),
    ("image_id region list", _res(image_id={"us-east-1": ["a"]}), "resources.image_id", "region names"),
    (
        "image_id without the region asked",
        _res(infra="aws/eu-west-1", image_id={"us-east-1": "ami-1"}),
        "resources.image_id",
        "no image for region 'eu-west-1'",
    ),
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
    ("file_mounts list", _task(file_mounts=["/a"]), "file_mounts", "must be a mapping"),
    (
        "file_mounts dest env unknown",
        _task(file_mounts={"/d/$NOPE": "./d"}),
        "file_mounts./d/$NOPE",
        "uses $NOPE",
    ),
    ("file_mounts tilde dest", _task(file_mounts={"~data": "./d"}), "file_mounts.~data", "'~/'"),
    (
        "file_mounts storage bucket name too short",
        _task(file_mounts={"/d": {"source": "s3://b"}}),
        "file_mounts./d.source",
        "'b' is not an S3 bucket name",
    ),
    ("file_mounts empty source", _task(file_mounts={"/d": ""}), "file_mounts./d", "local path or a URL"),
    ("name bad chars", _task(name="my job"), "name", "not a valid task name"),
    ("name leading dash", _task(name="-job"), "name", "starting with a letter or digit"),
    ("name too long", _task(name="a" * 64), "name", "1-63"),
    ("name int", _task(name=5), "name", "not a valid task name"),
]


@pytest.mark.parametrize(
    ("task", "field", "fragment"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_is_spec_error(task: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_task(task)
    assert info.value.field == field
    assert fragment in info.value.message
    assert str(info.value) == f"{field}: {info.value.message}"
    assert isinstance(info.value, ValueError)


def test_not_a_mapping() -> None:
    with pytest.raises(SpecError, match=r"^task: must be a mapping"):
        parse_task(["run", "x"])  # type: ignore[arg-type]


def test_spec_error_pickles() -> None:
    err = pickle.loads(pickle.dumps(SpecError("num_nodes", "must be at least 1")))
    assert (err.field, err.message, str(err)) == (
        "num_nodes",
        "must be at least 1",
        "num_nodes: must be at least 1",
    )


def test_master_port_is_allowed_and_rank_variables_are_complete() -> None:
    assert "MASTER_PORT" not in RANK_VARIABLES
    assert {"SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "MASTER_ADDR", "NODE_RANK", "RANK"} <= RANK_VARIABLES
    assert "SKYPILOT_SETUP_NUM_GPUS_PER_NODE" in RANK_VARIABLES
    # and the two the provider adds for whole-gang retries and hang detection: a user may not set them
    assert {"SKY_ATTEMPT", "SKY_PROGRESS_FILE"} <= RANK_VARIABLES
    assert len(RANK_VARIABLES) == 16
    spec = parse_task(_task(envs={"MASTER_PORT": 29501}))
    assert spec.envs == {"MASTER_PORT": "29501"}


# ------------------------------------------------------------------------------------------- good inputs


def test_seed_yaml_parses_and_round_trips() -> None:
    spec = parse_task(yaml.safe_load(SEED_YAML))
    assert spec.num_nodes == 4
    assert spec.run.startswith('if [ "$SKYPILOT_NODE_RANK" == "2" ]; then\n    exit 1\n')
    assert spec.run.endswith("sleep 10000\n")
    assert spec.resources == Resources()
    assert spec.setup is None
    assert spec.to_dict() == {"num_nodes": 4, "run": spec.run}
    assert parse_task(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec


def test_full_spec_round_trips_through_yaml() -> None:
    spec = parse_task(
        {
            "name": "train-llm",
            "num_nodes": 2,
            "resources": {
                "infra": "aws/us-east-1/us-east-1a",
                "cpus": "8+",
                "memory": 32,
                "accelerators": "H100:8",
                "instance_type": "p5.48xlarge",
                "use_spot": True,
                "image_id": "docker:pytorch/pytorch",
                "disk_size": 512,
                "labels": {"team": "ml", "cost": 7},
            },
            "setup": "pip install -r requirements.txt",
            "run": "torchrun train.py",
            "envs": {"EPOCHS": 3, "DEBUG": False, "LR": 0.5},
            "secrets": {"HF_TOKEN": "hf_abc"},
            "workdir": "/src/project",
            "file_mounts": {"/data": "s3://bucket/data", "~/cfg": "/etc/cfg"},
        }
    )
    assert spec.envs == {"EPOCHS": "3", "DEBUG": "false", "LR": "0.5"}
    assert spec.resources.labels == {"team": "ml", "cost": "7"}
    assert spec.resources.memory == "32"
    again = parse_task(yaml.safe_load(yaml.safe_dump(spec.to_dict(include_secrets=True))))
    assert again == spec
    assert spec.to_dict()["resources"]["infra"] == "aws/us-east-1/us-east-1a"
    assert spec.to_dict()["resources"]["accelerators"] == "H100:8"


def test_accelerator_fraction() -> None:
    spec = parse_task(_res(accelerators="V100:0.5"))
    acc = spec.resources.accelerators
    assert acc == Accelerator("V100", 0.5)
    assert acc is not None and acc.gpus_per_node == 1
    assert str(acc) == "V100:0.5"


@pytest.mark.parametrize(
    ("value", "name", "count", "gpus", "shown"),
    [
        ("V100:0.5", "V100", 0.5, 1, "V100:0.5"),
        ("H100:8", "H100", 8.0, 8, "H100:8"),
        ("H100:8.0", "H100", 8.0, 8, "H100:8"),
        ("A100:1.5", "A100", 1.5, 2, "A100:1.5"),
        ("V100", "V100", 1.0, 1, "V100:1"),
        (" A100-80GB : 2 ", "A100-80GB", 2.0, 2, "A100-80GB:2"),
        ({"V100": 0.5}, "V100", 0.5, 1, "V100:0.5"),
        ({"H100": 8}, "H100", 8.0, 8, "H100:8"),
        ({"L4": None}, "L4", 1.0, 1, "L4:1"),
        (Accelerator("T4", 4), "T4", 4.0, 4, "T4:4"),
    ],
)
def test_accelerator_forms(value: object, name: str, count: float, gpus: int, shown: str) -> None:
    acc = parse_task(_res(accelerators=value)).resources.accelerators
    assert acc is not None
    assert (acc.name, acc.count, acc.gpus_per_node, str(acc)) == (name, count, gpus, shown)


@pytest.mark.parametrize("count", [0, -1, 0.0, float("inf")])
def test_accelerator_constructor_rejects_bad_count(count: float) -> None:
    with pytest.raises(SpecError, match="greater than 0"):
        Accelerator("V100", count)


@pytest.mark.parametrize(
    ("resources", "cloud", "region", "zone"),
    [
        ({"infra": "aws"}, "aws", None, None),
        ({"infra": "AWS/us-east-1"}, "aws", "us-east-1", None),
        ({"infra": "aws/us-east-1/us-east-1a"}, "aws", "us-east-1", "us-east-1a"),
        ({"infra": "k8s"}, "kubernetes", None, None),
        ({"infra": "kubernetes"}, "kubernetes", None, None),
        (
            {"infra": "k8s/arn:aws:eks:us-east-1:1:cluster/c1"},
            "kubernetes",
            "arn:aws:eks:us-east-1:1:cluster/c1",
            None,
        ),
        ({"infra": "*/us-east-1"}, None, "us-east-1", None),
        ({"cloud": "K8S"}, "kubernetes", None, None),
        (
            {"cloud": "gcp", "region": "us-central1", "zone": "us-central1-a"},
            "gcp",
            "us-central1",
            "us-central1-a",
        ),
        ({"infra": "aws/us-east-1", "cloud": "aws"}, "aws", "us-east-1", None),
        ({"infra": "aws", "region": "us-west-2"}, "aws", "us-west-2", None),
        ({"infra": "k8s", "cloud": "kubernetes"}, "kubernetes", None, None),
    ],
)
def test_infra_parsing(resources: dict[str, object], cloud: str, region: str, zone: str) -> None:
    spec = parse_task(_task(resources=resources))
    assert (spec.resources.cloud, spec.resources.region, spec.resources.zone) == (cloud, region, zone)
    assert parse_task(spec.to_dict()).resources == spec.resources


def test_kubernetes_context_with_zone_round_trips_without_infra() -> None:
    spec = parse_task(_res(infra="k8s/ctx", zone="z1"))
    out = spec.to_dict()["resources"]
    assert "infra" not in out
    assert out == {"cloud": "kubernetes", "region": "ctx", "zone": "z1"}
    assert parse_task(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("cpus", "4", "4"),
        ("cpus", "4+", "4+"),
        ("cpus", 4, "4"),
        ("cpus", 0.5, "0.5"),
        ("cpus", " 2.0+ ", "2+"),
        ("memory", "16", "16"),
        ("memory", "16+", "16+"),
        ("memory", 16, "16"),
        ("memory", "16GB", "16"),
        ("memory", "16Gi+", "16+"),
        ("memory", "512MB", "0.5"),
        ("memory", "1TB+", "1024+"),
    ],
)
def test_quantities_normalised(key: str, value: object, expected: str) -> None:
    res = parse_task(_res(**{key: value})).resources
    assert getattr(res, key) == expected


def test_nulls_mean_not_given() -> None:
    spec = parse_task(
        {
            "run": "x",
            "name": None,
            "resources": None,
            "envs": None,
            "secrets": None,
            "setup": None,
            "workdir": None,
        }
    )
    assert spec == TaskSpec(run="x")
    assert parse_task(_res(cpus=None, use_spot=None, labels=None)).resources == Resources()


def test_blank_setup_is_no_setup() -> None:
    assert parse_task(_task(setup="   \n")).setup is None


def test_requested_lists_only_set_fields() -> None:
    assert Resources().requested() == {}
    res = parse_task(_res(cpus="4+", labels={"a": "b"}, use_spot=False, accelerators="V100:0.5")).resources
    assert res.requested() == {"cpus": "4+", "labels": {"a": "b"}, "accelerators": Accelerator("V100", 0.5)}
    assert parse_task(_res(use_spot=True)).resources.requested() == {"use_spot": True}


def test_resources_instance_is_validated_and_normalised() -> None:
    spec = task_from_args(run="x", resources=Resources(cloud="K8s", cpus="4"))
    assert spec.resources.cloud == "kubernetes"
    with pytest.raises(SpecError) as info:
        task_from_args(run="x", resources=Resources(cpus="abc"))
    assert info.value.field == "resources.cpus"


# ------------------------------------------------------------------------------------------- secrets


def test_secrets_never_in_repr_str_or_default_dict() -> None:
    spec = parse_task(_task(secrets={"HF_TOKEN": "hf_supersecret"}, envs={"A": "visible"}))
    for text in (repr(spec), str(spec), str(spec.to_dict()), yaml.safe_dump(spec.to_dict())):
        assert "hf_supersecret" not in text
        assert "HF_TOKEN" in text
    assert "visible" in repr(spec)
    assert spec.to_dict()["secrets"] == {"HF_TOKEN": "<redacted>"}
    assert spec.to_dict(include_secrets=True)["secrets"] == {"HF_TOKEN": "hf_supersecret"}
    assert spec.secrets == {"HF_TOKEN": "hf_supersecret"}


def test_redacted_replaces_longest_first_and_ignores_empty() -> None:
    spec = parse_task(_task(secrets={"SHORT": "abc", "LONG": "abcdef", "EMPTY": "", "RE": "a.b"}))
    assert spec.redacted("token=abcdef, part=abc, x=axb, y=a.b") == "token=***, part=***, x=axb, y=***"
    assert spec.redacted("nothing here") == "nothing here"
    assert TaskSpec(run="x").redacted("abc") == "abc"


# ------------------------------------------------------------------------------------------- overrides and args


def test_overrides_replace_top_level_and_merge_envs() -> None:
    base = {
        "num_nodes": 2,
        "run": "echo yaml",
        "resources": {"cpus": 2, "accelerators": "V100:1"},
        "envs": {"A": "yaml", "B": "yaml"},
        "secrets": {"S": "yaml-secret"},
    }
    spec = parse_task(
        base,
        overrides={
            "num_nodes": 4,
            "resources": {"cpus": 8},
            "envs": {"B": "arg", "C": 1},
            "secrets": {"T": "arg-secret"},
            "setup": None,  # None means "not given"
            "name": None,
        },
    )
    assert spec.num_nodes == 4
    assert spec.run == "echo yaml"
    assert spec.resources == Resources(cpus="8", accelerators=Accelerator("V100", 1))  # merged key by key
    assert spec.envs == {"A": "yaml", "B": "arg", "C": "1"}
    assert spec.secrets == {"S": "yaml-secret", "T": "arg-secret"}
    assert base["envs"] == {"A": "yaml", "B": "yaml"}  # input not mutated


def test_overrides_are_validated() -> None:
    with pytest.raises(SpecError) as info:
        parse_task(_task(), overrides={"num_node": 3})
    assert info.value.field == "num_node" and "num_nodes" in info.value.message
    with pytest.raises(SpecError) as info:
        parse_task(_task(), overrides={"num_nodes": 0})
    assert info.value.field == "num_nodes"
    with pytest.raises(SpecError) as info:
        parse_task(_task(envs={"K": "1"}), overrides={"secrets": {"K": "2"}})
    assert info.value.field == "secrets.K"


def test_bad_base_envs_not_hidden_by_override() -> None:
    with pytest.raises(SpecError) as info:
        parse_task(_task(envs=["A=1"]), overrides={"envs": {"B": "2"}})
    assert info.value.field == "envs"


def test_task_from_args() -> None:
    spec = task_from_args(
        run="python train.py",
        num_nodes=3,
        resources={"accelerators": {"H100": 8}},
        envs={"X": 1},
        secrets={"KEY": "v"},
        file_mounts={"/data": "./local"},
    )
    assert spec.num_nodes == 3
    assert spec.resources.accelerators == Accelerator("H100", 8)
    assert spec.envs == {"X": "1"} and spec.secrets == {"KEY": "v"}
    assert spec.file_mounts == {"/data": "./local"}  # no YAML file: left as given
    assert task_from_args(run="x") == TaskSpec(run="x", num_nodes=1)


def test_task_from_args_unknown_kwarg_suggests() -> None:
    with pytest.raises(SpecError) as info:
        task_from_args(run="x", resouces={"cpus": 2})
    assert info.value.field == "resouces"
    assert "did you mean 'resources'?" in info.value.message


# ------------------------------------------------------------------------------------------- YAML files


def test_load_task_yaml_resolves_relative_paths(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    path = proj / "task.yaml"
    path.write_text(
        "num_nodes: 2\n"
        "workdir: ./src\n"
        "file_mounts:\n"
        "  /data: ../data\n"
        "  /abs: /etc/hosts\n"
        "  ~/home: ~/x\n"
        "  /bucket: s3://bkt/p\n"
        "run: echo hi\n"
    )
    spec = load_task_yaml(path)
    assert spec.workdir == str(proj / "src")
    assert spec.file_mounts == {
        "/data": str(tmp_path / "data"),
        "/abs": "/etc/hosts",
        "~/home": "~/x",
        "/bucket": "s3://bkt/p",
    }


def test_load_task_yaml_relative_path_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.yaml").write_text(SEED_YAML + "workdir: .\n")
    monkeypatch.chdir(tmp_path.parent)
    spec = load_task_yaml(f"{tmp_path.name}/t.yaml", overrides={"num_nodes": 3, "workdir": "rel"})
    assert spec.num_nodes == 3
    assert spec.workdir == "rel"  # overrides are Python arguments: not resolved against the YAML directory
    assert load_task_yaml(tmp_path / "t.yaml").workdir == str(tmp_path)


def test_load_seed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "seed.yaml"
    path.write_text(SEED_YAML)
    spec = load_task_yaml(path)
    assert spec.num_nodes == 4
    assert spec == parse_task(yaml.safe_load(SEED_YAML))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "not found"),
        ("run: [unclosed\n", "invalid YAML"),
        ("- run: x\n", "must be a mapping"),
        ("", "got null"),
        ("just a string\n", "got str"),
        ("run: a\nrun: b\n", "duplicate key 'run'"),
    ],
)
def test_load_task_yaml_file_errors_name_the_path(tmp_path: Path, content: str | None, fragment: str) -> None:
    path = tmp_path / "task.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as info:
        load_task_yaml(path)
    assert info.value.field == str(path)
    assert fragment in info.value.message


def test_load_task_yaml_directory(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_task_yaml(tmp_path)
    assert info.value.field == str(tmp_path) and "directory" in info.value.message


def test_load_task_yaml_allows_merge_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("envs: &e {A: '1', B: '2'}\nsecrets:\n  <<: {S: x, T: y}\n  T: z\nrun: x\n")
    assert load_task_yaml(path).secrets == {"S": "x", "T": "z"}


def test_load_task_yaml_spec_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("num_node: 4\nrun: x\n")
    with pytest.raises(SpecError) as info:
        load_task_yaml(path)
    assert info.value.field == "num_node"
    assert "did you mean 'num_nodes'?" in info.value.message
    assert str(path) in info.value.message


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


@pytest.mark.parametrize(
    ("task", "caps", "field", "fragments"),
    [
        (_task(num_nodes=9), LOCAL, "num_nodes", ["at most 8", "local"]),
        (_res(accelerators="V100:0.5"), LOCAL, "resources.accelerators", ["local", "V100:0.5", "remove it"]),
        (_res(use_spot=True), LOCAL, "resources.use_spot", ["cannot honour use_spot", "no spot instances"]),
        (_res(infra="aws/us-east-1"), K8S, "resources.cloud", ["'aws'", "kubernetes", "remove cloud/infra"]),
        (_res(infra="k8s/ctx"), LOCAL, "resources.cloud", ["'kubernetes'", "accepts: local"]),
        (_res(infra="k8s/ctx", zone="z"), K8S, "resources.zone", ["cannot honour zone"]),
        (
            _task(file_mounts={"/d": "s3://bkt/x"}),
            dataclasses.replace(LOCAL, supports_bucket_mounts=False),
            "file_mounts./d",
            ["cannot copy bucket", "s3://bkt/x"],
        ),
    ],
)
def test_check_backend_refuses(
    task: dict[str, object], caps: BackendCapabilities, field: str, fragments: list[str]
) -> None:
    spec = parse_task(task)
    with pytest.raises(SpecError) as info:
        check_backend(spec, caps)
    assert info.value.field == field
    for fragment in fragments:
        assert fragment in info.value.message


@pytest.mark.parametrize(
    ("task", "caps"),
    [
        (_task(num_nodes=8), LOCAL),
        (_res(cloud="local", cpus="2+", memory="4", labels={"a": "b"}), LOCAL),
        (_task(file_mounts={"/d": "./local"}), LOCAL),
        (_res(infra="k8s/ctx", accelerators="V100:0.5", image_id="docker:x"), K8S),
        (_task(num_nodes=64, file_mounts={"/d": "s3://bkt"}), K8S),
    ],
)
def test_check_backend_accepts(task: dict[str, Any], caps: BackendCapabilities) -> None:
    check_backend(parse_task(task), caps)  # raises on failure


def test_is_bucket_source() -> None:
    assert is_bucket_source("s3://bucket/key")
    assert is_bucket_source("gs://b")
    assert not is_bucket_source("/local/path")
    assert not is_bucket_source("./rel")
    assert not is_bucket_source("~/x")


# ------------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "dest",
    ["~/../../../../escape", "~/data/../../x", "/data/../etc/passwd", "~/..", "/..", "~/a/.."],
)
def test_file_mount_destination_with_dotdot_is_an_error_in_args(dest: str) -> None:
    with pytest.raises(SpecError) as info:
        task_from_args(run="true", file_mounts={dest: "/etc/hosts"})
    assert info.value.field == f"file_mounts.{dest}"
    assert "'..'" in info.value.message and "home" in info.value.message


def test_file_mount_destination_with_dotdot_is_an_error_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_text("run: echo hi\nfile_mounts:\n  ~/../../../../escape: ./data\n")
    with pytest.raises(SpecError) as info:
        load_task_yaml(path)
    assert info.value.field == "file_mounts.~/../../../../escape"
    assert "'..'" in info.value.message and str(path) in info.value.message


def test_file_mount_override_with_dotdot_is_an_error() -> None:
    with pytest.raises(SpecError, match=r"file_mounts\.~/\.\./x"):
        parse_task(_task(), overrides={"file_mounts": {"~/../x": "/etc/hosts"}})


@pytest.mark.parametrize("dest", ["~/data..old/x", "~/..hidden", "/data/x..", "~/./x", "/opt/data"])
def test_file_mount_destinations_without_dotdot_segments_stay_valid(dest: str) -> None:
    assert task_from_args(run="true", file_mounts={dest: "/etc/hosts"}).file_mounts == {dest: "/etc/hosts"}


# ------------------------------------------------------------------------------------------- default cluster names

_DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")


def test_default_cluster_names_do_not_collide() -> None:
    from airflow_provider_sky.operators._spec import default_cluster_name

    run = "scheduled__2026-01-01T00:00:00+00:00"
    long_a, long_b = "x" * 40 + "_first", "x" * 40 + "_second"
    names = {
        default_cluster_name("adv_collide_A", run),
        default_cluster_name("adv-collide-a", run),  # the same slug, another DAG
        default_cluster_name(long_a, run),
        default_cluster_name(long_b, run),  # DAG ids differing after 40 characters
        default_cluster_name("train", run),
        default_cluster_name("eval", run),  # scheduled runs of different DAGs share run ids
        default_cluster_name("train", "manual__2026-01-02"),
    }
    assert len(names) == 7
    assert default_cluster_name("train", run) == default_cluster_name("train", run)  # stable for a run
    assert default_cluster_name("adv_collide_A", run).startswith("sky-adv-collide-a-")  # readable


@pytest.mark.parametrize(
    "dag_id",
    [
        "train",
        "adv_collide_A",
        "A" * 250,
        "Ünïcödé_DAG.v2",
        "___",
        "9_starts_with_digit",
        "ends_with_dash_-",
        "a.b.c-" * 30,
        "x" * 45 + "-" + "y" * 10,
    ],
)
def test_default_cluster_names_are_dns_1123_labels(dag_id: str) -> None:
    from airflow_provider_sky.operators._spec import check_cluster_name, default_cluster_name

    name = default_cluster_name(dag_id, "manual__2026-01-01T00:00:00.123456+00:00")
    assert _DNS_LABEL.match(name), name
    assert len(name) <= 63
    check_cluster_name(name)


# ------------------------------------------------------------------------------------------- alternatives


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        # SkyPilot's "any of these" mapping and "in this order" list: tried in the order written here
        ({"accelerators": {"A100": 8, "H100": 8}}, ["A100:8", "H100:8"]),
        ({"accelerators": ["L4:1", "A10G", {"T4": 2}]}, ["L4:1", "A10G:1", "T4:2"]),
        ({"accelerators": ["L4", "L4:1"]}, ["L4:1"]),  # duplicates collapse
        ({"any_of": [{"accelerators": "H100:8"}, {"accelerators": "A100:8"}]}, ["H100:8", "A100:8"]),
        (
            {"ordered": [{"accelerators": ["A100:8", "H100:8"]}, {"accelerators": "T4"}]},
            ["A100:8", "H100:8", "T4:1"],
        ),
    ],
)
def test_accelerator_alternatives_in_order(resources: dict[str, object], expected: list[str]) -> None:
    spec = parse_task(_res(**resources))
    assert [str(r.accelerators) for r in spec.resource_choices] == expected
    assert spec.resources == spec.resource_choices[0]
    assert parse_task(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec


def test_yaml_flow_set_of_accelerators_and_disk_size_units() -> None:
    """``{H100:8, H200:8}`` is, to YAML, a mapping of keys without values; SkyPilot reads it as a set."""
    spec = parse_task(
        yaml.safe_load("run: x\nresources:\n  accelerators: {H100:8, H200:8}\n  disk_size: 1024GB\n")
    )
    assert [str(r.accelerators) for r in spec.resource_choices] == ["H100:8", "H200:8"]
    assert spec.resources.disk_size == 1024
    assert parse_task(_res(disk_size="1TB")).resources.disk_size == 1024
    assert parse_task(_res(disk_size="256")).resources.disk_size == 256


def test_any_of_entries_override_the_keys_around_them() -> None:
    spec = parse_task(
        _res(
            cpus="4+",
            infra="k8s",
            any_of=[{"accelerators": "H100:8"}, {"accelerators": "A100:8", "cpus": 16, "infra": "ssh/pool"}],
        )
    )
    first, second = spec.resource_choices
    assert (first.cpus, first.cloud, str(first.accelerators)) == ("4+", "kubernetes", "H100:8")
    assert (second.cpus, second.cloud, second.region, str(second.accelerators)) == (
        "16",
        "ssh",
        "pool",
        "A100:8",
    )
    chosen = spec.with_resources(second)
    assert chosen.resources == second and chosen.resource_choices == (second,)
    assert parse_task(yaml.safe_load(yaml.safe_dump(chosen.to_dict()))) == chosen


def test_a_single_alternative_is_no_alternative() -> None:
    assert parse_task(_res(any_of=[{"accelerators": "H100:8"}])) == parse_task(_res(accelerators="H100:8"))
    assert parse_task(_res(accelerators=["H100:8"])).alternatives == ()


def test_resources_argument_merges_key_by_key_into_the_yaml(tmp_path: Path) -> None:
    """The argument used to replace the YAML's whole ``resources`` and silently drop its accelerators."""
    path = tmp_path / "t.yaml"
    path.write_text("resources:\n  accelerators: H100:8\n  cpus: 8+\n  infra: k8s\nrun: x\n")
    spec = load_task_yaml(path, overrides={"resources": {"cpus": 32}})
    assert spec.resources == Resources(cloud="kubernetes", cpus="32", accelerators=Accelerator("H100", 8))
    # a key set to None removes the YAML's; cloud replaces the YAML's infra
    spec = load_task_yaml(path, overrides={"resources": {"accelerators": None, "cloud": "local"}})
    assert spec.resources == Resources(cloud="local", cpus="8+")
    # a Resources object merges the same way (only what it sets)
    assert load_task_yaml(
        path, overrides={"resources": Resources(memory="64")}
    ).resources.accelerators == Accelerator("H100", 8)


def test_resources_argument_wins_inside_the_yaml_alternatives() -> None:
    base = _res(cpus=2, any_of=[{"accelerators": "H100:8", "cpus": 4}, {"accelerators": "A100:8"}])
    spec = parse_task(base, overrides={"resources": {"cpus": 16}})
    assert [(r.cpus, str(r.accelerators)) for r in spec.resource_choices] == [
        ("16", "H100:8"),
        ("16", "A100:8"),
    ]
    spec = parse_task(base, overrides={"resources": {"accelerators": "L4:1"}})
    assert [(r.cpus, str(r.accelerators)) for r in spec.resource_choices] == [("4", "L4:1"), ("2", "L4:1")]
    spec = parse_task(base, overrides={"resources": {"accelerators": "L4:1", "cpus": 1}})
    assert spec.alternatives == () and str(spec.resources.accelerators) == "L4:1"  # the same twice: one
    spec = parse_task(base, overrides={"resources": {"ordered": [{"accelerators": "T4"}]}})
    assert spec.resources == Resources(cpus="2", accelerators=Accelerator("T4", 1))


SSH = BackendCapabilities(
    name="ssh",
    max_nodes=4,
    supported_resources=frozenset({"cpus", "memory", "accelerators", "labels"}),
    clouds=frozenset({"ssh"}),
)
KINDS = conn_types()  # what the errors name: the connection types users create


def test_check_backend_names_every_field_it_cannot_honour_at_once() -> None:
    spec = parse_task(_res(infra="gcp/us-central1", use_spot=True, image_id="docker:x", accelerators="T4"))
    with pytest.raises(SpecError) as info:
        check_backend(spec, SSH, KINDS)
    err = info.value
    assert err.field == "resources.cloud, resources.use_spot, resources.image_id"
    assert "cannot run this task, 3 problems" in err.message
    assert "cloud 'gcp'" in err.message and "no backend of this provider runs on 'gcp'" in err.message
    assert "no spot instances" in err.message and "images are run by the kubernetes backend" in err.message
    assert "region" not in err.field  # a part of the refused infra, not a field of its own
    assert "pick a backend that supports" not in err.message  # the old hint named backends that do not exist


def test_check_backend_names_an_existing_backend_for_its_cloud() -> None:
    with pytest.raises(SpecError) as info:
        check_backend(parse_task(_res(infra="k8s", accelerators="T4")), SSH, KINDS)
    assert info.value.field == "resources.cloud"
    assert "skykubernetes connection" in info.value.message


def test_check_backend_accepts_when_one_alternative_fits_and_lists_all_when_none_does() -> None:
    fits = parse_task(_res(any_of=[{"infra": "aws", "accelerators": "H100:8"}, {"accelerators": "H100:8"}]))
    check_backend(fits, SSH, KINDS)
    none = parse_task(_res(any_of=[{"infra": "aws"}, {"use_spot": True}]))
    with pytest.raises(SpecError) as info:
        check_backend(none, SSH, KINDS)
    assert info.value.field == "resources"
    assert "none of the 2 alternatives" in info.value.message
    assert "#1 (cloud aws)" in info.value.message and "#2 (use_spot True)" in info.value.message


# -------------------------------------------------- names match whole: no trailing newline, CR, space, NUL

#: what a copy-paste leaves at the end of a name; Python's ``$`` also matches before a final newline
BAD_ENDINGS = ["\n", "\r", " ", "\0", "\r\n"]


@pytest.mark.parametrize("ending", BAD_ENDINGS, ids=repr)
@pytest.mark.parametrize(
    ("field", "task"),
    [
        ("envs.", lambda bad: _task(envs={f"MY_VAR{bad}": "1"})),
        ("secrets.", lambda bad: _task(secrets={f"HF_TOKEN{bad}": "hf_abc"})),
        ("name", lambda bad: _task(name=f"train{bad}")),
        ("resources.labels", lambda bad: _res(labels={f"team{bad}": "ml"})),
        ("resources.labels", lambda bad: _res(labels={f"example.com/team{bad}": "ml"})),
        ("file_mounts.", lambda bad: _task(file_mounts={f"/data{bad}": "/tmp"})),
    ],
)
def test_a_name_with_a_bad_ending_is_refused(field: str, task: Any, ending: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_task(task(ending))
    assert err.value.field.startswith(field)


@pytest.mark.parametrize("ending", BAD_ENDINGS, ids=repr)
def test_names_checked_outside_the_spec_match_whole(ending: str) -> None:
    from airflow_provider_sky.node.runtime import check_job_id, env_file
    from airflow_provider_sky.node.runtime_retry import relaunch_args
    from airflow_provider_sky.operators._spec import check_cluster_name

    with pytest.raises(SpecError, match="cluster_name"):
        check_cluster_name(f"train{ending}")
    with pytest.raises(ValueError):
        check_job_id(f"job{ending}")
    with pytest.raises(ValueError):
        env_file({f"HF_TOKEN{ending}": "x"})
    with pytest.raises(ValueError):
        relaunch_args("job", 2, 0.0, [("/r", 0)], ips=[f"10.0.0.1{ending}"])
    with pytest.raises(SpecError, match="accelerators"):
        Accelerator(f"A100{ending}", 1)


@pytest.mark.parametrize("bad", ["eu\0west", "aws/us-east-1\0", "aws/us\neast-1"], ids=repr)
def test_control_characters_in_resource_names_are_refused(bad: str) -> None:
    for task in (_res(infra=bad), _res(region=bad), _res(image_id=bad)):
        with pytest.raises(SpecError, match="control character"):
            parse_task(task)
    with pytest.raises(SpecError, match="control character|NUL byte"):
        parse_task(_res(labels={"team": f"ml{bad}"}))
    with pytest.raises(SpecError, match="control character"):
        parse_task(_task(file_mounts={"/data": f"/tmp/{bad}"}))


def test_good_names_still_parse() -> None:
    spec = parse_task(
        _task(
            name="train-llm.v2",
            envs={"MY_VAR": "1"},
            secrets={"HF_TOKEN": "hf_abc"},
            resources={"labels": {"team": "ml", "example.com/owner": "a_b", "Cost Center": "42"}},
            file_mounts={"/data": "/tmp", "~/x y": "/tmp"},
        )
    )
    assert spec.secrets == {"HF_TOKEN": "hf_abc"} and spec.resources.labels["example.com/owner"] == "a_b"


def _regex_patterns() -> list[tuple[str, int, str]]:
    """Every literal pattern given to ``re`` in the package: (file, line, pattern)."""
    import ast

    import airflow_provider_sky

    root = Path(airflow_provider_sky.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "re"
                and node.args
            ):
                arg = node.args[0]
                text = None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    text = arg.value
                elif isinstance(arg, ast.JoinedStr):  # f-strings: their literal parts
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)
                if text is not None:
                    found.append((str(path.relative_to(root)), node.lineno, text))
    return found


def test_no_pattern_in_the_package_ends_in_a_dollar_anchor() -> None:
    """``$`` matches before a trailing newline: a name check must be ``fullmatch`` (or end in ``\\Z``)."""
    patterns = _regex_patterns()
    assert len(patterns) > 10  # the scan finds the package's patterns
    dollar = [
        (f, line, p)
        for f, line, p in patterns
        if p.endswith("$") and not p.endswith("\\$") and "(?m)" not in p
    ]
    assert not dollar, f"use re.fullmatch (or \\Z) instead of a final '$': {dollar}"


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


def _assert_hidden(text: str) -> None:
    for part in SECRET_PARTS:
        assert part not in text, text


@pytest.mark.parametrize(
    ("task", "field", "fragment"),
    [pytest.param(t, f, m, id=i) for i, t, f, m in SECRET_BEARING],
)
def test_no_refusal_shows_a_secrets_value(task: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_task(task)
    assert err.value.field.startswith(field) and fragment in err.value.message
    for text in (str(err.value), repr(err.value), err.value.field, str(err.value.args)):
        _assert_hidden(text)
    # the same values given as arguments over a YAML-shaped base
    with pytest.raises(SpecError) as err2:
        parse_task({"run": "echo hi"}, overrides={k: v for k, v in task.items() if k != "run"})
    _assert_hidden(str(err2.value))


def test_a_plain_envs_value_is_still_shown() -> None:
    with pytest.raises(SpecError, match=r"envs.PORT: must be a string or number, got list \[1, 2\]"):
        parse_task(_task(envs={"PORT": [1, 2]}))


def test_an_unquoted_service_account_json_in_a_yaml_file_is_not_printed(tmp_path: Path) -> None:
    """The case of the bug report: YAML reads the pasted JSON as a mapping."""
    path = tmp_path / "task.yaml"
    key = SECRET.replace("\n", "\\n")
    path.write_text(
        f'run: echo hi\nsecrets:\n  SA_JSON: {{"type": "service_account", "private_key": "{key}"}}\n'
    )
    with pytest.raises(SpecError) as err:
        load_task_yaml(path)
    assert err.value.field == "secrets.SA_JSON" and "(value hidden)" in err.value.message
    _assert_hidden(str(err.value))


def test_the_dag_import_error_shows_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Airflow stores in its import_error table (and ``dags list-import-errors`` prints)."""
    from airflow.dag_processing.dagbag import DagBag

    key = SECRET.replace("\n", "\\n")
    (tmp_path / "task.yaml").write_text(
        f'run: echo hi\nsecrets:\n  SA_JSON: {{"type": "service_account", "private_key": "{key}"}}\n'
    )
    (tmp_path / "sa_dag.py").write_text(
        "import pendulum\n"
        "from airflow.sdk import DAG\n"
        "from airflow_provider_sky.taskgroup import sky_gang\n"
        "with DAG('sa_dag', schedule=None, start_date=pendulum.datetime(2026, 1, 1)):\n"
        f"    sky_gang(task_yaml={str(tmp_path / 'task.yaml')!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bag = DagBag(dag_folder=str(tmp_path), safe_mode=False)
    (error,) = bag.import_errors.values()
    assert "secrets.SA_JSON: must be a string, got a mapping (value hidden)" in error
    _assert_hidden(error)


# ------------------------------------------------- timing and count arguments: refused when the DAG is parsed


def _entry_points() -> dict[str, tuple[Any, tuple[str, ...]]]:
    """Each entry point as ``build(**timing)`` and the timing arguments it takes."""
    from airflow_provider_sky.decorators.sky import sky_task
    from airflow_provider_sky.operators.cluster import SkyClusterOperator
    from airflow_provider_sky.operators.down import SkyDownOperator
    from airflow_provider_sky.operators.job import SkyJobOperator
    from airflow_provider_sky.operators.rank import SkyRankOperator
    from airflow_provider_sky.sensors.gang import SkyGangSensor
    from airflow_provider_sky.taskgroup import sky_gang
    from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger

    watch = ("poll_interval", "grace", "lost_after", "hang_timeout")
    ids = {"cluster_task_id": "c", "job_task_id": "j"}
    return {
        "SkyClusterOperator": (
            lambda **kw: SkyClusterOperator(task_id="t", run="true", **kw),
            ("poll_interval", "grace", "orphan_timeout", "idle_down", "triggerers"),
        ),
        "SkyJobOperator": (
            lambda **kw: SkyJobOperator(task_id="t", cluster={}, run="true", **kw),
            (*watch, "orphan_timeout", "idle_down", "bridge_timeout"),
        ),
        "SkyRankOperator": (
            lambda **kw: SkyRankOperator(task_id="t", cluster={}, rank=0, job_id="j", **kw),
            watch,
        ),
        "SkyRankOperator.partial": (
            lambda **kw: SkyRankOperator.partial(task_id="t", cluster={}, **kw),
            watch,
        ),
        "SkyRankOperator.partial_in_triggerer": (
            lambda **kw: SkyRankOperator.partial_in_triggerer(task_id="t", cluster={}, **ids, **kw),
            watch,
        ),
        "SkyGangSensor": (lambda **kw: SkyGangSensor(task_id="t", cluster={}, job_id="j", **kw), watch),
        "SkyGangSensor.in_triggerer": (
            lambda **kw: SkyGangSensor.in_triggerer(task_id="t", cluster={}, **ids, **kw),
            watch,
        ),
        "SkyDownOperator": (lambda **kw: SkyDownOperator(task_id="t", **kw), ("grace",)),
        "sky_gang": (
            lambda **kw: sky_gang("g", num_nodes=2, run="true", **kw),
            (*watch, "orphan_timeout", "idle_down", "triggerers"),
        ),
        "@task.sky": (
            lambda **kw: sky_task(num_nodes=2, **kw)(lambda: "true"),
            (*watch, "orphan_timeout", "idle_down", "triggerers"),
        ),
        "SkyRankTrigger": (lambda **kw: SkyRankTrigger(rank=0, cluster={}, job_id="j", **kw), watch),
        "SkyGangTrigger": (lambda **kw: SkyGangTrigger(cluster={}, job_id="j", **kw), watch),
    }


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


@pytest.mark.parametrize(("entry", "arg", "value", "fragment"), TIMING_CASES)
def test_a_bad_timing_argument_is_refused_when_the_dag_is_parsed(
    entry: str, arg: str, value: object, fragment: str
) -> None:
    import pendulum
    from airflow.sdk import DAG

    build, _ = _entry_points()[entry]
    with DAG(f"bad_{arg}", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        with pytest.raises(SpecError) as err:
            build(**{arg: value})
    assert err.value.field == arg and fragment in err.value.message, str(err.value)


def test_every_entry_point_is_checked_for_every_timing_argument_it_takes() -> None:
    """The table above covers each entry point's timing arguments, read from its signature."""
    import inspect

    from airflow_provider_sky.spec.timing import LIMITS

    covered = {(p.values[0], p.values[1]) for p in TIMING_CASES}
    for entry, (_, args) in _entry_points().items():
        assert {(entry, a) for a in args} <= covered, entry
    from airflow_provider_sky.operators.cluster import SkyClusterOperator
    from airflow_provider_sky.operators.job import SkyJobOperator
    from airflow_provider_sky.taskgroup import sky_gang

    for name, fn in (
        ("sky_gang", sky_gang),
        ("SkyJobOperator", SkyJobOperator.__init__),
        ("SkyClusterOperator", SkyClusterOperator.__init__),
    ):
        taken = set(inspect.signature(fn).parameters) & set(LIMITS)
        assert {(name, a) for a in taken} <= covered, name


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"poll_interval": 30.0}, "lost_after", "at least poll_interval (30 s), got 10"),
        ({"poll_interval": 5.0, "lost_after": 4.0}, "lost_after", "one missed poll"),
        ({"poll_interval": 2.0, "orphan_timeout": 3.0}, "orphan_timeout", "2 x poll_interval = 4 s"),
        ({"poll_interval": 2.0, "hang_timeout": 3.0}, "hang_timeout", "2 x poll_interval = 4 s"),
    ],
)
def test_timing_arguments_that_disagree_are_refused(
    kwargs: dict[str, Any], field: str, fragment: str
) -> None:
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    with DAG("disagree", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        with pytest.raises(SpecError) as err:
            sky_gang("g", num_nodes=2, run="true", **kwargs)
    assert err.value.field == field and fragment in err.value.message, str(err.value)


def test_good_timing_arguments_at_the_edges_are_accepted() -> None:
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    with DAG("edges", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        for i, kw in enumerate(
            (
                {},
                {"poll_interval": 0.05, "grace": 0, "lost_after": 1, "orphan_timeout": 0, "hang_timeout": 0},
                {
                    "poll_interval": 300,
                    "grace": 3600,
                    "lost_after": 300,
                    "orphan_timeout": None,
                    "idle_down": 1,
                },
                {"hang_timeout": 600, "idle_down": None, "triggerers": 4, "orphan_timeout": 2},
            )
        ):
            sky_gang(f"g{i}", num_nodes=2, run="true", **kw)


# ---------------------------------------------- everything knowable is checked before the first backend call


def test_a_workdir_that_is_a_file_is_named_before_provisioning(sky_home: Path, tmp_path: Path) -> None:
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.local import LocalBackend

    (tmp_path / "train.py").write_text("print(1)\n")
    spec = task_from_args(run="true", workdir=str(tmp_path / "train.py"))
    with pytest.raises(SpecError, match="workdir: .*train.py is not a directory"):
        choose_resources(LocalBackend(sky_home), spec)
    # a good spec still passes, sources under ~ included
    choose_resources(LocalBackend(sky_home), task_from_args(run="true", workdir=str(tmp_path)))


def test_every_problem_of_the_task_itself_is_named_in_one_error() -> None:
    """A DAG author fixes them all in one edit, not one per parse."""
    with pytest.raises(SpecError) as err:
        parse_task(
            {
                "run": ["echo a"],
                "num_nodes": 0,
                "envs": {"RANK": "1"},
                "secrets": {"SA_JSON": {"private_key": SECRET}},
                "resources": {"accelerators": "V100:0"},
                "file_mounts": {"~data": "/tmp"},
            }
        )
    fields = err.value.field.split(", ")
    assert fields == [
        "run",
        "envs.RANK",
        "secrets.SA_JSON",
        "resources.accelerators",
        "num_nodes",
        "file_mounts.~data",
    ], err.value
    assert err.value.message.startswith("6 problems in this task: run: must be a string")
    _assert_hidden(str(err.value))
    # one problem is reported as it always was
    with pytest.raises(SpecError) as one:
        parse_task({"run": "true", "num_nodes": 0})
    assert one.value.field == "num_nodes" and one.value.message.startswith("must be at least 1")


@pytest.mark.parametrize(
    ("entry", "kwargs", "field"),
    [
        ("@task.sky", {"retries": -1}, "retries"),
        ("@task.sky", {"retry_delay": -5}, "retry_delay"),
        ("@task.sky", {"retry_on_exit_codes": [0]}, "retry_on_exit_codes"),
        ("sky_gang", {"retries": 101}, "retries"),
        ("SkyJobOperator", {"gang_retries": -1}, "gang_retries"),
        ("SkyRankOperator", {"gang_retry_delay": 3601}, "gang_retry_delay"),
        ("SkyGangSensor", {"gang_retries": 1.5}, "gang_retries"),
    ],
)
def test_bad_gang_retry_numbers_are_refused_naming_the_field(
    entry: str, kwargs: dict[str, Any], field: str
) -> None:
    """``@task.sky`` checks them when the function is decorated, before it is called in a DAG."""
    import pendulum
    from airflow.sdk import DAG

    build, _ = _entry_points()[entry]
    with DAG("bad_retry", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        with pytest.raises(SpecError) as err:
            build(**kwargs)
    assert err.value.field == field, err.value


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


def test_a_service_yaml_loads_as_the_task_sky_launch_runs(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(SERVICE_YAML)
    spec = load_task_yaml(path)
    assert spec.run == "python serve.py --port 8080"
    # nothing of service is kept: only a note of what was ignored, and why
    assert [f for f, _ in spec.ignored] == ["service"]
    assert "SkyServe" in spec.ignored[0][1] and "readiness" not in repr(spec) + repr(spec.to_dict())
    assert "service" not in spec.to_dict()
    res = spec.resources
    assert res.accelerators == Accelerator("L4", 1)  # gpus is accelerators
    assert (res.disk_tier, res.network_tier, res.ports) == ("best", "best", ("8080",))
    assert spec.envs == {"MODEL": "llama"} and spec.secrets == {}
    assert (spec.unset_envs, spec.unset_secrets) == (("WANDB_PROJECT",), ("HF_TOKEN",))
    assert spec.unset == ("envs.WANDB_PROJECT", "secrets.HF_TOKEN")
    # it round-trips, the null values included
    again = parse_task(yaml.safe_load(yaml.safe_dump(spec.to_dict(include_secrets=True))))
    assert again == spec
    assert spec.to_dict()["envs"] == {"MODEL": "llama", "WANDB_PROJECT": None}


@pytest.mark.parametrize(
    ("resources", "accelerators"),
    [
        ({"gpus": "H100:8"}, "H100:8"),
        ({"gpus": {"H100": 8, "A100": 8}}, "H100:8"),
        ({"gpus": "H100:8", "accelerators": None}, "H100:8"),
        ({"any_of": [{"gpus": "A100:8"}, {"accelerators": "H100:8"}]}, "A100:8"),
    ],
)
def test_gpus_is_accelerators(resources: dict[str, object], accelerators: str) -> None:
    spec = parse_task(_task(resources=resources))
    assert str(spec.resources.accelerators) == accelerators


def test_an_accelerators_argument_replaces_the_yamls_gpus() -> None:
    spec = parse_task(_res(gpus="H100:8", cpus=4), overrides={"resources": {"accelerators": "A100:1"}})
    assert str(spec.resources.accelerators) == "A100:1" and spec.resources.cpus == "4"
    spec = parse_task(_res(gpus="H100:8"), overrides={"resources": {"gpus": None}})
    assert spec.resources.accelerators is None


@pytest.mark.parametrize(
    ("ports", "expected"),
    [(8080, ("8080",)), ("8080", ("8080",)), ([8080, "9000-9010", 8080], ("8080", "9000-9010")), ([], ())],
)
def test_ports_forms(ports: object, expected: tuple[str, ...]) -> None:
    assert parse_task(_res(ports=ports)).resources.ports == expected


def test_ports_are_refused_naming_why_by_a_backend_without_them() -> None:
    spec = parse_task(_res(ports=[8080, "9000-9001"]))
    check_backend(spec, SSH)
    with pytest.raises(SpecError) as info:
        check_backend(spec, K8S)  # this test's K8S capabilities list no ports
    assert info.value.field == "resources.ports"
    assert "cannot honour ports (8080,9000-9001)" in info.value.message


def test_disk_and_network_tiers_are_accepted_and_named_as_ignored() -> None:
    from airflow_provider_sky.spec import ignored_resources

    spec = parse_task(_res(disk_tier="best", network_tier="best"))
    for caps in (LOCAL, SSH, K8S):
        check_backend(spec, caps)  # accepted everywhere
        ignored = ignored_resources(spec.resources, caps)
        assert [f for f, _ in ignored] == ["resources.disk_tier", "resources.network_tier"]
        assert f"the {caps.name} backend ignores disk_tier (best)" in ignored[0][1]
    assert ignored_resources(parse_task(_task()).resources, LOCAL) == []


def test_null_envs_and_secrets_are_given_at_launch() -> None:
    from airflow_provider_sky.spec import fill_at_launch

    task = _task(envs={"A": None, "B": "b"}, secrets={"TOKEN": None, "KEY": None})
    spec = parse_task(task)
    assert spec.unset == ("envs.A", "secrets.TOKEN", "secrets.KEY")
    # the arguments' envs= / secrets= are merged first
    given = parse_task(task, overrides={"envs": {"A": 1}, "secrets": {"TOKEN": "t0ken-value"}})
    assert given.envs == {"A": "1", "B": "b"} and given.unset == ("secrets.KEY",)
    # then DAG params, then (secrets only) an Airflow Variable
    variables = {"KEY": "k3y-value", "A": "never-used"}
    filled, found = fill_at_launch(spec, params={"A": 7, "TOKEN": "from-params"}, variable=variables.get)
    assert filled.envs == {"A": "7", "B": "b"}
    assert filled.secrets == {"TOKEN": "from-params", "KEY": "k3y-value"} and filled.unset == ()
    assert found == [
        "envs.A from a DAG param",
        "secrets.TOKEN from a DAG param",
        "secrets.KEY from an Airflow Variable",
    ]
    assert not any("value" in f for f in found)


def test_a_value_never_given_names_every_key_and_the_three_ways() -> None:
    from airflow_provider_sky.spec import fill_at_launch

    spec = parse_task(_task(envs={"A": None, "B": None}, secrets={"TOKEN": None, "KEY": None}))
    with pytest.raises(SpecError) as info:
        fill_at_launch(spec, params={"B": "b"}, variable={"KEY": "s3cret-key"}.get)
    err = info.value
    assert err.field == "envs.A, secrets.TOKEN"
    for way in (
        "secrets={'TOKEN': ...}",
        "a DAG param of the same name",
        "an Airflow Variable of the same name",
    ):
        assert way in err.message, err.message
    assert "s3cret-key" not in str(err)


def test_a_null_env_given_as_a_secret_is_that_secret() -> None:
    spec = parse_task(_task(envs={"HF_TOKEN": None}), overrides={"secrets": {"HF_TOKEN": "hf_abcdef"}})
    assert spec.secrets == {"HF_TOKEN": "hf_abcdef"} and spec.envs == {} and spec.unset == ()
    spec = parse_task(_task(envs={"HF_TOKEN": None}, secrets={"HF_TOKEN": None}))
    assert spec.unset == ("secrets.HF_TOKEN",)
    with pytest.raises(SpecError, match="secrets.HF_TOKEN: is also set in envs"):
        parse_task(_task(secrets={"HF_TOKEN": None}), overrides={"envs": {"HF_TOKEN": "x"}})


def test_a_secret_param_that_is_not_a_string_is_not_shown() -> None:
    from airflow_provider_sky.spec import fill_at_launch

    spec = parse_task(_task(secrets={"SA_JSON": None}))
    with pytest.raises(SpecError) as info:
        fill_at_launch(spec, params={"SA_JSON": {"private_key": "pk-very-secret"}})
    assert "value hidden" in str(info.value) and "pk-very-secret" not in str(info.value)


def test_provisioning_refuses_a_value_never_given(tmp_path: Path) -> None:
    """A spec built without the operator (the Python API) still cannot reach a node with a value missing."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.local import LocalBackend

    spec = parse_task(_task(envs={"A": None}, secrets={"TOKEN": None}))
    with pytest.raises(SpecError) as info:
        choose_resources(LocalBackend(state_dir=str(tmp_path)), spec)
    assert info.value.field == "envs.A, secrets.TOKEN"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "name: pipe\n---\nname: a\nrun: echo a\n---\nname: b\nrun: echo b\n",
            [
                "has 3 YAML documents",
                "a SkyPilot pipeline (2 tasks, run one after another: a, b)",
                "load it with sky_pipeline(",
            ],
        ),
        (
            "name: a\nrun: echo a\n---\nname: b\nrun: echo b\n",
            ["has 2 YAML documents", "a SkyPilot pipeline (2 tasks, run one after another: a, b)"],
        ),
        (
            "name: g\nexecution: parallel\n---\nname: server\nrun: x\n---\nname: client\nrun: y\n",
            [
                "a SkyPilot job group (2 tasks, run at the same time: server, client)",
                "sky_job_group(",
                "failing together",
            ],
        ),
    ],
)
def test_a_multi_document_file_says_what_it_is(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = tmp_path / "multi.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_task_yaml(path)
    assert info.value.field == str(path)
    assert "invalid YAML" not in info.value.message
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message


def test_a_file_with_one_task_and_empty_documents_loads(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text("---\nrun: echo a\n---\n")
    assert load_task_yaml(path).run == "echo a"


def test_each_backend_does_with_ports_and_tiers_what_the_readme_says() -> None:
    """Ports run on every backend: nothing to open on local and SSH, a Service on Kubernetes, a
    security-group rule on EC2 (tests/integration/test_ports.py); disk_tier / network_tier are accepted everywhere,
    each named as ignored."""
    from benchmarks.compat import capabilities

    spec = parse_task(_res(ports=8080, disk_tier="best", network_tier="best"))
    caps = capabilities()
    assert set(caps) == {"local", "ssh", "kubernetes", "aws"}
    for kind in ("local", "ssh", "kubernetes", "aws"):
        check_backend(spec, caps[kind])
    from airflow_provider_sky.spec import ignored_resources

    for c in caps.values():
        assert [f for f, _ in ignored_resources(spec.resources, c)] == [
            "resources.disk_tier",
            "resources.network_tier",
        ]


def test_a_storage_mount_in_copy_mode_is_its_source(tmp_path: Path) -> None:
    """SkyPilot's ``{source: ..., mode: COPY}`` puts the same files on the node as the source as a string."""
    (tmp_path / "code").mkdir()
    path = tmp_path / "task.yaml"
    path.write_text(
        "run: ls /code /data\nfile_mounts:\n"
        "  /code: {name: my-bucket, source: ./code, mode: COPY, persistent: false}\n"
        "  /data: {source: s3://bkt/shard, mode: copy}\n"
    )
    spec = load_task_yaml(path)
    assert spec.file_mounts == {"/code": str(tmp_path / "code"), "/data": "s3://bkt/shard"}
    # a bucket source is then what it is as a string: refused by a backend that cannot copy buckets
    with pytest.raises(SpecError, match="cannot copy bucket 's3://bkt/shard'"):
        check_backend(spec, dataclasses.replace(LOCAL, supports_bucket_mounts=False))
    # a named bucket in COPY mode is that bucket's files; MOUNT (SkyPilot's default mode) is a mount
    assert parse_task(_task(file_mounts={"/d": {"name": "bkt", "mode": "COPY"}})).file_mounts == {
        "/d": "s3://bkt"
    }
    for mount in ({"source": "s3://bkt", "mode": "MOUNT"}, {"source": "s3://bkt"}):
        assert parse_task(_task(file_mounts={"/d": mount})).storage["/d"].url == "s3://bkt"


# ------------------------------------------------------------------ SkyPilot keys accepted with a warning


def test_a_task_without_run_runs_setup_only_and_says_so() -> None:
    """SkyPilot's cluster YAML (``sky launch`` provisions and sets up; later jobs name the cluster)."""
    for task in ({"num_nodes": 2, "setup": "pip install x"}, {"run": None}, {"run": "  \n"}):
        spec = parse_task(task)
        assert spec.run == ""
        assert [f for f, _ in spec.ignored] == ["run"]
        assert "setup only" in spec.ignored[0][1] and "down=False" in spec.ignored[0][1]
        assert "run" not in spec.to_dict() and parse_task(spec.to_dict()) == spec
    assert parse_task(_task()).ignored == ()


def test_inputs_and_outputs_are_optimizer_hints_named_as_ignored() -> None:
    spec = parse_task(_task(inputs={"s3://b/x": 70}, outputs={"s3://b/y": 1}))
    assert [f for f, _ in spec.ignored] == ["inputs", "outputs"]
    assert all("optimizer hint" in why for _, why in spec.ignored)
    assert "inputs" not in spec.to_dict() and spec == parse_task(_task())


def test_job_recovery_is_named_as_ignored_with_the_retries_to_use() -> None:
    """``sky launch`` does not use managed-jobs recovery either; here the gang's retries= does that."""
    spec = parse_task(_res(cpus=2, job_recovery={"strategy": "FAILOVER", "max_restarts_on_errors": 3}))
    assert spec.ignored[0][0] == "resources.job_recovery" and "retries=" in spec.ignored[0][1]
    assert spec.resources == parse_task(_res(cpus=2)).resources
    spec = parse_task(_res(any_of=[{"cpus": 2, "spot_recovery": "x"}, {"cpus": 4}]))
    assert [f for f, _ in spec.ignored] == ["resources.any_of[0].spot_recovery"]
    assert "old name" in spec.ignored[0][1] and len(spec.alternatives) == 2


def test_a_per_region_image_id_is_one_alternative_per_region() -> None:
    images = {"us-east-1": "ami-east", "us-west-2": "ami-west"}
    spec = parse_task(_res(infra="aws", image_id=images))
    assert [(r.cloud, r.region, r.image_id) for r in spec.resource_choices] == [
        ("aws", "us-east-1", "ami-east"),
        ("aws", "us-west-2", "ami-west"),
    ]
    # a region given picks its image
    for res in ({"infra": "aws/us-west-2"}, {"cloud": "aws", "region": "us-west-2"}):
        spec = parse_task(_res(**res, image_id=images))
        assert (spec.resources.region, spec.resources.image_id, spec.alternatives) == (
            "us-west-2",
            "ami-west",
            (),
        )
    # written back as SkyPilot alternatives, it reads back the same
    spec = parse_task(_res(image_id=images))
    assert parse_task(spec.to_dict()) == spec


def test_a_git_workdir_is_checked_out_on_every_node() -> None:
    """SkyPilot's ``workdir: {url, ref}``: the URL is the workdir (run starts in ~/sky_workdir)."""
    spec = parse_task(_task(workdir={"url": "https://github.com/org/repo.git", "ref": "v0.4.0"}))
    assert spec.workdir == "https://github.com/org/repo.git"
    assert spec.workdir_git == GitWorkdir("https://github.com/org/repo.git", "v0.4.0")
    assert parse_task(spec.to_dict()) == spec and source_problems(spec) == []
    for url in ("git@github.com:org/repo.git", "ssh://git@host/r.git", "file:///srv/r", "git://h/r"):
        assert parse_task(_task(workdir={"url": url})).workdir_git == GitWorkdir(url)
    assert parse_task(_task(workdir={"url": "git://h/r", "ref": 1234567})).workdir_git == GitWorkdir(
        "git://h/r", "1234567"
    )


@pytest.mark.parametrize(
    ("workdir", "field", "fragment"),
    [
        ({"url": "--upload-pack=touch /tmp/x"}, "workdir.url", "must be a git URL"),
        ({"url": "ext::sh -c touch% /tmp/x"}, "workdir.url", "must be a git URL"),
        ({"url": "https://user:tok@github.com/o/r.git"}, "workdir.url", "password or token"),
        ({"ref": "main"}, "workdir.url", "must be a git URL"),
        ({"url": "git://h/r", "ref": "-c core.x=y"}, "workdir.ref", "branch, tag or commit"),
        ({"url": "git://h/r", "ref": "a..b"}, "workdir.ref", "branch, tag or commit"),
        ({"url": "git://h/r", "branch": "main"}, "workdir.branch", "(url, ref)"),
        ("https://github.com/o/r.git", "workdir", "write it as a mapping"),
    ],
)
def test_a_git_workdir_that_could_be_misread_is_refused(workdir: object, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_task(_task(workdir=workdir))
    assert err.value.field == field and fragment in err.value.message, err.value


def test_volumes_are_claims_mounted_on_every_node_of_the_kubernetes_backend() -> None:
    """SkyPilot's ``volumes: {PATH: NAME}``: a PersistentVolumeClaim; the other backends refuse it by name."""
    spec = parse_task(_task(volumes={"/mnt/data/": "train-ckpts"}))
    assert spec.volumes == {"/mnt/data": "train-ckpts"}
    assert parse_task(spec.to_dict()) == spec
    k8s = BackendCapabilities(
        name="kubernetes",
        max_nodes=8,
        supported_resources=frozenset(),
        clouds=frozenset(),
        supports_volumes=True,
    )
    check_backend(spec, k8s)
    ssh = BackendCapabilities(name="ssh", max_nodes=8, supported_resources=frozenset(), clouds=frozenset())
    with pytest.raises(SpecError) as err:
        check_backend(spec, ssh)
    assert err.value.field == "volumes./mnt/data" and "only the kubernetes backend" in err.value.message


@pytest.mark.parametrize(
    ("volumes", "fragment"),
    [
        (["/data"], "MOUNT_PATH: VOLUME_NAME"),
        ({"data": "v"}, "absolute path"),
        ({"/a/../etc": "v"}, "absolute path"),
        ({"/data": "Not_A_Claim"}, "PersistentVolumeClaim"),
        ({"/data": {"name": "v"}}, "PersistentVolumeClaim"),
    ],
)
def test_a_volume_that_cannot_be_a_claim_is_named(volumes: object, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_task(_task(volumes=volumes))
    assert err.value.field.startswith("volumes") and fragment in err.value.message, err.value


def test_a_mount_source_from_envs_is_the_value_not_a_path_beside_the_file(tmp_path: Path) -> None:
    """``source: ${BUCKET}`` was resolved beside the file first: ``/dir/s3://b`` became a local path."""
    path = tmp_path / "t.yaml"
    path.write_text(
        "envs: {BUCKET: s3://my-bucket/data, STORE: gs://b}\n"
        "file_mounts:\n  /d: {source: $BUCKET, mode: COPY}\n  /e: ${BUCKET}\nrun: x\n"
    )
    spec = load_task_yaml(path)
    assert spec.file_mounts == {"/d": "s3://my-bucket/data", "/e": "s3://my-bucket/data"}
    path.write_text("envs: {STORE: gs://b}\nfile_mounts:\n  /d: {source: $STORE, mode: MOUNT}\nrun: x\n")
    with pytest.raises(SpecError, match=r"'gs://b' is on Google Cloud Storage"):
        load_task_yaml(path)


# ------------------------------------------------------------------------------------------- resources.autostop


@pytest.mark.parametrize(
    ("autostop", "minutes", "down", "seconds"),
    [
        (True, 5, False, 300),  # SkyPilot's default idle time
        (10, 10, False, 600),
        ("10", 10, False, 600),
        ("10m", 10, False, 600),
        ("1H", 60, False, 3600),
        ("2d", 2880, False, 172800),
        ("1w", 10080, False, 604800),
        ({"idle_minutes": 2}, 2, False, 120),
        ({"down": True}, 5, True, 300),
        ({"idle_minutes": 3, "down": True, "wait_for": "JOBS"}, 3, True, 180),
        (0, 0, False, 60),  # as soon as idle: one minute here, so the pause between setup and run is not idle
    ],
)
def test_autostop_in_skypilots_forms_is_the_idle_time_of_the_cluster(
    autostop: object, minutes: int, down: bool, seconds: int
) -> None:
    spec = parse_task(_res(autostop=autostop))
    assert spec.autostop is not None
    got = spec.autostop
    assert (got.idle_minutes, got.down, got.idle_seconds) == (minutes, down, seconds)
    assert spec.resources == Resources()  # the cluster's setting, not a resource a backend must have
    assert parse_task(spec.to_dict()) == spec


@pytest.mark.parametrize("autostop", [False, None])
def test_autostop_false_or_empty_is_off(autostop: object) -> None:
    assert parse_task(_res(autostop=autostop)).autostop is None


def test_autostop_beside_alternatives_and_the_arguments_over_it() -> None:
    base = _res(autostop="10m", any_of=[{"cpus": 2}, {"cpus": 4}])
    spec = parse_task(base)
    assert spec.autostop is not None and spec.autostop.idle_minutes == 10 and len(spec.alternatives) == 2
    # the argument's autostop replaces the YAML's, and is not copied into the alternatives
    over = parse_task(base, overrides={"resources": {"autostop": {"idle_minutes": 1, "down": True}}})
    assert over.autostop is not None and (over.autostop.idle_minutes, over.autostop.down) == (1, True)
    assert parse_task(base, overrides={"resources": {"autostop": None}}).autostop is None
    assert parse_task(over.to_dict()) == over


def _autostop_gang(tmp_path: Path, **kwargs: Any) -> tuple[Any, Any]:
    """The cluster and job tasks sky_gang builds for a YAML with ``autostop: {idle_minutes: 2}``."""
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    path = tmp_path / "task.yaml"
    path.write_text("num_nodes: 2\nresources:\n  autostop:\n    idle_minutes: 2\nrun: echo hi\n")
    with DAG("autostop", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        group = sky_gang("g", task_yaml=str(path), **kwargs)
    return group.children["g.cluster"], group.children["g.job"]


@pytest.mark.parametrize(
    ("kwargs", "idle_down"),
    [
        ({"down": False}, 120.0),  # a kept cluster: the YAML's 2 idle minutes
        ({"down": False, "idle_down": 30}, 30.0),  # the argument wins
        ({"down": False, "idle_down": 0}, 0.0),  # 0: never
        # down=True (the default): the run's teardown removes the cluster, autostop changes nothing
        ({}, 0.0),
        ({"idle_down": 45}, 45.0),
    ],
)
def test_sky_gang_arms_the_nodes_with_the_yamls_autostop_only_for_a_kept_cluster(
    tmp_path: Path, kwargs: dict[str, Any], idle_down: float
) -> None:
    from airflow_provider_sky.operators._spec import idle_down_for

    cluster, job = _autostop_gang(tmp_path, **kwargs)
    for op in (cluster, job):  # both launch on the nodes, and the last launch's setting holds
        assert idle_down_for(op.idle_down, op.rendered_spec()) == idle_down


def test_a_stop_becomes_a_teardown_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from airflow_provider_sky.operators._spec import log_autostop

    logger = logging.getLogger("test.autostop")
    cluster, _ = _autostop_gang(tmp_path, down=False)
    with caplog.at_level(logging.INFO, logger="test.autostop"):
        log_autostop(cluster.idle_down, cluster.rendered_spec(), logger)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "SkyPilot would stop the cluster after 2 idle minutes and keep its disks" in record.message
    assert "it is torn down instead" in record.message
    caplog.clear()
    spec = parse_task(_res(autostop={"idle_minutes": 2, "down": True}))
    with caplog.at_level(logging.INFO, logger="test.autostop"):
        log_autostop(None, spec, logger)
        log_autostop(0, spec, logger)  # sky_gang(down=True): said once, as information
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    assert "torn down after 2 idle minutes (SkyPilot's autodown)" in caplog.records[0].message
    assert "is not used: idle_down=0 given" in caplog.records[1].message
