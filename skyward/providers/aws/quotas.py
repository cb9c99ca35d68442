"""EC2's vCPU quotas, read from Service Quotas before a launch: a region whose quota cannot fit
the pool is skipped without a launch call.

EC2 counts running instances against one vCPU quota per instance family group and market, per
region (e.g. "Running On-Demand P instances"). Only the value is compared (what the pool needs
against the limit): what already runs under the quota is not known without CloudWatch, so a
region that passes may still answer ``VcpuLimitExceeded`` at launch, which blocks it then.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

logger = logging.getLogger("skyward.aws")

# family group -> (on-demand quota code, spot quota code), as Service Quotas names them
_CODES = {
    "standard": ("L-1216C47A", "L-34B43A08"),  # A, C, D, H, I, M, R, T, Z
    "g": ("L-DB2E81BA", "L-3819A6DF"),  # G and VT
    "p": ("L-417A185B", "L-7212CCBC"),
}
_STANDARD = set("acdhimrtz")
_FAMILY = re.compile(r"^([a-z]+)")


@dataclass(frozen=True)
class Quota:
    """A vCPU quota of one region: its name and limit."""

    name: str
    vcpus: float


def group_of(instance_type: str) -> str | None:
    """The quota group of an instance type (``p4d.24xlarge`` -> ``p``), None when not known."""
    match = _FAMILY.match(instance_type)
    if not match:
        return None
    family = match[1]
    if family.startswith("vt") or family.startswith("g"):
        return "g"
    if family.startswith("p"):
        return "p"
    if family[0] in _STANDARD and not family.startswith("inf") and not family.startswith("trn"):
        return "standard"
    return None


def vcpu_quota(service_quotas: Any, instance_type: str, spot: bool) -> Quota | None:
    """The region's vCPU quota for `instance_type` in its market; None when it cannot be read
    (a family without a known quota, no permission, the service not answering): the launch is
    then tried, and its own answer decides."""
    group = group_of(instance_type)
    if group is None:
        return None
    code = _CODES[group][1 if spot else 0]
    try:
        quota = service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    except (ClientError, BotoCoreError) as exc:
        logger.info("quota %s could not be read: %s", code, exc)
        return None
    return Quota(str(quota.get("QuotaName", code)), float(quota["Value"]))
