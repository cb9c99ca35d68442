"""A small AWS Price List Query API on 127.0.0.1, for the real boto3 ``pricing`` client.

It speaks the service's protocol (AWS JSON 1.1: ``POST /`` with
``X-Amz-Target: AWSPriceListService.GetProducts`` and a JSON body of ServiceCode, Filters,
FormatVersion, NextToken and MaxResults) and answers ``GetProducts`` as the API reference
documents it: ``{"FormatVersion": "aws_v1", "PriceList": [...], "NextToken": ...}``, each
PriceList item a JSON document *as a string* in the AmazonEC2 price list shape (``product``
with its ``attributes`` and ``sku``, ``terms.OnDemand.<offer>.priceDimensions.<rate>
.pricePerUnit.USD``, and a ``Reserved`` term beside it that a reader must not take).

What it proves: that boto3, pointed here with ``AWS_ENDPOINT_URL_PRICING``, sends what skyward
asks (the TERM_MATCH filters; the request signed with SigV4 for us-east-1 and the ``pricing``
service), that skyward follows NextToken across pages (at most `page_size` products a page, or
the request's MaxResults), and that it reads the documented response shape, including the
service's errors (``AccessDeniedException`` and the like, `deny`). Filters match exactly, on the
attributes a registered product has. Anything it does not expect (another operation, a filter
type other than TERM_MATCH, a NextToken of another query, an unsigned request) is a 400 and an
entry in `errors`, which the tests assert empty.

What only the real API can show: the real products and their attribute values (which AWS
adds to and renames), the real prices (which drift), and its throttling.
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.support.localhttp import LocalServer, Reply, Request

TARGET = "AWSPriceListService.GetProducts"
_ON_DEMAND_OFFER = "JRTCKXETXF"  # the offer term code AWS gives on-demand terms
_HOURLY_RATE = "6YS6EN2CT7"


class _Refused(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass
class PriceListServer:
    """The server and the products it serves; `url` is what AWS_ENDPOINT_URL_PRICING takes."""

    page_size: int = 100  # the service's own maximum for MaxResults
    deny: str | None = None  # set: every call is refused with AccessDeniedException(deny)
    products: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # the decoded request bodies
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._skus = itertools.count(1)
        self._lock = threading.Lock()
        self._server = LocalServer(self._reply, methods=("POST",))
        self.url = self._server.url

    def __enter__(self) -> PriceListServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

    def add(
        self,
        instance_type: str,
        region: str,
        per_hour: str,
        *,
        operation: str = "RunInstances",
        **attributes: str,
    ) -> str:
        """Register a Linux, shared-tenancy EC2 product of `instance_type` in `region` at
        `per_hour` USD (a decimal string, as AWS writes it); `attributes` override or add
        product attributes. Returns its SKU."""
        sku = f"SKU{next(self._skus):012d}"
        offer = f"{sku}.{_ON_DEMAND_OFFER}"
        reserved = f"{sku}.4NA7Y494T4"
        self.products.append(
            {
                "product": {
                    "productFamily": "Compute Instance",
                    "attributes": {
                        "servicecode": "AmazonEC2",
                        "instanceType": instance_type,
                        "regionCode": region,
                        "operatingSystem": "Linux",
                        "tenancy": "Shared",
                        "preInstalledSw": "NA",
                        "capacitystatus": "Used",
                        "licenseModel": "No License required",
                        "operation": operation,
                        "usagetype": f"BoxUsage:{instance_type}",
                        **attributes,
                    },
                    "sku": sku,
                },
                "serviceCode": "AmazonEC2",
                "terms": {
                    "OnDemand": {
                        offer: {
                            "priceDimensions": {
                                f"{offer}.{_HOURLY_RATE}": {
                                    "unit": "Hrs",
                                    "endRange": "Inf",
                                    "description": f"${per_hour} per On Demand Linux "
                                    f"{instance_type} Instance Hour",
                                    "appliesTo": [],
                                    "rateCode": f"{offer}.{_HOURLY_RATE}",
                                    "beginRange": "0",
                                    "pricePerUnit": {"USD": per_hour},
                                }
                            },
                            "sku": sku,
                            "effectiveDate": "2026-11-01T00:00:00Z",
                            "offerTermCode": _ON_DEMAND_OFFER,
                            "termAttributes": {},
                        }
                    },
                    # A reserved term with another price: only the OnDemand one is the answer.
                    "Reserved": {
                        reserved: {
                            "priceDimensions": {
                                f"{reserved}.6YS6EN2CT7": {
                                    "unit": "Hrs",
                                    "endRange": "Inf",
                                    "description": "Linux/UNIX, 1 year, no upfront",
                                    "appliesTo": [],
                                    "rateCode": f"{reserved}.6YS6EN2CT7",
                                    "beginRange": "0",
                                    "pricePerUnit": {"USD": "0.0010000000"},
                                }
                            },
                            "sku": sku,
                            "effectiveDate": "2026-11-01T00:00:00Z",
                            "offerTermCode": "4NA7Y494T4",
                            "termAttributes": {
                                "LeaseContractLength": "1yr",
                                "OfferingClass": "standard",
                                "PurchaseOption": "No Upfront",
                            },
                        }
                    },
                },
                "version": "20261101000000",
                "publicationDate": "2026-11-01T00:00:00Z",
            }
        )
        return sku

    # -- the protocol

    def answer(self, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        """One request: its headers (names in lower case) and body -> the response body (or
        `_Refused`)."""
        target = headers.get("x-amz-target", "")
        if target != TARGET:
            raise self._error("UnknownOperationException", f"unexpected target {target!r}")
        if headers.get("content-type", "") != "application/x-amz-json-1.1":
            raise self._error("SerializationException", "not application/x-amz-json-1.1")
        auth = headers.get("authorization", "")
        if (
            not auth.startswith("AWS4-HMAC-SHA256 ")
            or "/us-east-1/pricing/aws4_request" not in auth
        ):
            raise self._error("IncompleteSignatureException", f"bad signature {auth!r}")
        try:
            request = json.loads(body)
        except ValueError:
            raise self._error("SerializationException", "the body is not JSON") from None
        with self._lock:
            self.requests.append(request)
        if self.deny is not None:
            raise _Refused("AccessDeniedException", self.deny)
        if request.get("ServiceCode") != "AmazonEC2":
            raise self._error("NotFoundException", f"no service {request.get('ServiceCode')!r}")
        if request.get("FormatVersion", "aws_v1") != "aws_v1":
            raise self._error("InvalidParameterException", "FormatVersion must be aws_v1")
        filters = request.get("Filters", [])
        for item in filters:
            if item.get("Type") != "TERM_MATCH" or not {"Field", "Value"} <= item.keys():
                raise self._error("InvalidParameterException", f"unsupported filter {item}")
        wanted = {item["Field"]: item["Value"] for item in filters}
        matches = [
            product
            for product in self.products
            if all(product["product"]["attributes"].get(k) == v for k, v in wanted.items())
        ]
        size = min(int(request.get("MaxResults", self.page_size)), self.page_size)
        start = 0
        if request.get("NextToken"):
            start = self._token_offset(request["NextToken"], wanted)
        page = matches[start : start + size]
        reply: dict[str, Any] = {
            "FormatVersion": "aws_v1",
            "PriceList": [json.dumps(product) for product in page],
        }
        if start + size < len(matches):
            reply["NextToken"] = self._token(start + size, wanted)
        return reply

    def _error(self, code: str, message: str) -> _Refused:
        self.errors.append(f"{code}: {message}")
        return _Refused(code, message)

    @staticmethod
    def _token(offset: int, wanted: dict[str, str]) -> str:
        return base64.b64encode(json.dumps([offset, wanted], sort_keys=True).encode()).decode()

    def _token_offset(self, token: str, wanted: dict[str, str]) -> int:
        try:
            offset, query = json.loads(base64.b64decode(token))
        except ValueError:
            raise self._error("InvalidNextTokenException", "unreadable NextToken") from None
        if query != wanted:
            raise self._error("InvalidNextTokenException", "NextToken of another query")
        return int(offset)

    def _reply(self, request: Request) -> Reply:
        try:
            status, reply = 200, self.answer(request.headers, request.body)
        except _Refused as exc:
            status = exc.status
            reply = {"__type": exc.code, "Message": exc.message}
        headers = {
            "Content-Type": "application/x-amz-json-1.1",
            "x-amzn-RequestId": "00000000-0000-0000-0000-000000000000",
        }
        return status, headers, json.dumps(reply).encode()
