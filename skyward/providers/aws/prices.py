"""One EC2 instance's price per hour, from AWS's own price services.

- on-demand: the Price List Query API (``pricing:GetProducts``, served from us-east-1 whatever
  the instance's region), the Linux, shared-tenancy, no-preinstalled-software product of the
  instance type in the region; its price is the product's OnDemand term in USD per hour;
- spot: ``ec2:DescribeSpotPriceHistory`` from now, for Linux/UNIX: the price in the pool's
  availability zone, or the lowest of the region's zones when the pool fixes none.

Answers are kept in `pricecache` (list prices for a week, spot prices for an hour). A price
that cannot be had is `Price.unknown` with what went wrong, never an exception. The endpoints
are boto3's: ``AWS_ENDPOINT_URL``, or ``AWS_ENDPOINT_URL_PRICING`` and ``AWS_ENDPOINT_URL_EC2``
for one service, are honoured by botocore itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from skyward.cost import CURRENCY, Price, dollars, dollars_per_hour
from skyward.providers.cloud import pricecache

PRICING_REGION = "us-east-1"
"""Where the Price List Query API is served from (it answers for every region)."""

LIST_API = "AWS Price List API"
SPOT_API = "EC2 spot price history"

# What makes one EC2 product a plain Linux instance: the Price List's attribute names and
# values (the product attributes of the AmazonEC2 service).
_LINUX = {
    "operatingSystem": "Linux",
    "tenancy": "Shared",
    "preInstalledSw": "NA",
    "capacitystatus": "Used",
}
# The product's `operation` for plain Linux; other Linux products (with a licence) add a code.
_PLAIN_LINUX_OPERATION = "RunInstances"


class _NoPrice(Exception):
    """The service answered, but with no price for the request (not kept in the cache)."""


def pricing_client(session: Any) -> Any:
    """A Price List Query API client of boto3 `session`, with few retries: a price is worth
    asking twice, not worth holding up a launch for."""
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10)
    return session.client("pricing", region_name=PRICING_REGION, config=config)


def on_demand(pricing: Any, instance_type: str, region: str) -> Price:
    """The on-demand Linux price of `instance_type` in `region`, from `pricing` (a
    `pricing_client`); "AWS Price List API, us-east-1, 2026-11-25" is its source."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    try:
        entry = pricecache.cached(
            "aws",
            f"on-demand {region} {instance_type}",
            pricecache.ON_DEMAND,
            lambda: _list_price(pricing, instance_type, region),
            float,
        )
    except ClientError as exc:
        return Price.unknown(f"{LIST_API}: {_client_error(exc)}")
    except (BotoCoreError, ResponseParserError, _NoPrice) as exc:
        return Price.unknown(f"{LIST_API}: {exc}")
    return Price(entry.value, f"{LIST_API}, {region}, {entry.day}")


def spot(ec2: Any, instance_type: str, zone: str | None = None) -> Price:
    """The spot price of `instance_type` in `zone`, or in the cheapest zone of `ec2`'s region;
    "EC2 spot price history, us-east-1b, 2026-11-25 14:02 UTC" is its source."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    region = str(ec2.meta.region_name)
    try:
        entry = pricecache.cached(
            "aws",
            f"spot {region} {instance_type}",
            pricecache.SPOT,
            lambda: _zone_prices(ec2, instance_type),
            lambda stored: {str(z): float(rate) for z, rate in stored.items()},
        )
        where, rate = _pick_zone(entry.value, zone, instance_type, region)
    except ClientError as exc:
        return Price.unknown(f"{SPOT_API}: {_client_error(exc)}")
    except (BotoCoreError, ResponseParserError, _NoPrice) as exc:
        return Price.unknown(f"{SPOT_API}: {exc}")
    return Price(rate, f"{SPOT_API}, {where}, {entry.minute}")


def running_cost(pricing: Any, ec2: Any, instances: Iterable[Mapping[str, Any]]) -> str:
    """What a pool's running `instances` cost (`skyward status`): ``$6.54/hour, about $1.20 so
    far`` (each from its launch, at least a minute), or why it is unknown."""
    region = str(ec2.meta.region_name)
    now = datetime.now(UTC)
    rate = spent = 0.0
    for instance in instances:
        if instance.get("State", {}).get("Name") not in ("pending", "running"):
            continue
        kind = str(instance["InstanceType"])
        if instance.get("InstanceLifecycle") == "spot":
            zone = instance.get("Placement", {}).get("AvailabilityZone")
            price = spot(ec2, kind, str(zone) if zone else None)
        else:
            price = on_demand(pricing, kind, region)
        if price.per_hour is None:
            return f"price unknown ({price.source})"
        launched = instance.get("LaunchTime")
        seconds = (now - launched).total_seconds() if isinstance(launched, datetime) else 0.0
        rate += price.per_hour
        spent += price.per_hour * max(price.minimum_seconds, seconds) / 3600
    if not rate:
        return ""
    return f"{dollars_per_hour(rate)}, about {dollars(spent)} so far"


def zone_of_subnet(ec2: Any, subnet_id: str) -> str:
    """The availability zone of `subnet_id` (where a pool with ``subnet_id=`` runs)."""
    return str(ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]["AvailabilityZone"])


# -- on-demand: the Price List ---------------------------------------------------------------


def _list_price(pricing: Any, instance_type: str, region: str) -> float:
    filters = [
        {"Type": "TERM_MATCH", "Field": field, "Value": value}
        for field, value in {"instanceType": instance_type, "regionCode": region, **_LINUX}.items()
    ]
    products = []
    for page in pricing.get_paginator("get_products").paginate(
        ServiceCode="AmazonEC2", Filters=filters, FormatVersion="aws_v1"
    ):
        # Each product is a JSON document of its own, as a string.
        products += [json.loads(text) for text in page.get("PriceList", [])]
    return on_demand_rate(products, f"{instance_type} in {region}")


def on_demand_rate(products: Iterable[Mapping[str, Any]], what: str) -> float:
    """The hourly on-demand USD price of the plain Linux product among `products` (parsed
    PriceList documents); `_NoPrice` when there is none, or no one price."""
    found: dict[float, list[str]] = {}
    plain: dict[float, list[str]] = {}
    for product in products:
        attributes = product.get("product", {}).get("attributes", {})
        sku = str(product.get("product", {}).get("sku", "?"))
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                amount = dimension.get("pricePerUnit", {}).get(CURRENCY)
                if amount is None or str(dimension.get("unit", "Hrs")).lower() not in ("hrs", "hr"):
                    continue
                rate = float(amount)
                found.setdefault(rate, []).append(sku)
                if attributes.get("operation", _PLAIN_LINUX_OPERATION) == _PLAIN_LINUX_OPERATION:
                    plain.setdefault(rate, []).append(sku)
    # Several products can match the filters (a licensed Linux beside the plain one): the
    # plain one's price is the instance's; if that still leaves several, none is a guess.
    rates = plain or found
    if not rates:
        raise _NoPrice(f"no on-demand Linux price per hour in {CURRENCY} for {what}")
    if len(rates) > 1:
        listed = "; ".join(f"{rate} ({', '.join(skus)})" for rate, skus in sorted(rates.items()))
        raise _NoPrice(f"several on-demand Linux prices for {what}: {listed}")
    return next(iter(rates))


# -- spot: the price history -----------------------------------------------------------------


def _zone_prices(ec2: Any, instance_type: str) -> dict[str, float]:
    """The current spot price of `instance_type` in each zone of `ec2`'s region."""
    history: list[dict[str, Any]] = []
    for page in ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=[instance_type],
        ProductDescriptions=["Linux/UNIX"],
        StartTime=datetime.now(UTC),
    ):
        history += page.get("SpotPriceHistory", [])
    return latest_by_zone(history)


def latest_by_zone(history: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Each zone's latest price in a ``SpotPriceHistory`` list (from a start time, EC2 answers
    with the price in effect then and any change since)."""
    latest: dict[str, tuple[str, float]] = {}
    for record in history:
        zone = str(record["AvailabilityZone"])
        # Timestamps are datetimes from boto3; str() keeps them comparable either way.
        stamp = str(record.get("Timestamp", ""))
        if zone not in latest or stamp >= latest[zone][0]:
            latest[zone] = (stamp, float(record["SpotPrice"]))
    return {zone: rate for zone, (_, rate) in latest.items()}


def _pick_zone(
    prices: Mapping[str, float], zone: str | None, instance_type: str, region: str
) -> tuple[str, float]:
    if zone is not None:
        if zone not in prices:
            raise _NoPrice(f"no Linux/UNIX spot price for {instance_type} in {zone}")
        return zone, prices[zone]
    if not prices:
        raise _NoPrice(f"no Linux/UNIX spot price for {instance_type} in {region}")
    # The cheapest zone; among equal prices the first by name, so the answer is stable.
    where = min(prices, key=lambda z: (prices[z], z))
    return where, prices[where]


def _client_error(exc: Any) -> str:
    error = exc.response.get("Error", {})
    return f"{error.get('Code', 'error')}: {error.get('Message', exc)}"
