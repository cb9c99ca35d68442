"""The start of a pool's agents, all ranks at once: open every session, check that the nodes run
this client's skyward, give each rank its identity (`InstanceInfo`) and plugins, and wait until
every rank is ready. The per-rank half of the conversation is `NodeSession`'s.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Sequence

from skyward.client import failures
from skyward.client.session import NodeSession
from skyward.errors import BootstrapError
from skyward.hardware import ClusterSpec
from skyward.info import InstanceInfo
from skyward.plugins.base import Plugin
from skyward.providers.base import Node
from skyward.providers.environment import client_python
from skyward.version import __version__
from skyward.worker.hostcheck import same_python

HEAD_PORT = "head"  # the port every pool has on node 0 (`InstanceInfo.head_port`)


async def handshake(
    sessions: Sequence[NodeSession],
    nodes: Sequence[Node],
    spec: ClusterSpec,
    plugins: Sequence[Plugin],
    plugins_blob: bytes,
    output_dirs: Sequence[str] = (),
    silence_timeout: float = 0.0,
    *,
    startup_timeout: float,
) -> list[InstanceInfo]:
    """Take every rank (`sessions`, in rank order) through the handshake; their identities,
    in the same order. A remote agent stops after `silence_timeout` s without a ping
    (`session.ping_agents`). Not done within `startup_timeout` s: a `BootstrapError` that says
    where each rank was."""
    try:
        return await asyncio.wait_for(
            _handshake(sessions, nodes, spec, plugins, plugins_blob, output_dirs, silence_timeout),
            startup_timeout,
        )
    except TimeoutError:
        late = f"the pool did not become ready within startup_timeout={startup_timeout:g} s"
        raise BootstrapError(failures.stuck_report(late, sessions)) from None


async def _handshake(
    sessions: Sequence[NodeSession],
    nodes: Sequence[Node],
    spec: ClusterSpec,
    plugins: Sequence[Plugin],
    plugins_blob: bytes,
    output_dirs: Sequence[str],
    silence_timeout: float,
) -> list[InstanceInfo]:
    names = tuple(dict.fromkeys((HEAD_PORT, *(name for p in plugins for name in p.ports))))
    started = await asyncio.gather(*(session.open(names) for session in sessions))
    versions = {s.skyward_version for s in started}
    if versions != {__version__}:
        raise BootstrapError(
            f"the nodes run skyward {sorted(versions)} but this client runs {__version__}"
        )
    wanted = client_python()
    for session, begun in zip(sessions, started, strict=True):
        if not same_python(begun.python_version, wanted):
            raise BootstrapError(
                f"node {session.node} ({begun.hostname}) runs Python {begun.python_version} but "
                f"this client runs {platform.python_version()}: functions pickled by "
                "cloudpickle do not cross "
                "minor versions, so no call was sent. Give the node this client's Python, or "
                f"run the client on Python {begun.python_version.rsplit('.', 1)[0]}",
                node=session.node,
            )
    infos = identities(nodes, spec, started[0].ports, output_dirs)
    await asyncio.gather(
        *(
            session.hello(info, plugins_blob, sessions, silence_timeout)
            for session, info in zip(sessions, infos, strict=True)
        )
    )
    return infos


def identities(
    nodes: Sequence[Node],
    spec: ClusterSpec,
    ports: dict[str, int],
    output_dirs: Sequence[str] = (),
) -> list[InstanceInfo]:
    """Each rank's `InstanceInfo`, in rank order (node 0's ranks first, `spec`'s
    `processes_per_node` a node): node 0's ports for all; its node's own GPUs where the
    provider knows them, else what the pool asked for; its output directory (its node's, or
    ``rank-<r>`` in it when a node holds several ranks)."""
    peers = tuple(node.private_addr for node in nodes)
    outputs = list(output_dirs) or [""] * len(nodes)
    asked = spec.accelerator
    per_node = spec.processes_per_node
    return [
        InstanceInfo(
            node=node.index,
            total_nodes=len(nodes),
            head_addr=peers[0],
            head_port=ports[HEAD_PORT],
            peers=peers,
            pool_id=spec.pool_id,
            accelerator=node.gpus[0].name if node.gpus else asked.name if asked else None,
            accelerator_count=len(node.gpus) or (asked.count if asked else 0),
            provider=spec.provider,
            ports=dict(ports),
            devices=tuple(gpu.index for gpu in node.gpus),
            output_dir=rank_dir(output, rank) if per_node > 1 and output else output,
            rank=rank,
            local_rank=local,
            processes_per_node=per_node,
            world_size=len(nodes) * per_node,
        )
        for node, output in zip(nodes, outputs, strict=True)
        for local in range(per_node)
        for rank in (node.index * per_node + local,)
    ]


def rank_dir(node_dir: str, rank: int) -> str:
    """Rank `rank`'s output directory in its node's `node_dir`, when a node holds several."""
    return f"{node_dir.rstrip('/')}/rank-{rank}"
