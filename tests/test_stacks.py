"""`pool.stacks()`: every node's threads' stacks, asked from the agents with SIGUSR2, on Local
agents and (tests/ssh, tests/slurm) over SSH channels and through srun."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

import skyward as sky


@sky.compute
def stuck_in_a_wait(node: int, seconds: float) -> str:
    if sky.instance_info().node == node:
        threading.Event().wait(seconds)  # a rank waiting for a peer that never comes
    return "done"


def assert_stuck_on(stacks: dict[int, str], node: int, nodes: int) -> None:
    """`node`'s stacks show the call waiting; every other node's show an idle agent."""
    assert sorted(stacks) == list(range(nodes)), stacks
    for index, text in stacks.items():
        assert "Thread 0x" in text and "most recent call first" in text, text
        assert ("stuck_in_a_wait" in text) == (index == node), (index, text)


def test_stacks_name_what_each_node_is_doing_while_one_is_stuck() -> None:
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        stuck: Future[str] = pool.submit(stuck_in_a_wait(1, 30), node=1)
        time.sleep(0.5)
        began = time.monotonic()
        found = pool.stacks(timeout=5)
        assert time.monotonic() - began < 5
        assert_stuck_on(found, node=1, nodes=2)
        assert not stuck.done()  # asking did not disturb the call
        assert "(node 1)" not in "\n".join(pool.logs())  # nor print anything on the node


def test_a_node_that_cannot_answer_is_named() -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        session = pool._sessions[0]
        session.stream.signal = lambda signum: None  # type: ignore[method-assign]  # lost signal
        assert pool.stacks(timeout=0.3) == {0: "(no answer within 0.3 s)"}


def test_stacks_of_a_closed_pool_is_an_error() -> None:
    pool = sky.ComputePool(nodes=1, stream_output=False)
    with pytest.raises(sky.PoolClosedError):
        pool.stacks()
