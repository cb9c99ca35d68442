"""A small Compute Engine API on 127.0.0.1 for the real `google.cloud.compute_v1` clients.

It answers only what `sky.GCP` calls, with bodies shaped as the public REST reference documents
them (https://cloud.google.com/compute/docs/reference/rest/v1):

- instances: bulkInsert, get, list, aggregatedList, delete (zonal);
- firewalls: insert, list, delete (global);
- machineTypes: get (zonal), for the types a test registers with `add_machine_type`;
- regions: get, with the region's ``quotas`` (`quotas`, over generous defaults);
- zoneOperations: get, wait, list; globalOperations: get, wait;
- the Cloud TPU v2 API (``/v2/projects/P/locations/Z/``): nodes, operations, queued resources
  (`tests.support.faketpu`, whose slices' hosts take addresses from the same list).

Every request body is parsed with the client library's own type
(``compute_v1.<Type>.from_json(body, ignore_unknown_fields=False)``) and so is every response
the server writes: an unknown field, or a field of the wrong type, is a 400 and a recorded
`errors` entry, which the tests assert empty. Calls the server does not know are a 501 and an
error too. It also checks what GCE itself would refuse: a VM without the pool label, names GCE
would reject, a duplicate firewall rule.

VMs: each one takes a free address from `addresses`, in whichever zone it is made (none free:
the bulkInsert operation fails with ZONE_RESOURCE_POOL_EXHAUSTED, all-or-nothing as `minCount`
says), becomes RUNNING after `boot_delay` and calls `on_running(instance)`; a deleted one is
STOPPING for `delete_delay`, then gone (`on_gone(instance)`).

Faults:

- `capacity`: False, every bulkInsert fails as above;
- `no_capacity`: zone (or ``"ZONE SPOT"``, spot VMs only) -> the error code its bulkInsert
  operations end with, with GCE's documented message: the zone's ZONE_RESOURCE_POOL_EXHAUSTED
  (or ..._WITH_DETAILS), or the region's QUOTA_EXCEEDED; a TPU slice asked there fails as for
  no capacity. Such a refusal leaves `refusal_leaves` of its VMs behind (as if GCE's own
  rollback of a half-done bulkInsert had not run yet);
- `fail`: call name -> how many times to answer 500 (-1: forever); `forbid`: calls answered
  403, as without the permission; `preempt(name)`.

`inserts` records each bulkInsert's (zone, provisioning model) and `slices` each zone a TPU
slice was asked in, in order; `quotas` sets what ``regions.get`` answers.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ClassVar

from google.cloud import compute_v1

from tests.support.fakebilling import FakeBilling, conforming
from tests.support.faketpu import TpuApi
from tests.support.localhttp import LocalServer, Reply, Request

BASE = "https://www.googleapis.com/compute/v1"
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")

# A region's quotas when a test sets none: (limit, usage) by metric, room for any test pool.
DEFAULT_QUOTAS = {
    "CPUS": (2400.0, 0.0),
    "INSTANCES": (6000.0, 0.0),
    "PREEMPTIBLE_CPUS": (0.0, 0.0),
    "IN_USE_ADDRESSES": (690.0, 0.0),
}

Hook = Callable[[dict[str, Any]], None]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "errors": [{"message": self.message, "domain": "global", "reason": self.reason}],
            }
        }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class FakeGCP(TpuApi):
    """The server and its state; `url` is what ``client_options.api_endpoint`` takes."""

    def __init__(
        self,
        project: str,
        addresses: list[str],
        *,
        boot_delay: float = 0.2,
        delete_delay: float = 0.2,
        operation_delay: float = 0.05,
        on_running: Hook | None = None,
        on_gone: Hook | None = None,
    ) -> None:
        self.project = project
        self.addresses = list(addresses)
        self.boot_delay = boot_delay
        self.delete_delay = delete_delay
        self.operation_delay = operation_delay
        self.on_running = on_running
        self.on_gone = on_gone
        self.capacity = True  # False: every bulkInsert fails for capacity
        self.no_capacity: dict[str, str] = {}  # zone (or "ZONE SPOT") -> the error code there
        self.refusal_leaves = 0  # VMs a refused bulkInsert leaves behind
        # region -> metric -> (limit, usage), over DEFAULT_QUOTAS
        self.quotas: dict[str, dict[str, tuple[float, float]]] = {}
        self.inserts: list[tuple[str, str]] = []  # bulkInsert: (zone, provisioning model)
        self.slices: list[str] = []  # the zone of each TPU slice asked for
        self.fail: dict[str, int] = {}
        self.forbid: set[str] = set()
        self.calls: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        # What each machine (VM name, or a TPU host's ``NODE-wN``) PUT to its metadata server's
        # guest attributes: "NAMESPACE/KEY" -> value. Only the machine's stand-in writes here.
        self.guest_attributes: dict[str, dict[str, str]] = {}
        self.firewalls: dict[str, dict[str, Any]] = {}
        self.machine_types: dict[str, dict[str, Any]] = {}  # name -> its vCPUs, memory, GPUs
        self.operations: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, float] = {}  # instance key / op name -> when its next step is
        self._requests: dict[str, dict[str, Any]] = {}  # requestId -> its operation
        self._ids = itertools.count(4_000_000_000_000_000_000)
        self._lock = threading.RLock()
        self._tpu_init()
        # The Cloud Billing Catalog at the same endpoint, as `api_endpoint=` points both: no
        # SKUs unless a test adds them (prices are then "unknown", as for an unlisted type).
        self.billing = FakeBilling()
        self._stop = threading.Event()
        self._server = LocalServer(
            self._reply, methods=("GET", "POST", "DELETE", "PATCH"), name="fakegcp"
        )
        self.url = self._server.url
        self._clock_thread = threading.Thread(target=self._clock, name="fakegcp-clock", daemon=True)

    # -- lifecycle

    def start(self) -> FakeGCP:
        self._server.start()
        self._clock_thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._clock_thread.join(10)

    def __enter__(self) -> FakeGCP:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what tests look at

    def labelled(self) -> list[str]:
        """Everything of any skyward pool that still exists (instances by label, firewall
        rules by name)."""
        with self._lock:
            found = [
                f"instance {i['name']} {i['status']}"
                for i in self.instances.values()
                if "skyward-pool" in i.get("labels", {})
            ]
            found += [f"firewall {name}" for name in self.firewalls if name.startswith("skyward-")]
            return sorted(found + self.tpu_labelled())

    def add_machine_type(
        self, name: str, cpus: int, memory_mb: int, gpus: tuple[str, int] | None = None
    ) -> None:
        """A machine type `machineTypes.get` answers for in every zone: `gpus` is the
        (accelerator type, count) it carries, as an accelerator-optimized type does."""
        self.machine_types[name] = {"cpus": cpus, "memory_mb": memory_mb, "gpus": gpus}

    def preempt(self, name: str) -> dict[str, Any]:
        """GCE reclaims spot VM `name`: TERMINATED, with a compute.instances.preempted
        operation on it, and its machine gone (`on_gone`)."""
        with self._lock:
            instance = next(i for i in self.instances.values() if i["name"] == name)
            instance["status"] = "TERMINATED"
            instance["lastStopTimestamp"] = _now()
            zone = instance["zone"].rsplit("/", 1)[-1]
            self._operation("compute.instances.preempted", instance, zone, delay=0.0)
        if self.on_gone is not None:
            self.on_gone(instance)
        return instance

    # -- the clock: operations finish, VMs boot and go

    def _clock(self) -> None:
        while not self._stop.wait(0.02):
            now = time.monotonic()
            booted: list[dict[str, Any]] = []
            gone: list[dict[str, Any]] = []
            with self._lock:
                for op in self.operations.values():
                    if op["status"] != "DONE" and self._timers.get(op["name"], 0) <= now:
                        op.update(status="DONE", progress=100, endTime=_now())
                for key, instance in list(self.instances.items()):
                    if self._timers.get(instance["name"], now + 1) > now:
                        continue
                    if instance["status"] == "PROVISIONING":
                        instance["status"] = "STAGING"
                    elif instance["status"] == "STAGING":
                        instance.update(status="RUNNING", lastStartTimestamp=_now())
                        booted.append(instance)
                        self._timers.pop(instance["name"])
                    elif instance["status"] == "STOPPING":
                        del self.instances[key]
                        self._timers.pop(instance["name"])
                        gone.append(instance)
                tpu_booted, tpu_gone = self.tpu_tick(now)
                booted += tpu_booted
                gone += tpu_gone
            for instance in booted:
                self._hook(self.on_running, instance)
            for instance in gone:
                self._hook(self.on_gone, instance)

    def _hook(self, hook: Hook | None, instance: dict[str, Any]) -> None:
        if hook is None:
            return
        try:
            hook(instance)
        except Exception as exc:
            self.errors.append(f"hook for {instance['name']}: {exc!r}")

    # -- HTTP

    def _reply(self, request: Request) -> Reply:
        if request.path.startswith("/v1/services"):  # `api_endpoint=` reaches the catalog too
            return self.billing.answer(request)
        body = request.body.decode()
        try:
            status, reply = 200, self.dispatch(request.method, request.path, request.query, body)
        except ApiError as exc:
            status, reply = exc.code, exc.body()
        headers = {"Content-Type": "application/json; charset=UTF-8"}
        return status, headers, json.dumps(reply).encode()

    _ROUTES: ClassVar[list[tuple[str, str, str]]] = [
        ("POST", r"zones/(?P<zone>[^/]+)/instances/bulkInsert", "instances.bulkInsert"),
        (
            "GET",
            r"zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)/getGuestAttributes",
            "instances.getGuestAttributes",
        ),
        ("GET", r"zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)", "instances.get"),
        ("DELETE", r"zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)", "instances.delete"),
        ("GET", r"zones/(?P<zone>[^/]+)/instances", "instances.list"),
        ("GET", r"aggregated/instances", "instances.aggregatedList"),
        ("POST", r"global/firewalls", "firewalls.insert"),
        ("GET", r"global/firewalls", "firewalls.list"),
        ("DELETE", r"global/firewalls/(?P<name>[^/]+)", "firewalls.delete"),
        ("GET", r"zones/(?P<zone>[^/]+)/machineTypes/(?P<name>[^/]+)", "machineTypes.get"),
        ("GET", r"regions/(?P<name>[^/]+)", "regions.get"),
        ("GET", r"zones/(?P<zone>[^/]+)/operations/(?P<name>[^/]+)", "zoneOperations.get"),
        ("POST", r"zones/(?P<zone>[^/]+)/operations/(?P<name>[^/]+)/wait", "zoneOperations.wait"),
        ("GET", r"zones/(?P<zone>[^/]+)/operations", "zoneOperations.list"),
        ("GET", r"global/operations/(?P<name>[^/]+)", "globalOperations.get"),
        ("POST", r"global/operations/(?P<name>[^/]+)/wait", "globalOperations.wait"),
    ]

    def _tpu_error(self, code: int, status: str, message: str) -> Exception:
        return ApiError(code, status, message)

    def dispatch(self, method: str, path: str, query: dict[str, str], body: str) -> Any:
        prefix = f"/compute/v1/projects/{self.project}/"
        tpu_prefix = f"/v2/projects/{self.project}/locations/"
        call = None
        args: dict[str, str] = {}
        if path.startswith(tpu_prefix):
            found = self.tpu_route(method, path[len(tpu_prefix) :])
            if found is not None:
                call, args = found
        elif path.startswith(prefix):
            rest = path[len(prefix) :]
            for verb, pattern, name in self._ROUTES:
                match = re.fullmatch(pattern, rest)
                if verb == method and match:
                    call, args = name, match.groupdict()
                    break
        if call is None:
            self.errors.append(f"unknown call {method} {path}")
            raise ApiError(501, "notImplemented", f"the fake does not implement {method} {path}")
        with self._lock:
            self.calls[call] += 1
            left = self.fail.get(call, 0)
            if left:
                self.fail[call] = left - 1 if left > 0 else left
                raise ApiError(500, "backendError", "Internal error. Please try again.")
            if call in self.forbid:
                raise ApiError(
                    403, "forbidden", f"Required permission for {call} on '{self.project}'"
                )
        if call.startswith("tpu."):
            return self.tpu_call(call, args, query, body)
        reply = getattr(self, "_" + call.replace(".", "_"))(query=query, body=body, **args)
        return reply

    # -- request and response checks

    def _parse(self, kind: Any, body: str) -> dict[str, Any]:
        try:
            kind.from_json(body, ignore_unknown_fields=False)
        except Exception as exc:
            self.errors.append(f"{kind.__name__} body rejected: {exc}")
            raise ApiError(400, "invalid", f"Invalid JSON payload: {exc}") from None
        parsed: dict[str, Any] = json.loads(body)
        return parsed

    def _check(self, kind: Any, reply: dict[str, Any]) -> dict[str, Any]:
        return conforming(kind, reply, self.errors)

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            self.errors.append(f"GCE would refuse: {message}")
            raise ApiError(400, "invalid", message)

    # -- operations

    def _operation(
        self,
        kind: str,
        target: dict[str, Any],
        zone: str | None,
        error: tuple[str, str] | None = None,
        delay: float | None = None,
    ) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{next(self._ids)}"
        scope = f"{BASE}/projects/{self.project}/" + (f"zones/{zone}" if zone else "global")
        op: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            "operationType": kind,
            "targetLink": target.get("selfLink", ""),
            "targetId": target.get("id", "0"),
            "status": "RUNNING",
            "user": "skyward-test@example.com",
            "progress": 0,
            "insertTime": _now(),
            "startTime": _now(),
            "selfLink": f"{scope}/operations/{name}",
        }
        if zone:
            op["zone"] = f"{BASE}/projects/{self.project}/zones/{zone}"
        if error:
            op["error"] = {"errors": [{"code": error[0], "message": error[1]}]}
            op["httpErrorStatusCode"] = 503
            op["httpErrorMessage"] = "SERVICE UNAVAILABLE"
        self.operations[name] = op
        self._timers[name] = time.monotonic() + (self.operation_delay if delay is None else delay)
        if delay == 0.0:
            op.update(status="DONE", progress=100, endTime=_now())
        return op

    def _idempotent(self, query: dict[str, str], make: Callable[[], dict[str, Any]]) -> Any:
        with self._lock:
            request = query.get("requestId")
            if request and request in self._requests:
                return self._check(compute_v1.Operation, dict(self._requests[request]))
            op = make()
            if request:
                self._requests[request] = op
            return self._check(compute_v1.Operation, dict(op))

    def _op(self, name: str) -> dict[str, Any]:
        op = self.operations.get(name)
        if op is None:
            raise ApiError(404, "notFound", f"The resource 'operations/{name}' was not found")
        return op

    def _wait(self, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self._lock:
                op = self._op(name)
                if op["status"] == "DONE":
                    return self._check(compute_v1.Operation, dict(op))
            time.sleep(0.01)
        with self._lock:
            return self._check(compute_v1.Operation, dict(self._op(name)))

    def _zoneOperations_get(self, zone: str, name: str, **_: Any) -> Any:
        with self._lock:
            return self._check(compute_v1.Operation, dict(self._op(name)))

    def _globalOperations_get(self, name: str, **_: Any) -> Any:
        return self._zoneOperations_get("", name)

    def _zoneOperations_wait(self, zone: str, name: str, **_: Any) -> Any:
        return self._wait(name)

    def _globalOperations_wait(self, name: str, **_: Any) -> Any:
        return self._wait(name)

    def _zoneOperations_list(self, zone: str, query: dict[str, str], **_: Any) -> Any:
        match = _filter(query.get("filter", ""), self.errors)
        with self._lock:
            items = [
                op
                for op in self.operations.values()
                if op.get("zone", "").endswith(f"/zones/{zone}") and match(op)
            ]
        return self._check(
            compute_v1.OperationList,
            {
                "kind": "compute#operationList",
                "id": f"projects/{self.project}/zones/{zone}/operations",
                "items": items,
            },
        )

    # -- instances

    def _instances_bulkInsert(self, zone: str, query: dict[str, str], body: str) -> Any:
        request = self._parse(compute_v1.BulkInsertInstanceResource, body)
        props = request.get("instanceProperties", {})
        count = int(request.get("count", 0))
        pattern = request.get("namePattern", "")
        self._require(count >= 1, "count must be at least 1")
        self._require(int(request.get("minCount", count)) == count, "minCount must equal count")
        self._require(bool(re.search(r"#+$", pattern)), f"bad namePattern {pattern!r}")
        labels = props.get("labels", {})
        self._require("skyward-pool" in labels, "a skyward VM without the skyward-pool label")
        self._require(
            all(re.fullmatch(r"[a-z0-9_-]{0,63}", v) for v in labels.values()), f"labels {labels}"
        )
        items = {i["key"]: i["value"] for i in props.get("metadata", {}).get("items", [])}
        self._require({"ssh-keys", "startup-script"} <= items.keys(), "metadata lacks keys/script")
        disks = props.get("disks", [])
        self._require(
            any(d.get("boot") and d.get("initializeParams", {}).get("sourceImage") for d in disks),
            "no boot disk with a sourceImage",
        )
        self._require("/" not in props.get("machineType", "/"), "machineType must be a name")

        def make() -> dict[str, Any]:
            digits = len(re.search(r"#+$", pattern).group())  # type: ignore[union-attr]
            stem = pattern[:-digits]
            taken = [
                int(i["name"][len(stem) :])
                for (z, _), i in self.instances.items()
                if z == zone and re.fullmatch(re.escape(stem) + r"\d+", i["name"])
            ]
            used = {i["networkInterfaces"][0]["networkIP"] for i in self.instances.values()}
            used |= self.tpu_addresses_in_use()
            free = [a for a in self.addresses if a not in used]
            target = {"selfLink": f"{BASE}/projects/{self.project}/zones/{zone}/instances"}
            model = str(props.get("scheduling", {}).get("provisioningModel", "STANDARD"))
            self.inserts.append((zone, model))
            refused = self.no_capacity.get(f"{zone} {model}") or self.no_capacity.get(zone)
            if refused:
                for n, address in zip(range(1, 1 + self.refusal_leaves), free, strict=False):
                    self._new_instance(zone, f"{stem}{n:0{digits}d}", props, address)
                error = self._refusal(refused, zone)
                return self._operation("bulkInsert", target, zone, error=error)
            if not self.capacity or len(free) < count:
                return self._operation(
                    "bulkInsert",
                    target,
                    zone,
                    error=(
                        "ZONE_RESOURCE_POOL_EXHAUSTED",
                        f"The zone 'projects/{self.project}/zones/{zone}' does not have enough "
                        "resources available to fulfill the request. Try a different zone, or "
                        "try again later.",
                    ),
                )
            start = max(taken, default=0) + 1
            for n, address in zip(range(start, start + count), free, strict=False):
                name = f"{stem}{n:0{digits}d}"
                self._require(bool(_NAME.match(name)), f"instance name {name!r}")
                self._new_instance(zone, name, props, address)
            return self._operation("bulkInsert", target, zone)

        return self._idempotent(query, make)

    def _refusal(self, code: str, zone: str) -> tuple[str, str]:
        """GCE's error for a request `zone` has no room for: `code` with its documented
        message."""
        where = f"projects/{self.project}/zones/{zone}"
        region = zone.rsplit("-", 1)[0]
        messages = {
            "ZONE_RESOURCE_POOL_EXHAUSTED": f"The zone '{where}' does not have enough resources "
            "available to fulfill the request. Try a different zone, or try again later.",
            "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": f"The zone '{where}' does not have "
            "enough resources available to fulfill the request. '(resource type:compute)'.",
            "QUOTA_EXCEEDED": f"Quota 'CPUS' exceeded.  Limit: 24.0 in region {region}.",
        }
        return code, messages.get(code, f"{code} in {where}")

    def _new_node(self, loc: str, node_id: str, node: dict[str, Any], hosts: int) -> str | None:
        """A slice asked for in zone `loc`: refused there for capacity as `no_capacity` says
        (``"ZONE SPOT"``: spot slices only, on the node or through a queued resource)."""
        self.slices.append(loc)
        spot = bool(node.get("schedulingConfig", {}).get("spot") or node.get("queuedResource"))
        if self.no_capacity.get(loc) or (spot and self.no_capacity.get(f"{loc} SPOT")):
            return (
                f'There is no more capacity in the zone "{loc}"; you can try in another zone '
                "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions)"
            )
        return super()._new_node(loc, node_id, node, hosts)

    def _new_instance(self, zone: str, name: str, props: dict[str, Any], address: str) -> None:
        link = f"{BASE}/projects/{self.project}/zones/{zone}/instances/{name}"
        nics = []
        for index, nic in enumerate(props.get("networkInterfaces", [])):
            out = {
                "kind": "compute#networkInterface",
                "name": f"nic{index}",
                "network": _full(nic.get("network", "global/networks/default"), self.project),
                "networkIP": address,
                "fingerprint": "abc=",
                "stackType": "IPV4_ONLY",
            }
            if nic.get("subnetwork"):
                out["subnetwork"] = _full(nic["subnetwork"], self.project)
            if nic.get("accessConfigs"):
                # The test machines have one address: the "external" one is the same.
                out["accessConfigs"] = [
                    {
                        "kind": "compute#accessConfig",
                        "type": "ONE_TO_ONE_NAT",
                        "name": "External NAT",
                        "natIP": address,
                        "networkTier": "PREMIUM",
                    }
                ]
            nics.append(out)
        instance = {
            "kind": "compute#instance",
            "id": str(next(self._ids)),
            "creationTimestamp": _now(),
            "name": name,
            "zone": f"{BASE}/projects/{self.project}/zones/{zone}",
            "machineType": f"{BASE}/projects/{self.project}/zones/{zone}/machineTypes/"
            + props["machineType"],
            "status": "PROVISIONING",
            "labels": dict(props.get("labels", {})),
            "tags": {**props.get("tags", {}), "fingerprint": "tags="},
            "metadata": {
                "kind": "compute#metadata",
                "fingerprint": "meta=",
                "items": props.get("metadata", {}).get("items", []),
            },
            "networkInterfaces": nics,
            "disks": [
                {
                    "kind": "compute#attachedDisk",
                    "type": "PERSISTENT",
                    "mode": "READ_WRITE",
                    "source": f"{BASE}/projects/{self.project}/zones/{zone}/disks/{name}",
                    "deviceName": "persistent-disk-0",
                    "index": 0,
                    "boot": True,
                    "autoDelete": True,
                    "diskSizeGb": str(d.get("initializeParams", {}).get("diskSizeGb", "10")),
                }
                for d in props.get("disks", [])
                if d.get("boot")
            ],
            "scheduling": props.get("scheduling", {}),
            "serviceAccounts": props.get("serviceAccounts", []),
            "selfLink": link,
            "cpuPlatform": "Unknown CPU Platform",
            "fingerprint": "inst=",
        }
        self.instances[(zone, name)] = instance
        self._timers[name] = time.monotonic() + self.boot_delay / 2

    def _instance(self, zone: str, name: str) -> dict[str, Any]:
        instance = self.instances.get((zone, name))
        if instance is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                "was not found",
            )
        return instance

    def put_guest_attribute(self, machine: str, path: str, value: str) -> None:
        """Machine `machine` PUT `value` to guest attribute `path` (``NAMESPACE/KEY``)."""
        with self._lock:
            self.guest_attributes.setdefault(machine, {})[path] = value

    def guest_items(self, machine: str, query_path: str) -> list[dict[str, str]]:
        """`machine`'s guest attributes under `query_path`, as the API lists them."""
        with self._lock:
            found = dict(self.guest_attributes.get(machine, {}))
        return [
            {"namespace": path.split("/", 1)[0], "key": path.split("/", 1)[1], "value": value}
            for path, value in sorted(found.items())
            if path.startswith(query_path)
        ]

    def _instances_getGuestAttributes(
        self, zone: str, name: str, query: dict[str, str], **_: Any
    ) -> Any:
        path = query.get("queryPath", "")
        with self._lock:
            self._instance(zone, name)
            items = self.guest_items(name, path)
        if not items:  # as GCE answers while the VM has written nothing there
            raise ApiError(404, "notFound", f"The guest attribute path {path!r} was not found")
        reply = {"queryPath": path, "queryValue": {"items": items}}
        return self._check(compute_v1.GuestAttributes, reply)

    def _instances_get(self, zone: str, name: str, **_: Any) -> Any:
        with self._lock:
            return self._check(compute_v1.Instance, dict(self._instance(zone, name)))

    def _instances_delete(self, zone: str, name: str, query: dict[str, str], **_: Any) -> Any:
        def make() -> dict[str, Any]:
            instance = self._instance(zone, name)
            if instance["status"] != "STOPPING":
                instance["status"] = "STOPPING"
                self._timers[name] = time.monotonic() + self.delete_delay
            return self._operation("delete", instance, zone)

        return self._idempotent(query, make)

    def _instances_list(self, zone: str, query: dict[str, str], **_: Any) -> Any:
        match = _filter(query.get("filter", ""), self.errors)
        with self._lock:
            items = [
                dict(i) for (z, _), i in sorted(self.instances.items()) if z == zone and match(i)
            ]
        return self._check(
            compute_v1.InstanceList,
            {
                "kind": "compute#instanceList",
                "id": f"projects/{self.project}/zones/{zone}/instances",
                "items": items,
                "selfLink": f"{BASE}/projects/{self.project}/zones/{zone}/instances",
            },
        )

    def _instances_aggregatedList(self, query: dict[str, str], **_: Any) -> Any:
        match = _filter(query.get("filter", ""), self.errors)
        scoped: dict[str, Any] = {}
        with self._lock:
            for (zone, _), instance in sorted(self.instances.items()):
                if match(instance):
                    scoped.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(
                        dict(instance)
                    )
        return self._check(
            compute_v1.InstanceAggregatedList,
            {
                "kind": "compute#instanceAggregatedList",
                "id": f"projects/{self.project}/aggregated/instances",
                "items": scoped,
                "selfLink": f"{BASE}/projects/{self.project}/aggregated/instances",
            },
        )

    # -- machine types

    def _machineTypes_get(self, zone: str, name: str, **_: Any) -> Any:
        shape = self.machine_types.get(name)
        if shape is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/zones/{zone}/machineTypes/{name}' "
                "was not found",
            )
        reply: dict[str, Any] = {
            "kind": "compute#machineType",
            "id": str(next(self._ids)),
            "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
            "name": name,
            "description": f"{shape['cpus']} vCPUs, {shape['memory_mb'] / 1024:g} GB RAM",
            "guestCpus": shape["cpus"],
            "memoryMb": shape["memory_mb"],
            "maximumPersistentDisks": 128,
            "maximumPersistentDisksSizeGb": "263168",
            "zone": zone,
            "selfLink": f"{BASE}/projects/{self.project}/zones/{zone}/machineTypes/{name}",
            "isSharedCpu": False,
            "architecture": "X86_64",
        }
        if shape["gpus"] is not None:
            kind, count = shape["gpus"]
            reply["accelerators"] = [{"guestAcceleratorType": kind, "guestAcceleratorCount": count}]
        return self._check(compute_v1.MachineType, reply)

    # -- regions

    def _regions_get(self, name: str, **_: Any) -> Any:
        if not _REGION.match(name):
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/regions/{name}' was not found",
            )
        with self._lock:
            quotas = {**DEFAULT_QUOTAS, **self.quotas.get(name, {})}
        reply = {
            "kind": "compute#region",
            "id": str(next(self._ids)),
            "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
            "name": name,
            "description": name,
            "status": "UP",
            "zones": [f"{BASE}/projects/{self.project}/zones/{name}-{z}" for z in "abcf"],
            "quotas": [
                {"metric": metric, "limit": limit, "usage": usage}
                for metric, (limit, usage) in sorted(quotas.items())
            ],
            "selfLink": f"{BASE}/projects/{self.project}/regions/{name}",
            "supportsPzs": False,
        }
        return self._check(compute_v1.Region, reply)

    # -- firewalls

    def _firewalls_insert(self, query: dict[str, str], body: str, **_: Any) -> Any:
        rule = self._parse(compute_v1.Firewall, body)
        name = rule.get("name", "")
        self._require(bool(_NAME.match(name)), f"firewall name {name!r}")
        self._require(bool(rule.get("network")), "a firewall rule needs a network")
        self._require(bool(rule.get("allowed")), "a firewall rule needs allowed")
        self._require(
            bool(rule.get("sourceRanges") or rule.get("sourceTags")), "no source for the rule"
        )

        def make() -> dict[str, Any]:
            if name in self.firewalls:
                raise ApiError(409, "alreadyExists", f"The resource '{name}' already exists")
            stored = {
                "kind": "compute#firewall",
                "id": str(next(self._ids)),
                "creationTimestamp": _now(),
                "priority": 1000,
                "direction": "INGRESS",
                "disabled": False,
                "logConfig": {"enable": False},
                **rule,
                "network": _full(rule["network"], self.project),
                "selfLink": f"{BASE}/projects/{self.project}/global/firewalls/{name}",
            }
            self.firewalls[name] = stored
            return self._operation("insert", stored, None)

        return self._idempotent(query, make)

    def _firewalls_list(self, query: dict[str, str], **_: Any) -> Any:
        match = _filter(query.get("filter", ""), self.errors)
        with self._lock:
            items = [dict(f) for f in self.firewalls.values() if match(f)]
        return self._check(
            compute_v1.FirewallList,
            {
                "kind": "compute#firewallList",
                "id": f"projects/{self.project}/global/firewalls",
                "items": items,
                "selfLink": f"{BASE}/projects/{self.project}/global/firewalls",
            },
        )

    def _firewalls_delete(self, name: str, query: dict[str, str], **_: Any) -> Any:
        def make() -> dict[str, Any]:
            rule = self.firewalls.pop(name, None)
            if rule is None:
                raise ApiError(404, "notFound", f"The resource '{name}' was not found")
            return self._operation("delete", rule, None)

        return self._idempotent(query, make)


def _full(path: str, project: str) -> str:
    if path.startswith("https://"):
        return path
    if not path.startswith("projects/"):
        path = f"projects/{project}/{path}"
    return f"{BASE}/{path}"


_TERM = re.compile(r'^\s*(?P<field>[\w.-]+)\s*(?P<op>=|!=|:)\s*(?P<value>"[^"]*"|\*|\S+)\s*$')


def _filter(text: str, errors: list[str]) -> Callable[[dict[str, Any]], bool]:
    """Compute's list filter, the forms the provider uses: ``field = "v"``, ``field != "v"``,
    ``field:*``, and several parenthesized terms (all must hold)."""
    text = text.strip()
    if not text:
        return lambda item: True
    terms = re.findall(r"\(([^()]*)\)", text) if text.startswith("(") else [text]
    checks = []
    for term in terms:
        match = _TERM.match(term)
        if not match:
            errors.append(f"unsupported filter {text!r}")
            raise ApiError(400, "invalid", f"Invalid value for field 'filter': '{text}'")
        checks.append((match["field"].split("."), match["op"], match["value"].strip('"')))

    def get(item: Any, path: list[str]) -> Any:
        for key in path:
            item = item.get(key) if isinstance(item, dict) else None
        return item

    def ok(item: dict[str, Any]) -> bool:
        for path, op, value in checks:
            found = get(item, path)
            if op == ":" and value == "*":
                good = found is not None
            elif op == "!=":
                good = found != value
            else:
                good = found == value
            if not good:
                return False
        return True

    return ok
