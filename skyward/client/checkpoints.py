"""The checkpoints nodes report (``sky.report(..., checkpoint=path)``), brought where every
node can read them again: what `ComputePool.latest_checkpoint` returns after a `replace`.

A checkpoint lives in its node's `sky.output_dir()`. When it is reported, the reporting node's
outputs are collected at once (incrementally, in the background) to the pool's ``output_dir``,
so the checkpoint outlives its node. On Local the path is on this machine already.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from skyward.data import S3_SCHEME, Data
from skyward.errors import DataError
from skyward.providers.base import Cluster, Log, Provider
from skyward.reports import Report

Submit = Callable[[Coroutine[Any, Any, None]], "Future[None]"]


class Checkpoints:
    """Reported checkpoints, newest last, each with the collection that brought it here."""

    def __init__(self, provider: Provider, log: Log, submit: Submit) -> None:
        self._provider = provider
        self._log = log
        self._submit = submit
        self._seen: list[tuple[str, Future[None]]] = []  # where each is, and its copy
        self._locks: dict[int, asyncio.Lock] = {}
        self._closed = False

    def reported(self, report: Report, cluster: Cluster | None) -> None:
        """Note a report that names a checkpoint, and start copying it off its node."""
        if report.checkpoint is None or cluster is None:
            return
        node = cluster.nodes[report.node]
        home = self._provider.node_output_dir(cluster, node)
        if os.path.isabs(home):  # the node writes on this machine: nothing to copy
            done: Future[None] = Future()
            done.set_result(None)
            self._seen.append((report.checkpoint, done))
            return
        relative = _under(report.checkpoint, home)
        outputs = cluster.spec.outputs
        if relative is None or outputs is None:
            why = (
                "is not under the node's sky.output_dir()"
                if relative is None
                else "cannot be kept: the pool has no output_dir"
            )
            failed: Future[None] = Future()
            failed.set_exception(
                DataError(
                    f"checkpoint {report.checkpoint} of node {report.node} {why}; write "
                    "checkpoints under sky.output_dir() in a pool with output_dir=...",
                    node=report.node,
                    path=report.checkpoint,
                )
            )
            self._seen.append((report.checkpoint, failed))
            return
        if outputs.startswith(S3_SCHEME):
            where = f"{outputs}/node-{report.node}/{relative}"
        else:
            where = os.path.join(outputs, f"node-{report.node}", relative)
        self._seen.append((where, self._submit(self._copy(cluster, report.node))))

    async def _copy(self, cluster: Cluster, index: int) -> None:
        async with self._lock(index):  # one collection of a node at a time; each incremental
            if self._closed:  # the pool is ending: its last collection covers this
                return
            await self._provider.collect_outputs(cluster, [index], self._log)

    def _lock(self, index: int) -> asyncio.Lock:
        return self._locks.setdefault(index, asyncio.Lock())

    async def collect(self, cluster: Cluster, indices: list[int]) -> None:
        """Collect the outputs of nodes `indices`, after any copy of theirs under way (every
        collection goes through here: two at once could each see the node's directory at
        another moment)."""
        locks = [self._lock(i) for i in sorted(indices)]  # one order: no deadlock
        async with contextlib.AsyncExitStack() as held:
            for lock in locks:
                await held.enter_async_context(lock)
            await self._provider.collect_outputs(cluster, indices, self._log)

    def close(self) -> None:
        """The pool's last collection is next and then the nodes go: copies that have not
        begun do nothing (a node's directory may be half removed when they would run)."""
        self._closed = True

    def latest(self, timeout: float) -> Data | None:
        """The newest reported checkpoint that reached a place every node can read, as a
        `sky.Data`; None when no node reported one. Waits for its copy, up to `timeout`."""
        problems: list[str] = []
        for where, copy in reversed(self._seen):
            try:
                copy.result(timeout)
            except (FutureTimeout, TimeoutError):
                problems.append(f"{where}: still being copied after {timeout:g} s")
                continue
            except Exception as exc:
                problems.append(str(exc))
                continue
            return Data(where)
        if problems:
            raise DataError(
                "no reported checkpoint could be brought back:\n  " + "\n  ".join(problems)
            )
        return None


def _under(path: str, home: str) -> str | None:
    """`path` relative to the node's output directory `home` (given relative to the node's
    cache directory, so only its tail is known here), or None when it is not under it."""
    marker = f"/{home.strip('/')}/"
    if marker not in f"{path.rstrip('/')}/":
        return None
    relative = f"{path.rstrip('/')}/".split(marker, 1)[1].rstrip("/")
    return relative or "."
