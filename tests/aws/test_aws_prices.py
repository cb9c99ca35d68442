"""An EC2 instance's price: on-demand from the Price List Query API (the stand-in of
`tests.support.awspricing`, reached by boto3 through AWS_ENDPOINT_URL_PRICING), spot from EC2's
spot price history (moto as a server), the disk cache in between, and `sky.AWS.price`.

No network namespace is used: nothing here connects anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

import skyward as sky
from skyward.cost import Price
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.aws import prices
from skyward.providers.cloud import pricecache
from tests.aws.conftest import REGION, MotoServer
from tests.support.awspricing import PriceListServer
from tests.support.sshd import free_port


def today() -> str:
    """The UTC date a price looked up now is stamped with (read at each use: a run that
    crosses midnight stamps the new day)."""
    return datetime.now(UTC).strftime("%Y-%m-%d")


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh price cache for every test."""
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prices"


@pytest.fixture
def moto(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    """EC2 (and every service but pricing) answered by moto."""
    moto_server.reset()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.url)
    return moto_server


def pricing() -> Any:
    return prices.pricing_client(boto3.session.Session(region_name=REGION))


def spec(accelerator: str | None = None) -> ClusterSpec:
    acc = Accelerator.parse(accelerator) if accelerator else None
    return ClusterSpec(nodes=2, pool_id="t-price", accelerator=acc, provider="aws")


def age_entries(cache: Path, by: timedelta) -> None:
    """Make every cache entry `by` older, as if it had been fetched that long ago."""
    for path in cache.glob("*.json"):
        data = json.loads(path.read_text())
        data["fetched"] = (datetime.fromisoformat(data["fetched"]) - by).isoformat()
        path.write_text(json.dumps(data))


# -- on-demand: the Price List Query API -------------------------------------------------------


def test_the_on_demand_price_is_the_products_on_demand_term(price_list: PriceListServer) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")
    price_list.add("m6i.large", "eu-west-1", "0.1070000000")
    price_list.add("m6i.xlarge", "us-east-1", "0.1920000000")

    price = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    assert price == Price(0.096, f"AWS Price List API, us-east-1, {today()}")
    (request,) = price_list.requests
    assert request["ServiceCode"] == "AmazonEC2"
    assert request["FormatVersion"] == "aws_v1"
    assert sorted((f["Type"], f["Field"], f["Value"]) for f in request["Filters"]) == [
        ("TERM_MATCH", "capacitystatus", "Used"),
        ("TERM_MATCH", "instanceType", "m6i.large"),
        ("TERM_MATCH", "operatingSystem", "Linux"),
        ("TERM_MATCH", "preInstalledSw", "NA"),
        ("TERM_MATCH", "regionCode", "us-east-1"),
        ("TERM_MATCH", "tenancy", "Shared"),
    ]


def test_every_page_is_read_and_the_plain_linux_product_wins(
    price_list: PriceListServer,
) -> None:
    # A licensed Linux product matches the same filters; it comes first, on a page of its own.
    price_list.add("g5.xlarge", "us-west-2", "1.9060000000", operation="RunInstances:0g00")
    price_list.add("g5.xlarge", "us-west-2", "1.0060000000")
    price_list.page_size = 1

    price = prices.on_demand(pricing(), "g5.xlarge", "us-west-2")

    assert price.per_hour == 1.006
    assert [bool(r.get("NextToken")) for r in price_list.requests] == [False, True]


def test_several_prices_for_the_plain_product_are_no_price(price_list: PriceListServer) -> None:
    first = price_list.add("m6i.large", "us-east-1", "0.0960000000")
    second = price_list.add("m6i.large", "us-east-1", "0.0990000000")

    price = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    assert price.per_hour is None
    assert price.source == (
        "AWS Price List API: several on-demand Linux prices for m6i.large in us-east-1: "
        f"0.096 ({first}); 0.099 ({second})"
    )


def test_no_product_is_unknown_and_asked_again_next_time(price_list: PriceListServer) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")

    first = prices.on_demand(pricing(), "m6i.large", "ap-south-2")
    second = prices.on_demand(pricing(), "m6i.large", "ap-south-2")

    why = "no on-demand Linux price per hour in USD for m6i.large in ap-south-2"
    assert first == second == Price.unknown(f"AWS Price List API: {why}")
    assert len(price_list.requests) == 2


def test_a_refusal_is_unknown_with_the_services_words(price_list: PriceListServer) -> None:
    price_list.deny = "User: arn:aws:iam::123456789012:user/x is not authorized"

    price = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    assert price == Price.unknown(
        "AWS Price List API: AccessDeniedException: "
        "User: arn:aws:iam::123456789012:user/x is not authorized"
    )


def test_a_price_service_that_is_down_is_unknown_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", f"http://127.0.0.1:{free_port()}")

    price = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    assert price.per_hour is None
    assert price.source.startswith("AWS Price List API: Could not connect to the endpoint URL")


# -- the cache ---------------------------------------------------------------------------------


def test_a_second_lookup_is_read_from_the_cache_until_it_is_a_week_old(
    price_list: PriceListServer, cache: Path
) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")
    first = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    # The stand-in's price changes, but a fresh entry is not asked again.
    price_list.products.clear()
    price_list.add("m6i.large", "us-east-1", "0.1010000000")
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1") == first
    assert len(price_list.requests) == 1

    age_entries(cache, timedelta(days=6, hours=23))
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert len(price_list.requests) == 1

    age_entries(cache, timedelta(hours=2))  # now more than 7 days old
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1") == Price(
        0.101, f"AWS Price List API, us-east-1, {today()}"
    )
    assert len(price_list.requests) == 2


def test_an_entry_dated_days_ago_says_so(price_list: PriceListServer, cache: Path) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")
    prices.on_demand(pricing(), "m6i.large", "us-east-1")
    age_entries(cache, timedelta(days=3))

    price = prices.on_demand(pricing(), "m6i.large", "us-east-1")

    three_days_ago = (datetime.now(UTC) - timedelta(days=3)).strftime("%Y-%m-%d")
    assert price.source == f"AWS Price List API, us-east-1, {three_days_ago}"
    assert len(price_list.requests) == 1


def test_a_corrupt_or_foreign_entry_is_fetched_again(
    price_list: PriceListServer, cache: Path
) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")
    prices.on_demand(pricing(), "m6i.large", "us-east-1")
    (entry,) = cache.glob("*.json")

    entry.write_text('{"provider": "aws", "query": "on-dem')
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert len(price_list.requests) == 2

    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "query": "on-demand us-east-1 m6i.xlarge"}))
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert len(price_list.requests) == 3

    entry.write_text(json.dumps({**data, "value": {"USD": "0.096"}}))  # not a price
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert len(price_list.requests) == 4
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no temporary file left


def test_a_cache_that_cannot_be_written_still_gives_the_price(
    price_list: PriceListServer, cache: Path
) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the folder would be")
    price_list.add("m6i.large", "us-east-1", "0.0960000000")

    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert prices.on_demand(pricing(), "m6i.large", "us-east-1").per_hour == 0.096
    assert len(price_list.requests) == 2


# -- spot: the price history -------------------------------------------------------------------


def test_the_spot_price_is_the_zones_or_the_regions_cheapest(moto: MotoServer) -> None:
    ec2 = boto3.session.Session(region_name=REGION).client("ec2")
    offered = ec2.describe_spot_price_history(InstanceTypes=["m5.large"])["SpotPriceHistory"]
    zones = sorted({record["AvailabilityZone"] for record in offered})
    assert len(zones) > 1

    cheapest = prices.spot(ec2, "m5.large")
    in_zone = prices.spot(ec2, "m5.large", zones[-1])

    # moto prices every zone the same (0.00001): the first zone by name is the cheapest.
    assert cheapest.per_hour == in_zone.per_hour == 0.00001
    assert cheapest.source.startswith(f"EC2 spot price history, {zones[0]}, {today()} ")
    assert cheapest.source.endswith(" UTC")
    assert in_zone.source.startswith(f"EC2 spot price history, {zones[-1]}, {today()} ")
    assert prices.spot(ec2, "m5.large", "us-east-1z") == Price.unknown(
        "EC2 spot price history: no Linux/UNIX spot price for m5.large in us-east-1z"
    )


def history(*records: tuple[str, str, datetime]) -> dict[str, Any]:
    return {
        "SpotPriceHistory": [
            {
                "AvailabilityZone": zone,
                "InstanceType": "g5.xlarge",
                "ProductDescription": "Linux/UNIX",
                "SpotPrice": price,
                "Timestamp": stamp,
            }
            for zone, price, stamp in records
        ]
    }


def test_each_zones_latest_price_counts_and_the_lowest_zone_wins(cache: Path) -> None:
    ec2 = boto3.session.Session(region_name=REGION).client("ec2")
    now = datetime.now(UTC)
    with Stubber(ec2) as stub:
        stub.add_response(
            "describe_spot_price_history",
            history(
                ("us-east-1a", "0.4100", now - timedelta(minutes=5)),
                ("us-east-1b", "0.2000", now - timedelta(hours=3)),  # before b's current price
                ("us-east-1b", "0.3900", now - timedelta(minutes=30)),
                ("us-east-1c", "0.4400", now - timedelta(minutes=1)),
            ),
        )
        price = prices.spot(ec2, "g5.xlarge")
        again = prices.spot(ec2, "g5.xlarge", "us-east-1c")  # from the cache: no call left
        stub.assert_no_pending_responses()

    assert price.per_hour == 0.39
    assert price.source.startswith("EC2 spot price history, us-east-1b, ")
    assert again.per_hour == 0.44

    age_entries(cache, timedelta(minutes=61))  # spot prices are kept an hour
    with Stubber(ec2) as stub:
        stub.add_response("describe_spot_price_history", history(("us-east-1a", "0.5", now)))
        assert prices.spot(ec2, "g5.xlarge").per_hour == 0.5
        stub.assert_no_pending_responses()


# -- sky.AWS.price -----------------------------------------------------------------------------


def test_the_provider_prices_the_instance_type_it_would_launch(
    price_list: PriceListServer,
) -> None:
    price_list.add("p4d.24xlarge", "eu-west-1", "35.3640000000")
    price_list.add("m6i.large", "eu-west-1", "0.1070000000")
    price_list.add("g6.12xlarge", "eu-west-1", "5.1830000000")

    aws = sky.AWS(region="eu-west-1")
    assert asyncio.run(aws.price(spec("A100"))).per_hour == 35.364
    assert asyncio.run(aws.price(spec())).per_hour == 0.107
    assert asyncio.run(sky.AWS(region="eu-west-1").price(spec("L4:4"))) == Price(
        5.183, f"AWS Price List API, eu-west-1, {today()}"
    )
    explicit = sky.AWS(region="eu-west-1", instance_type="g6.12xlarge")
    assert asyncio.run(explicit.price(spec())).per_hour == 5.183


def test_a_spot_provider_prices_its_subnets_zone(moto: MotoServer) -> None:
    ec2 = boto3.session.Session(region_name=REGION).client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.9.0/24", AvailabilityZone="us-east-1c")

    price = asyncio.run(
        sky.AWS(region=REGION, spot=True, subnet_id=subnet["Subnet"]["SubnetId"]).price(spec())
    )

    assert price.per_hour == 0.00001
    assert price.source.startswith(f"EC2 spot price history, us-east-1c, {today()} ")


def test_the_provider_never_raises(monkeypatch: pytest.MonkeyPatch, moto: MotoServer) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", f"http://127.0.0.1:{free_port()}")

    down = asyncio.run(sky.AWS(region=REGION).price(spec()))
    unknown_accelerator = asyncio.run(sky.AWS(region=REGION).price(spec("K80")))
    no_subnet = asyncio.run(sky.AWS(region=REGION, spot=True, subnet_id="subnet-404").price(spec()))

    assert down.per_hour is None
    assert down.source.startswith("AWS Price List API: Could not connect")
    assert unknown_accelerator.per_hour is None
    assert "accelerator 'K80' is not known to the AWS provider" in unknown_accelerator.source
    assert no_subnet.per_hour is None
    assert no_subnet.source.startswith("the AWS price lookup failed: ")
    assert "subnet-404" in no_subnet.source


def test_an_entry_kept_by_one_provider_serves_the_next(
    price_list: PriceListServer, cache: Path
) -> None:
    price_list.add("m6i.large", "us-east-1", "0.0960000000")
    asyncio.run(sky.AWS(region="us-east-1").price(spec()))
    asyncio.run(sky.AWS(region="us-east-1").price(spec()))

    assert len(price_list.requests) == 1
    assert pricecache.folder() == cache
    assert len(list(cache.glob("aws-*.json"))) == 1


def test_skyward_status_prices_a_pools_running_instances(price_list: PriceListServer) -> None:
    price_list.add("g5.xlarge", "us-east-1", "1.0060000000")
    ec2 = boto3.session.Session(region_name=REGION).client("ec2")
    half_an_hour_ago = datetime.now(UTC) - timedelta(minutes=30)
    running = {"InstanceType": "g5.xlarge", "State": {"Name": "running"}}
    instances = [
        {**running, "LaunchTime": half_an_hour_ago},
        {**running, "LaunchTime": datetime.now(UTC)},  # billed its first minute
        {**running, "State": {"Name": "shutting-down"}, "LaunchTime": half_an_hour_ago},
    ]
    line = prices.running_cost(pricing(), ec2, instances)
    # 2 x $1.006/hour; (30 min + 1 min) x $1.006/hour = $0.52
    assert line == "$2.012/hour, about $0.52 so far", line
    odd = [{"InstanceType": "p9.huge", "State": {"Name": "running"}}]
    assert prices.running_cost(pricing(), ec2, odd).startswith("price unknown (AWS Price List")
