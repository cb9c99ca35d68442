"""`Transfers`: files between this machine and a pool's nodes, through the pool's provider.

In: the `sky.Data` of a call's arguments, staged on every node before the call is sent. Out: the
nodes' `sky.output_dir()`, collected to the pool's ``output_dir`` on request and a last time
before the nodes go, and the checkpoints they report (`checkpoints.Checkpoints`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from skyward.client.checkpoints import Checkpoints
from skyward.console.console import Console
from skyward.data import Data, Placement
from skyward.errors import DataError, PoolClosedError
from skyward.providers.base import Cluster, Provider
from skyward.reports import Report
from skyward.transport.eventloop import LoopThread


class Transfers:
    """One pool's files in and out. `loop` and `cluster` are the pool's, set by it as soon as
    it has them (the loop at start, the cluster at launch)."""

    def __init__(
        self, provider: Provider, console: Console, outputs: str | None, collect_timeout: float
    ) -> None:
        self.loop: LoopThread | None = None
        self.cluster: Cluster | None = None
        self._provider = provider
        self._console = console
        self._outputs = outputs
        self._collect_timeout = collect_timeout
        self._checkpoints = Checkpoints(provider, console.status, self._submit)

    def use(self, provider: Provider) -> None:
        """Move files through `provider` (the one a pool with several landed on)."""
        self._provider = provider
        self._checkpoints = Checkpoints(provider, self._console.status, self._submit)

    def _running(self) -> tuple[LoopThread, Cluster]:
        if self.loop is None or self.cluster is None:
            raise PoolClosedError("the pool is not running")
        return self.loop, self.cluster

    # -- in --------------------------------------------------------------------------------

    def stage(self, found: list[Data]) -> bool:
        """Sync each `sky.Data` of a call to the nodes; whether any placement changed."""
        loop, cluster = self._running()
        unique = list({id(d): d for d in found}.values())
        placements = loop.run(self._stage(cluster, unique))
        changed = [d.place(p) for d, p in zip(unique, placements, strict=True)]
        return any(changed)

    async def _stage(self, cluster: Cluster, datas: list[Data]) -> list[Placement]:
        stage = self._provider.stage_data
        return list(await asyncio.gather(*(stage(cluster, d, self._console) for d in datas)))

    # -- out -------------------------------------------------------------------------------

    def collect(self) -> None:
        """Bring every node's outputs to the pool's ``output_dir`` now."""
        loop, cluster = self._running()
        loop.run(self._collect(cluster))

    async def _collect(self, cluster: Cluster) -> None:
        await self._checkpoints.collect(cluster, [node.index for node in cluster.nodes])

    def collect_at_close(self) -> BaseException | None:
        """The last collection, before the nodes go; what went wrong, if anything (even
        Ctrl-C: the nodes are removed first, then it is raised)."""
        self._checkpoints.close()  # no copy may list a directory being removed
        if self._outputs is None or self.loop is None or self.cluster is None:
            return None
        try:
            self.loop.run(asyncio.wait_for(self._collect(self.cluster), self._collect_timeout))
        except TimeoutError:
            return DataError(
                f"collecting the outputs to {self._outputs} took longer than "
                f"collect_timeout={self._collect_timeout:g} s; what arrived is there",
                path=self._outputs,
            )
        except BaseException as exc:
            return exc
        return None

    def reported(self, report: Report) -> None:
        """Start copying the checkpoint `report` names, if it names one, off its node."""
        if report.checkpoint is not None:
            self._checkpoints.reported(report, self.cluster)

    def latest_checkpoint(self, timeout: float) -> Data | None:
        """See `ComputePool.latest_checkpoint`."""
        return self._checkpoints.latest(timeout)

    def _submit(self, coro: Coroutine[Any, Any, None]) -> Future[None]:
        if self.loop is None:
            coro.close()
            raise PoolClosedError("the pool is not running")
        return self.loop.submit(coro)
