"""Accelerator names -> machine sizes: the offline table and the chooser over it that AWS's
instance types and GCP's machine types share (`validate` needs no network)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from skyward.errors import ConfigError
from skyward.hardware import Accelerator


@dataclass(frozen=True)
class Sizes:
    """One cloud's GPU machine sizes, by accelerator name, and the words its errors use."""

    table: Mapping[str, tuple[tuple[str, int], ...]]  # (machine type, GPUs), smallest first
    provider: str  # "AWS": the provider the errors name
    kind: str  # "EC2 instance type": what one size is called
    option: str  # "instance_type": the provider's argument that names a size

    def known(self) -> str:
        """The accelerator names this table maps, for error messages."""
        return ", ".join(self.table)

    def fit(self, accelerator: Accelerator, given: str | None) -> tuple[str, int]:
        """The machine type for `accelerator` and its GPU count: `given` (the user's type,
        which wins) or the smallest size with enough GPUs; `ConfigError` for an accelerator
        the table lacks or a count no size has."""
        sizes = self.table.get(accelerator.name)
        if sizes is None:
            raise ConfigError(
                f"accelerator {accelerator.name!r} is not known to the {self.provider} provider; "
                f"known ones: {self.known()} (optionally NAME:COUNT), or pass {self.option}= to "
                f"sky.{self.provider}"
            )
        if given is not None:
            return given, accelerator.count
        for name, count in sizes:
            if count >= accelerator.count:
                return name, count
        largest = sizes[-1]
        raise ConfigError(
            f"no {self.kind} has {accelerator.count} {accelerator.name} GPUs (the largest, "
            f"{largest[0]}, has {largest[1]}); ask for fewer per node and more nodes"
        )

    def accelerator_of(self, machine_type: str) -> Accelerator | None:
        """The accelerator a machine type of the table carries (None: a CPU or unknown type)."""
        for name, sizes in self.table.items():
            for candidate, count in sizes:
                if candidate == machine_type:
                    return Accelerator(name, count)
        return None
