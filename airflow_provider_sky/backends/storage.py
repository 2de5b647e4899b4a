"""S3 buckets in ``file_mounts``: copied to every node through presigned URLs, or mounted with rclone.

COPY (``/data: s3://bucket/path``): the launching side lists the objects with its own AWS credentials and
hands each node short-lived presigned GET URLs; the node downloads them with ``python3`` (which the runtime
already needs). The URLs travel in the script's text on the runner's stdin: never on a command line,
never in a file; the node holds no AWS credential.

MOUNT / MOUNT_CACHED (``{name: bucket, mode: MOUNT}``): ``rclone mount`` (FUSE) on every node, with
``--vfs-cache-mode writes`` (MOUNT: files written whole, like SkyPilot's MOUNT) or ``full`` (MOUNT_CACHED:
reads and writes cached on the node, like SkyPilot's rclone-based MOUNT_CACHED). rclone needs credentials
for as long as the mount lives: they are set in its environment by the script (stdin again), so they are
in no file and on no command line, and only the node user (and root) can read them from ``/proc``. The
mount point is recorded in the node root's ``mounts`` file, and teardown unmounts it before anything is
deleted (a delete through a live mount would delete the bucket's objects).

Nothing here imports Airflow: the hook builds :class:`S3Access` from an ``aws`` connection.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_sky.errors import StorageError
from airflow_provider_sky.spec.storage import StorageMount

log = logging.getLogger(__name__)

#: how long a presigned URL is valid (the copies of one launch start within it)
URL_TTL = 3600
#: JSON lines per node call: a script well under a pipe's buffer, so no shell writes it to a temp file
BATCH_BYTES = 48 * 1024

#: the node's downloader: one JSON line per object ({"p": path, "u": url}) on stdin; each file written
#: beside its path and renamed into place, so a failed copy leaves no half file. No single quote in it.
FETCH_PY = r"""
import json, os, shutil, sys, urllib.request
bad = 0
for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    item = json.loads(line)
    path = os.path.expanduser(item["p"])
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        part = path + ".sky-part"
        with urllib.request.urlopen(item["u"], timeout=120) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        os.replace(part, path)
    except Exception as e:
        bad += 1
        print("FAILED %s: %s: %s" % (item["k"], type(e).__name__, str(e)[:200]), file=sys.stderr)
sys.exit(1 if bad else 0)
"""

#: mount the bucket unless something is mounted there already (a reused cluster); exit 3 names what the
#: node lacks. ``sh -s -- TARGET REMOTE CACHE_MODE ROOT`` after the credentials' assignments.
MOUNT_SH = r"""
target=$1; remote=$2; cache=$3; root=$4
command -v rclone >/dev/null 2>&1 || { echo "rclone is not installed on the node" >&2; exit 3; }
command -v fusermount3 >/dev/null 2>&1 || command -v fusermount >/dev/null 2>&1 || {
  echo "FUSE (fusermount3 or fusermount) is not installed on the node" >&2; exit 3; }
[ -e /dev/fuse ] || { echo "the node has no /dev/fuse (FUSE is not available to it)" >&2; exit 3; }
if awk -v t="$target" '$2 == t { found = 1 } END { exit !found }' /proc/mounts 2>/dev/null; then
  echo "ALREADY $target"; exit 0
fi
mkdir -p "$target" "$root" || exit 1
printf '%s\n' "$target" >> "$root/mounts"
export RCLONE_CONFIG_SKYS3_TYPE=s3 RCLONE_CONFIG_SKYS3_PROVIDER=AWS RCLONE_CONFIG_SKYS3_ENV_AUTH=false
export RCLONE_CONFIG_SKYS3_ACCESS_KEY_ID RCLONE_CONFIG_SKYS3_SECRET_ACCESS_KEY RCLONE_CONFIG_SKYS3_SESSION_TOKEN
export RCLONE_CONFIG_SKYS3_REGION RCLONE_CONFIG_SKYS3_ENDPOINT
[ -n "$RCLONE_CONFIG_SKYS3_SESSION_TOKEN" ] || unset RCLONE_CONFIG_SKYS3_SESSION_TOKEN
# an endpoint of its own (MinIO, moto, ...) serves buckets by path, not by host name (rclone's AWS
# provider would always ask bucket.host)
if [ -n "$RCLONE_CONFIG_SKYS3_ENDPOINT" ]; then
  export RCLONE_CONFIG_SKYS3_PROVIDER=Other RCLONE_CONFIG_SKYS3_FORCE_PATH_STYLE=true
else unset RCLONE_CONFIG_SKYS3_ENDPOINT; fi
# the AWS SDK inside rclone cannot load AWS_CA_BUNDLE itself ("unsupported transport"): rclone's flag can
set --
[ -z "${AWS_CA_BUNDLE:-}" ] || set -- "--ca-cert=$AWS_CA_BUNDLE"
unset AWS_CA_BUNDLE
rclone mount "skys3:$remote" "$target" "$@" --daemon --config /dev/null --vfs-cache-mode "$cache" \
  --dir-cache-time 5s --log-level ERROR --log-file "$root/rclone.log" </dev/null >/dev/null 2>&1 || {
  rc=$?; tail -n 5 "$root/rclone.log" >&2 2>/dev/null; exit $rc; }
echo "MOUNTED $target"
"""


@dataclass(frozen=True)
class S3Access:
    """The launching side's S3: ``client()`` makes a boto3 S3 client with the deployment's credentials;
    ``credentials()`` gives (key id, secret, token or None) for a node's rclone mount."""

    client: Callable[[], Any]
    credentials: Callable[[], tuple[str, str, str | None]]
    region: str | None = None
    endpoint_url: str | None = None


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


def _client_error(exc: Exception) -> str:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
    return f"{code or type(exc).__name__}: {exc}"


def listing(s3: Any, url: str) -> list[tuple[str, str]]:
    """(object key, path relative to the destination) for what a COPY of ``url`` gets: the one object
    when ``url`` names one ("" relative path: the destination is that file), else every object under it
    (``url`` as a directory). A key that would leave the destination (``..``, ``/`` at its start) is
    an error."""
    bucket, key = _split(url)
    if key and not key.endswith("/"):
        try:
            s3.head_object(Bucket=bucket, Key=key)
            return [(key, "")]
        except Exception as exc:  # a 404 here: the URL is a prefix (or nothing)
            if "404" not in str(exc) and "NoSuchKey" not in str(exc) and "Not Found" not in str(exc):
                raise
    prefix = key.rstrip("/") + "/" if key else ""
    out: list[tuple[str, str]] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            k = obj["Key"]
            rel = k[len(prefix) :]
            if not rel or rel.endswith("/"):
                continue  # a "folder" marker object
            if rel.startswith("/") or ".." in rel.split("/") or "\0" in rel or "\n" in rel:
                raise StorageError(
                    "", f"object {k!r} of {url} would be written outside the destination; rename it"
                )
            out.append((k, rel))
    return out


def fetch_scripts(items: list[tuple[str, str, str]]) -> list[str]:
    """Node scripts that download (key, target path, presigned URL) items, a batch each."""
    scripts: list[str] = []
    lines: list[str] = []
    size = 0

    def close() -> None:
        body = "\n".join(lines)
        scripts.append(f"python3 -c {shlex.quote(FETCH_PY)} <<'__SKY_FETCH__'\n{body}\n__SKY_FETCH__\n")

    for key, path, url in items:
        line = json.dumps({"k": key, "p": path, "u": url})
        if lines and size + len(line) > BATCH_BYTES:
            close()
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
    if lines:
        close()
    return scripts


def presigned_copy(access: S3Access, url: str, target: str) -> list[tuple[str, str, str]]:
    """(key, node path, presigned URL) for every object a COPY of ``url`` to ``target`` fetches."""
    s3 = access.client()
    bucket, _ = _split(url)
    try:
        found = listing(s3, url)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError("", f"listing {url} failed ({_client_error(exc)})") from None
    if not found:
        raise StorageError("", f"{url} holds no object; check the bucket and path")
    return [
        (
            key,
            target if not rel else f"{target.rstrip('/')}/{rel}",
            s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=URL_TTL),
        )
        for key, rel in found
    ]


def prepare_mount(access: S3Access, mount: StorageMount) -> bool:
    """The bucket a mount needs, there before any node mounts it: created when it does not exist, a local
    ``source`` uploaded to it. True: this call created it."""
    s3 = access.client()
    created = False
    try:
        s3.head_bucket(Bucket=mount.bucket)
    except Exception as exc:
        if "404" not in str(exc) and "NoSuchBucket" not in str(exc) and "Not Found" not in str(exc):
            raise StorageError(
                "", f"bucket {mount.bucket!r} cannot be reached ({_client_error(exc)})"
            ) from None
        kwargs: dict[str, Any] = {"Bucket": mount.bucket}
        if access.region and access.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": access.region}
        try:
            s3.create_bucket(**kwargs)
        except Exception as exc2:
            raise StorageError(
                "", f"creating bucket {mount.bucket!r} failed ({_client_error(exc2)})"
            ) from None
        created = True
        log.info("created bucket %s", mount.bucket)
    if mount.upload is not None:
        local = Path(mount.upload).expanduser()
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in files:
            rel = path.name if local.is_file() else path.relative_to(local).as_posix()
            key = f"{mount.prefix}/{rel}" if mount.prefix else rel
            try:
                s3.upload_file(str(path), mount.bucket, key)
            except Exception as exc:
                raise StorageError(
                    "", f"uploading {path} to {mount.url} failed ({_client_error(exc)})"
                ) from None
    return created


def mount_script(access: S3Access, mount: StorageMount) -> str:
    """The node script that mounts ``mount`` (``sh -s -- TARGET REMOTE CACHE_MODE ROOT``), with the
    credentials as shell assignments in its text (stdin only)."""
    key_id, secret, token = access.credentials()
    values = {
        "RCLONE_CONFIG_SKYS3_ACCESS_KEY_ID": key_id,
        "RCLONE_CONFIG_SKYS3_SECRET_ACCESS_KEY": secret,
        "RCLONE_CONFIG_SKYS3_SESSION_TOKEN": token or "",
        "RCLONE_CONFIG_SKYS3_REGION": access.region or "us-east-1",
        "RCLONE_CONFIG_SKYS3_ENDPOINT": access.endpoint_url or "",
    }
    assigns = "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())
    return assigns + MOUNT_SH


def mount_args(mount: StorageMount, target: str, root: str) -> list[str]:
    remote = mount.bucket + (f"/{mount.prefix}" if mount.prefix else "")
    cache = "full" if mount.mode == "MOUNT_CACHED" else "writes"
    return [target, remote, cache, root]


def needs_storage(dests: dict[str, str], mounts: dict[str, StorageMount]) -> bool:
    """Whether syncing these mounts needs S3 access."""
    return bool(mounts) or any(src.startswith("s3://") for src in dests.values())


def node_path(home: str, dest: str) -> str:
    return f"{home}/{dest[2:]}" if dest.startswith("~/") else dest


def redact(text: str, access: S3Access | None) -> str:
    """``text`` without the credentials (an rclone error may echo its environment)."""
    if access is None:
        return text
    try:
        key_id, secret, token = access.credentials()
    except Exception:
        return text
    for value in (secret, token, key_id):
        if value:
            text = text.replace(value, "***")
    return text


__all__ = [
    "S3Access",
    "StorageError",
    "fetch_scripts",
    "mount_args",
    "mount_script",
    "needs_storage",
    "node_path",
    "prepare_mount",
    "presigned_copy",
    "redact",
]
