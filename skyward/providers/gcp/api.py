"""The Compute API calls' common parts: retries, timeouts, long-running operations, errors.

Every call passes its own retry and timeout: the library's defaults retry reads for ten minutes,
which would hide a broken endpoint from a teardown that has its own deadline. Mutations carry a
``request_id``, so retrying one can never make a second resource.

A request GCE refuses for want of room is a `NoRoom`: a zone without capacity now (`ZONE`: the
next zone may have some) or a regional quota too low (`REGION`: no zone of that region will do);
failover (`provision`) reads which.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as gexc
from google.api_core.retry import Retry, if_exception_type
from google.cloud import compute_v1

from skyward.errors import ProvisionError

CALL_TIMEOUT = 30.0  # seconds for one HTTP call

_TRANSIENT = if_exception_type(
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.ServiceUnavailable,
    gexc.GatewayTimeout,
    gexc.TooManyRequests,
    ConnectionError,
)

ApiError = (gexc.GoogleAPIError, OSError)
"""What a failed call raises: the API's answer, or the transport's."""

ZONE = "zone"
REGION = "region"
# GCE's codes for a zone that cannot take the VMs now (its operation's ``error.errors[].code``).
ZONE_CODES = (
    "ZONE_RESOURCE_POOL_EXHAUSTED",
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
    "RESOURCE_POOL_EXHAUSTED",
    "RESOURCE_EXHAUSTED",
)
# The same said in words only: GCE's stockout messages do not always come with those codes.
_ZONE_WORDS = ("stockout", "does not have enough resources available")


class NoRoom(ProvisionError):
    """A request refused for want of room. `scope`: `ZONE` (that zone has no capacity now) or
    `REGION` (a quota, which GCE counts per region); `answer`: the cloud's code and words."""

    def __init__(self, message: str, *, scope: str, answer: str) -> None:
        super().__init__(message)
        self.scope = scope
        self.answer = answer


def no_room(code: str, message: str) -> str | None:
    """Whether a refusal (`code`, `message`) says a zone (`ZONE`) or a region's quota
    (`REGION`) has no room; None when it says something else."""
    if "QUOTA" in code.upper():  # QUOTA_EXCEEDED in an operation, quotaExceeded from a call
        return REGION
    words = message.lower()
    if code in ZONE_CODES or any(w in words for w in _ZONE_WORDS):
        return ZONE
    return None


def refusal(exc: BaseException) -> tuple[str, str]:
    """A failed call's code (GCE's first error reason, e.g. ``quotaExceeded``) and words."""
    if isinstance(exc, gexc.GoogleAPICallError):
        reasons = [str(e.get("reason", "")) for e in exc.errors if isinstance(e, dict)]
        return next((r for r in reasons if r), ""), str(exc.message)
    return "", str(exc)


def retry(deadline: float = 30.0) -> Retry:
    """Retry transient failures (5xx, 429, dropped connections) with backoff for `deadline` s."""
    return Retry(predicate=_TRANSIENT, initial=0.2, maximum=5.0, multiplier=2.0, timeout=deadline)


def request_id() -> str:
    return str(uuid.uuid4())


def ask_delete(method: Callable[..., object], request: object) -> None:
    """Ask for one deletion with `method` (not waited for, not retried here: the teardown's
    loop retries with its own deadline); "not found" is done."""
    with contextlib.suppress(gexc.NotFound):
        method(request=request, retry=None, timeout=CALL_TIMEOUT)


def is_done(operation: Any) -> bool:
    return bool(operation.status == compute_v1.Operation.Status.DONE)


def operation_error(operation: Any) -> tuple[str, str] | None:
    """The first error of a finished operation: (code, message), or None if it succeeded."""
    errors = list(operation.error.errors)
    if not errors:
        return None
    return str(errors[0].code), "; ".join(str(e.message) for e in errors)


def wait(clients: Any, project: str, operation: Any, deadline: float) -> Any:
    """Wait for a zonal or global `operation` until DONE (`wait` blocks server-side, up to two
    minutes a call) or until `deadline` (monotonic); the finished operation."""
    while not is_done(operation):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"operation {operation.name} still {operation.status.name}")
        timeout = min(CALL_TIMEOUT * 5, max(1.0, left))
        if operation.zone:
            zone = str(operation.zone).rsplit("/", 1)[-1]
            operation = clients.zone_operations.wait(
                project=project, zone=zone, operation=operation.name, retry=retry(), timeout=timeout
            )
        else:
            operation = clients.global_operations.wait(
                project=project, operation=operation.name, retry=retry(), timeout=timeout
            )
    return operation


def describe(exc: BaseException) -> str:
    """One line for a failed call (the library's message names the HTTP method and URL)."""
    return " ".join(str(exc).split())
