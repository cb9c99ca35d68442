"""Data in and outputs out for nodes on remote hosts: the `Provider` verbs `stage_data` and
`collect_outputs` of every remote provider (SSH, AWS, GCP; Slurm calls the functions itself),
over the pool's own connections.

- `stage_tree`: a `sky.Data` tree is scanned here and pushed to every node that lacks it
  (`files.push_tree`: one content-addressed store per host, only missing content travels); each
  node remembers which trees it holds, so an unchanged `Data` costs a local rescan and nothing on
  the wire. A replaced node starts with none and gets them again on the next call.
- `collect_outputs`: each node's output directory (``<cache>/outputs/<pool>/node-<i>``) is
  pulled to ``<output_dir>/node-<i>`` (`files.pull_tree`, incremental), or uploaded by the node
  itself to ``s3://.../node-<i>`` (`skyward.worker.s3sync`).
- `remove_outputs`: the pool's output directories go with the pool (SSH hosts outlive it).
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import Sequence

from skyward.data import S3_SCHEME, Data, Placement
from skyward.errors import DataError
from skyward.providers.base import Cluster, Log, Provider, local_outputs, output_path
from skyward.providers.remote import files
from skyward.providers.remote.bootstrap import RemoteNode, module_command, remote_nodes
from skyward.providers.remote.hoststeps import CACHE
from skyward.transport.stdinenv import READ_ENV, env_line
from skyward.worker import treestore

HOST_CACHE = f'"{CACHE}"'  # as a shell word


class RemoteData(Provider):
    """`stage_data` and `collect_outputs` for providers whose nodes are `RemoteNode`s; list it
    before `Provider` in the class's bases (SSH; AWS and GCP through `CloudProvider`)."""

    async def stage_data(self, cluster: Cluster, data: Data, log: Log) -> Placement:
        return await stage_tree(cluster, data, log)

    async def collect_outputs(self, cluster: Cluster, nodes: Sequence[int], log: Log) -> None:
        if cluster.spec.outputs is not None:
            await collect_outputs(cluster, nodes, cluster.spec.outputs)


async def stage_tree(cluster: Cluster, data: Data, log: Log) -> Placement:
    """Where the nodes find `data`, after pushing it to those that lack it."""
    if data.is_s3:
        return ("s3", data.source)
    manifest = await asyncio.to_thread(treestore.scan, data.existing_path())
    single = manifest.entries[0].path if manifest.single else ""
    lacking = [n for n in remote_nodes(cluster) if manifest.digest not in n.trees]
    if lacking:
        await files.push_tree(lacking, data.path, manifest, log)
        for node in lacking:
            node.trees.add(manifest.digest)
    return ("tree", manifest.digest, single)


async def collect_outputs(cluster: Cluster, indices: Sequence[int], output_dir: str) -> None:
    """Bring the output directories of nodes `indices` to the pool's `output_dir`; one
    `DataError` naming every node that failed (the others are collected all the same)."""
    nodes = remote_nodes(cluster)
    results = await asyncio.gather(
        *(_collect_one(cluster, nodes[i], output_dir) for i in indices), return_exceptions=True
    )
    failed = [(i, r) for i, r in zip(indices, results, strict=True) if isinstance(r, Exception)]
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    if len(failed) == 1:
        raise failed[0][1]
    if failed:
        raise DataError(
            f"collecting outputs from {len(failed)} node(s) failed:\n"
            + "\n".join(f"  node {i}: {error}" for i, error in failed),
            node=failed[0][0],
            path=output_dir,
        )


async def _collect_one(cluster: Cluster, node: RemoteNode, output_dir: str) -> None:
    where = output_path(cluster, node.index)
    if not output_dir.startswith(S3_SCHEME):
        stats = await files.pull_tree(node, where, local_outputs(cluster, node.index), node.pulled)
        node.pulled = stats.paths or node.pulled
        return
    if node.python is None:
        raise DataError(f"node {node.index} was never prepared", node=node.index)
    uri = f"{output_dir}/node-{node.index}"
    # `where` is relative to the host's cache directory; the module runs there.
    command = module_command(
        node.python, "skyward.worker.s3sync", "upload", where, uri, cwd=HOST_CACHE
    )
    # A node that never started its agent has no directory: nothing to upload.
    absent = f"test -d {HOST_CACHE}/{shlex.quote(where)} || {{ echo '{{}}'; exit 0; }}"
    # The credentials the pool gave, on the command's stdin (`stdinenv`), never its argv.
    env = env_line({k: v for k, v in node.agent_env.items() if k != "PYTHONPATH"})
    done = await node.host.run(f"{READ_ENV}{absent}; {command}", env)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    result = _last_json(lines)
    if done.status != 0 or "error" in result:
        reason = result.get("error") or done.tail or f"exit status {done.status}"
        raise DataError(
            f"node {node.index} ({node.host}) could not upload its outputs to {uri}: {reason}",
            node=node.index,
            path=uri,
        )


def outputs_removal(cluster: Cluster) -> str:
    """The shell command that removes the pool's output directory from a host."""
    return f"rm -rf {HOST_CACHE}/{shlex.quote(f'outputs/{cluster.spec.pool_id}')}"


async def remove_outputs(cluster: Cluster) -> None:
    """Remove the pool's output directories from its hosts (best effort, bounded)."""
    command = outputs_removal(cluster)
    hosts = {id(n.host): n.host for n in remote_nodes(cluster) if not n.host.closed}
    await asyncio.gather(
        *(asyncio.wait_for(h.run(command), 30) for h in hosts.values()), return_exceptions=True
    )


def _last_json(lines: list[str]) -> dict[str, object]:
    for line in reversed(lines):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}
