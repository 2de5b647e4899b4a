"""SkyPilot's ``workdir: {url, ref}``: every node checks the repository out into ``~/sky_workdir``.

Each node fetches the one ref it needs (``git fetch --depth 1``; a commit a server will not hand out by
id is found in a full fetch) and checks it out, so a cluster that is used again gets the ref's newest
commit. A node without git is a clear error naming the field; the URL and the ref are checked by the
spec (no option, no credential, no transport helper), and git never prompts (a private repository the
node cannot reach fails instead of waiting).
"""

from __future__ import annotations

from airflow_provider_sky.errors import SpecError
from airflow_provider_sky.runners.base import CommandRunner, RunnerError
from airflow_provider_sky.spec.task import GitWorkdir

#: ``sh -s -- URL REF DIR``; exit 3: no git on the node
CHECKOUT_SH = r"""set -u
url=$1 ref=$2 dir=$3
command -v git >/dev/null 2>&1 || { echo "git is not installed" >&2; exit 3; }
export GIT_TERMINAL_PROMPT=0 GIT_ASKPASS=true
mkdir -p "$dir" && cd "$dir" || exit 1
[ -d .git ] || git init -q . || exit 1
git remote remove sky-workdir >/dev/null 2>&1
git remote add sky-workdir "$url" || exit 1
if git fetch -q --depth 1 sky-workdir "${ref:-HEAD}"; then
  target=FETCH_HEAD
else
  [ -n "$ref" ] || exit 1
  echo "fetching $ref alone failed; fetching the whole repository" >&2
  git fetch -q --tags sky-workdir '+refs/heads/*:refs/remotes/sky-workdir/*' || exit 1
  target=$ref
fi
git -c advice.detachedHead=false checkout -q -f "$target" -- || exit 1
git remote remove sky-workdir
"""


def checkout(runner: CommandRunner, ip: str, home: str, repo: GitWorkdir) -> None:
    """Check ``repo`` out into ``home/sky_workdir`` on one node; a SpecError naming ``workdir`` if not."""
    what = repo.url + (f" at {repo.ref}" if repo.ref else "")
    try:
        res = runner.run_script(CHECKOUT_SH, [repo.url, repo.ref or "", f"{home}/sky_workdir"], timeout=1800)
    except RunnerError as exc:
        raise SpecError("workdir", f"checking out {what} on {ip} failed: {exc}") from None
    if res.returncode == 3:
        raise SpecError(
            "workdir",
            f"{ip} has no git, which a git workdir ({repo.url}) needs: install git on the nodes "
            "(Debian/Ubuntu: apt-get install git; in the image for image_id), or give a local directory "
            "(workdir: PATH) that is copied to every node",
        )
    if res.returncode != 0:
        tail = (res.error_text or f"exit code {res.returncode}").strip()[-800:]
        raise SpecError("workdir", f"checking out {what} on {ip} failed: {tail}")
