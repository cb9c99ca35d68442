"""What a pool costs and its budget: the meter's arithmetic (each machine billed from its grant,
at its own price, at least the price's minimum), and `ComputePool(max_cost=)` on real Local
pools whose provider names a price (the clouds' price lookups are tested in tests/aws and
tests/gcp)."""

from __future__ import annotations

import asyncio
import time

import pytest

import skyward as sky
from skyward.client.spend import Bill, Meter
from skyward.console.progress import Progress
from skyward.cost import Price
from skyward.hardware import ClusterSpec
from skyward.providers.base import Cluster


class Priced(sky.Local):
    """Local processes at a price, as a cloud's would be; records whether it launched."""

    def __init__(self, price: Price) -> None:
        super().__init__()
        self._price = price
        self.launches = 0

    async def price(self, spec: ClusterSpec) -> Price:
        return self._price

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        self.launches += 1
        return await super().launch(spec, progress)


# -- the meter -------------------------------------------------------------------------------


def test_each_machine_is_billed_from_its_grant_and_at_least_its_minimum() -> None:
    meter = Meter(Price(3.6, "test", minimum_seconds=60.0))  # $0.001 a second
    meter.began("a", at=1000.0)
    meter.began("b", at=1000.0)
    assert meter.cost(now=1010.0).spent == pytest.approx(0.12)  # 2 x the 60 s minimum
    assert meter.cost(now=1100.0).spent == pytest.approx(0.2)  # 2 x 100 s
    meter.ended("b", at=1100.0)
    cost = meter.cost(now=1200.0)
    assert cost.spent == pytest.approx(0.3) and cost.per_hour == pytest.approx(3.6)


def test_a_replacement_granted_ahead_is_billed_from_then_and_the_lost_machine_until_replaced() -> (
    None
):
    meter = Meter(Price(3600.0, "test", minimum_seconds=0.0))  # $1 a second
    bill = Bill(meter)
    began = time.time()
    bill.granted(0)
    bill.granted(1)
    bill.granted(1)  # node 1 still runs: this is its replacement, started ahead
    assert meter.cost().per_hour == pytest.approx(3 * 3600.0)  # three machines paid for
    bill.replaced(1)
    assert meter.cost().per_hour == pytest.approx(2 * 3600.0)
    bill.settled([0, 1])  # both have their machine: nothing more to bill
    assert meter.cost().per_hour == pytest.approx(2 * 3600.0)
    bill.ended()
    spent = meter.cost().spent
    assert spent is not None and 0 <= spent <= 3 * (time.time() - began) + 1e-6
    assert meter.cost().per_hour == 0


def test_each_machine_is_billed_at_the_price_of_what_was_launched() -> None:
    spot = Price(1.0, "spot quote", minimum_seconds=0.0)
    on_demand = Price(3.0, "on-demand in zone-b", minimum_seconds=0.0)
    meter = Meter(spot)
    bill = Bill(meter)
    bill.quoted(spot)
    assert bill.price_line(2) == "2 x $1.00/hour = $2.00/hour (spot quote)"
    bill.granted(0, on_demand, at=1000.0)
    bill.granted(1, on_demand, at=1000.0)
    cost = meter.cost(now=1036.0)
    assert cost.price == on_demand and cost.per_hour == pytest.approx(6.0)
    assert cost.spent == pytest.approx(2 * 3.0 * 36 / 3600)
    assert bill.launched_line() == "launched: 2 x $3.00/hour = $6.00/hour (on-demand in zone-b)"
    # What was launched with no price of its own is counted at the quote, and says so.
    bill.granted(2, Price.unknown("the price list did not answer"), at=1000.0)
    assert meter.cost(now=1036.0).per_hour == pytest.approx(7.0)
    assert "what was launched: price unknown (the price list did not answer)" in (
        bill.launched_line()
    )


def test_what_the_launch_was_quoted_at_says_nothing_more() -> None:
    price = Price(1.5, "quote")
    bill = Bill(Meter(price))
    bill.quoted(price)
    bill.settled(range(1))
    bill.granted(1, Price(1.5, "on-demand in zone-a; the quote's price list"))
    assert bill.launched_line() == "" and bill.meter.cost().per_hour == pytest.approx(3.0)


def test_an_unknown_price_counts_nothing_and_cannot_keep_a_budget() -> None:
    meter = Meter(Price.unknown("the price service did not answer"), max_cost=5.0)
    meter.began("a")
    assert meter.cost().spent is None and str(meter.cost()) == "price unknown"
    with pytest.raises(sky.ConfigError, match="cannot be kept: this pool's price is unknown"):
        meter.check_start(1)


def test_the_budget_warns_once_at_80_percent_then_is_exceeded() -> None:
    meter = Meter(Price(3600.0, "test", minimum_seconds=0.0), max_cost=10.0)
    meter.began("a", at=0.0)
    assert meter.warning(now=7.9) is None and meter.over(now=7.9) is None
    warning = meter.warning(now=8.0)
    assert warning is not None and "80% of max_cost $10.00 spent ($8.00)" in warning, warning
    assert meter.warning(now=9.0) is None  # once
    error = meter.over(now=10.0)
    assert isinstance(error, sky.BudgetExceeded) and error.spent == pytest.approx(10.0)


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(sky.ConfigError, match="max_cost must be a positive"):
        sky.ComputePool(nodes=1, max_cost=0)


# -- pools -----------------------------------------------------------------------------------


@sky.compute
def node_index() -> int:
    return sky.instance_info().node


def test_a_priced_pool_says_its_rate_first_and_its_cost_last(
    capfd: pytest.CaptureFixture[str],
) -> None:
    provider = Priced(Price(1.5, "Test Price API, 2026-11-26"))
    with sky.ComputePool(provider=provider, nodes=2, stream_output=False) as pool:
        assert node_index() @ pool == [0, 1]
        cost = pool.cost
    assert cost.price.per_hour == 1.5 and cost.per_hour == 3.0
    # two machines for at least a minute each: $0.05 at the least
    assert cost.spent is not None and cost.spent >= 0.05
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[skyward]")]
    assert "2 x $1.50/hour = $3.00/hour (Test Price API, 2026-11-26)" in lines[1], lines
    assert "; cost $0.05" in lines[-1], lines


def test_a_free_pool_says_so_and_its_last_line_names_no_cost(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        node_index() >> pool
        assert pool.cost.spent == 0
    err = capfd.readouterr().err
    assert "costs nothing: the local provider runs on machines you already have" in err, err
    assert "cost $" not in err


def test_an_unknown_price_is_said_and_the_pool_still_starts(
    capfd: pytest.CaptureFixture[str],
) -> None:
    provider = Priced(Price.unknown("Test Price API: connection refused"))
    with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
        assert node_index() >> pool == 0
        assert pool.cost.spent is None
    err = capfd.readouterr().err
    assert "price unknown (Test Price API: connection refused)" in err, err
    assert "cost unknown (price unknown)" in err, err


def test_a_budget_below_one_minute_is_refused_before_any_launch() -> None:
    provider = Priced(Price(60.0, "test"))  # $1 a minute per node
    with pytest.raises(sky.ConfigError, match=r"does not cover one minute of this pool"):
        with sky.ComputePool(provider=provider, nodes=2, max_cost=1.5, stream_output=False):
            pass
    assert provider.launches == 0


@sky.compute
def work(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_a_spent_budget_stops_the_call_and_tears_the_pool_down(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # $1 a second for each of 2 nodes, billed by the second: $10 lasts about 5 s.
    provider = Priced(Price(3600.0, "test", minimum_seconds=0.0))
    began = time.monotonic()
    called = False
    with pytest.raises(sky.BudgetExceeded) as caught:
        with sky.ComputePool(provider=provider, nodes=2, max_cost=10.0, stream_output=False) as p:
            called = True
            work(60) @ p
    assert called, "the budget ran out before the call: nothing was tested"
    assert time.monotonic() - began < 30, "the call was not stopped"
    error = caught.value
    assert error.max_cost == 10.0 and 10.0 <= error.spent < 12.0, error.spent
    err = capfd.readouterr().err
    assert "80% of max_cost $10.00 spent" in err, err  # the warning came first
    assert err.index("of max_cost $10.00 spent") < err.index("the running call was stopped")
    assert "lasts less than a minute at this rate" in err, err
    assert p.cost.per_hour == 0  # every machine let go


class SlowToConnect(Priced):
    """Its machines are granted at once, then take their time to be reached."""

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        self.launches += 1
        for node in range(spec.nodes):
            progress.granted(node)
        await asyncio.sleep(60)
        return await super().launch(spec, progress)


def test_a_budget_spent_during_the_launch_cancels_it() -> None:
    provider = SlowToConnect(Price(3600.0, "test", minimum_seconds=0.0))  # $1 a second
    began = time.monotonic()
    with pytest.raises(sky.BudgetExceeded) as caught:
        with sky.ComputePool(provider=provider, nodes=1, max_cost=2.0, stream_output=False):
            pass
    assert time.monotonic() - began < 20
    assert provider.launches == 1 and 2.0 <= caught.value.spent < 3.0


class Queued(Priced):
    """A launch that waits in a queue before its nodes are granted (and says nothing of the
    grant: they are the pool's from the end of the launch)."""

    granted_at = 0.0

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        await asyncio.sleep(1)
        self.granted_at = time.time()
        return await super().launch(spec, progress)


def test_the_wait_before_a_grant_is_not_billed() -> None:
    provider = Queued(Price(3600.0, "test", minimum_seconds=0.0))  # $1 a second a node
    with sky.ComputePool(provider=provider, nodes=2, stream_output=False) as pool:
        assert node_index() @ pool == [0, 1]
    closed = time.time()
    spent = pool.cost.spent
    # Billed from the grant, not from the launch call a second before it.
    assert spent is not None and 0 < spent <= 2 * (closed - provider.granted_at)
