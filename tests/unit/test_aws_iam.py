"""The IAM policy docs/backends/aws.md gives users, against the backend's real calls.

What moto (5.2.x) can check, and what it cannot: with auth enforced (``MotoEC2.enforce_iam``) it checks
each call's action against the caller's policies (Allow / Deny, wildcards), but for EC2 it evaluates
every statement against the resource ``*`` and with no condition keys of the request, so a statement's
``Resource`` and its ``Condition`` (the tag conditions) are never exercised. So: the policy is shown to
allow the whole lifecycle (actions), and its actions are shown to be exactly the ones the backend calls,
recorded on the wire; the conditions are checked for their shape only.
"""

from __future__ import annotations

from typing import Any

from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from sshd import needs_sshd

from airflow_provider_sky.backends.aws import iam

pytestmark = needs_sshd


def _docs_policy() -> dict[str, Any]:
    """The IAM policy JSON the AWS backend's page (docs/backends/aws.md) gives users."""
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "backends" / "aws.md").read_text()
    after = text[text.index("**IAM permissions**") :]
    block = after[after.index("```json") + len("```json") : after.index("```", after.index("```json") + 7)]
    policy: dict[str, Any] = json.loads(block)
    return policy


def test_the_docs_policy_is_the_one_made_from_the_backends_list_of_actions() -> None:
    """One list in code (``backends/aws/iam.py``) of the EC2 actions the backend calls; the docs'
    policy is the one made from it, for the default owner."""
    assert _docs_policy() == iam.policy()
    assert _actions(_docs_policy()) == iam.ACTIONS


def _actions(policy: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for st in policy["Statement"]:
        acts = st["Action"]
        out.update([acts] if isinstance(acts, str) else acts)
    return out


def test_every_ec2_call_in_the_backends_code_is_in_the_list() -> None:
    """Also the calls of paths no test above walks: each ``ec2.<method>(`` of ``backends/aws`` (waiters
    and paginators by the operation they call) is an action of ``iam.ACTIONS``, and each action of the
    list is called somewhere."""
    import re
    from pathlib import Path

    import airflow_provider_sky.backends.aws as package

    waiters = {"instance_running": "describe_instances", "instance_terminated": "describe_instances"}
    found: dict[str, str] = {}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        text = path.read_text()
        for method in re.findall(r"\bec2\.(\w+)\(", text):
            if method not in ("get_paginator", "get_waiter"):
                found.setdefault(method, path.name)
        for kind, op in re.findall(r"get_(paginator|waiter)\(\s*\"(\w+)\"", text):
            found.setdefault(waiters.get(op, "?" + op) if kind == "waiter" else op, path.name)
    actions = {"ec2:" + "".join(w.title() for w in m.split("_")): where for m, where in found.items()}
    assert set(actions) == iam.ACTIONS, (
        f"called, not in the list: {sorted(set(actions) - iam.ACTIONS)}; "
        f"listed, never called: {sorted(iam.ACTIONS - set(actions))}"
    )
