"""The host key a VM (or a TPU slice's host) made at boot and published as a guest attribute
(`startup.publish_key`): only the machine writes it, through its metadata server, and only
those allowed ``compute.instances.getGuestAttributes`` (``tpu.nodes.getGuestAttributes``) read
it. The client trusts that key, for that machine's address only."""

from __future__ import annotations

from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import compute_v1, tpu_v2

from skyward.providers.cloud.bootscript import public_key
from skyward.providers.gcp import api, startup, tpus
from skyward.providers.gcp.provision import MachineAddress
from skyward.providers.gcp.settings import Access, Clients

QUERY_PATH = f"{startup.KEY_NAMESPACE}/"


def published_key(
    clients: Clients, access: Access, pool_id: str, machine: MachineAddress
) -> str | None:
    """`machine`'s public host key (``KEYTYPE BLOB``), or None while it has published none.
    Blocking."""
    try:
        if machine.worker is None:
            asked = compute_v1.GetGuestAttributesInstanceRequest(
                project=access.project,
                zone=access.zone,
                instance=machine.name,
                query_path=QUERY_PATH,
            )
            reply: Any = clients.instances.get_guest_attributes(
                request=asked, retry=api.retry(), timeout=api.CALL_TIMEOUT
            )
            values = [reply.query_value]
        else:
            name = f"{tpus.parent(access.project, access.zone)}/nodes/{tpus.node_name(pool_id)}"
            request = tpu_v2.GetGuestAttributesRequest(
                name=name, query_path=QUERY_PATH, worker_ids=[str(machine.worker)]
            )
            answer = clients.tpu.get_guest_attributes(
                request=request, retry=api.retry(), timeout=api.CALL_TIMEOUT
            )
            values = [a.query_value for a in answer.guest_attributes]
    except gexc.NotFound:  # nothing published yet
        return None
    for value in values:
        for item in value.items:
            if item.namespace == startup.KEY_NAMESPACE and item.key == startup.KEY_NAME:
                return public_key(item.value)
    return None
