"""SkyPilot YAML compatibility: how many of SkyPilot's own example tasks load, and on which backends.

``make compat`` (= ``.venv/bin/python -m benchmarks.compat``) reads every file of the corpus in
``../shared/skypilot-corpus/`` (SkyPilot's ``examples/`` and ``llm/`` task YAMLs, with ``index.tsv`` naming
each file's origin and kind), loads each with :func:`load_task_yaml` as a user would (a multi-document
file with ``load_pipeline_yaml``, as ``sky_pipeline`` does), and checks each
loaded task against every backend's capabilities (nothing is launched). It prints:

- per kind of file (task, service, pool, multi-doc): loaded, refused, crashed;
- the refusals grouped by the field named in the error, each group marked ``cloud-only`` (a feature only
  a cloud service has: SkyServe pools, TPUs, another cloud or its object store), ``to fill in`` (the example
  leaves a bucket name for its user to write, which SkyPilot needs as well) or ``could run`` (a gang on
  some backend could honour it), with how many files each blocks and one example message;
- per backend: how many of the loaded tasks it can run as they are.

A file that makes the loader raise anything but a ``SpecError`` is a crash (a bug). The result is also
written as JSON to ``benchmarks/results/compat-<date>-<commit>.json``. Not part of ``make test``: the corpus
is data outside the repository; when it is absent this says so and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.registry import by_kind, conn_types
from airflow_provider_sky.spec import BackendCapabilities, SpecError, load_task_yaml, parse_task
from airflow_provider_sky.spec.capabilities import check_backend
from airflow_provider_sky.spec.yamlfile import load_job_group_yaml, load_pipeline_yaml

REPO = Path(__file__).resolve().parent.parent
#: ``../shared/skypilot-corpus`` beside the checkout (a worktree one level deeper finds it one level up)
CORPUS = next(
    (c for c in (p / "shared" / "skypilot-corpus" for p in (REPO.parent, REPO.parent.parent)) if c.is_dir()),
    REPO.parent / "shared" / "skypilot-corpus",
)
RESULTS = Path(__file__).resolve().parent / "results"
#: the corpus kinds that are meant to be run as tasks (``skip`` rows are configs, manifests, compose files)
KINDS = ("task", "service", "pool", "multi-doc")
#: fields (or field prefixes) whose refusal is a feature only a cloud service has
CLOUD_ONLY = (
    "pool",  # SkyPilot's managed-job worker pools
    "resources.accelerator_args",  # TPU runtime versions
    "resources.job_recovery",  # the managed-jobs controller
    "config.gcp",  # GCP settings (managed instance groups)
)
#: clouds no backend of this provider offers: a task that asks for one of them only is cloud-only
OTHER_CLOUDS = (
    "gcp",
    "azure",
    "lambda",
    "runpod",
    "oci",
    "ibm",
    "scp",
    "fluidstack",
    "paperspace",
    "cudo",
    "do",
    "vast",
    "nebius",
    "hyperbolic",
    "vsphere",
    "seeweb",
    "primeintellect",
    "shadeform",
)


def capabilities() -> dict[str, BackendCapabilities]:
    """Each backend's capabilities as a connection with room for any gang would give them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = (
        ed25519.Ed25519PrivateKey.generate()
        .private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        .decode()
    )
    configs: dict[str, dict[str, Any]] = {
        "local": {},
        "ssh": {"hosts": "u@127.0.0.1"},
        "kubernetes": {},
        "aws": {"region": "us-east-1", "private_key": key},
    }
    caps = {}
    for kind, config in configs.items():
        try:
            c = by_kind(kind).make(config).capabilities
        except BackendError as exc:  # the backend's extra is not installed
            print(f"compat: {kind}: {exc}", file=sys.stderr)
            continue
        caps[kind] = dataclasses.replace(c, max_nodes=max(c.max_nodes, 1000))  # an SSH pool of enough hosts
    return caps


#: what a refusal of a file mount says when the bucket is on another cloud's object store
OTHER_STORE = "this provider fetches and mounts S3 buckets only"
#: what it says when the example leaves the bucket for the user to name (SkyPilot refuses it as well)
PLACEHOLDER = ("needs a bucket: give name:", "is not an S3 bucket name")


def cloud_only(field: str, message: str) -> bool:
    if any(field == f or field.startswith(f + ".") for f in CLOUD_ONLY):
        return True
    text = message.lower()
    if "file_mounts" in field and OTHER_STORE in message:
        return True  # a GCS / OCI / Nebius ... bucket: another cloud's store
    return (
        field.endswith(("cloud", "infra"))
        and any(f"'{c}'" in text or f" {c}" in text for c in OTHER_CLOUDS)
        or ("tpu" in text and "accelerators" in field)
    )


def to_fill_in(field: str, message: str) -> bool:
    """The example leaves a value for its user to write (a bucket name), which SkyPilot needs as well."""
    return "file_mounts" in field and any(p in message for p in PLACEHOLDER) and OTHER_STORE not in message


def group_of(field: str, message: str = "") -> str:
    """``resources.ports`` stays; ``envs.HF_TOKEN`` -> ``envs.<key>``; an error about the file itself (its
    field is the path) -> ``(file) <the message's first words>``."""
    head, _, rest = field.partition(".")
    if "/" in head:
        if ": " in field:  # a key of the file's header: ``path: primary_tasks``
            return "(file) " + field.rsplit(": ", 1)[1]
        return "(file) " + message.split(":")[0][:40]
    if head in ("envs", "secrets", "file_mounts") and rest:
        return f"{head}.<key>"
    if head == "resources" and rest:
        sub = rest.split(".")[0].split("[")[0]
        return f"resources.{sub}"
    return field


def measure(corpus: Path) -> dict[str, Any]:
    rows = [
        line.rstrip("\n").split("\t") for line in (corpus / "index.tsv").read_text().splitlines()[1:] if line
    ]
    caps = capabilities()
    kinds = conn_types()  # as a launch does: a refusal names the backend that runs the cloud, if any
    files: list[dict[str, Any]] = []
    for origin, kind, name, *_ in rows:
        if kind not in KINDS:
            continue
        path = corpus / name
        entry: dict[str, Any] = {"origin": origin, "kind": kind, "file": name}
        try:
            if (
                kind == "multi-doc"
            ):  # sky_pipeline's loader (sky_job_group's for a job group), each task checked
                try:
                    _, tasks = load_pipeline_yaml(path)
                except SpecError as exc:
                    if not exc.field.endswith(": execution"):
                        raise
                    tasks = load_job_group_yaml(path).tasks
                specs = [parse_task(t) for t in tasks]
            else:
                specs = [load_task_yaml(path)]
        except SpecError as exc:
            entry.update(
                outcome="refused",
                field=exc.field,
                group=group_of(exc.field, exc.message),
                message=exc.message[:300],
            )
            entry["cloud_only"] = cloud_only(exc.field, exc.message)
            entry["to_fill_in"] = not entry["cloud_only"] and to_fill_in(exc.field, exc.message)
        except Exception as exc:  # any other exception is a loader bug, counted as such
            entry.update(outcome="crashed", error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            entry["outcome"] = "loaded"
            runs = {}
            for backend, c in caps.items():
                runs[backend] = ""
                for spec in specs:
                    try:
                        check_backend(spec, c, kinds)
                    except SpecError as exc:
                        runs[backend] = f"{exc.field}: {exc.message}"[:200]
                        break
            entry["backends"] = runs
        files.append(entry)
    return {"corpus": str(corpus), "files": files, "backends": sorted(caps)}


def report(result: dict[str, Any]) -> str:
    files = result["files"]
    out = []
    out.append("kind        files  loaded  refused  crashed")
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    for f in files:
        by_kind[f["kind"]][f["outcome"]] += 1
    total: Counter[str] = Counter()
    for kind in KINDS:
        c = by_kind[kind]
        total.update(c)
        out.append(f"{kind:<10} {sum(c.values()):>6} {c['loaded']:>7} {c['refused']:>8} {c['crashed']:>8}")
    n = sum(total.values())
    out.append(f"{'all':<10} {n:>6} {total['loaded']:>7} {total['refused']:>8} {total['crashed']:>8}")
    tasks = by_kind["task"]
    share = tasks["loaded"] / max(1, sum(tasks.values()))
    out.append(
        f"single-document task files loaded: {tasks['loaded']}/{sum(tasks.values())} = {share:.0%} (goal >= 95%)"
    )
    refused = [f for f in files if f["outcome"] == "refused"]
    could = [f for f in refused if not f["cloud_only"] and not f.get("to_fill_in")]
    fill = [f for f in refused if f.get("to_fill_in")]
    cloud = len(refused) - len(could) - len(fill)
    out.append(
        f"refused: {len(refused)} files, {cloud} cloud-only, {len(fill)} with a value left for the user to fill "
        f"in (SkyPilot needs it too), {len(could)} a backend could honour (goal: 0)"
    )
    out.append("")
    out.append("refused, by the field the error names   files  kind of refusal  example")
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in refused:
        groups[f["group"]].append(f)
    for group, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        kinds = {
            ("cloud-only" if m["cloud_only"] else "to fill in" if m.get("to_fill_in") else "could run")
            for m in members
        }
        example = members[0]["message"].replace("\n", " ")[:90]
        out.append(f"  {group[:38]:<38} {len(members):>5}  {'/'.join(sorted(kinds)):<15}  {example}")
    crashed = [f for f in files if f["outcome"] == "crashed"]
    if crashed:
        out.append("")
        out.append(f"crashed: {len(crashed)} (goal: 0)")
        out.extend(f"  {f['file']}: {f['error']}" for f in crashed)
    out.append("")
    loaded = [f for f in files if f["outcome"] == "loaded"]
    out.append(f"loaded tasks each backend can run as they are (of {len(loaded)}):")
    for backend in result["backends"]:
        ok = sum(1 for f in loaded if not f["backends"].get(backend))
        why = Counter(f["backends"][backend].split(":")[0] for f in loaded if f["backends"].get(backend))
        top = ", ".join(f"{k} {v}" for k, v in why.most_common(4))
        out.append(f"  {backend:<11} {ok:>4}   refused by: {top or '-'}")
    return "\n".join(out)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--corpus", type=Path, default=CORPUS, help=f"the corpus directory (default {CORPUS})"
    )
    parser.add_argument("--no-save", action="store_true", help="print only; write no results file")
    args = parser.parse_args(argv)
    if not (args.corpus / "index.tsv").is_file():
        print(
            f"compat: no SkyPilot corpus at {args.corpus} (its index.tsv is missing); nothing measured",
            file=sys.stderr,
        )
        return 2
    result = measure(args.corpus)
    print(report(result))
    if not args.no_save:
        commit = _commit()
        day = datetime.date.today().isoformat()
        result.update(commit=commit, date=day)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"compat-{day}-{commit}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwritten: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
