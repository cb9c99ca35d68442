"""A fake ``nvidia-smi``: a script that prints what a real machine's nvidia-smi printed.

Neither this machine nor CI has a GPU. The recorded outputs under ``tests/data/gpus`` (see its
README) stand in for the hardware, and only for the GPU inventory: put the script's folder first
on a PATH and `skyward.worker.gpus.find` runs it as it would run the real one.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import skyward as sky
from skyward.hardware import ClusterSpec

RECORDED = Path(__file__).resolve().parent.parent / "data" / "gpus"
MACHINES = ("h100-driver580", "a100x8-driver550", "a100-mig-driver535", "driver-failed")


def recorded(machine: str, name: str) -> str:
    """One recorded output of `machine`: ``query.txt`` or ``nvidia-smi.txt``."""
    return (RECORDED / machine / name).read_text()


def fake_nvidia_smi(machine: str, directory: Path) -> Path:
    """Write ``directory/nvidia-smi`` answering as `machine`'s did; returns `directory`.

    ``machine="hung"`` writes one that never answers (a driver in trouble).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if machine == "hung":
        body = "exec sleep 600\n"
    else:
        folder = RECORDED / machine
        status_file = folder / "status"
        status = status_file.read_text().strip() if status_file.exists() else "0"
        body = (
            'case "$*" in\n'
            f"  --query-gpu=*) cat {shlex.quote(str(folder / 'query.txt'))} ;;\n"
            f"  *) cat {shlex.quote(str(folder / 'nvidia-smi.txt'))} ;;\n"
            "esac\n"
            f"exit {status}\n"
        )
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n# recorded nvidia-smi of {machine} (tests/data/gpus)\n{body}")
    script.chmod(0o755)
    return directory


WHEEL = "SKYWARD_TEST_JAX_WHEEL"


class WheelSeen(sky.Plugin):
    """Placed after the JAX plugin: replaces the jax requirement it added with the variable
    `WHEEL` naming it (so the nodes need nothing this interpreter lacks: no CUDA jax is
    installed), and keeps the spec each `transform` saw."""

    name = "wheel-seen"

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[ClusterSpec] = []

    def transform(self, image: sky.Image, cluster: ClusterSpec) -> sky.Image:
        self.specs.append(cluster)
        jax = ",".join(p for p in image.pip if p.startswith("jax"))
        return image.without_packages(["jax", "jaxlib"]).with_env({WHEEL: jax})


@sky.compute
def wheel() -> str | None:
    """The JAX wheel the pool chose for this node (`WheelSeen`)."""
    return os.environ.get(WHEEL)
