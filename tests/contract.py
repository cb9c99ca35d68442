"""The provider contract: every provider passes these (launch, run, broadcast, fail, terminate).

A provider's test module subclasses `ProviderContract` and supplies the `make_provider` fixture
(a fresh provider object each call) and `nodes_available` (how many nodes it can launch).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

import skyward as sky


@sky.compute
def identity() -> tuple[int, int, str, str]:
    info = sky.instance_info()
    return info.node, os.getpid(), info.head_addr, info.pool_id


@sky.compute
def add(a: int, b: int) -> int:
    return a + b


@sky.compute
def crash_node(node: int) -> str:
    if sky.instance_info().node == node:
        print("about to crash", flush=True)
        os._exit(9)
    time.sleep(60)
    return "late"


@sky.compute
def raise_error(message: str) -> None:
    raise LookupError(message)


class ProviderContract:
    """Subclass with `make_provider` and `nodes_available` fixtures to run the contract."""

    @pytest.fixture
    def make_provider(self) -> Callable[[], object]:
        raise NotImplementedError

    @pytest.fixture
    def nodes_available(self) -> int:
        return 2

    def _pool(self, make_provider: Callable[[], object], nodes: int) -> sky.ComputePool:
        return sky.ComputePool(
            provider=make_provider(),
            nodes=nodes,  # type: ignore[arg-type]
            stream_output=False,
        )

    def test_launch_run_and_broadcast(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        nodes = min(2, nodes_available)
        with self._pool(make_provider, nodes) as pool:
            results = identity() @ pool
            assert [r[0] for r in results] == list(range(nodes))
            assert len({r[3] for r in results}) == 1 and results[0][3] == pool.pool_id
            assert len({r[2] for r in results}) == 1, "every node must agree on the head"
            assert add(2, 3) >> pool == 5
            assert (add(1, 1) & add(2, 2)) >> pool == (2, 4)

    def test_user_exception_comes_back_as_itself(self, make_provider: Callable[[], object]) -> None:
        with self._pool(make_provider, 1) as pool:
            with pytest.raises(LookupError, match="contract-42"):
                raise_error("contract-42") >> pool

    def test_node_death_fails_the_broadcast_and_stops_the_others(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        nodes = min(2, nodes_available)
        with self._pool(make_provider, nodes) as pool:
            with pytest.raises(sky.WorkerError) as caught:
                crash_node(nodes - 1) @ pool
            assert caught.value.node == nodes - 1
            assert "about to crash" in str(caught.value)
            assert "exit status 9" in str(caught.value)

    def test_terminate_leaves_nothing(self, make_provider: Callable[[], object]) -> None:
        provider = make_provider()
        with sky.ComputePool(
            provider=provider,
            nodes=1,  # type: ignore[arg-type]
            stream_output=False,
        ) as pool:
            pid = (identity() >> pool)[1]
        self.assert_gone(provider, [pid])

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        """Check the agents with `pids` no longer run (override for remote nodes)."""
        from tests.conftest import wait_gone

        assert not wait_gone(pids, timeout=10)
