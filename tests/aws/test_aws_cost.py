"""What an EC2 pool costs, end to end: moto's EC2 wired to bare Debian hosts, the price from the
Price List Query API stand-in (`tests.support.awspricing`) through boto3. The price line before
launch, the total at teardown, "price unknown" with the price service down, and `max_cost`:
refused before any launch call, and spent mid-call (the call stopped, the pool torn down,
nothing left in moto)."""

from __future__ import annotations

import re
import time
import types
from collections.abc import Callable

import pytest

import skyward as sky
from skyward.client import spend
from tests.aws.conftest import Ec2Hosts, Stubs, aws_for, leftovers, new_session
from tests.support.awspricing import PriceListServer
from tests.support.sshd import free_port

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

TYPE = "m6i.large"  # what a pool with no accelerator runs on


@sky.compute
def work(seconds: float) -> int:
    time.sleep(seconds)
    return sky.instance_info().node


def test_the_price_comes_first_and_the_total_last(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    price_list: PriceListServer,
    capfd: pytest.CaptureFixture[str],
) -> None:
    price_list.add(TYPE, "us-east-1", "0.0960000000")
    with sky.ComputePool(provider=aws_for(ec2_hosts(), stubs), nodes=2) as pool:
        assert work(0) @ pool == [0, 1]
        cost = pool.cost
    assert cost.price.per_hour == pytest.approx(0.096) and cost.per_hour == pytest.approx(0.192)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[skyward]")]
    assert lines[1].endswith(
        "2 x $0.096/hour = $0.192/hour (AWS Price List API, us-east-1, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())})"
    ), lines
    # two instances, each billed its first minute at least: $0.0032
    assert "removed 2 instances in" in lines[-1] and lines[-1].endswith("; cost $0.0032"), lines


def test_spot_that_fell_back_to_on_demand_is_billed_on_demand_in_the_zone_it_runs_in(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    price_list: PriceListServer,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """spot="prefer" with no spot capacity: the pool runs on-demand, and what it says and
    counts is the on-demand price, not the spot quote it started with."""
    price_list.add(TYPE, "us-east-1", "0.0960000000")
    sim = ec2_hosts()
    zone = sim.ec2.describe_subnets(SubnetIds=[sim.subnet_id])["Subnets"][0]["AvailabilityZone"]
    stubs.fail_in_zone = {f"{zone} spot": ("InsufficientInstanceCapacity", "no spot capacity")}
    today = time.strftime("%Y-%m-%d", time.gmtime())
    with sky.ComputePool(provider=aws_for(sim, stubs, spot="prefer"), nodes=1) as pool:
        assert work(0) >> pool == 0
        cost = pool.cost
    on_demand = f"on-demand in {zone}; AWS Price List API, us-east-1, {today}"
    assert cost.price == sky.Price(pytest.approx(0.096), on_demand)  # type: ignore[arg-type]
    assert cost.per_hour == pytest.approx(0.096)
    spent = pool.cost.spent
    assert spent is not None and spent >= 0.096 / 60 - 1e-12  # its first minute at least
    assert stubs.launches == [("us-east-1", zone), ("us-east-1", zone)]  # spot, then on-demand
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[skyward]")]
    said = "\n".join(lines)
    # The quote before launch was spot's; once launched, the price line is the on-demand one.
    assert f"1 x $0.00/hour = $0.00/hour (EC2 spot price history, {zone}, " in said, said
    assert f"launched: 1 x $0.096/hour = $0.096/hour ({on_demand})" in said, said
    assert said.index("no spot capacity in any location") < said.index("launched: ")
    assert lines[-1].endswith("; cost $0.0016"), lines


def test_with_the_price_service_down_the_price_is_unknown_and_the_pool_starts(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", f"http://127.0.0.1:{free_port()}")
    with sky.ComputePool(provider=aws_for(ec2_hosts(), stubs), nodes=1) as pool:
        assert work(0) >> pool == 0
        assert pool.cost.spent is None
    err = capfd.readouterr().err
    assert "price unknown (AWS Price List API: Could not connect to the endpoint URL" in err, err
    assert "cost unknown (price unknown)" in err


def test_a_budget_is_refused_before_any_launch_or_spent_mid_call_leaving_nothing(
    ec2_hosts: Callable[..., Ec2Hosts],
    stubs: Stubs,
    price_list: PriceListServer,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    price_list.add(TYPE, "us-east-1", "36.0000000000")  # a cent a second per instance
    sim = ec2_hosts()
    # 2 x $36/hour bill $1.20 for the first minute, whatever happens: $1.00 cannot start.
    with pytest.raises(sky.ConfigError, match=r"max_cost=\$1.00 does not cover one minute"):
        with sky.ComputePool(provider=aws_for(sim, stubs), nodes=2, max_cost=1.0):
            pass
    assert stubs.launches == []

    # $1.60 lasts 80 s; the meter's clock runs 10 times faster than the wall's (only the
    # meter's: the pool, EC2 and the hosts run in real time), so the test waits about 8 s.
    began = time.time()
    warped = types.SimpleNamespace(time=lambda: began + (time.time() - began) * 10)
    monkeypatch.setattr(spend, "time", warped)
    with pytest.raises(sky.BudgetExceeded) as caught:
        with sky.ComputePool(provider=aws_for(sim, stubs), nodes=2, max_cost=1.6) as pool:
            work(600) @ pool
    assert 1.6 <= caught.value.spent < 1.9, (caught.value.spent, str(caught.value))
    assert len(stubs.launches) == 1
    err = capfd.readouterr().err
    assert "max_cost $1.60 lasts about 1 min at this rate" in err, err
    warned = re.search(r"(\d+)% of max_cost \$1.60 spent", err)
    assert warned is not None and 80 <= int(warned[1]) < 100, err
    assert err.index(warned[0]) < err.index("the running call was stopped")
    assert pool.cost.per_hour == 0
    assert leftovers(new_session(stubs).client("ec2"), pool.pool_id) == []
