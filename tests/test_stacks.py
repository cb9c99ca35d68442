"""`pool.stacks()`: every node's threads' stacks, asked from the agents with SIGUSR2, on Local
agents and (tests/ssh, tests/slurm) over SSH channels and through srun."""

from __future__ import annotations

import faulthandler
import tempfile
import threading
import time
from concurrent.futures import Future

import pytest

import skyward as sky
from skyward.worker import agent


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


def test_a_stalled_broadcast_fails_naming_the_stuck_node_with_its_stack(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Node 1 waits forever while node 0 finished: nothing finishes and nobody reports for
    stall_timeout, so the pool shows every node's stacks and the broadcast raises, naming
    node 1, within stall_timeout + 5 s."""
    with sky.ComputePool(nodes=2, stall_timeout=2) as pool:
        began = time.monotonic()
        with pytest.raises(sky.WorkerError) as caught:
            stuck_in_a_wait(1, 600) @ pool
        took = time.monotonic() - began
    assert took < 2 + 5, f"named after {took:.1f} s"
    assert caught.value.node == 1, str(caught.value)
    message = str(caught.value)
    assert "made no progress for 2 s (stall_timeout" in message and "stuck_in_a_wait" in message
    err = capfd.readouterr().err
    assert "did not move" in err and "--- node 0:" in err and "--- node 1:" in err, err


def test_the_calls_thread_is_cut_out_of_a_dump() -> None:
    """The stall watch compares the stack of the thread that runs the calls only: the agent's
    own threads move whenever it answers. A real faulthandler dump with two threads."""
    release = threading.Event()
    other = threading.Thread(target=release.wait, name="other")
    other.start()
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        dump = out.read()
    release.set()
    other.join()
    mine = agent._thread_in(dump, threading.get_ident())
    theirs = agent._thread_in(dump, other.ident)
    assert "test_the_calls_thread_is_cut_out_of_a_dump" in mine and mine in dump, dump
    assert "in wait" in theirs and "test_the_calls_thread" not in theirs, dump
    assert agent._thread_in(dump[:40], threading.get_ident()) == dump[:40]  # cut short


@sky.compute
def working_or_stuck(stuck: int, seconds: float) -> str:
    """Node `stuck` waits; the others work for `seconds`, one frame deeper every 0.1 s, so
    their stacks differ whenever they are sampled a second apart."""
    if sky.instance_info().node == stuck:
        threading.Event().wait(seconds)
        return "waited"
    return _deeper(time.monotonic(), seconds, depth=0)


def _deeper(began: float, seconds: float, depth: int) -> str:
    while time.monotonic() < began + seconds:
        if time.monotonic() > began + 0.1 * (depth + 1):
            return _deeper(began, seconds, depth + 1)
        time.sleep(0.01)
    return "worked"


def test_a_stall_fails_only_the_node_whose_stack_did_not_move(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Three busy nodes, node 1 stuck, nodes 0 and 2 working without reporting: node 1 is
    failed and named; the console says that the others' stacks moved."""
    with sky.ComputePool(nodes=3, stall_timeout=2) as pool:
        with pytest.raises(sky.WorkerError) as caught:
            working_or_stuck(1, 8) @ pool
    assert caught.value.node == 1 and not caught.value.stopped, str(caught.value)
    assert "its stack did not move" in str(caught.value), str(caught.value)
    err = capfd.readouterr().err
    assert "node(s) [1] did not move" in err and "node(s) [0, 2] moved" in err, err
    assert "failing node(s) [1]\n" in err, err


def test_a_stall_whose_stacks_all_moved_fails_no_node(capfd: pytest.CaptureFixture[str]) -> None:
    """Every busy node works without reporting past stall_timeout: the console says that
    their stacks moved and none is stuck, and the calls run to their end."""
    with sky.ComputePool(nodes=2, stall_timeout=1) as pool:
        assert working_or_stuck(-1, 4) @ pool == ["worked", "worked"]
    err = capfd.readouterr().err
    assert "node(s) [0, 1] moved" in err and "no node is stuck" in err, err
    assert "did not move" not in err, err


def test_reports_are_progress_for_the_stall_watch() -> None:
    """A call that reports more often than stall_timeout is not a stall, however long it runs."""
    with sky.ComputePool(nodes=1, stall_timeout=1, stream_output=False) as pool:
        assert reporting(steps=12, every=0.25) >> pool == 12


@sky.compute
def reporting(steps: int, every: float) -> int:
    for step in range(steps):
        time.sleep(every)
        sky.report({"step": float(step)})
    return steps


def test_stall_timeout_must_be_positive() -> None:
    with pytest.raises(sky.ConfigError, match="stall_timeout"):
        sky.ComputePool(nodes=1, stall_timeout=0)
