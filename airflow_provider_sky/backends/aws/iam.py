"""The EC2 actions the backend calls, one list, and the least-privilege IAM policy made from it.

Every boto3 EC2 call of ``backends/aws`` is one of these (waiters and paginators included: they call
``DescribeInstances``); the policy in docs/backends/aws.md is :func:`policy` (a test checks both: that
page against this, and the calls recorded on the wire against :data:`ACTIONS`). An action missing from a user's
policy is an error naming the cause where it is called, never a quieter fallback.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.backends.aws.config import DEFAULT_OWNER
from airflow_provider_sky.backends.aws.ec2 import TAG_OWNER

#: read-only calls: finding clusters, images, subnets, what a cluster left, a root volume's size
#: (a replaced node gets the disk of the one it replaces), the Test button's zones
READ = (
    "ec2:DescribeInstances",
    "ec2:DescribeImages",
    "ec2:DescribeSubnets",
    "ec2:DescribeVpcs",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribeKeyPairs",
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeVolumes",
)
#: calls that make something (tagged in the same call)
CREATE = ("ec2:RunInstances", "ec2:CreateSecurityGroup", "ec2:ImportKeyPair")
#: calls on what the owner tag says is ours (CreateTags also: the head's role, the pinned host key)
OURS = (
    "ec2:CreateTags",
    "ec2:StartInstances",
    "ec2:TerminateInstances",
    "ec2:AuthorizeSecurityGroupIngress",
    "ec2:DeleteSecurityGroup",
    "ec2:DeleteKeyPair",
)
#: every EC2 action the backend calls
ACTIONS = frozenset(READ + CREATE + OURS)


def policy(owner: str = DEFAULT_OWNER) -> dict[str, Any]:
    """The least-privilege policy for a connection whose ``owner`` is ``owner``: the ``Condition``s keep
    the identity off instances, groups and key pairs it did not make."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Read", "Effect": "Allow", "Resource": "*", "Action": list(READ)},
            {"Sid": "Create", "Effect": "Allow", "Resource": "*", "Action": list(CREATE)},
            {
                "Sid": "TagWhatIsCreated",
                "Effect": "Allow",
                "Resource": "*",
                "Action": "ec2:CreateTags",
                "Condition": {"StringEquals": {"ec2:CreateAction": [a[4:] for a in CREATE]}},
            },
            {
                "Sid": "OnlyOurs",
                "Effect": "Allow",
                "Resource": "*",
                "Action": list(OURS),
                "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_OWNER}": owner}},
            },
        ],
    }
