"""What skyward creates in Compute Engine, how it is labelled and named, and how it is found.

Instances carry the labels ``skyward-pool=<pool>``, ``skyward-created-by`` and
``skyward-created-at`` (labels, not local state, are the record). Firewall rules have no labels
in the Compute API, so theirs is the name: ``skyward-<pool>-ssh`` and ``skyward-<pool>-internal``,
with the pool in their description too. The same code finds a pool at the end of its ``with``
block, after a launch that failed half-way, and from another process (``skyward down``).
"""

from __future__ import annotations

import getpass
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from skyward.providers.gcp.api import CALL_TIMEOUT, retry
from skyward.providers.gcp.settings import Access

POOL_LABEL = "skyward-pool"
CREATED_BY_LABEL = "skyward-created-by"
CREATED_AT_LABEL = "skyward-created-at"
FIREWALL_SUFFIXES = ("-ssh", "-internal")
_MAX_SLUG = 40  # skyward-<slug>-internal stays within GCE's 63 characters


def slug(pool_id: str) -> str:
    """`pool_id` as GCE names and label values allow it: lowercase, digits and dashes."""
    text = re.sub(r"[^a-z0-9-]", "-", pool_id.lower())[-_MAX_SLUG:].strip("-")
    return text or "pool"


def label_value(text: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def pool_labels(pool_id: str, now: datetime | None = None) -> dict[str, str]:
    """The labels every instance (and its boot disk) of `pool_id` gets."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (containers): the host still says something
        user = "unknown"
    stamp = int((now or datetime.now(UTC)).timestamp())
    return {
        POOL_LABEL: slug(pool_id),
        CREATED_BY_LABEL: label_value(f"{user}-at-{socket.gethostname()}"),
        CREATED_AT_LABEL: str(stamp),
    }


def base_name(pool_id: str) -> str:
    return f"skyward-{slug(pool_id)}"


def name_pattern(pool_id: str, zone: str | None = None) -> str:
    """bulkInsert's name pattern: GCE numbers the instances, after any of the pool's own in
    that zone. A VM of the pool made in another `zone` than its others (a replacement where the
    pool's zone had no room) carries the zone's letter: names are unique per zone only, and
    the pool's VMs are told apart by name."""
    letter = f"-{zone.rsplit('-', 1)[-1]}" if zone else ""
    return f"{base_name(pool_id)}{letter}-###"


def network_tag(pool_id: str) -> str:
    return base_name(pool_id)


def firewall_names(pool_id: str) -> list[str]:
    return [f"{base_name(pool_id)}{suffix}" for suffix in FIREWALL_SUFFIXES]


def pool_of_firewall(name: str) -> str | None:
    """The pool slug a skyward firewall rule belongs to, or None for anyone else's rule."""
    if not name.startswith("skyward-"):
        return None
    for suffix in FIREWALL_SUFFIXES:
        if name.endswith(suffix):
            return name[len("skyward-") : -len(suffix)] or None
    return None


def network_url(access: Access, network: str | None) -> str:
    name = network or "default"
    return name if "/" in name else f"projects/{access.project}/global/networks/{name}"


def subnetwork_url(access: Access, subnetwork: str | None) -> str | None:
    if not subnetwork or "/" in subnetwork:
        return subnetwork
    return f"projects/{access.project}/regions/{access.region}/subnetworks/{subnetwork}"


def instance_filter(pool_id: str | None) -> str:
    if pool_id is None:
        return f"labels.{POOL_LABEL}:*"
    return f'labels.{POOL_LABEL} = "{slug(pool_id)}"'


def zone_of(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def list_instances(clients: Any, project: str, pool_id: str | None) -> list[tuple[str, Any]]:
    """(zone, instance) of every instance labelled by `pool_id` (or by any pool), all zones."""
    pages = clients.instances.aggregated_list(
        request={"project": project, "filter": instance_filter(pool_id)},
        retry=retry(),
        timeout=CALL_TIMEOUT,
    )
    found = []
    for scope, scoped in pages:
        for instance in scoped.instances:
            found.append((zone_of(scope), instance))
    return sorted(found, key=lambda pair: str(pair[1].name))


def list_firewalls(clients: Any, project: str, pool_id: str | None) -> list[Any]:
    """skyward's firewall rules (of `pool_id`, or of every pool)."""
    wanted = None if pool_id is None else slug(pool_id)
    rules = clients.firewalls.list(project=project, retry=retry(), timeout=CALL_TIMEOUT)
    return [
        rule
        for rule in rules
        if (owner := pool_of_firewall(str(rule.name))) is not None
        and (wanted is None or owner == wanted)
    ]


@dataclass
class PoolResources:
    """Everything of one pool that still exists."""

    pool_id: str
    instances: list[tuple[str, Any]] = field(default_factory=list)  # (zone, instance)
    firewalls: list[str] = field(default_factory=list)
    tpus: list[str] = field(default_factory=list)  # "node ACCELERATOR STATE" lines
    queued: list[str] = field(default_factory=list)  # queued resource ids
    created_at: datetime | None = None
    created_by: str | None = None

    def describe(self) -> list[str]:
        """One line per resource, for `skyward ls` and error messages."""
        lines = [
            f"instance {i.name} {zone_of(str(i.machine_type))} {i.status} ({zone})"
            for zone, i in self.instances
        ]
        lines += [f"TPU {line}" for line in self.tpus]
        lines += [f"queued resource {name}" for name in self.queued]
        return lines + [f"firewall rule {name}" for name in self.firewalls]


def find(
    clients: Any,
    project: str,
    pool_id: str | None = None,
    found_elsewhere: Iterable[tuple[dict[str, str], Callable[[PoolResources], None]]] = (),
) -> dict[str, PoolResources]:
    """Every skyward resource of `project` (or only `pool_id`'s), by pool. `found_elsewhere`:
    (labels, how to add it to its pool) of resources listed by other APIs (TPU nodes)."""
    pools: dict[str, PoolResources] = {}
    for zone, instance in list_instances(clients, project, pool_id):
        labels = dict(instance.labels)
        pool = pools.setdefault(labels[POOL_LABEL], PoolResources(labels[POOL_LABEL]))
        pool.instances.append((zone, instance))
        pool.created_by = pool.created_by or labels.get(CREATED_BY_LABEL)
        stamp = _stamp(labels.get(CREATED_AT_LABEL))
        if stamp is not None and (pool.created_at is None or stamp < pool.created_at):
            pool.created_at = stamp
    pools.update(_found_elsewhere(pools, found_elsewhere))
    for rule in list_firewalls(clients, project, pool_id):
        owner = pool_of_firewall(str(rule.name)) or "?"
        pools.setdefault(owner, PoolResources(owner)).firewalls.append(str(rule.name))
    return pools


def _found_elsewhere(
    pools: dict[str, PoolResources],
    found: Iterable[tuple[dict[str, str], Callable[[PoolResources], None]]],
) -> dict[str, PoolResources]:
    for labels, add in found:
        owner = labels.get(POOL_LABEL, "?")
        pool = pools.setdefault(owner, PoolResources(owner))
        add(pool)
        pool.created_by = pool.created_by or labels.get(CREATED_BY_LABEL)
        stamp = _stamp(labels.get(CREATED_AT_LABEL))
        if stamp is not None and (pool.created_at is None or stamp < pool.created_at):
            pool.created_at = stamp
    return pools


def names(items: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """name -> zone of listed instances."""
    return {str(instance.name): zone for zone, instance in items}


def _stamp(value: str | None) -> datetime | None:
    try:
        return datetime.fromtimestamp(int(value), UTC) if value else None
    except ValueError:
        return None
