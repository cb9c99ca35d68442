"""A VM's or TPU host's price from the Cloud Billing Catalog (the stand-in of
`tests.support.fakebilling`, through the real ``billing_v1`` client) and the machine type's
shape from the Compute API (`tests.support.fakegcp`), then `sky.GCP.price`.

The SKUs registered here are shaped and named as the catalog's own (``A2 Instance Core running
in Americas``); the expected figures are worked out by hand from them. No network namespace is
used: nothing here connects anywhere but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

import skyward as sky
from skyward.cost import Price
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.gcp import prices, tpu_types
from tests.gcp.conftest import PROJECT, ZONE
from tests.support.fakebilling import COMPUTE_ENGINE, FakeBilling
from tests.support.fakegcp import FakeGCP
from tests.support.sshd import free_port


def today() -> str:
    """The UTC date a price looked up now is stamped with (read at each use: a run that
    crosses midnight stamps the new day)."""
    return datetime.now(UTC).strftime("%Y-%m-%d")


REGION = "us-central1"
AMERICAS = ["us-central1", "us-east1", "us-west4"]
CLOUD_TPU = "E000-3F24-B8AA"


def source() -> str:
    return f"Cloud Billing Catalog API, {REGION}, {today()}"


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh price cache for every test."""
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prices"


@pytest.fixture
def billing(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBilling]:
    with FakeBilling() as fake:
        monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING", fake.url)
        catalog(fake)
        yield fake
        assert fake.errors == []


@pytest.fixture
def compute(api_fake: FakeGCP, monkeypatch: pytest.MonkeyPatch) -> FakeGCP:
    monkeypatch.setenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE", api_fake.url)
    api_fake.add_machine_type("a2-highgpu-1g", 12, 85 * 1024, ("nvidia-tesla-a100", 1))
    api_fake.add_machine_type("a2-ultragpu-2g", 24, 340 * 1024, ("nvidia-a100-80gb", 2))
    api_fake.add_machine_type("g2-standard-4", 4, 16 * 1024, ("nvidia-l4", 1))
    api_fake.add_machine_type("e2-standard-2", 2, 8 * 1024)
    api_fake.add_machine_type("n1-standard-4", 4, 15 * 1024)
    api_fake.add_machine_type("n2-standard-2", 2, 8 * 1024)
    return api_fake


def catalog(fake: FakeBilling) -> None:
    """The SKUs every test sees: what a VM is priced by, and what it must not be priced by.

    The descriptions are the catalog's own, as Google's Cloud Billing documentation and public
    catalog readers quote them (``A2 Instance Core running in Hong Kong``, ``Nvidia Tesla K80
    GPU attached to Spot Preemptible VMs running in Warsaw``, ``TpuV5e running in Americas``):
    a spot GPU or TPU is named by a suffix, a spot core or memory SKU by a prefix, a few spot
    GPUs by the prefix too, and a few spot SKUs are filed under usage type ``OnDemand``. The
    prices are made up (the tests work them out by hand), the words are not."""
    fake.add_service("95FF-2EF5-5EA1", "Cloud Storage")
    fake.add_service(CLOUD_TPU, "Cloud TPU")
    on_demand = {
        "A2 Instance Core running in Americas": ("0.031611", "CPU", "h"),
        "A2 Instance Ram running in Americas": ("0.004237", "RAM", "GiBy.h"),
        "Nvidia Tesla A100 GPU running in Americas": ("2.933908", "GPU", "h"),
        "Nvidia Tesla A100 80GB GPU running in Americas": ("3.92808", "GPU", "h"),
        "Nvidia Tesla T4 GPU running in Americas": ("0.35", "GPU", "h"),
        "E2 Instance Core running in Americas": ("0.021811", "CPU", "h"),
        "E2 Instance Ram running in Americas": ("0.002923", "RAM", "GiBy.h"),
        "N1 Predefined Instance Core running in Americas": ("0.031611", "N1Standard", "h"),
        "N1 Predefined Instance Ram running in Americas": ("0.004237", "RAM", "GiBy.h"),
        "G2 Instance Core running in Americas": ("0.024988", "CPU", "h"),
        "G2 Instance Ram running in Americas": ("0.002927", "RAM", "GiBy.h"),
        # Not the predefined types' rates, though they read alike:
        "N1 Custom Instance Core running in Americas": ("0.033174", "N1Standard", "h"),
        "N1 Custom Extended Instance Ram running in Americas": ("0.009550", "RAM", "GiBy.h"),
        "Nvidia Tesla A100 GPU Virtual Workstation running in Americas": ("9.1", "GPU", "h"),
        "Sole Tenancy Instance Core running in Americas": ("0.034773", "CPU", "h"),
    }
    for description, (price, group, unit) in on_demand.items():
        fake.add_sku(description, price, group=group, regions=AMERICAS, unit=unit)
    spot = {
        "Spot Preemptible A2 Instance Core running in Americas": ("0.0094833", "CPU", "h"),
        "Spot Preemptible A2 Instance Ram running in Americas": ("0.0012711", "RAM", "GiBy.h"),
        "Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas": (
            "0.88017",
            "GPU",
            "h",
        ),
        "Nvidia Tesla T4 GPU attached to Spot Preemptible VMs running in Americas": (
            "0.14",
            "GPU",
            "h",
        ),
        "Spot Preemptible N2 Instance Core running in Americas": ("0.0079", "CPU", "h"),
        "Spot Preemptible N2 Instance Ram running in Americas": ("0.0011", "RAM", "GiBy.h"),
        "Spot Preemptible G2 Instance Core running in Americas": ("0.0099", "CPU", "h"),
        "Spot Preemptible G2 Instance Ram running in Americas": ("0.0012", "RAM", "GiBy.h"),
        "Spot Preemptible Nvidia L4 GPU running in Americas": ("0.22", "GPU", "h"),
    }
    for description, (price, group, unit) in spot.items():
        fake.add_sku(
            description, price, group=group, regions=AMERICAS, unit=unit, usage="Preemptible"
        )
    # The GPU's first tier is the one that counts (a later tier starts at 720 hours).
    fake.add_sku(
        "Nvidia L4 GPU running in Americas",
        "",
        group="GPU",
        regions=AMERICAS,
        tiers=[(0, "0.56"), (720, "0.40")],
    )
    # The same family elsewhere, and committed use here.
    fake.add_sku(
        "A2 Instance Core running in Belgium", "0.034773", group="CPU", regions=["europe-west1"]
    )
    fake.add_sku(
        "Commitment v1: A2 Cpu in Americas for 1 Year",
        "0.019915",
        group="CPU",
        regions=AMERICAS,
        usage="Commit1Yr",
    )
    # TPUs: per-chip SKUs, in the Compute Engine service (v5e, v6e) and in Cloud TPU's.
    fake.add_sku("TpuV5e running in Americas", "1.2", group="TPU", regions=["us-west4"])
    fake.add_sku(
        "TpuV5e attached to Spot Preemptible VMs running in Americas",
        "0.48",
        group="TPU",
        regions=["us-west4"],
        usage="Preemptible",
    )
    fake.add_sku("TpuV6e running in Americas", "2.7", group="TPU", regions=["us-east1", "us-east5"])
    # Spot, though filed as on-demand: its words say what it is.
    fake.add_sku(
        "TpuV6e attached to Spot Preemptible VMs running in Americas",
        "1.08",
        group="TPU",
        regions=["us-east5"],
    )
    # Other products for the same chips.
    fake.add_sku(
        "DWS Defined Duration V5e running in Americas", "0.6", group="TPU", regions=["us-west4"]
    )
    fake.add_sku("Reserved V5e TPU in Calendar Mode", "0.9", group="TPU", regions=["us-west4"])
    fake.add_sku(
        "Tpu-v4 Pod running in Americas", "3.22", group="TPU", regions=AMERICAS, service=CLOUD_TPU
    )


def clients(compute: FakeGCP | str, billing: FakeBilling | str) -> tuple[Any, Any]:
    credentials = AnonymousCredentials()
    return (
        prices.machine_types_client(credentials, getattr(compute, "url", compute)),
        prices.catalog_client(credentials, getattr(billing, "url", billing)),
    )


def vm(compute: FakeGCP | str, billing: FakeBilling | str, machine: str, spot: bool) -> Price:
    machine_types, catalog = clients(compute, billing)
    return prices.vm_price(machine_types, catalog, PROJECT, ZONE, machine, spot)


def spec(accelerator: str | None = None, nodes: int = 1) -> ClusterSpec:
    acc = Accelerator.parse(accelerator) if accelerator else None
    return ClusterSpec(nodes=nodes, pool_id="t-price", accelerator=acc, provider="gcp")


def gcp(zone: str = ZONE, **kwargs: Any) -> sky.GCP:
    return sky.GCP(project=PROJECT, zone=zone, credentials=AnonymousCredentials(), **kwargs)


def sku_calls(billing: FakeBilling) -> list[tuple[str, dict[str, str]]]:
    return [(path, query) for path, query in billing.requests if path.endswith("/skus")]


# -- VMs ---------------------------------------------------------------------------------------


def test_a_vm_is_its_cores_its_memory_and_its_gpus(compute: FakeGCP, billing: FakeBilling) -> None:
    # 12 x 0.031611 + 85 GiB x 0.004237 + 1 x 2.933908
    price = vm(compute, billing, "a2-highgpu-1g", spot=False)

    assert price.source == source()
    assert price.per_hour == pytest.approx(3.673385, abs=1e-9)
    ((path, query),) = sku_calls(billing)
    assert path == f"/v1/services/{COMPUTE_ENGINE}/skus"
    assert query["currencyCode"] == "USD"


def test_a_spot_vm_is_priced_by_the_spot_skus(compute: FakeGCP, billing: FakeBilling) -> None:
    # 12 x 0.0094833 + 85 GiB x 0.0012711 + 1 x 0.88017
    price = vm(compute, billing, "a2-highgpu-1g", spot=True)

    assert price == Price(pytest.approx(1.1020131, abs=1e-9), source())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        ("g2-standard-4", 4 * 0.0099 + 16 * 0.0012 + 0.22),  # "Spot Preemptible Nvidia L4 GPU"
        ("n2-standard-2", 2 * 0.0079 + 8 * 0.0011),  # "Spot Preemptible N2 Instance Core"
    ],
    ids=["g2", "n2"],
)
def test_every_way_the_catalog_names_a_spot_sku_is_read(
    compute: FakeGCP, billing: FakeBilling, machine: str, expected: float
) -> None:
    assert vm(compute, billing, machine, spot=True).per_hour == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        ("e2-standard-2", 2 * 0.021811 + 8 * 0.002923),  # 0.067006
        ("n1-standard-4", 4 * 0.031611 + 15 * 0.004237),  # 0.189999, not the custom rates
        ("g2-standard-4", 4 * 0.024988 + 16 * 0.002927 + 0.56),  # 0.706784, the first tier
        ("a2-ultragpu-2g", 24 * 0.031611 + 340 * 0.004237 + 2 * 3.92808),  # the 80GB GPU
    ],
    ids=["e2", "n1", "g2", "a2-ultra"],
)
def test_each_family_has_its_own_rates(
    compute: FakeGCP, billing: FakeBilling, machine: str, expected: float
) -> None:
    assert vm(compute, billing, machine, spot=False).per_hour == pytest.approx(expected, abs=1e-9)


def test_every_page_of_the_catalog_is_read(compute: FakeGCP, billing: FakeBilling) -> None:
    billing.page_size = 3

    price = vm(compute, billing, "a2-highgpu-1g", spot=False)

    assert price.per_hour == pytest.approx(3.673385, abs=1e-9)
    tokens = [query.get("pageToken") for _, query in sku_calls(billing)]
    assert len(tokens) > 5 and tokens[0] is None and all(tokens[1:])


def test_a_part_without_a_sku_is_unknown_and_named(compute: FakeGCP, billing: FakeBilling) -> None:
    assert vm(compute, billing, "n2-standard-2", spot=False) == Price.unknown(
        "Cloud Billing Catalog API: no on-demand SKU for the n2 core per h in this region"
    )
    assert vm(compute, billing, "e2-standard-2", spot=True) == Price.unknown(
        "Cloud Billing Catalog API: no spot SKU for the e2 core per h in this region"
    )


def test_two_rates_for_one_part_are_no_price(compute: FakeGCP, billing: FakeBilling) -> None:
    second = billing.add_sku(
        "E2 Instance Core running in Americas", "0.0219", group="CPU", regions=[REGION]
    )

    price = vm(compute, billing, "e2-standard-2", spot=False)

    assert price.per_hour is None
    assert price.source.startswith("Cloud Billing Catalog API: several rates for the e2 core: ")
    assert second["skuId"] in price.source


def test_an_unknown_machine_type_is_unknown(compute: FakeGCP, billing: FakeBilling) -> None:
    price = vm(compute, billing, "z9-standard-2", spot=False)

    assert price.per_hour is None
    assert price.source.startswith("Compute Engine API, machine type z9-standard-2: 404 ")


def test_a_catalog_that_is_down_is_unknown_not_an_error(compute: FakeGCP) -> None:
    price = vm(compute, f"http://127.0.0.1:{free_port()}", "e2-standard-2", spot=False)

    assert price.per_hour is None
    assert price.source.startswith("Cloud Billing Catalog API: ")
    assert "Connection refused" in price.source


def test_the_catalog_and_the_shape_are_read_once_a_week(
    compute: FakeGCP, billing: FakeBilling, cache: Path
) -> None:
    first = vm(compute, billing, "a2-highgpu-1g", spot=False)
    assert vm(compute, billing, "a2-highgpu-1g", spot=False) == first
    assert vm(compute, billing, "e2-standard-2", spot=False).known  # the same region's SKUs
    assert (len(sku_calls(billing)), compute.calls["machineTypes.get"]) == (1, 2)

    for path in cache.glob("gcp-*.json"):
        data = json.loads(path.read_text())
        data["fetched"] = (datetime.fromisoformat(data["fetched"]) - timedelta(days=8)).isoformat()
        path.write_text(json.dumps(data))
    assert vm(compute, billing, "a2-highgpu-1g", spot=False) == first
    assert (len(sku_calls(billing)), compute.calls["machineTypes.get"]) == (2, 3)


# -- TPUs --------------------------------------------------------------------------------------


def test_a_tpu_host_is_its_chips_at_the_per_chip_rate(billing: FakeBilling) -> None:
    _, catalog = clients("unused", billing)
    v5e = tpu_types.parse("tpu-v5litepod-16")  # 4 hosts of 4 chips
    v6e = tpu_types.parse("v6e-8")  # one host of 8 chips
    v4 = tpu_types.parse("v4-32")

    assert prices.tpu_price(catalog, v5e, "us-west4", spot=False) == Price(
        4 * 1.2, f"Cloud Billing Catalog API, us-west4, {today()}"
    )
    assert prices.tpu_price(catalog, v5e, "us-west4", spot=True).per_hour == 4 * 0.48
    assert prices.tpu_price(catalog, v6e, "us-east1", spot=False).per_hour == 8 * 2.7
    # In us-east5 a spot SKU filed as on-demand sits beside the on-demand one: each is itself.
    assert prices.tpu_price(catalog, v6e, "us-east5", spot=False).per_hour == 8 * 2.7
    assert prices.tpu_price(catalog, v6e, "us-east5", spot=True).per_hour == 8 * 1.08
    assert prices.tpu_price(catalog, v4, "us-central1", spot=False) == Price.unknown(
        "Cloud Billing Catalog API: TPU v4 is priced per device or per pod there, not per "
        "chip; skyward prices only v5p, v5e and v6e hosts"
    )
    assert [path for path, _ in billing.requests].count("/v1/services") == 1
    assert ("/v1/services/" + CLOUD_TPU + "/skus") in [path for path, _ in billing.requests]


# -- sky.GCP.price -----------------------------------------------------------------------------


def test_the_provider_prices_the_machine_type_it_would_launch(
    compute: FakeGCP, billing: FakeBilling
) -> None:
    assert asyncio.run(gcp().price(spec("A100"))) == Price(
        pytest.approx(3.673385, abs=1e-9),  # type: ignore[arg-type]
        source(),
    )
    spot = asyncio.run(gcp(spot=True).price(spec("A100")))
    assert spot.per_hour == pytest.approx(1.1020131, abs=1e-9)
    cpu = asyncio.run(gcp().price(spec()))
    assert cpu.per_hour == pytest.approx(0.067006, abs=1e-9)
    explicit = asyncio.run(gcp(machine_type="n1-standard-4").price(spec()))
    assert explicit.per_hour == pytest.approx(0.189999, abs=1e-9)


def test_the_provider_prices_one_host_of_its_tpu_slice(
    billing: FakeBilling, monkeypatch: pytest.MonkeyPatch
) -> None:
    price = asyncio.run(gcp(zone="us-west4-a").price(spec("tpu-v5litepod-16", nodes=4)))
    assert price == Price(4 * 1.2, f"Cloud Billing Catalog API, us-west4, {today()}")

    # api_endpoint= points the catalog client too, as it does the TPU API's.
    monkeypatch.delenv("CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING")
    before = len(sku_calls(billing))
    v6e = gcp(zone="us-east1-d", api_endpoint=billing.url, spot=True)
    assert asyncio.run(v6e.price(spec("v6e-8"))) == Price.unknown(
        "Cloud Billing Catalog API: no spot SKU for the TPU v6e chip per h in this region"
    )
    assert len(sku_calls(billing)) == before + 2  # both services' SKUs in us-east1


def test_the_provider_never_raises(compute: FakeGCP, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING", f"http://127.0.0.1:{free_port()}"
    )

    down = asyncio.run(gcp().price(spec("A100")))
    unknown_accelerator = asyncio.run(gcp().price(spec("V100")))
    no_project = asyncio.run(
        sky.GCP(zone=ZONE, credentials=AnonymousCredentials()).price(spec("A100"))
    )

    assert down.per_hour is None
    assert down.source.startswith("Cloud Billing Catalog API: ")
    assert unknown_accelerator.per_hour is None
    assert "accelerator 'V100' is not known to the GCP provider" in unknown_accelerator.source
    assert no_project.per_hour is None
    assert no_project.source.startswith("the GCP price lookup failed: no Google Cloud project")
