"""A region's Compute Engine quotas, read before launching there: a region that cannot fit the
pool is skipped without an insert call.

GCE counts VM quotas per region (``regions.get`` lists them: ``quotas[]`` with ``metric``,
``limit`` and ``usage``). A pool of N VMs needs N ``INSTANCES``; N times the machine type's
vCPUs of its family's CPU quota (``N2_CPUS``, ``A2_CPUS``...) where the region lists one, else
of ``CPUS``; and N times its GPUs of ``NVIDIA_<GPU>_GPUS``. Spot VMs count against the
preemptible quota (``PREEMPTIBLE_CPUS``, ``PREEMPTIBLE_NVIDIA_<GPU>_GPUS``) where the region
grants one (a limit above 0), else against the standard one, as the GCE quota docs say.

This is only a shortcut past a launch GCE would refuse: a quota that cannot be read (the call
fails, the metric is not listed, the machine type's vCPUs are unknown) is never a reason to
skip. What is not read here (project-wide quotas such as ``GPUS_ALL_REGIONS``, disks,
addresses) still ends an attempt with QUOTA_EXCEEDED, which blocks the region then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from skyward.providers.gcp import api
from skyward.providers.gcp.machine_types import Choice
from skyward.providers.gcp.settings import Clients

QUOTA_CALL_TIMEOUT = 10.0  # seconds: a quota read must not hold a launch up


@dataclass(frozen=True)
class Quota:
    """One regional quota: its limit and what is in use."""

    limit: float
    usage: float

    @property
    def free(self) -> float:
        return self.limit - self.usage


def read(clients: Clients, project: str, region: str) -> dict[str, Quota] | None:
    """`region`'s quotas by metric, or None when they cannot be read."""
    try:
        found = clients.regions.get(
            project=project,
            region=region,
            retry=api.retry(QUOTA_CALL_TIMEOUT),
            timeout=QUOTA_CALL_TIMEOUT,
        )
    except api.ApiError:
        return None
    return {str(q.metric): Quota(float(q.limit), float(q.usage)) for q in found.quotas}


def shortfall(
    quotas: Mapping[str, Quota],
    choice: Choice,
    nodes: int,
    spot: bool,
    vcpus: Callable[[], int | None],
) -> str | None:
    """Why `quotas` cannot fit `nodes` VMs of `choice` (one quota, in words), or None when
    they can or it cannot be told. `vcpus`: the machine type's vCPUs (None: unknown), asked
    only when the region lists a CPU quota."""
    market = "spot" if spot else "on-demand"
    what = f"{nodes} x {choice.machine_type} ({market})"
    family = f"{choice.machine_type.split('-', 1)[0].upper()}_CPUS"
    needs: list[tuple[str, float]] = [("INSTANCES", nodes)]
    cpus = _metric(quotas, family if family in quotas else "CPUS", "PREEMPTIBLE_CPUS", spot)
    if cpus in quotas:
        per_vm = vcpus()
        if per_vm is not None:
            needs.append((cpus, per_vm * nodes))
    if choice.gpu is not None:
        gpus = f"NVIDIA_{choice.gpu.upper().replace('-', '_')}_GPUS"
        needs.append((_metric(quotas, gpus, f"PREEMPTIBLE_{gpus}", spot), choice.gpus * nodes))
    for metric, need in needs:
        quota = quotas.get(metric)
        if quota is not None and quota.free < need:
            return (
                f"its {metric} quota has {quota.free:g} free ({quota.usage:g} of {quota.limit:g} "
                f"in use); {what} need {need:g}"
            )
    return None


def _metric(quotas: Mapping[str, Quota], standard: str, preemptible: str, spot: bool) -> str:
    """The metric spot or standard VMs count against: spot VMs use the preemptible quota
    where the region grants one, else the standard one."""
    granted = quotas.get(preemptible)
    return preemptible if spot and granted is not None and granted.limit > 0 else standard
