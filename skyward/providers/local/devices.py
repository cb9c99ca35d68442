"""Which of this machine's GPUs each Local node owns.

A pool without an accelerator is a CPU pool, as on a cloud: its nodes see no GPU. A pool that
names one (``"GPU"``, ``"H100"``, ``"H100:2"``) gives every node its own GPUs, disjoint and in
order, because NCCL refuses two ranks on one GPU. A request this machine cannot serve is a
`ConfigError` that says what the machine has, raised before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.worker.gpus import Gpu, Inventory, matches, visible, visible_env


def usable(inventory: Inventory, environ: Mapping[str, str]) -> tuple[Gpu, ...]:
    """The GPUs this process may hand out: whole GPUs (not in MIG mode), and only those the
    client's own ``CUDA_VISIBLE_DEVICES`` lists (by index or UUID) when it is set."""
    return visible(inventory, environ.get("CUDA_VISIBLE_DEVICES")).usable


def assign(
    inventory: Inventory,
    accelerator: Accelerator | None,
    nodes: int,
    environ: Mapping[str, str] | None = None,
) -> list[tuple[Gpu, ...]]:
    """Each node's GPUs, in node order: none for a CPU pool; else `accelerator.count` GPUs
    that match its name, disjoint, in the machine's order."""
    if accelerator is None:
        return [()] * nodes
    if accelerator.is_tpu:
        raise ConfigError(
            f"the Local provider cannot provide accelerator={str(accelerator)!r}: it runs on "
            "this machine's CPU and NVIDIA GPUs; no provider reaches TPUs yet (a GCP provider "
            "is planned)"
        )
    available = usable(inventory, os.environ if environ is None else environ)
    if not inventory.gpus:
        why = f" ({inventory.problem})" if inventory.problem else ""
        raise ConfigError(
            f"accelerator={str(accelerator)!r} asks for NVIDIA GPUs, but no NVIDIA GPU was "
            f"found on this machine{why}. Drop accelerator= for a CPU pool, or use sky.SSH or "
            "sky.AWS"
        )
    fitting = [gpu for gpu in available if matches(accelerator.name, gpu)]
    needed = nodes * accelerator.count
    if len(fitting) < needed:
        raise ConfigError(
            f"nodes={nodes} with accelerator={str(accelerator)!r} needs {needed} GPU(s) of "
            f"its own for every node, and this machine has {describe(inventory, available)}. "
            "A Local node never shares a GPU with another (NCCL refuses two ranks on one "
            "GPU): ask for fewer nodes or fewer GPUs per node"
        )
    count = accelerator.count
    return [tuple(fitting[i * count : (i + 1) * count]) for i in range(nodes)]


def describe(inventory: Inventory, available: tuple[Gpu, ...]) -> str:
    """What this machine has, in words, and how many of its GPUs a pool may not use."""
    hidden = len(inventory.usable) - len(available)
    extra = f"; {hidden} of them hidden by CUDA_VISIBLE_DEVICES" if hidden else ""
    return inventory.describe() + extra


def device_env(owned: tuple[Gpu, ...]) -> dict[str, str]:
    """The environment that shows a node exactly its GPUs: none at all for a CPU node, and
    JAX told to use the CPU then."""
    if not owned:
        return {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    return visible_env(owned)
