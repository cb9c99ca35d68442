"""What skyward creates in EC2, how it is tagged, and how it is found and removed again.

Everything a pool creates carries ``skyward:pool=<pool id>``, ``skyward:created-by`` and
``skyward:created-at``; the tags, not any local state, are the record. So the same code removes a
pool at the end of its ``with`` block, after a launch that failed half-way, and from another
process (`AWS.cleanup`, ``skyward down``) after the client died. Every call covers the whole pool
(the call count does not grow with the number of nodes); `teardown` removes what is found here.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

POOL_TAG = "skyward:pool"
CREATED_BY_TAG = "skyward:created-by"
CREATED_AT_TAG = "skyward:created-at"
LIVE_STATES = ("pending", "running", "shutting-down", "stopping", "stopped")


def created_by() -> str:
    """Who made a resource: ``user@host``, so a shared account can tell pools apart."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (containers): the host still says something
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def pool_tags(pool_id: str, now: datetime | None = None) -> list[dict[str, str]]:
    """The tags every resource of `pool_id` gets."""
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [
        {"Key": POOL_TAG, "Value": pool_id},
        {"Key": CREATED_BY_TAG, "Value": created_by()},
        {"Key": CREATED_AT_TAG, "Value": stamp},
        {"Key": "Name", "Value": f"skyward-{pool_id}"},
    ]


def tag_spec(resource_type: str, tags: list[dict[str, str]]) -> dict[str, Any]:
    return {"ResourceType": resource_type, "Tags": tags}


def tag_value(resource: dict[str, Any], key: str) -> str | None:
    for tag in resource.get("Tags", []):
        if tag.get("Key") == key:
            return str(tag.get("Value"))
    return None


def _parse_stamp(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


@dataclass
class PoolResources:
    """Everything tagged with one pool id that still exists."""

    pool_id: str
    instances: list[dict[str, Any]] = field(default_factory=list)  # not terminated
    groups: list[str] = field(default_factory=list)
    key_pairs: list[str] = field(default_factory=list)
    placement_groups: list[str] = field(default_factory=list)
    created_at: datetime | None = None
    created_by: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.instances or self.groups or self.key_pairs or self.placement_groups)

    def describe(self) -> list[str]:
        """One line per resource, for `skyward ls` and error messages."""
        lines = [
            f"instance {i['InstanceId']} {i.get('InstanceType', '?')} {i['State']['Name']}"
            for i in self.instances
        ]
        lines += [f"security group {g}" for g in self.groups]
        lines += [f"key pair {k}" for k in self.key_pairs]
        lines += [f"placement group {p}" for p in self.placement_groups]
        return lines

    def _note(self, resource: dict[str, Any]) -> None:
        stamp = _parse_stamp(tag_value(resource, CREATED_AT_TAG))
        if stamp is not None and (self.created_at is None or stamp < self.created_at):
            self.created_at = stamp
        self.created_by = self.created_by or tag_value(resource, CREATED_BY_TAG)


def find(ec2: Any, pool_id: str | None = None) -> dict[str, PoolResources]:
    """Every skyward resource in the client's region (or only `pool_id`'s), by pool id."""
    if pool_id is None:
        flt = [{"Name": "tag-key", "Values": [POOL_TAG]}]
    else:
        flt = [{"Name": f"tag:{POOL_TAG}", "Values": [pool_id]}]
    pools: dict[str, PoolResources] = {}

    def entry(resource: dict[str, Any]) -> PoolResources | None:
        pid = tag_value(resource, POOL_TAG)
        if pid is None:
            return None
        pool = pools.setdefault(pid, PoolResources(pid))
        pool._note(resource)
        return pool

    states = {"Name": "instance-state-name", "Values": list(LIVE_STATES)}
    for page in ec2.get_paginator("describe_instances").paginate(Filters=[*flt, states]):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                if (pool := entry(instance)) is not None:
                    pool.instances.append(instance)
    for page in ec2.get_paginator("describe_security_groups").paginate(Filters=flt):
        for group in page["SecurityGroups"]:
            if (pool := entry(group)) is not None:
                pool.groups.append(group["GroupId"])
    for pair in ec2.describe_key_pairs(Filters=flt)["KeyPairs"]:
        if (pool := entry(pair)) is not None:
            pool.key_pairs.append(pair["KeyName"])
    for placement in ec2.describe_placement_groups(Filters=flt)["PlacementGroups"]:
        if (pool := entry(placement)) is not None:
            pool.placement_groups.append(placement["GroupName"])
    for pool in pools.values():
        pool.instances.sort(key=lambda i: (i.get("AmiLaunchIndex", 0), i["InstanceId"]))
    return pools


def instance_states(ec2: Any, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``describe_instances`` for `ids` in one call (per page): id -> instance."""
    ids = list(ids)
    found: dict[str, dict[str, Any]] = {}
    if not ids:
        return found
    for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=ids):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                found[instance["InstanceId"]] = instance
    return found
