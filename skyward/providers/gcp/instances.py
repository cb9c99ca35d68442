"""A pool's Compute Engine VMs as plain functions: set up, run, wait, explain.

Each function is one step of a launch, blocking (the provider runs them in a thread), and each
records what it makes in the pool's `teardown.Made` before or as GCE makes it:

- `set_up` creates the pool's two firewall rules (`create_firewalls`: SSH from the client's CIDR
  to the pool's network tag; everything between VMs with that tag) and returns the bulkInsert
  request body (`bulk_body`, made again for each zone a launch tries);
- `run` starts N VMs with ONE ``instances.bulkInsert`` (``minCount = count``: GCE starts all N
  or none) and waits for its operation; a refusal for want of room is `api.NoRoom`;
- `wait_running` waits until all of them run (one zonal list a poll), failing if one stops;
- `loss_of` / `describe_loss` say why a VM went away (a preemption is a zone operation of type
  ``compute.instances.preempted`` on the instance).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from skyward.errors import ProvisionError
from skyward.hardware import ClusterSpec
from skyward.providers.base import NodeLoss
from skyward.providers.cloud.provider import public_cidr
from skyward.providers.gcp import api, resources, teardown
from skyward.providers.gcp.machine_types import Choice
from skyward.providers.gcp.resources import network_url, subnetwork_url
from skyward.providers.gcp.settings import Access, Clients, MachineSettings

PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
_UP = ("PROVISIONING", "STAGING", "RUNNING")
_GONE = ("STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED")
PREEMPTED = "compute.instances.preempted"

CheckCancel = Callable[[], None]
logger = logging.getLogger("skyward.gcp")


def set_up(
    clients: Clients,
    access: Access,
    settings: MachineSettings,
    spec: ClusterSpec,
    choice: Choice,
    metadata: dict[str, str],
    made: teardown.Made,
    deadline: float,
    check_cancel: CheckCancel,
) -> compute_v1.BulkInsertInstanceResource:
    """Create the pool's firewall rules; return the bulkInsert body of its VMs (count unset)."""
    create_firewalls(clients, access, settings, spec.pool_id, made, deadline, check_cancel)
    return bulk_body(access, settings, spec, choice, metadata)


def bulk_body(
    access: Access,
    settings: MachineSettings,
    spec: ClusterSpec,
    choice: Choice,
    metadata: dict[str, str],
) -> compute_v1.BulkInsertInstanceResource:
    """The bulkInsert body of the pool's VMs in `access.zone`'s region (count unset)."""
    tag = resources.network_tag(spec.pool_id)
    labels = resources.pool_labels(spec.pool_id)
    properties = compute_v1.InstanceProperties(
        machine_type=choice.machine_type,
        labels=labels,
        tags=compute_v1.Tags(items=[tag]),
        metadata=compute_v1.Metadata(
            items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]
        ),
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                type_="PERSISTENT",
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=settings.image or choice.image,
                    disk_size_gb=settings.disk_size_gb,
                    labels=labels,
                ),
            )
        ],
        network_interfaces=[_interface(access, settings)],
        scheduling=_scheduling(settings, choice),
    )
    if settings.service_account:
        # The VMs' own credentials (e.g. for gs:// data): an account the user owns.
        properties.service_accounts = [
            compute_v1.ServiceAccount(
                email=settings.service_account,
                scopes=["https://www.googleapis.com/auth/cloud-platform"],
            )
        ]
    return compute_v1.BulkInsertInstanceResource(
        name_pattern=resources.name_pattern(spec.pool_id), instance_properties=properties
    )


def _interface(access: Access, settings: MachineSettings) -> compute_v1.NetworkInterface:
    """The VMs' network interface: the pool's network (and subnetwork), with a public address
    unless `use_private_ips`."""
    interface = compute_v1.NetworkInterface(network=network_url(access, settings.network))
    subnetwork = subnetwork_url(access, settings.subnetwork)
    if subnetwork:
        interface.subnetwork = subnetwork
    if not settings.use_private_ips:
        interface.access_configs = [
            compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
        ]
    return interface


def _scheduling(settings: MachineSettings, choice: Choice) -> compute_v1.Scheduling:
    """What the VMs do on host maintenance and preemption, spot or standard."""
    scheduling = compute_v1.Scheduling(
        automatic_restart=False,
        # GPU VMs cannot live-migrate; spot VMs must not.
        on_host_maintenance="TERMINATE" if choice.is_gpu or settings.spot else "MIGRATE",
        provisioning_model="SPOT" if settings.spot else "STANDARD",
    )
    if settings.spot:
        # STOP, not DELETE: a preempted VM stays (TERMINATED) so `explain` can say what happened.
        scheduling.instance_termination_action = "STOP"
    return scheduling


def named(
    body: compute_v1.BulkInsertInstanceResource, name_pattern: str
) -> compute_v1.BulkInsertInstanceResource:
    """A copy of `body` whose VMs are named by `name_pattern`."""
    renamed = compute_v1.BulkInsertInstanceResource(body)
    renamed.name_pattern = name_pattern
    return renamed


def create_firewalls(
    clients: Clients,
    access: Access,
    settings: MachineSettings,
    pool_id: str,
    made: teardown.Made,
    deadline: float,
    check_cancel: CheckCancel,
) -> None:
    """The pool's two rules: SSH from the client's CIDR to the pool's network tag, and
    everything between machines with that tag (VMs or TPU hosts)."""
    cidrs = [settings.ssh_cidr] if settings.ssh_cidr else _client_cidrs(settings)
    tag = resources.network_tag(pool_id)
    network = network_url(access, settings.network)
    ssh_rule, internal_rule = resources.firewall_names(pool_id)
    about = f"skyward pool {pool_id}"
    rules = [
        compute_v1.Firewall(
            name=ssh_rule,
            description=f"{about}: SSH from the client",
            network=network,
            direction="INGRESS",
            source_ranges=cidrs,
            target_tags=[tag],
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
        ),
        # One rule has one allow-list for all its sources: traffic inside the pool needs its own.
        compute_v1.Firewall(
            name=internal_rule,
            description=f"{about}: everything between the pool's VMs",
            network=network,
            direction="INGRESS",
            source_tags=[tag],
            target_tags=[tag],
            allowed=[compute_v1.Allowed(I_p_protocol="all")],
        ),
    ]
    operations = []
    for rule in rules:
        check_cancel()
        made.add(teardown.FIREWALL, rule.name)
        operations.append(
            clients.firewalls.insert_unary(
                request=compute_v1.InsertFirewallRequest(
                    project=access.project, firewall_resource=rule, request_id=api.request_id()
                ),
                retry=api.retry(),
                timeout=api.CALL_TIMEOUT,
            )
        )
    for operation in operations:
        failed = api.operation_error(api.wait(clients, access.project, operation, deadline))
        if failed is not None:
            raise ProvisionError(
                f"creating the firewall rules of {about}: {failed[0]}: {failed[1]}"
            )
    check_cancel()


def run(
    clients: Clients,
    access: Access,
    body: compute_v1.BulkInsertInstanceResource,
    count: int,
    deadline: float,
) -> None:
    """Start `count` VMs with `body` in `access.zone` in one call, all or none. GCE refusing
    for want of room (its operation's error, e.g. ZONE_RESOURCE_POOL_EXHAUSTED or
    QUOTA_EXCEEDED, or the call's own) is `api.NoRoom`; any other failure a `ProvisionError`."""
    request = compute_v1.BulkInsertInstanceResource(body)
    request.count = count
    request.min_count = count  # all-or-nothing: fewer than count and GCE deletes what it made
    logger.info("starting %d x %s in %s", count, body.instance_properties.machine_type, access.zone)
    try:
        operation = clients.instances.bulk_insert_unary(
            request=compute_v1.BulkInsertInstanceRequest(
                project=access.project,
                zone=access.zone,
                bulk_insert_instance_resource_resource=request,
                request_id=api.request_id(),
            ),
            retry=api.retry(),
            timeout=api.CALL_TIMEOUT,
        )
    except gexc.GoogleAPICallError as exc:  # refused at once (a 403 quotaExceeded)
        code, message = api.refusal(exc)
        if api.no_room(code, message) is None:
            raise
        operation_failed: tuple[str, str] | None = (code, message)
    else:
        done = api.wait(clients, access.project, operation, deadline)
        operation_failed = api.operation_error(done)
    if operation_failed is not None:
        words = _launch_words(operation_failed, count, body, access)
        scope = api.no_room(*operation_failed)
        if scope is not None:
            code, message = operation_failed
            raise api.NoRoom(words, scope=scope, answer=f"{code}: {message}")
        raise ProvisionError(words)


def wait_running(
    clients: Clients,
    access: Access,
    pool_id: str,
    count: int,
    exclude: set[str],
    *,
    deadline: float,
    poll: float,
    check_cancel: CheckCancel,
) -> list[Any]:
    """Wait until `count` VMs of the pool (other than `exclude`) run; in name order (bulkInsert
    numbers them in order). One that stops fails them all."""
    while True:
        listed = clients.instances.list(
            request={
                "project": access.project,
                "zone": access.zone,
                "filter": resources.instance_filter(pool_id),
            },
            retry=api.retry(),
            timeout=api.CALL_TIMEOUT,
        )
        ours = sorted((i for i in listed if i.name not in exclude), key=lambda i: str(i.name))
        gone = [i for i in ours if i.status in _GONE]
        if gone:
            reasons = "; ".join(f"{i.name}: {i.status}" for i in gone)
            raise ProvisionError(
                f"GCE started {count} VM(s) but {len(gone)} stopped at once ({reasons}); a pool "
                "needs all of them, so all were deleted. Try again, another zone, fewer nodes, "
                "or spot=False"
            )
        running = [i for i in ours if i.status == "RUNNING"]
        if len(running) >= count:
            return running[:count]
        if time.monotonic() > deadline:
            raise ProvisionError(
                f"only {len(running)} of {count} VM(s) were running before the boot_timeout; "
                "all were deleted"
            )
        check_cancel()
        time.sleep(poll)


def loss_of(clients: Clients, access: Access, zone: str, name: str) -> NodeLoss | None:
    """Why VM `name` went away (a preemption named as such), or None while it runs."""
    try:
        instance = clients.instances.get(
            project=access.project, zone=zone, instance=name, retry=api.retry(5), timeout=10
        )
    except gexc.NotFound:
        return NodeLoss(f"VM {name} no longer exists")
    except api.ApiError:
        return None
    if instance.status in _UP:
        return None
    preempted: bool | None = None
    try:
        operations = clients.zone_operations.list(
            request={
                "project": access.project,
                "zone": zone,
                "filter": f'(operationType = "{PREEMPTED}") (targetLink = "{instance.self_link}")',
            },
            retry=api.retry(5),
            timeout=10,
        )
        preempted = any(True for _ in operations)
    except api.ApiError:
        preempted = None  # unknown: judge by the VM alone
    return describe_loss(instance, preempted)


def describe_loss(instance: Any, preempted: bool | None) -> NodeLoss | None:
    """Why a VM is gone, in words. `preempted`: whether GCE logged a preemption operation for
    it (None: not known; then a stopped spot VM counts as preempted: skyward never stops one)."""
    status = str(instance.status)
    if status in _UP:
        return None
    spot = str(instance.scheduling.provisioning_model) == "SPOT" or bool(
        instance.scheduling.preemptible
    )
    stopped = f" at {instance.last_stop_timestamp}" if instance.last_stop_timestamp else ""
    if preempted or (preempted is None and spot and status in ("TERMINATED", "STOPPING")):
        return NodeLoss(
            f"VM {instance.name} was preempted: GCE reclaimed the spot VM{stopped} "
            f"(status {status})",
            preempted=True,
        )
    return NodeLoss(f"VM {instance.name} is {status}{stopped}")


def _client_cidrs(settings: MachineSettings) -> list[str]:
    if settings.use_private_ips:
        return list(PRIVATE_RANGES)  # the client is inside the VPC or on a VPN
    return [public_cidr("GCP")]


def _launch_words(
    failed: tuple[str, str], count: int, body: compute_v1.BulkInsertInstanceResource, access: Access
) -> str:
    code, message = failed
    what = f"{count} x {body.instance_properties.machine_type} in {access.zone}"
    if api.no_room(code, message) is not None:
        return (
            f"GCE could not start {what} ({code}: {message}). Nothing was left running. Try "
            "another zone, fewer nodes, spot=False, or ask for more quota"
        )
    return f"GCE could not start {what} ({code}: {message}); nothing was left running"
