"""Accelerator names -> EC2 instance types, checked against what EC2 itself reports.

The table is the offline half (validate needs no network); `check` is the online half, run
against ``describe_instance_types`` before anything is created, so a stale table or a wrong
``instance_type=`` fails with a clear message instead of a pool without the GPUs it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.providers.cloud.sizes import Sizes

# (instance type, GPUs per instance), smallest first. A100/H200 come only in 8-GPU sizes.
GPU_TYPES: Mapping[str, tuple[tuple[str, int], ...]] = {
    "T4": (("g4dn.xlarge", 1), ("g4dn.12xlarge", 4), ("g4dn.metal", 8)),
    "A10G": (("g5.xlarge", 1), ("g5.12xlarge", 4), ("g5.48xlarge", 8)),
    "L4": (("g6.xlarge", 1), ("g6.12xlarge", 4), ("g6.48xlarge", 8)),
    "L40S": (("g6e.xlarge", 1), ("g6e.12xlarge", 4), ("g6e.48xlarge", 8)),
    "A100": (("p4d.24xlarge", 8),),
    "A100-80GB": (("p4de.24xlarge", 8),),
    "H100": (("p5.4xlarge", 1), ("p5.48xlarge", 8)),
    "H200": (("p5en.48xlarge", 8),),
}

# How EC2 names the GPU (GpuInfo.Gpus[].Name) and the least memory per GPU it must have, in MiB.
_EC2_GPU: Mapping[str, tuple[str, int]] = {
    "A100-80GB": ("A100", 80 * 1024),
}

CPU_TYPE = "m6i.large"
"""The instance type of a pool without an accelerator (2 vCPUs, 8 GiB, x86_64)."""


@dataclass(frozen=True)
class Choice:
    """The instance type a pool will use and the GPUs each instance must report."""

    instance_type: str
    gpu: str | None = None  # EC2's name for the GPU, None for CPU pools
    gpus: int = 0
    min_gpu_memory_mib: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.gpu is not None


SIZES = Sizes(GPU_TYPES, "AWS", "EC2 instance type", "instance_type")
known = SIZES.known
accelerator_of = SIZES.accelerator_of


def choose(accelerator: Accelerator | None, instance_type: str | None) -> Choice:
    """Pick the instance type for `accelerator` (or check `instance_type` names one); offline."""
    if accelerator is None:
        return Choice(instance_type or CPU_TYPE)
    # The user's type wins; `check` verifies against EC2 that it has these GPUs.
    name, count = SIZES.fit(accelerator, instance_type)
    gpu, memory = _EC2_GPU.get(accelerator.name, (accelerator.name, 0))
    return Choice(name, gpu, count, memory)


def check(choice: Choice, info: Mapping[str, Any]) -> None:
    """Raise `ConfigError` unless ``describe_instance_types`` `info` has the chosen GPUs."""
    if not choice.is_gpu:
        return
    gpus = info.get("GpuInfo", {}).get("Gpus", [])
    found = sum(
        int(g.get("Count", 0))
        for g in gpus
        if str(g.get("Name", "")).upper() == choice.gpu
        and int(g.get("MemoryInfo", {}).get("SizeInMiB", 0)) >= choice.min_gpu_memory_mib
    )
    if found < choice.gpus:
        have = ", ".join(f"{g.get('Count')} x {g.get('Name')}" for g in gpus) or "no GPU"
        raise ConfigError(
            f"EC2 reports {have} for instance type {choice.instance_type}, but the pool asks "
            f"for {choice.gpus} x {choice.gpu}: pick a matching instance_type= or accelerator="
        )


def architecture(info: Mapping[str, Any]) -> str:
    """``x86_64`` or ``arm64``: which AMI family the instance type boots."""
    archs = info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
    return "arm64" if "arm64" in archs and "x86_64" not in archs else "x86_64"
