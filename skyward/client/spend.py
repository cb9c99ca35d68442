"""What a pool spends, and its budget (`ComputePool(max_cost=)`).

Every machine the pool pays for is billed from when it is granted (the cloud's instance runs,
Slurm's allocation starts: the provider says so, `Progress.granted`; else the end of its
launch) until the pool lets it go, and for at least its price's `minimum_seconds`: AWS and
GCP bill a started instance a minute at least. Each machine at its own price: what was
launched (spot or on-demand, in its zone), which the provider names with the grant, else the
price the pool was quoted before launch. A lost node's machine stays on the bill until its
replacement is asked for; a replacement started ahead (a preemption notice) is billed from its
grant. With the price unknown, nothing is counted and no budget can be kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from skyward.cost import Cost, Price, dollars, dollars_per_hour
from skyward.errors import BudgetExceeded, ConfigError

WARN_AT = 0.8  # the share of `max_cost` that gets a warning


@dataclass
class _Machine:
    price: Price
    began: float
    ended: float | None = None

    def billed(self, now: float) -> float:
        """Seconds billed so far."""
        end = self.ended if self.ended is not None else now
        return max(self.price.minimum_seconds, end - self.began)


class Meter:
    """The pool's machines, each with its price and when it was granted and let go; `price`
    one node's (the quote before launch, then what was launched); `max_cost` the budget, if
    any. Times are `time.time()`. Thread-safe: a provider may grant from its threads."""

    def __init__(self, price: Price, max_cost: float | None = None) -> None:
        if max_cost is not None and max_cost <= 0:
            raise ConfigError(f"max_cost must be a positive number of dollars, got {max_cost}")
        self.price = price
        self.max_cost = max_cost
        self._machines: dict[Hashable, _Machine] = {}
        self._lock = threading.Lock()
        self.warned = False

    def began(self, machine: Hashable, at: float | None = None, price: Price | None = None) -> None:
        """`machine` is granted: billed from `at` (now by default) at `price` (the meter's
        `price` with None)."""
        with self._lock:
            began = time.time() if at is None else at
            self._machines[machine] = _Machine(price or self.price, began)

    def forget(self, machine: Hashable) -> None:
        """`machine` was never made after all."""
        with self._lock:
            self._machines.pop(machine, None)

    def ended(self, machine: Hashable, at: float | None = None) -> None:
        """`machine` is let go (a lost node's, once its replacement is asked for)."""
        with self._lock:
            found = self._machines.get(machine)
            if found is not None and found.ended is None:
                found.ended = time.time() if at is None else at

    def ended_all(self, at: float | None = None) -> None:
        for machine in list(self._machines):
            self.ended(machine, at)

    def price_of(self, machine: Hashable) -> Price | None:
        """What `machine` is billed at (None: not on the meter)."""
        with self._lock:
            found = self._machines.get(machine)
        return None if found is None else found.price

    def cost(self, now: float | None = None) -> Cost:
        now = time.time() if now is None else now
        with self._lock:
            machines = list(self._machines.values())
        rates = [m.price.per_hour for m in machines]
        if not machines and self.price.per_hour is None:
            return Cost(self.price, None, None, self.max_cost)
        rate = spent = 0.0
        for machine, per_hour in zip(machines, rates, strict=True):
            if per_hour is None:  # one machine's price is unknown: so is the pool's
                return Cost(self.price, None, None, self.max_cost)
            rate += per_hour if machine.ended is None else 0.0
            spent += per_hour * machine.billed(now) / 3600
        return Cost(self.price, rate, spent, self.max_cost)

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

    def lasts(self, rate: float) -> str:
        """How long what is left of the budget lasts at `rate` (dollars an hour), in words."""
        spent = self.cost().spent or 0.0
        if self.max_cost is None or not rate:
            return ""
        hours = max(0.0, self.max_cost - spent) / rate
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
    granted ahead of its loss, and the lines the console shows."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.quote = meter.price  # what the pool was told before launch
        self._serial = 0
        self._machines: dict[int, int] = {}  # node -> its machine's serial
        self._ahead: dict[int, int] = {}  # node -> its replacement, granted before its loss
        self._unpriced = False  # something launched had no price: counted at the quote

    def quoted(self, price: Price) -> None:
        """`price` is one node's, as the provider quoted it before launch."""
        self.quote = self.meter.price = price

    def granted(self, node: int, price: Price | None = None, at: float | None = None) -> None:
        """A machine for `node` is granted (at `at`, now by default): the node's own, or its
        replacement when the node still has one (started ahead, on a preemption notice). It is
        billed at `price`, what was launched; the quote with None, or when what was launched
        has no price the quote has (so that a budget is still kept)."""
        if price is not None and price.per_hour is None and self.quote.per_hour is not None:
            self._unpriced = True
            price = dataclasses.replace(
                self.quote,
                source=f"{self.quote.source}; what was launched: price unknown ({price.source})",
            )
        self._serial += 1
        self.meter.began(self._serial, at, price)
        if price is not None:
            self.meter.price = price
        if node in self._machines:
            earlier = self._ahead.pop(node, None)
            if earlier is not None:
                self.meter.ended(earlier, at)
            self._ahead[node] = self._serial
        else:
            self._machines[node] = self._serial

    def settled(self, nodes: Iterable[int]) -> None:
        """A launch or a replacement returned with `nodes`: those the provider did not say
        were granted are from now."""
        for node in nodes:
            if node not in self._machines:
                self.granted(node)

    def replaced(self, node: int) -> None:
        """`node`'s lost machine is let go (its replacement is asked for); a replacement granted
        ahead takes its place."""
        old = self._machines.pop(node, None)
        if old is not None:
            self.meter.ended(old)
        ahead = self._ahead.pop(node, None)
        if ahead is not None:
            self._machines[node] = ahead

    def let_go(self) -> None:
        """The launch failed (no room there): what it was granted is let go, and a launch
        elsewhere starts afresh."""
        self.meter.ended_all()
        self._machines, self._ahead = {}, {}

    def ended(self) -> None:
        self.meter.ended_all()

    def price_line(self, nodes: int) -> str:
        """The console's first word on money: the pool's quoted rate, or why there is none."""
        price = self.quote
        if price.per_hour is None:
            return f"price unknown ({price.source})"
        if price.per_hour == 0:
            return f"costs nothing: {price.source}"
        each = dollars_per_hour(price.per_hour)
        return self._rate_line(f"{nodes} x {each}", price.per_hour * nodes, price.source)

    def launched_line(self) -> str:
        """Once launched: the rate of what was launched where it is not the quote's (spot fell
        back to on-demand, another zone's spot price), or where it has no price; "" where
        the quote holds."""
        prices = [self.meter.price_of(serial) for serial in self._machines.values()]
        launched = Counter(p for p in prices if p is not None)
        if not self._unpriced and all(p.per_hour == self.quote.per_hour for p in launched):
            return ""
        if any(p.per_hour is None for p in launched):
            return "launched: price unknown (" + "; ".join(p.source for p in launched) + ")"
        rate = sum((p.per_hour or 0.0) * n for p, n in launched.items())
        if len(launched) == 1:  # the usual case: every node alike
            ((price, nodes),) = launched.items()
            each = dollars_per_hour(price.per_hour or 0.0)
            return self._rate_line(f"launched: {nodes} x {each}", rate, price.source)
        parts = [
            f"{n} x {dollars_per_hour(p.per_hour or 0.0)} ({p.source})" for p, n in launched.items()
        ]
        return self._rate_line(f"launched: {' + '.join(parts)}", rate)

    def _rate_line(self, nodes: str, rate: float, source: str = "") -> str:
        """``2 x $1.50/hour = $3.00/hour (source); max_cost $5.00 lasts about 1 h 40 min at
        this rate``."""
        line = f"{nodes} = {dollars_per_hour(rate)}" + (f" ({source})" if source else "")
        lasts = self.meter.lasts(rate)
        return f"{line}; {lasts}" if lasts else line

    def so_far(self) -> str:
        """For the live region: ``$0.42 at $9.83/hour`` ("" when the pool costs nothing)."""
        cost = self.meter.cost()
        if cost.spent is None or (not cost.per_hour and not cost.spent):
            return ""
        return str(cost)

    def dollars(self) -> tuple[float | None, float | None]:
        """The pool's rate now and what it has spent, in dollars (None: price unknown)."""
        cost = self.meter.cost()
        return cost.per_hour, cost.spent

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
