"""Connection parsing and precedence as a matrix (field × extra × linked connection → settings), in
milliseconds: no Airflow database, no hosts. The lookups themselves are tested in test_connection_lookup."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_sky.backends import BackendError
from airflow_provider_sky.backends.registry import by_kind

# -- where each setting comes from -------------------------------------------------------------------------


# -- extras ---------------------------------------------------------------------------------------------------


# -- a reused ssh connection -------------------------------------------------------------------------------


# -- the registry is the one list ------------------------------------------------------------------------


def test_the_local_test_button_names_an_unwritable_state_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(BackendError, match="state_dir: .* is not writable"):
        by_kind("local").make({"state_dir": str(blocker / "sub")}).test_connection()
    assert "state in" in by_kind("local").make({"state_dir": str(tmp_path)}).test_connection()


# -- name fields match whole: a pasted newline, CR, trailing space or NUL is named, not carried to a node ----
