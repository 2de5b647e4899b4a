"""Fake GPUs for tests (this machine has none): the fake ``nvidia-smi`` / ``rocm-smi`` of ``tests/fakes`` on
PATH, with a GPU list per machine. For SSH test hosts see ``SSHDCluster(gpus=...)`` in ``sshd.py``.

GPU lines are what the fake tools read: ``<name as nvidia-smi prints it>, <memory in MiB>``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"

H100 = "NVIDIA H100 80GB HBM3, 81559"
A100_80 = "NVIDIA A100-SXM4-80GB, 81920"
A100_40 = "NVIDIA A100-SXM4-40GB, 40960"
V100 = "Tesla V100-SXM2-16GB, 16384"
T4 = "Tesla T4, 15360"
L4 = "NVIDIA L4, 23034"
A10G = "NVIDIA A10G, 23028"
MI300X = "AMD Instinct MI300X OAM, 196592"


def fake_bin(directory: Path) -> Path:
    """``directory/bin`` holding ``nvidia-smi`` and ``rocm-smi``: links to the fakes."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("nvidia-smi", "rocm-smi"):
        link = bin_dir / tool
        if not link.exists():
            link.symlink_to(FAKES / f"{tool}-fake")
    return bin_dir


def local_gpus(
    monkeypatch: pytest.MonkeyPatch, directory: Path, lines: Sequence[str], *, rocm: Sequence[str] = ()
) -> None:
    """This process (and the local backend's detection) sees the fake tools with ``lines`` as its GPUs."""
    bin_dir = fake_bin(directory)
    nvidia = directory / "nvidia-gpus"
    nvidia.write_text("".join(f"{line}\n" for line in lines))
    amd = directory / "rocm-gpus"
    amd.write_text("".join(f"{line}\n" for line in rocm))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", str(nvidia))
    monkeypatch.setenv("FAKE_ROCM_SMI_GPUS", str(amd))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")


def no_gpu_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH without nvidia-smi / rocm-smi (what this machine has anyway, made explicit)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
