"""What NVIDIA GPUs a machine has: the accelerator inventory.

Standard library only: it runs on the client (for Local) and on every host (inside the host
check), before any environment exists. NVML (the ``pynvml`` module of nvidia-ml-py) is asked
when it can be imported, ``nvidia-smi`` otherwise; a machine with neither has no GPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Gpu:
    """One GPU as CUDA numbers it on its machine."""

    index: int  # the machine's device number (what CUDA_VISIBLE_DEVICES takes)
    name: str  # as a pool spells it: "H100", "A100-80GB", "L4"
    model: str  # as the driver reports it: "NVIDIA H100 80GB HBM3"
    memory_mib: int
    uuid: str = ""
    mig: bool = False  # in MIG mode: split into instances, not assignable whole


@dataclass(frozen=True)
class Inventory:
    """A machine's GPUs, its driver, and the highest CUDA that driver supports."""

    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None  # "580.65.06"
    cuda: str | None = None  # "13.0"

    @property
    def cuda_major(self) -> int | None:
        """The CUDA major version the driver supports (13 for "13.0"), None without a driver."""
        return int(self.cuda.split(".")[0]) if self.cuda else None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        data = json.loads(text)
        return cls(
            gpus=tuple(Gpu(**gpu) for gpu in data["gpus"]),
            driver=data["driver"],
            cuda=data["cuda"],
        )
