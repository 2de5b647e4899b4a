"""A kubeconfig for the service account a ``skykubernetes`` connection acts as, after checking that the
account is there and may do what the provider does (``docs/kubernetes-rbac.yaml`` makes it).

    python -m airflow_provider_sky.backends.kubernetes.account --namespace sky-gangs --service-account sky-airflow \\
        --output sky-airflow.kubeconfig

Run it with the rights that applied the manifest (your own kubeconfig). It names each missing piece
(namespace, service account, its token, a RoleBinding of it) before writing anything, then checks every
permission as the account itself, as the connection's Test button does. The token is written to the
output file only (mode 0600), never printed.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from airflow_provider_sky.errors import AccountError as AccountError

#: where to look for the manifest, for the messages
MANIFEST = "docs/kubernetes-rbac.yaml"
TOKEN_TYPE = "kubernetes.io/service-account-token"
#: the token controller fills a new token secret within a second or two
TOKEN_WAIT = 30.0


@dataclass(frozen=True)
class Account:
    namespace: str
    service_account: str


def _admin_client(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import config

    return config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)


def _missing(api: Any, rbac: Any, acct: Account) -> list[str]:
    """The pieces of the manifest not in the cluster (empty: all there)."""
    from kubernetes.client.rest import ApiException

    def exists(read: Any, *args: Any) -> bool:
        try:
            read(*args)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    ns, sa = acct.namespace, acct.service_account
    if not exists(api.read_namespace, ns):
        return [f"namespace {ns}"]
    missing = []
    if not exists(api.read_namespaced_service_account, sa, ns):
        missing.append(f"service account {ns}/{sa}")
    if not _token_secrets(api, acct):
        missing.append(f"a token secret of {sa} (type {TOKEN_TYPE})")
    bound = [
        b.metadata.name
        for b in rbac.list_namespaced_role_binding(ns).items
        if any(s.kind == "ServiceAccount" and s.name == sa and s.namespace == ns for s in b.subjects or [])
    ]
    if not bound:
        missing.append(f"a RoleBinding of service account {sa} in namespace {ns}")
    return missing


def _token_secrets(api: Any, acct: Account) -> list[Any]:
    return [
        s
        for s in api.list_namespaced_secret(acct.namespace).items
        if s.type == TOKEN_TYPE
        and (s.metadata.annotations or {}).get("kubernetes.io/service-account.name") == acct.service_account
    ]


def _token(api: Any, acct: Account) -> str:
    """The account's token, from its token secret (waits while the token controller fills it)."""
    deadline = time.monotonic() + TOKEN_WAIT
    while True:
        for secret in _token_secrets(api, acct):
            token = (secret.data or {}).get("token")
            if token:
                return base64.b64decode(token).decode()
        if time.monotonic() > deadline:
            raise AccountError(
                f"the token secret of {acct.namespace}/{acct.service_account} has no token after "
                f"{TOKEN_WAIT:.0f} s: is the cluster's token controller running?"
            )
        time.sleep(0.5)


def _cluster_entry(admin: Any) -> dict[str, Any]:
    """The API server and its CA as the admin client reaches it, for a standalone kubeconfig."""
    conf = admin.configuration
    cluster: dict[str, Any] = {"server": conf.host}
    if conf.ssl_ca_cert:
        cluster["certificate-authority-data"] = base64.b64encode(Path(conf.ssl_ca_cert).read_bytes()).decode()
    if not conf.verify_ssl:
        cluster["insecure-skip-tls-verify"] = True
    if getattr(conf, "tls_server_name", None):
        cluster["tls-server-name"] = conf.tls_server_name
    return cluster


def kubeconfig_for(
    acct: Account, *, kubeconfig: str | None = None, context: str | None = None
) -> dict[str, Any]:
    """The account's kubeconfig (token included), or AccountError naming what the cluster lacks."""
    from kubernetes import client

    admin = _admin_client(kubeconfig, context)
    try:
        api, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
        missing = _missing(api, rbac, acct)
        if missing:
            raise AccountError(
                f"missing: {'; '.join(missing)}. Apply {MANIFEST} (kubectl apply -f {MANIFEST}, "
                f"with namespace {acct.namespace!r} and service account {acct.service_account!r} in it)"
            )
        token = _token(api, acct)
        cluster = _cluster_entry(admin)
    finally:
        admin.close()
    name = f"{acct.service_account}@{acct.namespace}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": acct.service_account, "user": {"token": token}}],
        "contexts": [
            {
                "name": name,
                "context": {"cluster": "cluster", "user": acct.service_account, "namespace": acct.namespace},
            }
        ],
        "current-context": name,
    }


def write_private(path: Path, text: str) -> None:
    """``text`` to ``path``, readable by its owner only from the first byte (it holds a token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_permissions(path: Path, namespace: str) -> str:
    """As the account: every permission the provider uses (the connection's Test button's check)."""
    from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend

    backend = KubernetesBackend.from_config({"kube_config_path": str(path), "namespace": namespace})
    try:
        return backend.test_connection()
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_provider_sky.backends.kubernetes.account",
        description=f"Write the kubeconfig of the service account {MANIFEST} makes, after checking it.",
    )
    parser.add_argument("--namespace", default="sky-gangs")
    parser.add_argument("--service-account", default="sky-airflow")
    parser.add_argument("--output", required=True, help="the kubeconfig file to write (mode 0600)")
    parser.add_argument("--kubeconfig", help="yours, with the rights that applied the manifest")
    parser.add_argument("--context", help="its context (default: the current one)")
    args = parser.parse_args(argv)
    acct = Account(args.namespace, args.service_account)
    out = Path(args.output)
    try:
        config = kubeconfig_for(acct, kubeconfig=args.kubeconfig, context=args.context)
    except AccountError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_private(out, yaml.safe_dump(config, sort_keys=False))
    try:
        said = check_permissions(out, acct.namespace)
    except Exception as exc:  # the backend's BackendError names every missing permission
        print(f"wrote {out}, but as {acct.service_account}: {exc}", file=sys.stderr)
        return 1
    extra = f'{{"kube_config_path": "{out.resolve()}", "namespace": "{acct.namespace}"}}'
    print(f"wrote {out} (service account {acct.namespace}/{acct.service_account}): {said}")
    print(f"airflow connections add sky_default --conn-type skykubernetes --conn-extra '{extra}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
