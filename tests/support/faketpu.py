"""The Cloud TPU v2 API part of `tests.support.fakegcp.FakeGCP` (a mixin), for the real
`google.cloud.tpu_v2` client with REST transport.

It answers ``v2/projects/P/locations/Z/``: ``nodes`` create/get/list/delete, ``operations/*``
get, ``queuedResources`` create/get/list/delete, with bodies shaped as the v2 REST reference
documents them (https://cloud.google.com/tpu/docs/reference/rest/v2). Every request body is
parsed with the library's own type (``tpu_v2.Node`` / ``QueuedResource``
``.from_json(body, ignore_unknown_fields=False)``), and so is every response the fake writes
(operations with ``google.longrunning``'s). It also refuses what the API would: a node without
the pool label or the pool's metadata, an unknown accelerator type, no runtime version, a
duplicate id (409), a queued resource whose node spec is not one node, spot on the node itself
for v5e/v5p/v6e (their spot is queued resources only), deleting a queued resource that still
holds a node without ``force``.

A slice of H hosts takes H free addresses (fewer free, or ``capacity = False``: the create
operation fails with RESOURCE_EXHAUSTED, a queued resource goes FAILED; nothing is made), is
CREATING then READY after ``boot_delay``, calling ``on_running`` once per host with an
instance-shaped dict (``name``, ``networkInterfaces[0].networkIP``, ``metadata.items``), so the
VMs' boot simulator serves TPU hosts unchanged; a deleted slice is DELETING for
``delete_delay``, then gone (``on_gone`` per host).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import json_format

_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_TYPE = re.compile(r"^(?P<gen>v2|v3|v4|v5p|v5litepod|v6e)-(?P<size>\d+)$")
_QUEUED_SPOT_ONLY = ("v5p", "v5litepod", "v6e")


def hosts_of(accelerator_type: str) -> int | None:
    """Hosts in a slice, as Google's docs give them (None: not an accelerator type we know)."""
    match = _TYPE.match(accelerator_type)
    if not match:
        return None
    size = int(match["size"])
    if match["gen"] in ("v5litepod", "v6e"):  # chips: 8 on one host, else 4 a host
        return 1 if size <= 8 else size // 4
    return max(1, size // 8)  # TensorCores: 8 a host


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TpuApi:
    """Mixin: FakeGCP supplies project, addresses, delays, capacity, errors, hooks, _lock."""

    project: str
    addresses: list[str]
    boot_delay: float
    delete_delay: float
    capacity: bool
    errors: list[str]
    instances: dict[tuple[str, str], dict[str, Any]]
    _lock: Any
    _ids: Any

    def _tpu_init(self) -> None:
        self.tpu_nodes: dict[str, dict[str, Any]] = {}  # full name -> Node JSON
        self.queued: dict[str, dict[str, Any]] = {}  # full name -> QueuedResource JSON
        self.tpu_operations: dict[str, dict[str, Any]] = {}
        self._tpu_timers: dict[str, float] = {}  # full name -> when its next step is
        self._op_of: dict[str, str] = {}  # node name -> its create operation

    # -- what tests look at

    def tpu_labelled(self) -> list[str]:
        with self._lock:
            found = [
                f"tpu {n['name'].rsplit('/', 1)[-1]} {n['state']}"
                for n in self.tpu_nodes.values()
                if "skyward-pool" in n.get("labels", {})
            ]
            found += [
                f"queued {q['name'].rsplit('/', 1)[-1]}"
                for q in self.queued.values()
                if q["name"].rsplit("/", 1)[-1].startswith("skyward-")
            ]
            return found

    def preempt_tpu(self, node_id: str) -> None:
        """GCP reclaims a spot slice: PREEMPTED, every host's machine gone (`on_gone`)."""
        with self._lock:
            node = next(n for k, n in self.tpu_nodes.items() if k.endswith(f"/nodes/{node_id}"))
            node["state"] = "PREEMPTED"
        for host in _hosts(node):
            self._hook(self.on_gone, host)

    _hook: Callable[[Any, dict[str, Any]], None]
    on_gone: Any
    guest_items: Callable[[str, str], list[dict[str, str]]]

    def tpu_addresses_in_use(self) -> set[str]:
        return {e["ipAddress"] for n in self.tpu_nodes.values() for e in n["networkEndpoints"]}

    # -- routes

    _TPU_ROUTES: tuple[tuple[str, str, str], ...] = (
        ("POST", r"(?P<loc>[^/]+)/nodes", "tpu.nodes.create"),
        ("GET", r"(?P<loc>[^/]+)/nodes", "tpu.nodes.list"),
        ("GET", r"(?P<loc>[^/]+)/nodes/(?P<id>[^/:]+)", "tpu.nodes.get"),
        (
            "POST",
            r"(?P<loc>[^/]+)/nodes/(?P<id>[^/:]+):getGuestAttributes",
            "tpu.nodes.getGuestAttributes",
        ),
        ("DELETE", r"(?P<loc>[^/]+)/nodes/(?P<id>[^/:]+)", "tpu.nodes.delete"),
        ("GET", r"(?P<loc>[^/]+)/operations/(?P<id>[^/:]+)", "tpu.operations.get"),
        ("POST", r"(?P<loc>[^/]+)/queuedResources", "tpu.queuedResources.create"),
        ("GET", r"(?P<loc>[^/]+)/queuedResources", "tpu.queuedResources.list"),
        ("GET", r"(?P<loc>[^/]+)/queuedResources/(?P<id>[^/:]+)", "tpu.queuedResources.get"),
        (
            "DELETE",
            r"(?P<loc>[^/]+)/queuedResources/(?P<id>[^/:]+)",
            "tpu.queuedResources.delete",
        ),
    )

    def tpu_route(self, method: str, rest: str) -> tuple[str, dict[str, str]] | None:
        for verb, pattern, name in self._TPU_ROUTES:
            match = re.fullmatch(pattern, rest)
            if verb == method and match:
                return name, match.groupdict()
        return None

    def tpu_call(self, call: str, args: dict[str, str], query: dict[str, str], body: str) -> Any:
        handler: Callable[..., Any] = getattr(self, "_" + call.replace(".", "_"))
        return handler(query=query, body=body, **args)

    # -- checks (FakeGCP supplies _require, the API's 400, and _tpu_error)

    _require: Callable[[bool, str], None]
    _tpu_error: Callable[[int, str, str], Exception]

    def _tpu_parse(self, kind: Any, body: str) -> dict[str, Any]:
        try:
            kind.from_json(body, ignore_unknown_fields=False)
        except Exception as exc:
            self.errors.append(f"{kind.__name__} body rejected: {exc}")
            raise self._tpu_error(400, "INVALID_ARGUMENT", f"Invalid JSON payload: {exc}") from None
        parsed: dict[str, Any] = json.loads(body)
        return parsed

    def _tpu_check(self, kind: Any, reply: dict[str, Any]) -> dict[str, Any]:
        try:
            if kind is operations_pb2.Operation:
                json_format.Parse(json.dumps(reply), operations_pb2.Operation())
            else:
                kind.from_json(json.dumps(reply), ignore_unknown_fields=False)
        except Exception as exc:
            self.errors.append(f"the fake wrote a bad {kind.__name__}: {exc}")
        return reply

    def _check_node(self, node: dict[str, Any], queued: bool) -> int:
        """What the API refuses in a node; its host count."""
        kind = node.get("acceleratorType", "")
        hosts = hosts_of(kind)
        self._require(hosts is not None, f"unknown acceleratorType {kind!r}")
        self._require(bool(node.get("runtimeVersion")), "a node needs a runtimeVersion")
        labels = node.get("labels", {})
        self._require("skyward-pool" in labels, "a skyward TPU without the skyward-pool label")
        self._require(
            all(re.fullmatch(r"[a-z0-9_-]{0,63}", v) for v in labels.values()), f"labels {labels}"
        )
        self._require(
            {"ssh-keys", "startup-script"} <= node.get("metadata", {}).keys(),
            "metadata lacks ssh-keys/startup-script",
        )
        spot = node.get("schedulingConfig", {})
        generation = kind.split("-", 1)[0]
        self._require(
            not ((spot.get("spot") or spot.get("preemptible")) and generation in _QUEUED_SPOT_ONLY),
            f"spot {kind} is only offered through queued resources",
        )
        self._require(not queued or not spot, "a queued resource's node takes no schedulingConfig")
        assert hosts is not None
        return hosts

    # -- operations

    def _tpu_op(
        self, loc: str, target: str, error: tuple[int, str] | None = None
    ) -> dict[str, Any]:
        name = f"projects/{self.project}/locations/{loc}/operations/operation-{next(self._ids)}"
        op: dict[str, Any] = {"name": name, "done": error is not None}
        if error:
            op["error"] = {"code": error[0], "message": error[1]}
        self.tpu_operations[name] = op
        self._op_of[target] = name
        return op

    def _tpu_operations_get(self, loc: str, id: str, **_: Any) -> Any:
        with self._lock:
            name = f"projects/{self.project}/locations/{loc}/operations/{id}"
            op = self.tpu_operations.get(name)
            if op is None:
                raise self._tpu_error(404, "NOT_FOUND", f"operation {name} not found")
            return self._tpu_check(operations_pb2.Operation, dict(op))

    # -- nodes

    def _new_node(self, loc: str, node_id: str, node: dict[str, Any], hosts: int) -> str | None:
        """Make a slice (CREATING); None, or why there is no capacity."""
        used = {i["networkInterfaces"][0]["networkIP"] for i in self.instances.values()}
        free = [a for a in self.addresses if a not in used | self.tpu_addresses_in_use()]
        if not self.capacity or len(free) < hosts:
            return (
                f'There is no more capacity in the zone "{loc}"; you can try in another zone '
                "where Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions)"
            )
        name = f"projects/{self.project}/locations/{loc}/nodes/{node_id}"
        external = bool(node.get("networkConfig", {}).get("enableExternalIps"))
        stored = {
            **node,
            "name": name,
            "state": "CREATING",
            "health": "HEALTHY",
            "apiVersion": "V2",
            "id": str(next(self._ids)),
            "createTime": _now(),
            "networkEndpoints": [
                {
                    "ipAddress": a,
                    "port": 8470,
                    **({"accessConfig": {"externalIp": a}} if external else {}),
                }
                for a in free[:hosts]
            ],
        }
        self.tpu_nodes[name] = stored
        self._tpu_timers[name] = time.monotonic() + self.boot_delay
        return None

    def _tpu_nodes_create(self, loc: str, query: dict[str, str], body: str, **_: Any) -> Any:
        node = self._tpu_parse(tpu_v2.Node, body)
        node_id = query.get("nodeId", "")
        self._require(bool(_ID.match(node_id)), f"nodeId {node_id!r}")
        hosts = self._check_node(node, queued=False)
        with self._lock:
            name = f"projects/{self.project}/locations/{loc}/nodes/{node_id}"
            if name in self.tpu_nodes:
                raise self._tpu_error(409, "ALREADY_EXISTS", f"node {name} already exists")
            no_capacity = self._new_node(loc, node_id, node, hosts)
            op = self._tpu_op(loc, name, (8, no_capacity) if no_capacity else None)
            return self._tpu_check(operations_pb2.Operation, dict(op))

    def _node(self, loc: str, id: str) -> dict[str, Any]:
        name = f"projects/{self.project}/locations/{loc}/nodes/{id}"
        node = self.tpu_nodes.get(name)
        if node is None:
            raise self._tpu_error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        return node

    def _tpu_nodes_get(self, loc: str, id: str, **_: Any) -> Any:
        with self._lock:
            return self._tpu_check(tpu_v2.Node, dict(self._node(loc, id)))

    def _tpu_nodes_getGuestAttributes(self, loc: str, id: str, body: str, **_: Any) -> Any:
        """Each asked worker's guest attributes: what host ``ID-wN`` PUT (`guest_items`)."""
        asked = json.loads(body or "{}")
        path = asked.get("queryPath", "")
        with self._lock:
            hosts = len(self._node(loc, id)["networkEndpoints"])
        workers = asked.get("workerIds") or [str(i) for i in range(hosts)]
        found = [
            {"queryPath": path, "queryValue": {"items": self.guest_items(f"{id}-w{w}", path)}}
            for w in workers
        ]
        return self._tpu_check(tpu_v2.GetGuestAttributesResponse, {"guestAttributes": found})

    def _in(self, loc: str, name: str, kind: str) -> bool:
        """Whether `name` is a `kind` in location `loc` ("-": in any, as AIP-159 reads across
        collections)."""
        zone = "[^/]+" if loc == "-" else re.escape(loc)
        return (
            re.fullmatch(f"projects/{self.project}/locations/{zone}/{kind}/[^/]+", name) is not None
        )

    def _tpu_nodes_list(self, loc: str, **_: Any) -> Any:
        with self._lock:
            nodes = [
                dict(n) for k, n in sorted(self.tpu_nodes.items()) if self._in(loc, k, "nodes")
            ]
        return self._tpu_check(tpu_v2.ListNodesResponse, {"nodes": nodes})

    def _tpu_nodes_delete(self, loc: str, id: str, **_: Any) -> Any:
        with self._lock:
            node = self._node(loc, id)
            self._start_delete(node)
            return self._tpu_check(operations_pb2.Operation, dict(self._tpu_op(loc, "")))

    def _start_delete(self, node: dict[str, Any]) -> None:
        if node["state"] != "DELETING":
            node["state"] = "DELETING"
            self._tpu_timers[node["name"]] = time.monotonic() + self.delete_delay

    # -- queued resources

    def _tpu_queuedResources_create(
        self, loc: str, query: dict[str, str], body: str, **_: Any
    ) -> Any:
        queued = self._tpu_parse(tpu_v2.QueuedResource, body)
        qid = query.get("queuedResourceId", "")
        self._require(bool(_ID.match(qid)), f"queuedResourceId {qid!r}")
        specs = queued.get("tpu", {}).get("nodeSpec", [])
        self._require(len(specs) == 1, "one node spec per queued resource")
        spec = specs[0]
        self._require(
            spec.get("parent") == f"projects/{self.project}/locations/{loc}", "nodeSpec.parent"
        )
        self._require(bool(_ID.match(spec.get("nodeId", ""))), "nodeSpec.nodeId")
        self._check_node(spec.get("node", {}), queued=True)
        with self._lock:
            name = f"projects/{self.project}/locations/{loc}/queuedResources/{qid}"
            if name in self.queued:
                raise self._tpu_error(409, "ALREADY_EXISTS", f"{name} already exists")
            self.queued[name] = {
                **queued,
                "name": name,
                "createTime": _now(),
                "state": {"state": "ACCEPTED"},
            }
            self._tpu_timers[name] = time.monotonic() + self.boot_delay / 4
            return self._tpu_check(operations_pb2.Operation, dict(self._tpu_op(loc, name)))

    def _queued(self, loc: str, id: str) -> dict[str, Any]:
        name = f"projects/{self.project}/locations/{loc}/queuedResources/{id}"
        queued = self.queued.get(name)
        if queued is None:
            raise self._tpu_error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        return queued

    def _tpu_queuedResources_get(self, loc: str, id: str, **_: Any) -> Any:
        with self._lock:
            return self._tpu_check(tpu_v2.QueuedResource, dict(self._queued(loc, id)))

    def _tpu_queuedResources_list(self, loc: str, **_: Any) -> Any:
        with self._lock:
            items = [
                dict(q)
                for k, q in sorted(self.queued.items())
                if self._in(loc, k, "queuedResources")
            ]
        return self._tpu_check(tpu_v2.ListQueuedResourcesResponse, {"queuedResources": items})

    def _tpu_queuedResources_delete(
        self, loc: str, id: str, query: dict[str, str], **_: Any
    ) -> Any:
        with self._lock:
            queued = self._queued(loc, id)
            spec = queued["tpu"]["nodeSpec"][0]
            node = self.tpu_nodes.get(f"{spec['parent']}/nodes/{spec['nodeId']}")
            if node is not None:
                if query.get("force") != "true":
                    raise self._tpu_error(
                        400, "FAILED_PRECONDITION", "the queued resource still has a node"
                    )
                self._start_delete(node)
            queued["state"] = {"state": "DELETING"}
            self._tpu_timers[queued["name"]] = time.monotonic() + self.delete_delay
            return self._tpu_check(operations_pb2.Operation, dict(self._tpu_op(loc, "")))

    # -- the clock

    def tpu_tick(self, now: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Advance slices and queued resources; (hosts booted, hosts gone) for the hooks."""
        booted: list[dict[str, Any]] = []
        gone: list[dict[str, Any]] = []
        for name, node in list(self.tpu_nodes.items()):
            if self._tpu_timers.get(name, now + 1) > now:
                continue
            self._tpu_timers.pop(name)
            if node["state"] == "CREATING":
                node["state"] = "READY"
                op = self.tpu_operations.get(self._op_of.get(name, ""))
                if op is not None:
                    op["done"] = True
                booted += _hosts(node)
            elif node["state"] == "DELETING":
                del self.tpu_nodes[name]
                gone += _hosts(node)
        for name, queued in list(self.queued.items()):
            state = queued["state"]["state"]
            spec = queued["tpu"]["nodeSpec"][0]
            node_name = f"{spec['parent']}/nodes/{spec['nodeId']}"
            if (
                state == "PROVISIONING"
                and self.tpu_nodes.get(node_name, {}).get("state") == "READY"
            ):
                queued["state"] = {"state": "ACTIVE"}
            if self._tpu_timers.get(name, now + 1) > now:
                continue
            self._tpu_timers.pop(name)
            if state == "ACCEPTED":
                loc = spec["parent"].rsplit("/", 1)[-1]
                node = {**spec["node"], "queuedResource": name}
                hosts = hosts_of(node["acceleratorType"]) or 1
                no_capacity = self._new_node(loc, spec["nodeId"], node, hosts)
                if no_capacity:
                    queued["state"] = {
                        "state": "FAILED",
                        "failedData": {"error": {"code": 8, "message": no_capacity}},
                    }
                else:
                    queued["state"] = {"state": "PROVISIONING"}
            elif state == "DELETING" and node_name not in self.tpu_nodes:
                del self.queued[name]
            elif state == "DELETING":
                self._tpu_timers[name] = now + 0.05
        return booted, gone


def _hosts(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Each host of a slice as the boot simulator sees a VM."""
    short = node["name"].rsplit("/", 1)[-1]
    items = [{"key": k, "value": v} for k, v in node.get("metadata", {}).items()]
    return [
        {
            "name": f"{short}-w{i}",
            "networkInterfaces": [{"networkIP": e["ipAddress"]}],
            "metadata": {"items": items},
        }
        for i, e in enumerate(node["networkEndpoints"])
    ]
