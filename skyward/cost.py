"""What a pool costs: one node's `Price` per hour as its provider found it, and `Cost`, the
pool's rate and what it has spent so far (`ComputePool.cost`).

Prices are in US dollars per hour, as the clouds publish them. A price the provider could not
get is `Price.unknown` (its `per_hour` is None, with the reason), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

CURRENCY = "USD"


@dataclass(frozen=True)
class Price:
    """One node's price per hour (`per_hour`, None when unknown), where it came from (the
    API and the date it answered, or why there is none), and the least a started machine is
    billed (`minimum_seconds`: 60 on AWS and GCP; none for a rate the user gives)."""

    per_hour: float | None
    source: str
    minimum_seconds: float = 60.0

    @classmethod
    def unknown(cls, why: str) -> Price:
        return cls(None, why)

    @classmethod
    def free(cls, why: str) -> Price:
        return cls(0.0, why, 0.0)

    @classmethod
    def given(cls, per_hour: float, by: str) -> Price:
        """A rate the user gave (`sky.SSH(price_per_hour=)`): billed by the second."""
        return cls(per_hour, f"as given by {by}", 0.0)

    def launched(self, market: str, zone: str) -> Price:
        """This price as that of a machine launched `market` ("spot", "on-demand") in `zone`:
        its source says so (``on-demand in us-east-1b; AWS Price List API, ...``)."""
        return Price(self.per_hour, f"{market} in {zone}; {self.source}", self.minimum_seconds)

    @property
    def known(self) -> bool:
        return self.per_hour is not None

    def __str__(self) -> str:
        return "price unknown" if self.per_hour is None else dollars_per_hour(self.per_hour)


def dollars(amount: float) -> str:
    """``$0.0042``, ``$1.27``, ``$1,204.50``: cents, or more digits below a cent."""
    if amount == 0:
        return "$0"
    if abs(amount) < 0.01:
        return f"${amount:.4f}"
    return f"${amount:,.2f}"


def dollars_per_hour(rate: float) -> str:
    """``$0.096/hour``, ``$1.006/hour``, ``$32.77/hour``: a rate as the price lists write it
    (up to four decimals below $10, whole cents above)."""
    if rate >= 10 or rate == 0:
        return f"{dollars(rate)}/hour"
    digits = f"{rate:.4f}".rstrip("0")
    if len(digits.split(".")[1]) < 2:
        digits = f"{rate:.2f}"
    return f"${digits}/hour"


@dataclass(frozen=True)
class Cost:
    """What a pool costs (`ComputePool.cost`): one node's `price`, the pool's rate now
    (`per_hour`: every machine it pays for, a replacement started ahead included), what it
    has `spent` so far (each machine from its grant, at its own price, at least the 60 s the
    clouds bill), and
    its `max_cost`. The dollar figures are None when the price is unknown."""

    price: Price
    per_hour: float | None
    spent: float | None
    max_cost: float | None = None

    def __str__(self) -> str:
        if self.per_hour is None or self.spent is None:
            return "price unknown"
        return f"{dollars(self.spent)} so far at {dollars_per_hour(self.per_hour)}"
