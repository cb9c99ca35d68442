"""Failover: the locations a pool may start in, tried in order until one has room.

A cloud answers "no room" in two ways: a zone without capacity for the machine type now
(EC2's ``InsufficientInstanceCapacity``, GCE's ``ZONE_RESOURCE_POOL_EXHAUSTED``), which blocks
that zone, and a quota too low for the pool, which blocks its whole region (quotas are
regional) and is read before any launch where the cloud lets us. A provider records each such
answer in `Attempts` (a console line each, so a user who waits sees why) and goes on to the
next location; when none is left, `Attempts.exhausted` is the one `NoCapacity` error listing
every location and what it answered. Every node of a pool lands in one zone: a collective
across zones is slower and costs cross-zone traffic, which is not what users want.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from skyward.errors import NoCapacity


@dataclass(frozen=True)
class Attempt:
    """One location tried (``us-east-1a``, ``region us-west-2``) and what it answered."""

    where: str
    answer: str


@dataclass
class Attempts:
    """The locations tried so far for one launch, told as they go (`tell`)."""

    what: str  # what was asked for: "2 x p4d.24xlarge"
    tell: Callable[[str], None]
    tried: list[Attempt] = field(default_factory=list)
    blocked_regions: set[str] = field(default_factory=set)

    def failed(self, where: str, answer: str) -> None:
        """`where` cannot take the pool (`answer`, in the cloud's words); the next is tried."""
        self.tried.append(Attempt(where, answer))
        self.tell(f"{where}: {answer}; trying the next location")

    def block_region(self, region: str, answer: str) -> None:
        """Region `region` cannot take the pool (a quota): none of its zones is tried."""
        self.blocked_regions.add(region)
        self.failed(f"region {region}", answer)

    def exhausted(self, hint: str = "") -> NoCapacity:
        """The error once every location failed, each with its answer."""
        lines = "\n".join(f"  {a.where}: {a.answer}" for a in self.tried)
        more = f"\n{hint}" if hint else ""
        return NoCapacity(
            f"no location could start {self.what}; nothing was left running:\n{lines}{more}",
            attempts=[(a.where, a.answer) for a in self.tried],
        )
