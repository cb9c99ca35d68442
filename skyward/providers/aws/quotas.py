"""EC2's vCPU quotas, read from Service Quotas before a launch: a region whose quota cannot fit
the pool is skipped without a launch call.

EC2 counts running instances against one vCPU quota per instance family group and market, per
region (e.g. "Running On-Demand P instances"). Only the value is compared (what the pool needs
against the limit): what already runs under the quota is not known without CloudWatch, so a
region that passes may still answer ``VcpuLimitExceeded`` at launch, which blocks it then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

logger = logging.getLogger("skyward.aws")


@dataclass(frozen=True)
class QuotaGroup:
    """A family group of EC2's vCPU quotas, as Service Quotas names it, with the codes of its
    on-demand and spot quotas; `spot` is None where no spot quota is known (HPC and High
    Memory instances have no spot market; P6 and later are not in AWS's table)."""

    name: str
    on_demand: str
    spot: str | None


_P = "L-417A185B"  # "Running On-Demand P instances": every P generation
# Instance type prefixes, the longer before the shorter they start with ("dl" before "d"),
# and their group, from AWS's table of EC2 quotas (Service Quotas user guide, "Amazon EC2
# instance type quotas"); None: a family with no vCPU quota to read (Mac: Dedicated Hosts).
_GROUPS: tuple[tuple[str, QuotaGroup | None], ...] = (
    ("dl", QuotaGroup("DL", "L-6E869C2A", "L-85EED4F7")),
    ("inf", QuotaGroup("Inf", "L-1945791B", "L-B5D1601B")),
    ("trn", QuotaGroup("Trn", "L-2C3B7624", "L-6B0D517C")),
    ("hpc", QuotaGroup("HPC", "L-F7808C92", None)),
    ("mac", None),
    ("u", QuotaGroup("High Memory", "L-43DA4232", None)),
    ("vt", QuotaGroup("G and VT", "L-DB2E81BA", "L-3819A6DF")),
    ("g", QuotaGroup("G and VT", "L-DB2E81BA", "L-3819A6DF")),
    ("p2", QuotaGroup("P", _P, "L-7212CCBC")),  # spot: "All P4, P3 and P2 Spot ..."
    ("p3", QuotaGroup("P", _P, "L-7212CCBC")),
    ("p4", QuotaGroup("P", _P, "L-7212CCBC")),
    ("p5", QuotaGroup("P", _P, "L-C4BD4855")),  # spot: "All P5 Spot Instance Requests"
    ("p", QuotaGroup("P", _P, None)),
    ("f", QuotaGroup("F", "L-74FC7D96", "L-88CF9481")),
    ("x", QuotaGroup("X", "L-7295265B", "L-E3A00192")),
    *(
        (letter, QuotaGroup("Standard (A, C, D, H, I, M, R, T, Z)", "L-1216C47A", "L-34B43A08"))
        for letter in "acdhimrtz"
    ),
)


@dataclass(frozen=True)
class Quota:
    """A vCPU quota of one region: its name and limit."""

    name: str
    vcpus: float


def group_of(instance_type: str) -> QuotaGroup | None:
    """The quota group of an instance type (``p4d.24xlarge`` -> P), None when not known."""
    for prefix, group in _GROUPS:
        if instance_type.startswith(prefix):
            return group
    return None


def vcpu_quota(service_quotas: Any, instance_type: str, spot: bool) -> Quota | None:
    """The region's vCPU quota for `instance_type` in its market; None when it cannot be read
    (a family without a known quota, no permission, the service not answering): the launch is
    then tried, and its own answer decides."""
    group = group_of(instance_type)
    code = None if group is None else group.spot if spot else group.on_demand
    if code is None:
        return None
    try:
        quota = service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    except (ClientError, BotoCoreError) as exc:
        logger.info("quota %s could not be read: %s", code, exc)
        return None
    return Quota(str(quota.get("QuotaName", code)), float(quota["Value"]))
