"""Collections of a node's outputs never overlap, and none begins after the pool's last one
(`skyward.client.checkpoints.Checkpoints`).

A checkpoint's copy runs in the background when it is reported; the pool's last collection
comes right before the nodes' directories are removed. A copy that overlapped it, or listed a
directory halfway through its removal, would take the files it no longer saw for deleted ones
and remove their local copies. The provider here is Local with its collection recorded (and
slowed, so that copies and collections would overlap): the one stand-in is the time a
collection takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import pytest

from skyward.client.checkpoints import Checkpoints
from skyward.hardware import ClusterSpec
from skyward.providers.base import Cluster, Log, Node
from skyward.providers.local.provider import Local, LocalCluster, LocalNode
from skyward.reports import Report
from skyward.transport.eventloop import LoopThread


class SlowCollections(Local):
    """Local whose nodes write to a relative (remote-style) directory, and whose collections
    are recorded as (event, nodes, time) and take `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.events: list[tuple[str, tuple[int, ...]]] = []

    def node_output_dir(self, cluster: Cluster, node: Node) -> str:
        return f"outputs/{cluster.spec.pool_id}/node-{node.index}"

    async def collect_outputs(self, cluster: Cluster, nodes: Sequence[int], log: Log) -> None:
        self.events.append(("begin", tuple(nodes)))
        await asyncio.sleep(self.seconds)
        self.events.append(("end", tuple(nodes)))


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("skyward-test-checkpoints")
    try:
        yield thread
    finally:
        thread.stop()


def cluster(nodes: int) -> LocalCluster:
    made = LocalCluster(ClusterSpec(nodes=nodes, pool_id="pool-ckpt", outputs="/tmp/runs"), [])
    made.nodes = [LocalNode(i, made) for i in range(nodes)]
    return made


def report(node: int, step: int) -> Report:
    checkpoint = f"~/.cache/skyward/outputs/pool-ckpt/node-{node}/checkpoints/step-{step}"
    return Report(node, time.time(), {"step": step}, checkpoint)


def test_the_last_collection_waits_for_copies_and_none_begins_after_it(
    loop: LoopThread,
) -> None:
    provider = SlowCollections(0.2)
    pool = cluster(2)
    checkpoints = Checkpoints(provider, lambda line: None, loop.submit)
    checkpoints.reported(report(0, 10), pool)  # a copy of node 0 begins in the background
    time.sleep(0.05)
    checkpoints.close()  # the pool's last collection is next
    loop.run(checkpoints.collect(pool, [0, 1]))
    checkpoints.reported(report(0, 20), pool)  # reported as the pool ends: copies nothing
    time.sleep(0.3)
    assert provider.events == [
        ("begin", (0,)),
        ("end", (0,)),  # the copy under way ends before the last collection begins
        ("begin", (0, 1)),
        ("end", (0, 1)),
    ]


def test_copies_of_one_node_run_one_after_another(loop: LoopThread) -> None:
    provider = SlowCollections(0.05)
    pool = cluster(1)
    checkpoints = Checkpoints(provider, lambda line: None, loop.submit)
    for step in (10, 20, 30):
        checkpoints.reported(report(0, step), pool)
    assert checkpoints.latest(timeout=5) is not None  # waits for the newest copy
    time.sleep(0.2)
    kinds = [event for event, _ in provider.events]
    assert kinds == ["begin", "end"] * 3, provider.events
