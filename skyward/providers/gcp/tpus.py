"""A pool's TPU slice as plain functions: create, wait until every host is ready, list, delete.

A slice is ONE TPU node (``projects.locations.nodes``) whose hosts are the pool's nodes, in the
order of its ``networkEndpoints`` (the API's worker order). Spot on v5e, v5p and v6e goes
through a queued resource (``queuedResources`` with ``spot: {}``) holding that node; older
generations take ``schedulingConfig.spot`` on the node itself. The node carries the pool's
labels, network tag (the pool's firewall rules apply) and metadata (``ssh-keys`` and the
shared ``startup-script``, which TPU VMs run at boot as GCE VMs do). Queued resources have no
labels in the v2 API: theirs is the name, as for firewall rules.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from skyward.errors import ProvisionError
from skyward.providers.base import NodeLoss
from skyward.providers.gcp import api, resources
from skyward.providers.gcp.resources import network_url, subnetwork_url
from skyward.providers.gcp.settings import Access, Clients, MachineSettings
from skyward.providers.gcp.tpu_types import TpuType

CheckCancel = Callable[[], None]
logger = logging.getLogger("skyward.gcp")

TPU = "tpu"  # the kinds of `teardown.Made` this module records
QUEUED = "queued"
_CAPACITY_CODES = (8,)  # google.rpc.Code.RESOURCE_EXHAUSTED: no capacity or quota
_LOST = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING", "HIDDEN")


ALL_LOCATIONS = "-"
"""The location that lists every zone's TPU nodes and queued resources in one call (reading
across collections, AIP-159), for ``skyward ls`` and ``skyward down``; each one listed carries
its own zone in its name, which is what its deletion uses."""


def parent(project: str, zone: str) -> str:
    return f"projects/{project}/locations/{zone}"


def node_name(pool_id: str) -> str:
    """The pool's TPU node, and its queued resource when it has one."""
    return f"{resources.base_name(pool_id)}-tpu"


def pool_of_queued(name: str) -> str | None:
    """The pool slug a skyward queued resource belongs to (by name), or None."""
    short = name.rsplit("/", 1)[-1]
    if short.startswith("skyward-") and short.endswith("-tpu"):
        return short[len("skyward-") : -len("-tpu")] or None
    return None


def uses_queue(tpu: TpuType, spot: bool) -> bool:
    """Spot on v5e/v5p/v6e is only offered through queued resources."""
    return spot and tpu.generation.queued_spot


def node_body(
    access: Access,
    settings: MachineSettings,
    pool_id: str,
    tpu: TpuType,
    metadata: dict[str, str],
    runtime_version: str | None,
) -> tpu_v2.Node:
    """The TPU node of pool `pool_id` (its spot setting is added by `create`)."""
    network = tpu_v2.NetworkConfig(
        network=network_url(access, settings.network),
        enable_external_ips=not settings.use_private_ips,
    )
    subnetwork = subnetwork_url(access, settings.subnetwork)
    if subnetwork:
        network.subnetwork = subnetwork
    node = tpu_v2.Node(
        accelerator_type=tpu.accelerator_type,
        runtime_version=runtime_version or tpu.generation.runtime_version,
        network_config=network,
        labels=resources.pool_labels(pool_id),
        metadata=metadata,
        tags=[resources.network_tag(pool_id)],
        description=f"skyward pool {pool_id}",
    )
    if settings.service_account:
        node.service_account = tpu_v2.ServiceAccount(
            email=settings.service_account,
            scope=["https://www.googleapis.com/auth/cloud-platform"],
        )
    return node


def create(
    clients: Clients,
    access: Access,
    pool_id: str,
    node: tpu_v2.Node,
    tpu: TpuType,
    spot: bool,
    record: Callable[[str, str], None],
) -> str | None:
    """Ask for the slice; `record(kind, name)` is called first. Returns the create operation's
    name (None for a queued resource, whose own state says how it goes)."""
    name = node_name(pool_id)
    where = parent(access.project, access.zone)
    logger.info("creating TPU %s (%d hosts) in %s", tpu.accelerator_type, tpu.hosts, access.zone)
    if uses_queue(tpu, spot):
        record(QUEUED, name)
        record(TPU, name)
        clients.tpu.create_queued_resource(
            request=tpu_v2.CreateQueuedResourceRequest(
                parent=where,
                queued_resource_id=name,
                queued_resource=tpu_v2.QueuedResource(
                    tpu=tpu_v2.QueuedResource.Tpu(
                        node_spec=[
                            tpu_v2.QueuedResource.Tpu.NodeSpec(
                                parent=where, node_id=name, node=node
                            )
                        ]
                    ),
                    spot=tpu_v2.QueuedResource.Spot(),
                ),
                request_id=api.request_id(),
            ),
            retry=api.retry(),
            timeout=api.CALL_TIMEOUT,
        )
        return None
    if spot:
        node.scheduling_config = tpu_v2.SchedulingConfig(spot=True)
    record(TPU, name)
    operation = clients.tpu.create_node(
        request=tpu_v2.CreateNodeRequest(parent=where, node_id=name, node=node),
        retry=api.retry(),
        timeout=api.CALL_TIMEOUT,
    )
    return str(operation.operation.name)


def wait_ready(
    clients: Clients,
    access: Access,
    pool_id: str,
    tpu: TpuType,
    operation: str | None,
    *,
    deadline: float,
    poll: float,
    check_cancel: CheckCancel,
) -> tpu_v2.Node:
    """Wait until the slice is READY with an address for each of its hosts; fail at once when
    its creation fails (no capacity, a failed queued resource) or it is lost."""
    name = f"{parent(access.project, access.zone)}/nodes/{node_name(pool_id)}"
    what = f"TPU {tpu.accelerator_type} ({tpu.hosts} hosts) in {access.zone}"
    while True:
        if operation is not None:
            op = clients.tpu.get_operation(
                request={"name": operation}, retry=api.retry(), timeout=api.CALL_TIMEOUT
            )
            if op.done and op.error.code:
                raise _failed(what, op.error.code, op.error.message)
            if op.done:
                operation = None
        else:
            with contextlib.suppress(gexc.NotFound):  # a queued resource makes it later
                queued = clients.tpu.get_queued_resource(
                    name=f"{parent(access.project, access.zone)}/queuedResources/"
                    f"{node_name(pool_id)}",
                    retry=api.retry(),
                    timeout=api.CALL_TIMEOUT,
                )
                state = queued.state.state.name
                if state in ("FAILED", "SUSPENDED"):
                    error = queued.state.failed_data.error
                    raise _failed(what, error.code or 8, error.message or state)
        node: tpu_v2.Node | None
        try:
            node = clients.tpu.get_node(name=name, retry=api.retry(), timeout=api.CALL_TIMEOUT)
        except gexc.NotFound:
            node = None
        if node is not None:
            state = node.state.name
            if state in _LOST:
                raise ProvisionError(f"{what} is {state} before it was ready; it was deleted")
            if state == "READY" and len(endpoints(node)) == tpu.hosts:
                return node
        if time.monotonic() > deadline:
            raise ProvisionError(f"{what} was not ready before the boot_timeout; it was deleted")
        check_cancel()
        time.sleep(poll)


def endpoints(node: Any) -> list[Any]:
    """The slice's hosts in worker order (the API lists them so)."""
    return [e for e in node.network_endpoints if e.ip_address]


def address(endpoint: Any, private: bool) -> str:
    return str(endpoint.ip_address if private else endpoint.access_config.external_ip)


def list_nodes(clients: Any, project: str, zone: str, pool_id: str | None) -> list[Any]:
    """The TPU nodes labelled by `pool_id` (or by any pool) in `zone`. The v2 list takes no
    filter: the labels are checked here."""
    wanted = None if pool_id is None else resources.slug(pool_id)
    listed = clients.tpu.list_nodes(
        parent=parent(project, zone), retry=api.retry(), timeout=api.CALL_TIMEOUT
    )
    return [
        node
        for node in listed
        if (owner := node.labels.get(resources.POOL_LABEL)) and wanted in (None, owner)
    ]


def list_queued(clients: Any, project: str, zone: str, pool_id: str | None) -> list[Any]:
    """skyward's queued resources (by name) of `pool_id`, or of every pool, in `zone`."""
    wanted = None if pool_id is None else resources.slug(pool_id)
    listed = clients.tpu.list_queued_resources(
        parent=parent(project, zone), retry=api.retry(), timeout=api.CALL_TIMEOUT
    )
    return [
        q
        for q in listed
        if (owner := pool_of_queued(str(q.name))) is not None and wanted in (None, owner)
    ]


def delete_node(clients: Any, name: str) -> None:
    """Ask for a node's deletion (not waited for); "not found" is done."""
    api.ask_delete(clients.tpu.delete_node, tpu_v2.DeleteNodeRequest(name=name))


def delete_queued(clients: Any, name: str) -> None:
    """Delete a queued resource and (``force``) the node it made; "not found" is done."""
    request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=True, request_id=api.request_id())
    api.ask_delete(clients.tpu.delete_queued_resource, request)


def loss_of(clients: Clients, access: Access, pool_id: str, worker: int) -> NodeLoss | None:
    """Why host `worker` of the slice went away (the slice goes as a whole), or None."""
    name = f"{parent(access.project, access.zone)}/nodes/{node_name(pool_id)}"
    try:
        node = clients.tpu.get_node(name=name, retry=api.retry(5), timeout=10)
    except gexc.NotFound:
        return NodeLoss(f"TPU {node_name(pool_id)} no longer exists")
    except api.ApiError:
        return None
    state = node.state.name
    if state == "PREEMPTED":
        return NodeLoss(
            f"TPU {node_name(pool_id)} (host {worker}) was preempted: GCP reclaimed the spot slice",
            preempted=True,
        )
    if state in _LOST:
        return NodeLoss(f"TPU {node_name(pool_id)} (host {worker}) is {state}")
    return None


def _failed(what: str, code: int, message: str) -> ProvisionError:
    """The slice's creation failed: for want of room in its zone (capacity, or a TPU quota,
    which the TPU API counts per zone) an `api.NoRoom` the next zone may answer otherwise."""
    if code in _CAPACITY_CODES:
        return api.NoRoom(
            f"GCP could not create {what} (RESOURCE_EXHAUSTED: {message}). Nothing was left "
            "running. Try another zone, spot=True (queued), a smaller slice, or ask for quota",
            scope=api.ZONE,
            answer=f"RESOURCE_EXHAUSTED: {message}",
        )
    return ProvisionError(
        f"GCP could not create {what} (code {code}: {message}); nothing was left running"
    )


Found = tuple[dict[str, str], Callable[[resources.PoolResources], None]]


def found(clients: Any, project: str, zone: str, pool_id: str | None) -> list[Found]:
    """skyward's TPU nodes and queued resources in `zone`, for `resources.find`; none when the
    TPU API is off or forbidden in the project (then there are none of skyward's either)."""
    try:
        nodes = list_nodes(clients, project, zone, pool_id)
        queued = list_queued(clients, project, zone, pool_id)
    except (gexc.PermissionDenied, gexc.Forbidden):
        return []
    out: list[Found] = []
    for node in nodes:
        line = f"{str(node.name).rsplit('/', 1)[-1]} {node.accelerator_type} {node.state.name}"
        out.append((dict(node.labels), partial(_append, "tpus", line)))
    for item in queued:
        short = str(item.name).rsplit("/", 1)[-1]
        labels = {resources.POOL_LABEL: pool_of_queued(short) or "?"}
        out.append((labels, partial(_append, "queued", short)))
    return out


def _append(kind: str, line: str, pool: resources.PoolResources) -> None:
    getattr(pool, kind).append(line)
