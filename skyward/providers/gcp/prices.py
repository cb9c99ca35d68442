"""One VM's or TPU host's price per hour, from Google's Cloud Billing Catalog API.

Compute Engine prices a predefined machine type by its parts, and so does this module:

- the machine type's vCPUs and memory (and the GPUs an accelerator-optimized type carries)
  come from the Compute API (``machineTypes.get``), not from the name;
- each part's rate is a SKU of the Compute Engine service (``services/6F81-5844-456A``) in the
  region: the family's "Instance Core" (per vCPU hour) and "Instance Ram" (per GiB hour), e.g.
  ``N1 Predefined Instance Core running in Americas``, and the GPU's, e.g. ``Nvidia Tesla A100
  GPU running in Americas``;
- a spot VM's parts are the spot SKUs. The catalog names them two ways: the machine's cores and
  memory with a prefix (``Spot Preemptible N2 Instance Core running in Americas``), most GPUs
  and TPUs with a suffix (``Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in
  Americas``, ``TpuV5e attached to Spot Preemptible VMs running in ...``), a few GPUs with the
  prefix (``Spot Preemptible Nvidia L4 GPU running in ...``). A SKU is spot when its usage type
  is ``Preemptible`` or its description says so: a few spot SKUs are filed as ``OnDemand``;
- a TPU host is its chips times the generation's per-chip SKU (resource group ``TPU``: ``TpuV5e
  running in Americas``), looked for in the Compute Engine service and in the one named "Cloud
  TPU" (found by name, with ``services.list``). Only the generations the catalog prices per
  chip (v5p, v5e, v6e) are priced; the older ones' SKUs are per device or per pod (``Tpu-v4
  Pod ...``), and are `Price.unknown`.

A SKU's rate is the latest pricing of its list, the last tier that starts at zero usage, in USD.
When no SKU, or several at different rates, fit a part, the price is `Price.unknown` naming the
part: never a guess. The SKUs of one service in one region are kept in `pricecache` for a week.

The Catalog API's endpoint: ``api_endpoint=`` of `sky.GCP` (as for the TPU API), else
``CLOUDSDK_API_ENDPOINT_OVERRIDES_CLOUDBILLING``, else cloudbilling.googleapis.com. The client
libraries are imported lazily: ``import skyward`` never needs them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from skyward.cost import CURRENCY, Price, dollars, dollars_per_hour
from skyward.providers.cloud import pricecache
from skyward.providers.gcp.tpu_types import TpuType

COMPUTE_SERVICE = "6F81-5844-456A"
"""The Cloud Billing Catalog's id of the Compute Engine service."""

TPU_SERVICE = "Cloud TPU"
"""The display name of the service that holds the older TPU generations' SKUs."""

CATALOG = "Cloud Billing Catalog API"
CALL_TIMEOUT = 60.0  # seconds for one page (up to 5,000 SKUs)

# Each part of a price and the unit its SKU must be priced in.
_UNITS = {"core": "h", "ram": "GiBy.h", "gpu": "h", "tpu": "h"}
# What `category.resource_group` says a SKU prices, where it says it; other groups (N1's cores
# are "N1Standard") leave it to the description.
_GROUPS = {"CPU": "core", "RAM": "ram", "GPU": "gpu", "TPU": "tpu"}
# Words a predefined VM's core or memory SKU may carry besides its family and part; anything
# else (Custom, Extended, Sole Tenancy, Commitment, ...) is another product.
_QUALIFIERS = {"amd", "intel", "arm", "predefined", "instance"}
# Families whose SKUs do not start with their name.
_FAMILY_WORDS = {"c2": ["compute", "optimized"], "m1": ["memory-optimized"]}
# TPU generations the catalog prices per chip, and the names its SKUs give them.
_PER_CHIP = {"v5p": {"v5p"}, "v5litepod": {"v5e", "v5lite", "v5litepod"}, "v6e": {"v6e"}}
_TPU_NAME = re.compile(r"tpu[\s-]*(v\d+)[\s-]*(lite\s*pod|lite|[a-z]?)")
# How a description says its SKU is spot: before the part (cores, RAM, a few GPUs) or after it
# (most GPUs and TPUs).
_SPOT_PREFIXES = ("spot preemptible ", "preemptible ")
_SPOT_SUFFIX = re.compile(r"\s+attached\s+to\s+(?:spot\s+)?preemptible\s+vms$")


@dataclass(frozen=True)
class Shape:
    """A machine type as the Compute API reports it."""

    name: str
    cpus: int
    memory_gib: float
    accelerators: tuple[tuple[str, int], ...] = ()  # (accelerator type, count) it carries

    @property
    def family(self) -> str:
        return self.name.split("-", 1)[0].lower()


@dataclass(frozen=True)
class Rate:
    """One SKU of the catalog, as far as a price needs it."""

    sku: str
    description: str
    family: str  # category.resource_family: "Compute"
    group: str  # category.resource_group: "RAM", "GPU", "N1Standard", ...
    usage: str  # category.usage_type: "OnDemand", "Preemptible", ...
    unit: str  # pricing_expression.usage_unit: "h", "GiBy.h"
    price: float  # USD per unit


class _NoPrice(Exception):
    """The catalog has no one rate for a part of the price."""


# -- clients ---------------------------------------------------------------------------------


def catalog_client(credentials: Any, endpoint: str | None) -> Any:
    """A Cloud Billing Catalog client (REST, as the Compute clients)."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import billing_v1

    options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    return billing_v1.CloudCatalogClient(
        credentials=credentials, client_options=options, transport="rest"
    )


def machine_types_client(credentials: Any, endpoint: str | None) -> Any:
    """A Compute API ``machineTypes`` client, pointed where the provider's other clients are."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import compute_v1

    options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    return compute_v1.MachineTypesClient(
        credentials=credentials, client_options=options, transport="rest"
    )


# -- the prices ------------------------------------------------------------------------------


def machine_shape(machine_types: Any, project: str, zone: str, machine_type: str) -> Shape:
    """`machine_type`'s vCPUs, memory and GPUs in `zone`, from the Compute API (kept a week:
    a predefined type does not change). Raises what the API raises."""
    from skyward.providers.gcp import api

    def fetch() -> dict[str, Any]:
        found = machine_types.get(
            project=project,
            zone=zone,
            machine_type=machine_type,
            retry=api.retry(),
            timeout=api.CALL_TIMEOUT,
        )
        return {
            "cpus": int(found.guest_cpus),
            "memory_mb": int(found.memory_mb),
            "accelerators": [
                [str(a.guest_accelerator_type), int(a.guest_accelerator_count)]
                for a in found.accelerators
            ],
        }

    def read(stored: Any) -> Shape:
        return Shape(
            machine_type,
            int(stored["cpus"]),
            int(stored["memory_mb"]) / 1024,
            tuple((str(kind), int(count)) for kind, count in stored["accelerators"]),
        )

    query = f"machine type {zone} {machine_type}"
    return pricecache.cached("gcp", query, pricecache.ON_DEMAND, fetch, read).value


def vm_price(
    machine_types: Any, catalog: Any, project: str, zone: str, machine_type: str, spot: bool
) -> Price:
    """One VM of `machine_type` in `zone`: its `machine_shape`, then its `machine_price`."""
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError

    try:
        shape = machine_shape(machine_types, project, zone, machine_type)
    except (GoogleAPIError, GoogleAuthError, OSError) as exc:
        return Price.unknown(f"Compute Engine API, machine type {machine_type}: {exc}")
    return machine_price(catalog, shape, zone.rsplit("-", 1)[0], spot)


def machine_price(catalog: Any, shape: Shape, region: str, spot: bool) -> Price:
    """One VM of `shape` in `region`: cores x the family's core rate + GiB x its memory rate
    + each GPU's rate; "Cloud Billing Catalog API, us-central1, 2026-11-25" is its source."""

    def total(rates: list[Rate]) -> float:
        core = _one(rates, f"{shape.family} core", spot, "core", _family_part(shape, "core"))
        ram = _one(rates, f"{shape.family} memory", spot, "ram", _family_part(shape, "ram"))
        amount = shape.cpus * core + shape.memory_gib * ram
        for kind, count in shape.accelerators:
            amount += count * _one(rates, f"{kind} GPU", spot, "gpu", _gpu_part(kind))
        return amount

    return _priced(catalog, region, lambda: [COMPUTE_SERVICE], total)


def tpu_price(catalog: Any, tpu: TpuType, region: str, spot: bool) -> Price:
    """One host of TPU slice `tpu` in `region`: its chips x the generation's per-chip rate."""
    names = _PER_CHIP.get(tpu.generation.api)
    if names is None:
        return Price.unknown(
            f"{CATALOG}: TPU {tpu.generation.api} is priced per device or per pod there, not "
            "per chip; skyward prices only v5p, v5e and v6e hosts"
        )
    chips = _chips_per_host(tpu)

    def total(rates: list[Rate]) -> float:
        what = f"TPU {tpu.generation.api} chip"
        return chips * _one(rates, what, spot, "tpu", _tpu_part(names))

    def services() -> list[str]:
        found = _service_ids(catalog).get(TPU_SERVICE)
        return [COMPUTE_SERVICE] + ([found] if found else [])

    return _priced(catalog, region, services, total)


# -- the catalog -----------------------------------------------------------------------------


def _priced(
    catalog: Any,
    region: str,
    services: Callable[[], list[str]],
    total: Callable[[list[Rate]], float],
) -> Price:
    """`total` over the SKUs of the `services()` in `region`, dated by the oldest catalog read;
    the catalog's failures, and a part it has no one rate for, as `Price.unknown`."""
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError

    try:
        entries = [_region_rates(catalog, service, region) for service in services()]
        rates = [rate for entry in entries for rate in entry.value]
        amount = total(rates)
    except (GoogleAPIError, GoogleAuthError, OSError, _NoPrice) as exc:
        return Price.unknown(f"{CATALOG}: {exc}")
    day = min(entry.day for entry in entries)
    return Price(amount, f"{CATALOG}, {region}, {day}")


def _region_rates(catalog: Any, service: str, region: str) -> pricecache.CachedPrice[list[Rate]]:
    """The on-demand and preemptible SKUs of `service` sold in `region` (kept a week)."""
    from skyward.providers.gcp import api

    def fetch() -> list[dict[str, Any]]:
        pages = catalog.list_skus(
            request={"parent": f"services/{service}", "currency_code": CURRENCY},
            retry=api.retry(),
            timeout=CALL_TIMEOUT,
        )
        # The catalog cannot filter by region: every page is read, only the region's kept.
        return [
            asdict(rate)
            for rate in (_rate(sku) for sku in pages if region in sku.service_regions)
            if rate is not None
        ]

    def read(stored: Any) -> list[Rate]:
        return [
            Rate(
                str(fields["sku"]),
                str(fields["description"]),
                str(fields["family"]),
                str(fields["group"]),
                str(fields["usage"]),
                str(fields["unit"]),
                float(fields["price"]),
            )
            for fields in stored
        ]

    query = f"skus {service} {region}"
    return pricecache.cached("gcp", query, pricecache.ON_DEMAND, fetch, read)


def _rate(sku: Any) -> Rate | None:
    """`sku`'s rate now: the last pricing of its timeline, the last tier starting at zero."""
    category = sku.category
    if category.usage_type not in ("OnDemand", "Preemptible") or not sku.pricing_info:
        return None
    expression = sku.pricing_info[-1].pricing_expression
    tiers = [t for t in expression.tiered_rates if t.start_usage_amount == 0]
    if not tiers:
        return None
    money = tiers[-1].unit_price
    if money.currency_code and money.currency_code != CURRENCY:
        return None
    return Rate(
        sku=str(sku.sku_id),
        description=str(sku.description),
        family=str(category.resource_family),
        group=str(category.resource_group),
        usage=str(category.usage_type),
        unit=str(expression.usage_unit),
        price=int(money.units) + int(money.nanos) / 1e9,
    )


def _service_ids(catalog: Any) -> dict[str, str]:
    """The catalog's services: display name -> service id (kept a week)."""
    from skyward.providers.gcp import api

    def fetch() -> dict[str, str]:
        pages = catalog.list_services(retry=api.retry(), timeout=CALL_TIMEOUT)
        return {str(s.display_name): str(s.service_id) for s in pages}

    def read(stored: Any) -> dict[str, str]:
        return {str(name): str(service) for name, service in stored.items()}

    return pricecache.cached("gcp", "services", pricecache.ON_DEMAND, fetch, read).value


# -- which SKU prices which part -------------------------------------------------------------

_Match = Callable[[list[str]], bool]


def _one(rates: Iterable[Rate], what: str, spot: bool, part: str, match: _Match) -> float:
    """The one spot (or on-demand) rate of `part` (core, ram, gpu, tpu) whose description's
    words `match`."""
    found: dict[float, list[str]] = {}
    for rate in rates:
        if _GROUPS.get(rate.group, part) != part:
            continue
        # Machine parts are Compute SKUs; what family the catalog files TPUs under varies.
        if rate.unit != _UNITS[part] or (part != "tpu" and rate.family != "Compute"):
            continue
        words, says_spot = _described(rate.description)
        if (rate.usage == "Preemptible" or says_spot) != spot:
            continue
        if match(words):
            found.setdefault(rate.price, []).append(f"{rate.description!r} ({rate.sku})")
    if not found:
        kind = "spot" if spot else "on-demand"
        raise _NoPrice(f"no {kind} SKU for the {what} per {_UNITS[part]} in this region")
    if len(found) > 1:
        listed = "; ".join(f"{price} {', '.join(skus)}" for price, skus in sorted(found.items()))
        raise _NoPrice(f"several rates for the {what}: {listed}")
    return next(iter(found))


def _described(description: str) -> tuple[list[str], bool]:
    """A SKU description's words before where it runs, without the words that say it is spot,
    and whether they said so: ``Spot Preemptible N2D AMD Instance Core running in Americas``
    -> (n2d amd instance core, True); ``Nvidia Tesla A100 GPU attached to Spot Preemptible
    VMs running in Americas`` -> (nvidia tesla a100 gpu, True)."""
    text = re.split(r"\s+(?:running\s+)?in\s+", description.lower().strip(), maxsplit=1)[0]
    spot = text.startswith(_SPOT_PREFIXES)
    for prefix in _SPOT_PREFIXES:
        text = text.removeprefix(prefix)
    text, suffixes = _SPOT_SUFFIX.subn("", text)
    return text.split(), spot or suffixes > 0


def _family_part(shape: Shape, part: str) -> _Match:
    family = _FAMILY_WORDS.get(shape.family, [shape.family])

    def match(words: list[str]) -> bool:
        rest = words[len(family) :]
        return (
            words[: len(family)] == family
            and rest.count("core" if part == "core" else "ram") == 1
            and set(rest) <= _QUALIFIERS | {"core" if part == "core" else "ram"}
        )

    return match


def _gpu_part(accelerator_type: str) -> _Match:
    """``nvidia-tesla-a100`` is priced by ``Nvidia Tesla A100 GPU``, ``nvidia-a100-80gb`` by
    ``Nvidia Tesla A100 80GB GPU``: the same model words, whatever the vendor words."""
    vendor = {"nvidia", "tesla"}
    model = set(accelerator_type.lower().split("-")) - vendor

    def match(words: list[str]) -> bool:
        return "gpu" in words and set(words) - vendor - {"gpu"} == model

    return match


def _tpu_part(names: set[str]) -> _Match:
    """``TpuV5e`` (or ``TPU v5e``, ``Tpu-v6e``) and nothing else: not ``Reserved V5e TPU in
    Calendar Mode``, ``DWS Defined Duration V5e`` or ``Tpu-v4 Pod``, other products."""

    def match(words: list[str]) -> bool:
        found = _TPU_NAME.fullmatch(" ".join(words))
        return found is not None and re.sub(r"\s", "", found[1] + found[2]) in names

    return match


def _chips_per_host(tpu: TpuType) -> int:
    """Chips on one host of `tpu`: v5e and v6e sizes count chips, v5p's count TensorCores (two
    a chip); a multi-host slice has `per_host` of those on each host."""
    units = tpu.size if tpu.hosts == 1 else tpu.generation.per_host
    return units if tpu.generation.api in ("v5litepod", "v6e") else units // 2


def running_cost(
    machine_types: Any, catalog: Any, project: str, instances: Iterable[tuple[str, Any]]
) -> str:
    """What a pool's running VMs cost (`skyward status`): ``$7.35/hour, about $1.20 so far``
    (each from its last start, at least a minute), or why it is unknown. `instances`: (zone,
    `compute_v1.Instance`) pairs, as `resources.find` lists them."""
    now = datetime.now(UTC)
    rate = spent = 0.0
    for zone, instance in instances:
        if str(instance.status) not in ("PROVISIONING", "STAGING", "RUNNING"):
            continue
        machine_type = str(instance.machine_type).rsplit("/", 1)[-1]
        spot = str(instance.scheduling.provisioning_model) == "SPOT"
        price = vm_price(machine_types, catalog, project, zone, machine_type, spot)
        if price.per_hour is None:
            return f"price unknown ({price.source})"
        started = str(instance.last_start_timestamp or instance.creation_timestamp or "")
        try:
            seconds = (now - datetime.fromisoformat(started)).total_seconds()
        except ValueError:
            seconds = 0.0
        rate += price.per_hour
        spent += price.per_hour * max(price.minimum_seconds, seconds) / 3600
    if not rate:
        return ""
    return f"{dollars_per_hour(rate)}, about {dollars(spent)} so far"
