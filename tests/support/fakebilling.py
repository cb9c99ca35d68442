"""A small Cloud Billing Catalog API on 127.0.0.1, for the real ``billing_v1`` client (REST).

It answers the two calls of the public catalog as the REST reference documents them
(https://cloud.google.com/billing/docs/reference/rest/v1/services and ``services.skus``):

- ``GET /v1/services`` -> ``{"services": [{"name", "serviceId", "displayName",
  "businessEntityName"}], "nextPageToken"}``;
- ``GET /v1/services/{id}/skus`` -> ``{"skus": [Sku...], "nextPageToken"}``, each SKU with its
  ``category`` (resourceFamily, resourceGroup, usageType), ``serviceRegions`` and
  ``pricingInfo[].pricingExpression`` (usageUnit, ``tieredRates[].startUsageAmount`` and
  ``unitPrice`` {currencyCode, units, nanos}).

Both page with ``pageToken``/``pageSize`` (at most `page_size` items a page: set it low to make
the client follow the tokens) and ``currencyCode`` is checked (only USD is served). Every reply
is parsed with the library's own type (``billing_v1.ListSkusResponse.from_json(...,
ignore_unknown_fields=False)``) before it is written: a field the library does not know, or of
the wrong type, is an entry in `errors`, which the tests assert empty, and so is any call the
fake does not serve.

What it proves: that the official client's requests reach these paths with the parameters
skyward sets, that skyward follows the pages, and that it reads the documented SKU shape (the
latest pricing, its zero-usage tier, units + nanos). The SKUs are the test's (`add_sku`); the
price tests (tests/gcp/test_gcp_prices.py) register descriptions as the catalog writes them
(``Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas``, ``Spot
Preemptible N2 Instance Core running in Americas``, ``TpuV5e running in Americas``), quoted
from Google's reference and from public readers of the live catalog, not names made to fit
the matching. What only the real API can show: that Google has not renamed them since,
which services hold which SKUs, and the prices themselves, which drift.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from decimal import Decimal
from typing import Any

from google.cloud import billing_v1

from tests.support.localhttp import LocalServer, Reply, Request

COMPUTE_ENGINE = "6F81-5844-456A"


class _Refused(Exception):
    def __init__(self, code: int, status: str, message: str) -> None:
        super().__init__(message)
        self.code, self.status, self.message = code, status, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}


class FakeBilling:
    """The server, its services and their SKUs; `url` is what ``api_endpoint`` takes."""

    def __init__(self, page_size: int = 5000) -> None:
        self.page_size = page_size  # the API's own maximum
        self.services: dict[str, str] = {COMPUTE_ENGINE: "Compute Engine"}  # id -> display name
        self.skus: dict[str, list[dict[str, Any]]] = {COMPUTE_ENGINE: []}
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of each call
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server = LocalServer(self.answer, methods=("GET",))
        self.url = self._server.url

    def __enter__(self) -> FakeBilling:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

    def add_service(self, service_id: str, display_name: str) -> None:
        self.services[service_id] = display_name
        self.skus.setdefault(service_id, [])

    def add_sku(
        self,
        description: str,
        price: str,
        *,
        group: str,
        regions: list[str],
        usage: str = "OnDemand",
        unit: str = "h",
        family: str = "Compute",
        service: str = COMPUTE_ENGINE,
        tiers: list[tuple[float, str]] | None = None,
    ) -> dict[str, Any]:
        """Register a SKU priced `price` USD (a decimal string) per `unit`, or by `tiers`
        ((start usage amount, price) pairs). Returns it, in the API's JSON shape."""
        number = next(self._ids)
        sku_id = f"{number:04X}-{number * 7 % 65536:04X}-{number * 13 % 65536:04X}"
        rates = [
            {"startUsageAmount": start, "unitPrice": _money(amount)}
            for start, amount in (tiers or [(0, price)])
        ]
        sku = {
            "name": f"services/{service}/skus/{sku_id}",
            "skuId": sku_id,
            "description": description,
            "category": {
                "serviceDisplayName": self.services[service],
                "resourceFamily": family,
                "resourceGroup": group,
                "usageType": usage,
            },
            "serviceRegions": regions,
            "pricingInfo": [
                {
                    "summary": "",
                    "pricingExpression": {
                        "usageUnit": unit,
                        "displayQuantity": 1,
                        "tieredRates": rates,
                        "usageUnitDescription": {"h": "hour", "GiBy.h": "gibibyte hour"}.get(
                            unit, unit
                        ),
                        "baseUnit": {"h": "s", "GiBy.h": "By.s"}.get(unit, unit),
                        "baseUnitDescription": "second",
                        "baseUnitConversionFactor": 3600,
                    },
                    "currencyConversionRate": 1,
                    "effectiveTime": "2026-11-01T08:00:00.000Z",
                }
            ],
            "serviceProviderName": "Google",
        }
        with self._lock:
            self.skus[service].append(sku)
        return sku

    # -- the API

    def dispatch(self, path: str, query: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            self.requests.append((path, dict(query)))
        if path == "/v1/services":
            services = [
                {
                    "name": f"services/{service_id}",
                    "serviceId": service_id,
                    "displayName": name,
                    "businessEntityName": "businessEntities/GCP",
                }
                for service_id, name in sorted(self.services.items())
            ]
            items, token = self._page(services, query)
            return self._checked(
                billing_v1.ListServicesResponse, {"services": items, "nextPageToken": token}
            )
        match = re.fullmatch(r"/v1/services/(?P<service>[^/]+)/skus", path)
        if match is None:
            self.errors.append(f"unknown call GET {path}")
            raise _Refused(404, "NOT_FOUND", f"the fake does not serve {path}")
        service = match["service"]
        if service not in self.skus:
            raise _Refused(404, "NOT_FOUND", f"Service {service} not found")
        currency = query.get("currencyCode", "USD")
        if currency != "USD":
            self.errors.append(f"currencyCode {currency!r}")
            raise _Refused(400, "INVALID_ARGUMENT", f"currency {currency} is not served here")
        with self._lock:
            skus = list(self.skus[service])
        items, token = self._page(skus, query)
        return self._checked(billing_v1.ListSkusResponse, {"skus": items, "nextPageToken": token})

    def _page(self, items: list[dict[str, Any]], query: dict[str, str]) -> tuple[list[Any], str]:
        size = min(int(query.get("pageSize") or self.page_size), self.page_size)
        start = int(query.get("pageToken") or 0)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def _checked(self, kind: Any, reply: dict[str, Any]) -> dict[str, Any]:
        return conforming(kind, reply, self.errors)

    def answer(self, request: Request) -> Reply:
        """One request of the catalog's REST API (also for `FakeGCP`, which serves it beside
        Compute Engine's)."""
        try:
            status, reply = 200, self.dispatch(request.path, request.query)
        except _Refused as exc:
            status, reply = exc.code, exc.body()
        headers = {"Content-Type": "application/json; charset=UTF-8"}
        return status, headers, json.dumps(reply).encode()


def conforming(kind: Any, reply: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    """`reply`, noting in `errors` if it is not a `kind` (a proto-plus message type of the
    client library) as the library reads it: the fakes' shapes must not drift from Google's."""
    try:
        kind.from_json(json.dumps(reply), ignore_unknown_fields=False)
    except Exception as exc:
        errors.append(f"the fake wrote a bad {kind.__name__}: {exc}")
    return reply


def _money(amount: str) -> dict[str, Any]:
    """A decimal USD amount as google.type.Money: whole units (an int64, so a JSON string)
    and nanos."""
    value = Decimal(amount)
    units = int(value)
    return {"currencyCode": "USD", "units": str(units), "nanos": int((value - units) * 10**9)}
