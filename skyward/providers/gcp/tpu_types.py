"""TPU accelerator types -> hosts per slice, runtime version and how spot is asked for.

Names are accepted in the seed documents' spelling (``tpu-v5litepod-16``, ``tpu-v6e-8``) and in
the TPU API's accelerator types (``v5litepod-16``, ``v4-32``); both normalise to the API's. The
number after the generation counts TensorCores for v2, v3, v4 and v5p (2 per chip, 4 chips per
host: ``v4-32`` is 16 chips on 4 hosts) and chips for v5e and v6e (up to 8 chips on one host,
4 chips per host beyond: ``v5litepod-16`` is 4 hosts). Offline: `validate` needs no network.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from skyward.errors import ConfigError
from skyward.hardware import Accelerator


@dataclass(frozen=True)
class Generation:
    """One TPU generation as the API names it."""

    api: str  # the accelerator type's prefix: "v5litepod"
    runtime_version: str  # the TPU VM image for this generation
    sizes: tuple[int, ...]  # the slice sizes the API offers (the number after the dash)
    per_host: int  # units of the size on one host of a multi-host slice
    single_host_max: int  # the largest size that is one host
    queued_spot: bool  # spot only through a queued resource (``spot: {}``)


# Sizes: v2-v5p count TensorCores (8 a host), v5e/v6e count chips (4 a host past 8).
GENERATIONS: Mapping[str, Generation] = {
    "v2": Generation("v2", "tpu-ubuntu2204-base", (8, 32, 128, 256, 512), 8, 8, False),
    "v3": Generation(
        "v3", "tpu-ubuntu2204-base", (8, 32, 64, 128, 256, 512, 1024, 2048), 8, 8, False
    ),
    "v4": Generation(
        "v4", "tpu-ubuntu2204-base", (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), 8, 8, False
    ),
    "v5p": Generation(
        "v5p", "v2-alpha-tpuv5", (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 6144), 8, 8, True
    ),
    "v5litepod": Generation(
        "v5litepod", "v2-alpha-tpuv5-lite", (1, 4, 8, 16, 32, 64, 128, 256), 4, 8, True
    ),
    "v6e": Generation("v6e", "v2-alpha-tpuv6e", (1, 4, 8, 16, 32, 64, 128, 256), 4, 8, True),
}
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod"}
_NAME = re.compile(r"^(?:tpu-)?(?P<gen>v\d+[a-z]*)-(?P<size>\d+)$")


@dataclass(frozen=True)
class TpuType:
    """A slice: its API accelerator type, generation and host count."""

    generation: Generation
    size: int

    @property
    def accelerator_type(self) -> str:
        return f"{self.generation.api}-{self.size}"

    @property
    def hosts(self) -> int:
        if self.size <= self.generation.single_host_max:
            return 1
        return self.size // self.generation.per_host


def is_tpu_name(text: str) -> bool:
    """Whether `text` reads as a TPU type in either spelling (not whether it is offered)."""
    return bool(_NAME.match(text.strip().lower()))


def parse(accelerator: Accelerator | str) -> TpuType:
    """The slice `accelerator` names; `ConfigError` for an unknown generation or size."""
    text = (accelerator.name if isinstance(accelerator, Accelerator) else accelerator).lower()
    match = _NAME.match(text.strip())
    if not match:
        raise ConfigError(
            f"{text!r} is not a TPU accelerator type such as 'tpu-v5litepod-16' or 'v4-32'"
        )
    gen = _ALIASES.get(match["gen"], match["gen"])
    generation = GENERATIONS.get(gen)
    if generation is None:
        raise ConfigError(
            f"TPU generation {match['gen']!r} is not known; known ones: {', '.join(GENERATIONS)}"
        )
    size = int(match["size"])
    if size not in generation.sizes:
        sizes = ", ".join(f"{generation.api}-{s}" for s in generation.sizes)
        raise ConfigError(f"there is no TPU {generation.api}-{size}; the API offers {sizes}")
    return TpuType(generation, size)
