"""Find processes a test left behind, by what they touch: their command line or working directory.

The scan itself lives in the package's dev tools (the demo uses it too); tests import it from here.
"""

from __future__ import annotations

from airflow_provider_sky.dev.stack import processes_under

__all__ = ["processes_under"]
