"""What a pool spends, and its budget (`ComputePool(max_cost=)`).

Every machine the pool pays for is billed from its launch (the moment the pool asks the cloud
for it, not when it answers) until the pool lets it go, and for at least the price's
`minimum_seconds`: AWS and GCP bill a started instance a minute at least. A lost node's
machine stays on the bill until its replacement takes its place; a replacement started ahead
(a preemption notice) is billed from then. With the price unknown, nothing is counted and no
budget can be kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from skyward.cost import Cost, Price, dollars, dollars_per_hour
from skyward.errors import BudgetExceeded, ConfigError

WARN_AT = 0.8  # the share of `max_cost` that gets a warning


@dataclass
class _Machine:
    began: float
    ended: float | None = None

    def billed(self, now: float, minimum: float) -> float:
        """Seconds billed so far."""
        return max(minimum, (self.ended if self.ended is not None else now) - self.began)


class Meter:
    """The pool's machines with when each was launched and let go, priced at `price` per hour
    each; `max_cost` the budget, if any. Times are `time.time()`."""

    def __init__(self, price: Price, max_cost: float | None = None) -> None:
        if max_cost is not None and max_cost <= 0:
            raise ConfigError(f"max_cost must be a positive number of dollars, got {max_cost}")
        self.price = price
        self.max_cost = max_cost
        self._machines: dict[Hashable, _Machine] = {}
        self.warned = False

    def began(self, machine: Hashable, at: float | None = None) -> None:
        """`machine` is launched (billed from `at`, now by default)."""
        self._machines[machine] = _Machine(time.time() if at is None else at)

    def forget(self, machine: Hashable) -> None:
        """`machine` was never made after all."""
        self._machines.pop(machine, None)

    def ended(self, machine: Hashable, at: float | None = None) -> None:
        """`machine` is let go (a lost node's, once its replacement took its place)."""
        found = self._machines.get(machine)
        if found is not None and found.ended is None:
            found.ended = time.time() if at is None else at

    def ended_all(self, at: float | None = None) -> None:
        for machine in list(self._machines):
            self.ended(machine, at)

    def cost(self, now: float | None = None) -> Cost:
        now = time.time() if now is None else now
        rate = self.price.per_hour
        if rate is None:
            return Cost(self.price, None, None, self.max_cost)
        live = sum(1 for m in self._machines.values() if m.ended is None)
        minimum = self.price.minimum_seconds
        seconds = sum(m.billed(now, minimum) for m in self._machines.values())
        return Cost(self.price, rate * live, rate * seconds / 3600, self.max_cost)

    # -- the budget ------------------------------------------------------------------------

    def check_start(self, nodes: int) -> None:
        """Before launch: a budget needs a known price and must cover every node's first
        minute; `ConfigError` otherwise (nothing is launched)."""
        if self.max_cost is None:
            return
        if self.price.per_hour is None:
            raise ConfigError(
                f"max_cost={dollars(self.max_cost)} cannot be kept: this pool's price is unknown "
                f"({self.price.source}); start it without max_cost, or where the price service "
                "answers"
            )
        # What the cloud bills however soon the pool ends: it could not run within less.
        least = self.price.minimum_seconds
        first = self.price.per_hour * nodes * least / 3600
        if first > self.max_cost:
            raise ConfigError(
                f"max_cost={dollars(self.max_cost)} does not cover one minute of this pool: "
                f"{nodes} x {dollars_per_hour(self.price.per_hour)} costs {dollars(first)} for "
                f"the first {least:g} s, which the cloud bills for each machine however soon it "
                "stops; raise max_cost, or use fewer or cheaper nodes"
            )

    def lasts(self, nodes: int) -> str:
        """How long the budget lasts at the pool's rate, in words."""
        if self.max_cost is None or not self.price.per_hour:
            return ""
        hours = self.max_cost / (self.price.per_hour * nodes)
        return f"max_cost {dollars(self.max_cost)} lasts {_hours(hours)} at this rate"

    def over(self, now: float | None = None) -> BudgetExceeded | None:
        """The error to end the pool with once the budget is spent; None before."""
        cost = self.cost(now)
        if self.max_cost is None or cost.spent is None or cost.spent < self.max_cost:
            return None
        return BudgetExceeded(
            f"the pool spent {dollars(cost.spent)} of its max_cost={dollars(self.max_cost)} "
            f"(at {dollars_per_hour(cost.per_hour or 0.0)}): the running call was stopped and "
            "the pool torn down",
            spent=cost.spent,
            max_cost=self.max_cost,
        )

    def warning(self, now: float | None = None) -> str | None:
        """The one warning at `WARN_AT` of the budget (None before, and after it was given)."""
        cost = self.cost(now)
        if self.warned or self.max_cost is None or cost.spent is None:
            return None
        if cost.spent < WARN_AT * self.max_cost:
            return None
        self.warned = True
        left = ""
        if cost.per_hour:
            left = f", in {_hours((self.max_cost - cost.spent) / cost.per_hour)}"
        return (
            f"{cost.spent / self.max_cost:.0%} of max_cost {dollars(self.max_cost)} spent "
            f"({dollars(cost.spent)}); the pool stops at {dollars(self.max_cost)}{left}"
        )


async def watch_budget(
    meter: Meter, say: Callable[[str], None], spent: Callable[[BudgetExceeded], None]
) -> None:
    """Check the budget every second: `say` the warning once, then `spent` with the error
    when it is reached (and stop watching)."""
    while True:
        if (warning := meter.warning()) is not None:
            say(warning)
        if (error := meter.over()) is not None:
            spent(error)
            return
        await asyncio.sleep(_next_check(meter))


def _next_check(meter: Meter) -> float:
    """A second, or less when the budget runs out sooner (a test's steep price)."""
    cost = meter.cost()
    if meter.max_cost is None or not cost.per_hour or cost.spent is None:
        return 1.0
    return max(0.05, min(1.0, (meter.max_cost - cost.spent) / cost.per_hour * 3600 / 2))


def _hours(hours: float) -> str:
    """``less than a minute``, ``about 5 min``, ``about 2 h 5 min``."""
    minutes = round(hours * 60)
    if minutes < 1:
        return "less than a minute"
    if minutes < 60:
        return f"about {minutes} min"
    whole, rest = divmod(minutes, 60)
    return f"about {whole} h {rest} min" if rest else f"about {whole} h"


class Bill:
    """The pool's nodes on its `Meter`: which machine each node runs on now, a replacement
    started ahead, and the lines the console shows."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self._serial = 0
        self._machines: dict[int, int] = {}  # node -> its machine's serial
        self._ahead: dict[int, int] = {}  # node -> its replacement started ahead

    def _new(self) -> int:
        self._serial += 1
        self.meter.began(self._serial)
        return self._serial

    def launched(self, nodes: int) -> None:
        """Every node's machine is asked for now."""
        self._machines = {node: self._new() for node in range(nodes)}

    def nothing_launched(self) -> None:
        """The launch just asked for made nothing (no location had room): it costs nothing."""
        for serial in self._machines.values():
            self.meter.forget(serial)
        self._machines = {}

    def started_ahead(self, node: int) -> None:
        """`node`'s replacement is asked for now, ahead of its loss."""
        self._ahead.setdefault(node, self._new())

    def replaced(self, node: int) -> None:
        """`node` is on its replacement now; its lost machine is let go."""
        old = self._machines.get(node)
        if old is not None:
            self.meter.ended(old)
        ahead = self._ahead.pop(node, None)
        self._machines[node] = ahead if ahead is not None else self._new()

    def ended(self) -> None:
        self.meter.ended_all()

    def price_line(self, nodes: int) -> str:
        """The console's first word on money: the pool's rate, or why there is none."""
        price = self.meter.price
        if price.per_hour is None:
            return f"price unknown ({price.source})"
        if price.per_hour == 0:
            return f"costs nothing: {price.source}"
        line = (
            f"{nodes} x {dollars_per_hour(price.per_hour)} = "
            f"{dollars_per_hour(price.per_hour * nodes)} ({price.source})"
        )
        lasts = self.meter.lasts(nodes)
        return f"{line}; {lasts}" if lasts else line

    def so_far(self) -> str:
        """For the live region: ``$0.42 at $9.83/hour`` ("" when the pool costs nothing)."""
        cost = self.meter.cost()
        if cost.spent is None or (not cost.per_hour and not cost.spent):
            return ""
        return str(cost)

    def total(self) -> str:
        """For the teardown's last line: ``cost $0.42`` ("" when it cost nothing)."""
        cost = self.meter.cost()
        if cost.spent is None:
            return "cost unknown (price unknown)"
        return f"cost {dollars(cost.spent)}" if cost.spent else ""

    def closed(self) -> str:
        """The pool's machines are gone: the teardown's words on what it cost."""
        self.ended()
        return self.total()
