"""SkyPilot storage in ``file_mounts``: bucket URLs and ``{name, source, store, mode, persistent}`` mounts.

SkyPilot's meaning (``sky/data/storage.py``), and what this provider does with it:

- ``/dest: s3://bucket/path`` (a string) is a COPY: every node gets the bucket's files before setup.
- ``{source: s3://bucket/path, mode: COPY}``, ``{name: bucket, mode: COPY}``: the same COPY.
- ``{source: ./local, mode: COPY}`` (any name/store): the local files, copied as a local source is.
- ``{source: s3://bucket/path}`` or ``{name: bucket}`` with ``mode: MOUNT`` (SkyPilot's default) or
  ``MOUNT_CACHED``: the bucket mounted on every node (rclone, FUSE). A named bucket that does not exist is
  created; with a local ``source`` it is created and the files uploaded first.
- S3 only (``store: s3``, or no store): the one object store the tests have a real server for (moto). Other
  stores (GCS, Azure, R2, OCI, ...) are refused naming the field, with the way round (copy it in setup).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_sky.spec.common import SpecError, _type_name

#: the keys of a SkyPilot storage mount (``config`` is a store's own settings)
STORAGE_KEYS = frozenset({"name", "source", "store", "mode", "persistent", "config"})
MODES = ("COPY", "MOUNT", "MOUNT_CACHED")
#: SkyPilot's store names and URL schemes for stores this provider does not reach, and what they are
OTHER_STORES: dict[str, str] = {
    "gcs": "Google Cloud Storage",
    "gs": "Google Cloud Storage",
    "azure": "Azure Blob Storage",
    "az": "Azure Blob Storage",
    "https": "Azure Blob Storage or a web URL",
    "r2": "Cloudflare R2",
    "oci": "OCI Object Storage",
    "ibm": "IBM Cloud Object Storage",
    "cos": "IBM Cloud Object Storage",
    "nebius": "Nebius Object Storage",
    "coreweave": "CoreWeave object storage",
    "cw": "CoreWeave object storage",
    "hf": "the Hugging Face Hub",
    "vastdata": "VAST Data",
}
#: an S3 bucket name as AWS allows it (3-63 lower-case letters, digits, '.', '-'; no '..')
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: ``$VAR`` and ``${VAR}``, as SkyPilot's ``_fill_in_env_vars`` finds them
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class StorageMount:
    """A bucket mounted on every node (``mode: MOUNT`` / ``MOUNT_CACHED``)."""

    #: ``s3://bucket`` or ``s3://bucket/prefix``
    url: str
    mode: str = "MOUNT"
    #: a local directory or file uploaded to the bucket before it is mounted (SkyPilot's local ``source``)
    upload: str | None = None
    #: False: the bucket is deleted at teardown if this provider created it (SkyPilot's ``persistent``)
    persistent: bool = True

    @property
    def bucket(self) -> str:
        return self.url[len("s3://") :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        return self.url[len("s3://") :].partition("/")[2].strip("/")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.upload is not None:
            out.update(name=self.bucket, source=self.upload, store="s3")
        elif self.prefix:
            out["source"] = self.url
        else:
            out.update(name=self.bucket, store="s3")
        if not self.persistent:
            out["persistent"] = False
        return out


def fill_env_refs(value: object, envs: Mapping[str, str]) -> object:
    """``$VAR`` / ``${VAR}`` in every string of ``value`` (keys included) replaced by the task's envs, as
    SkyPilot does for ``file_mounts`` at parse time; a name that is not in ``envs`` stays as written."""

    def one(text: str) -> str:
        return _ENV_REF.sub(lambda m: envs.get(m.group(1) or m.group(2), m.group(0)), text)

    if isinstance(value, str):
        return one(value)
    if isinstance(value, Mapping):
        return {(one(k) if isinstance(k, str) else k): fill_env_refs(v, envs) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_env_refs(v, envs) for v in value]
    return value


def env_refs(value: object) -> set[str]:
    """The names ``$VAR`` / ``${VAR}`` refer to in every string of ``value`` (keys included)."""
    if isinstance(value, str):
        return {m.group(1) or m.group(2) for m in _ENV_REF.finditer(value)}
    if isinstance(value, Mapping):
        return set().union(*(env_refs(k) | env_refs(v) for k, v in value.items()))
    if isinstance(value, list):
        return set().union(*(env_refs(v) for v in value))
    return set()


def is_storage_dict(src: object) -> bool:
    return isinstance(src, Mapping) and bool(src) and set(src) <= STORAGE_KEYS


def bucket_url_problem(url: str) -> str | None:
    """Why a bucket URL cannot be used (None: an ``s3://`` URL with a valid bucket name)."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme != "s3":
        what = OTHER_STORES.get(scheme, f"a {scheme}:// store")
        return (
            f"{url!r} is on {what}; this provider fetches and mounts S3 buckets only (s3://...). Copy the "
            f"data in setup with that store's own tool (e.g. gcloud storage cp for gs://), or move it to S3"
        )
    bucket = rest.split("/", 1)[0]
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        return (
            f"{bucket!r} is not an S3 bucket name: 3-63 lower-case letters, digits, '.' and '-', starting "
            "and ending with a letter or digit"
        )
    return None


def _refs_left(text: str) -> str | None:
    m = _ENV_REF.search(text)
    return m.group(1) or m.group(2) if m else None


def parse_storage(where: str, src: Mapping[str, Any]) -> str | StorageMount:
    """One storage mount: a string source (a COPY: the local path or bucket URL, copied as written), or a
    :class:`StorageMount`. Raises SpecError naming ``where`` and the fix."""
    extra = set(src) & {"config"}
    if extra:
        raise SpecError(
            f"{where}.config",
            "a store's own settings (config:) are not supported; remove it (the bucket is mounted with "
            "rclone's defaults)",
        )
    for key in ("name", "store", "mode"):
        value = src.get(key)
        if value is not None and not isinstance(value, str):
            raise SpecError(f"{where}.{key}", f"must be a string, got {_type_name(value)} {value!r}")
        if isinstance(value, str) and (name := _refs_left(value)):
            raise SpecError(
                f"{where}.{key}",
                f"uses ${name}, which envs does not give a value here; set envs: {{{name}: ...}} in the "
                f"task or pass envs={{'{name}': ...}} (file_mounts are filled when the task is loaded)",
            )
    mode = (src.get("mode") or "MOUNT").strip().upper()
    if mode not in MODES:
        raise SpecError(f"{where}.mode", f"must be one of {', '.join(MODES)}, got {src.get('mode')!r}")
    name = (src.get("name") or "").strip() or None
    store = (src.get("store") or "").strip().lower() or None
    persistent = src.get("persistent", True)
    if not isinstance(persistent, bool):
        raise SpecError(f"{where}.persistent", f"must be true or false, got {persistent!r}")
    source = src.get("source")
    if isinstance(source, list):
        if len(source) != 1:
            raise SpecError(
                f"{where}.source",
                f"lists {len(source)} sources; this provider takes one source per mount: give one mount "
                "per source",
            )
        source = source[0]
    if source is not None and (not isinstance(source, str) or not source.strip()):
        raise SpecError(
            f"{where}.source",
            f"must be a local path or a bucket URL such as s3://bucket/path, got {_type_name(source)} {source!r}",
        )
    source = source.strip() if isinstance(source, str) else None
    if source is not None and (name_ := _refs_left(source)):
        raise SpecError(
            f"{where}.source",
            f"uses ${name_}, which envs does not give a value here; set envs: {{{name_}: ...}} in the task "
            f"or pass envs={{'{name_}': ...}} (file_mounts are filled when the task is loaded)",
        )
    if store is not None and store != "s3":
        what = OTHER_STORES.get(store, f"the store {store!r}")
        raise SpecError(
            f"{where}.store",
            f"is {store!r} ({what}); this provider fetches and mounts S3 buckets only: write store: s3 "
            "(or leave store out), or copy the data in setup with that store's own tool",
        )
    remote = source is not None and "://" in source
    if remote:
        assert source is not None
        if problem := bucket_url_problem(source):
            raise SpecError(f"{where}.source", problem)
        if mode == "COPY":
            return source
        return StorageMount(url=source, mode=mode, persistent=True)
    if name is None:
        if source is not None and mode == "COPY":
            return source  # a local source copied: the node gets the same files
        raise SpecError(
            where,
            "needs a bucket: give name: (an S3 bucket, created if it does not exist) or source: "
            "s3://bucket/path" + (" (the local source is uploaded to the named bucket)" if source else ""),
        )
    url = f"s3://{name}"
    if problem := bucket_url_problem(url):
        raise SpecError(f"{where}.name", problem)
    if mode == "COPY":
        return source if source is not None else url  # a local source is copied as it is
    return StorageMount(url=url, mode=mode, upload=source, persistent=persistent)
