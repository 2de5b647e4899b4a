"""SkyPilot's multi-node examples: each YAML of ``tests/data/skypilot_examples`` (origins and
expected outcomes in its ``index.yaml``; not verbatim copies, see there) parses as it is; on a backend with
enough GPUs the cluster provisions, setup and run go, and every rank sees the right ``SKYPILOT_*`` values
and ``CUDA_VISIBLE_DEVICES``. The ``run`` and ``setup`` commands are replaced by an env dump here (as
arguments: the files are used as they are).

The GPUs are FAKE (this machine has none): the fake nvidia-smi of ``tests/fakes`` on PATH for the local
backend, and on the SSH test hosts (``SSHDCluster(gpus=...)``). Everything else is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from gpus import A100_40, A100_80, H100, L4, T4, V100

from airflow_provider_sky.spec import SpecError, load_task_yaml, parse_task

DATA = Path(__file__).resolve().parents[1] / "data" / "skypilot_examples"
INDEX: dict[str, Any] = yaml.safe_load((DATA / "index.yaml").read_text())
EXAMPLES: dict[str, dict[str, Any]] = INDEX["examples"]
#: a fake nvidia-smi line per SkyPilot name the examples ask for
LINES = {"L4": L4, "A100": A100_40, "A100-80GB": A100_80, "V100": V100, "H100": H100, "T4": T4}


def _expect(name: str) -> Any:
    return EXAMPLES[name]["expect"]


def _named(kind: str) -> list[str]:
    """The examples whose expectation is ``kind`` (``runs``, ``refused``, ``parse_error``)."""
    out = []
    for name, entry in sorted(EXAMPLES.items()):
        expect = entry["expect"]
        if expect == kind or (isinstance(expect, dict) and kind in expect):
            out.append(name)
    return out


def test_the_index_names_every_file_and_its_origin() -> None:
    assert INDEX["repo"] == "skypilot-org/skypilot"
    assert sorted(EXAMPLES) == sorted(p.name for p in DATA.glob("*.yaml") if p.name != "index.yaml")
    assert len(EXAMPLES) >= 12
    for name, entry in EXAMPLES.items():
        assert len(entry["commit"]) == 40 and int(entry["commit"], 16) >= 0, name
        assert entry["path"].endswith((".yaml", ".yml")), name
        assert (DATA / name).read_text().startswith("# NOT VERBATIM"), name  # says so at its top


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_parses_as_it_is(name: str) -> None:
    expect = _expect(name)
    if isinstance(expect, dict) and "parse_error" in expect:
        with pytest.raises(SpecError) as info:
            load_task_yaml(DATA / name)
        assert info.value.field == expect["parse_error"]
        return
    spec = load_task_yaml(DATA / name)
    assert spec.num_nodes >= 1 and spec.run
    assert load_task_yaml(DATA / name) == spec
    assert parse_task(yaml.safe_load(yaml.safe_dump(spec.to_dict(include_secrets=True)))) == spec


# ------------------------------------------------------------------------------------------- local backend


# ------------------------------------------------------------------------------------------- SSH hosts

#: each host a mixed GPU box: devices of a type keep the indices nvidia-smi gives them
MIXED_BOX = [L4, L4, A100_40, V100, *[H100] * 8]
DEVICES = {"L4": [0, 1], "A100": [2], "V100": [3], "H100": list(range(4, 12))}
#: the runnable examples whose hosts need no more CPUs than this test machine has (2)
ON_SSH = [n for n in _named("runs") if "cpus" not in (load_task_yaml(DATA / n).resources.requested())]
