"""Only a missing ``sky_default`` connection means "the local backend" (issue 14).

A lookup that fails for another reason (here a secrets backend that denies access, as a Vault policy does)
used to be swallowed too, and the job silently ran on this machine instead of the user's cluster. Real
Airflow secrets-backend loading, in a fresh process so the backend is configured before Airflow reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBE = """
from airflow_provider_sky.hooks.sky import SkyHook
try:
    print("CONFIG", SkyHook("sky_default").backend_config())
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""


def _probe(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_a_missing_default_connection_means_the_local_backend() -> None:
    assert "CONFIG ('local', {})" in _probe({})


def test_a_default_connection_that_cannot_be_read_is_an_error_naming_it() -> None:
    text = _probe({"AIRFLOW__SECRETS__BACKEND": "helpers_secrets.DenyingSecretsBackend"})
    assert "CONFIG ('local'" not in text, text
    assert "ERROR" in text and "sky_default" in text and "policy denies" in text, text
