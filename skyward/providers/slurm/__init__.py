"""Slurm: pools on an HPC cluster's allocation, one agent per node as a job step.

`Slurm` is imported when asked for, so reading this folder's registry entry (`entry`) does not
import asyncssh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.slurm.provider import Slurm

__all__ = ["Slurm"]


def __getattr__(name: str) -> Any:
    if name == "Slurm":
        from skyward.providers.slurm.provider import Slurm

        return Slurm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
