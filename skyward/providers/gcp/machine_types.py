"""Accelerator names -> Compute Engine machine types, and the boot image for each.

g2 (L4), a2 (A100), a3 (H100, H200) are accelerator-optimized families: the GPUs come with the
machine type, so no ``guestAccelerators`` are asked for, and such VMs cannot live-migrate
(``onHostMaintenance=TERMINATE``). The table is offline: `validate` needs no network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.providers.cloud.sizes import Sizes

# (machine type, GPUs per VM), smallest first.
GPU_TYPES: Mapping[str, tuple[tuple[str, int], ...]] = {
    "L4": (
        ("g2-standard-4", 1),
        ("g2-standard-24", 2),
        ("g2-standard-48", 4),
        ("g2-standard-96", 8),
    ),
    "A100": (
        ("a2-highgpu-1g", 1),
        ("a2-highgpu-2g", 2),
        ("a2-highgpu-4g", 4),
        ("a2-highgpu-8g", 8),
        ("a2-megagpu-16g", 16),
    ),
    "A100-80GB": (
        ("a2-ultragpu-1g", 1),
        ("a2-ultragpu-2g", 2),
        ("a2-ultragpu-4g", 4),
        ("a2-ultragpu-8g", 8),
    ),
    "H100": (
        ("a3-highgpu-1g", 1),
        ("a3-highgpu-2g", 2),
        ("a3-highgpu-4g", 4),
        ("a3-highgpu-8g", 8),
    ),
    "H200": (("a3-ultragpu-8g", 8),),
}

CPU_TYPE = "e2-standard-2"
"""The machine type of a pool without an accelerator (2 vCPUs, 8 GiB)."""

# Deep Learning VM images (NVIDIA driver and CUDA installed), by image family, and Ubuntu for CPU.
GPU_IMAGE = (
    "projects/deeplearning-platform-release/global/images/family/"
    "common-cu128-ubuntu-2204-nvidia-570"
)
CPU_IMAGE = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"


@dataclass(frozen=True)
class Choice:
    """The machine type a pool will use and the GPUs it carries."""

    machine_type: str
    gpu: str | None = None
    gpus: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def image(self) -> str:
        return GPU_IMAGE if self.is_gpu else CPU_IMAGE


SIZES = Sizes(GPU_TYPES, "GCP", "Compute Engine machine type", "machine_type")
known = SIZES.known
accelerator_of = SIZES.accelerator_of


def choose(accelerator: Accelerator | None, machine_type: str | None = None) -> Choice:
    """Pick the machine type for `accelerator` (or keep `machine_type`); offline."""
    if accelerator is None:
        implied = accelerator_of(machine_type) if machine_type else None
        if implied is not None and machine_type is not None:
            return Choice(machine_type, implied.name, implied.count)
        return Choice(machine_type or CPU_TYPE)
    if accelerator.is_tpu:
        raise ConfigError(
            f"accelerator {accelerator} is a TPU: TPU VMs are not supported by sky.GCP yet "
            f"(GPU VMs are: {known()})"
        )
    name, count = SIZES.fit(accelerator, machine_type)
    return Choice(name, accelerator.name, count)
