"""One ``RunInstances`` of a cluster, and how it is undone when anything after it fails.

Why a client token: a RunInstances whose reply is lost (a timeout, a dropped connection) may have made
every instance anyway, and the caller never learns their ids. The token is EC2's idempotency key (a
retry of the same call, as botocore makes, gives the same instances, not a second set) and it is
recorded on each instance (``ClientToken``), so the undo finds them: it looks up the cluster's tagged
instances and keeps those carrying this launch's token, whatever the reply said. It never says nothing
is left without having looked, and says so when the look-up itself failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.backends.aws import ec2 as api
from airflow_provider_sky.backends.base import BackendError


def _token() -> str:
    return f"sky-{uuid.uuid4().hex}"  # EC2 takes up to 64 ASCII characters


@dataclass
class Launch:
    """A launch of instances for cluster ``name``: its token, whether it was sent, the ids it returned."""

    name: str
    owner: str
    token: str = field(default_factory=_token)
    sent: bool = False
    ids: list[str] = field(default_factory=list)
    #: the call failed without EC2's definite answer (no reply, a 5xx): its instances may exist
    unsure: bool = False

    def run(self, ec2: Any, request: dict[str, Any], what: str) -> list[dict[str, Any]]:
        """RunInstances with this launch's token; the instances it returned."""
        self.sent = True
        try:
            launched: list[dict[str, Any]] = ec2.run_instances(**request, ClientToken=self.token)["Instances"]
        except Exception as exc:
            self.unsure = not definite(exc)
            raise api.client_error(what, exc) from None
        except BaseException:  # killed while waiting for the reply
            self.unsure = True
            raise
        self.ids = [str(i["InstanceId"]) for i in launched]
        return launched

    def find(self, ec2: Any, delays: Sequence[float] = ()) -> list[str]:
        """The live instances of this launch: the ids it returned and every instance tagged for the
        cluster and owner that carries its token. When the reply was lost and nothing is found yet, it
        looks again after each of ``delays`` (EC2's listings are eventually consistent)."""
        found: list[str] = []
        for delay in (0.0, *(delays if self.unsure and not self.ids else ())):
            time.sleep(delay)
            instances = api.describe_instances(ec2, self.name, self.owner)
            found = [str(i["InstanceId"]) for i in instances if i.get("ClientToken") == self.token]
            if found:
                break
        return sorted(set(self.ids) | set(found))

    def undo(self, ec2: Any, wait: float, delays: Sequence[float] = ()) -> tuple[str, bool]:
        """Terminate every instance of this launch (:meth:`find`) and wait until they are gone.
        Returns what was found and done, in words, and whether nothing of the launch is left."""
        if not self.sent:
            return "", True
        try:
            ids = self.find(ec2, delays)
        except BackendError as exc:
            note = f"looking up the instances of the launch (client token {self.token}) failed: {exc}"
            try:  # at least those it returned
                api.terminate_and_wait(ec2, self.ids, wait)
            except BackendError as term:
                note += f"; terminating {', '.join(self.ids)} failed too: {term}"
            return (
                f"{note}; instances of it may be left, tagged {api.TAG_CLUSTER}={self.name}: tear the "
                "cluster down to remove them",
                False,
            )
        if not ids:
            return "no instance of the launch found (looked up by its client token)", True
        lost = [i for i in ids if i not in self.ids]
        how = f", {len(lost)} of them found by the launch's client token (its reply was lost)" if lost else ""
        try:
            api.terminate_and_wait(ec2, ids, wait)
        except BackendError as exc:
            return (
                f"{len(ids)} instance(s) made ({', '.join(ids)}){how}; terminating them failed: {exc}",
                False,
            )
        return f"{len(ids)} instance(s) made ({', '.join(ids)}){how}, terminated", True


#: error codes EC2 answers when it did not (or may not have) carried the call out
_UNSURE = {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable", "RequestTimeout"}


def definite(exc: BaseException) -> bool:
    """EC2 answered with an error that means it made nothing (a 4xx, or a known cause such as
    insufficient capacity); not a timeout, a dropped connection or a server error."""
    code, _ = api.error_code(exc)
    if not code or code in _UNSURE:
        return False
    response = getattr(exc, "response", None) or {}
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return status < 500 or code in api.CAUSES
