"""`sky.report` on the Local provider: reports reach the client while calls run, in order, and
before the call's result; `on_report`; what is accepted; `sky.report` away from a node."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward import reports
from skyward.client.session import NodeSession
from skyward.transport import messages


class Listener:
    """The module pool's `on_report`: every report, and an optional hook for one test."""

    def __init__(self) -> None:
        self.hook: Callable[[sky.Report], None] | None = None
        self.seen: list[sky.Report] = []

    def __call__(self, report: sky.Report) -> None:
        self.seen.append(report)
        if self.hook is not None:
            self.hook(report)


LISTENER = Listener()


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    with sky.ComputePool(nodes=2, stream_output=False, on_report=LISTENER) as running:
        yield running


def tagged(pool: sky.ComputePool, tag: str) -> list[sky.Report]:
    return [r for r in pool.reports if r.metrics.get("tag") == tag]


@sky.compute
def steps(tag: str, count: int) -> int:
    node = sky.instance_info().node
    for step in range(count):
        sky.report({"tag": tag, "step": step, "node": node, "loss": 1.0 / (step + 1)})
    return count


def test_a_report_reaches_the_client_while_the_call_still_runs(
    pool: sky.ComputePool, tmp_path: Path
) -> None:
    go_on = tmp_path / "go-on"

    @sky.compute
    def report_then_wait(path: str) -> bool:
        sky.report({"tag": "running", "epoch": 1})
        deadline = time.monotonic() + 30
        while not os.path.exists(path):  # the client creates it once it has the report
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def on_report(report: sky.Report) -> None:
        if report.metrics.get("tag") == "running":
            go_on.touch()

    LISTENER.hook = on_report
    try:
        assert report_then_wait(str(go_on)) >> pool is True
    finally:
        LISTENER.hook = None
    (seen,) = tagged(pool, "running")
    assert seen.metrics == {"tag": "running", "epoch": 1}
    assert seen.checkpoint is None
    assert abs(seen.time - time.time()) < 60  # the node's wall clock


def test_a_broadcast_keeps_each_nodes_reports_in_order_with_its_node(
    pool: sky.ComputePool,
) -> None:
    tag = uuid.uuid4().hex
    assert steps(tag, 50) @ pool == [50, 50]
    got = tagged(pool, tag)
    assert len(got) == 100
    for node in (0, 1):
        mine = [r for r in got if r.node == node]
        assert [r.metrics["step"] for r in mine] == list(range(50))
        assert all(r.metrics["node"] == node for r in mine)
        assert [r.time for r in mine] == sorted(r.time for r in mine)
    assert [r for r in LISTENER.seen if r.metrics.get("tag") == tag] == got
    latest = pool.console.latest  # what a live status line would show: node 0's last report
    assert latest is not None and (latest.node, latest.metrics["step"]) == (0, 49)


def test_every_report_made_before_return_is_in_pool_reports_when_the_call_returns(
    pool: sky.ComputePool,
) -> None:
    for _ in range(5):
        tag = uuid.uuid4().hex
        assert steps(tag, 300) >> pool == 300
        assert len(tagged(pool, tag)) == 300
    tags = [uuid.uuid4().hex for _ in range(4)]
    assert sky.gather(*(steps(tag, 200) for tag in tags)) >> pool == (200,) * 4
    assert [len(tagged(pool, tag)) for tag in tags] == [200] * 4
    future = pool.submit(steps(tag := uuid.uuid4().hex, 200))
    assert future.result(timeout=30) == 200
    assert len(tagged(pool, tag)) == 200


def test_reports_made_before_a_call_raises_arrive_too(pool: sky.ComputePool) -> None:
    tag = uuid.uuid4().hex

    @sky.compute
    def report_then_fail() -> None:
        sky.report({"tag": tag, "last": 1})
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        report_then_fail() >> pool
    assert [r.metrics["last"] for r in tagged(pool, tag)] == [1]


def test_a_checkpoint_path_is_carried_as_a_string(pool: sky.ComputePool) -> None:
    tag = uuid.uuid4().hex

    @sky.compute
    def save() -> None:
        sky.report({"tag": tag}, checkpoint="/ckpt/step-10")
        sky.report({"tag": tag, "step": 20}, checkpoint=Path("/ckpt") / "step-20")

    save() >> pool
    assert [(r.metrics.get("step"), r.checkpoint) for r in tagged(pool, tag)] == [
        (None, "/ckpt/step-10"),
        (20, "/ckpt/step-20"),
    ]


def test_numpy_scalars_arrive_as_plain_numbers(pool: sky.ComputePool) -> None:
    np = pytest.importorskip("numpy")
    tag = uuid.uuid4().hex

    @sky.compute
    def numbers() -> None:
        sky.report(
            {
                "tag": tag,
                "f32": np.float32(0.5),
                "f64": np.float64(0.25),
                "i64": np.int64(3),
                "flag": np.bool_(True),
                "zero_d": np.array(2.0),
                "one": np.array([7]),
            }
        )

    numbers() >> pool
    (got,) = tagged(pool, tag)
    assert got.metrics == {
        "tag": tag,
        "f32": 0.5,
        "f64": 0.25,
        "i64": 3,
        "flag": True,
        "zero_d": 2.0,
        "one": 7,
    }
    assert [type(v) for v in got.metrics.values()] == [str, float, float, int, bool, float, int]


def test_a_jax_scalar_is_read_when_sent(pool: sky.ComputePool) -> None:
    pytest.importorskip("jax")
    tag = uuid.uuid4().hex

    @sky.compute
    def jax_loss() -> None:
        import jax.numpy as jnp

        sky.report({"tag": tag, "loss": jnp.float32(1.5) * 2})

    jax_loss() >> pool
    (got,) = tagged(pool, tag)
    assert got.metrics["loss"] == 3.0 and type(got.metrics["loss"]) is float


def test_a_bad_metric_raises_type_error_on_the_node_naming_the_key(
    pool: sky.ComputePool,
) -> None:
    @sky.compute
    def bad(value: Any) -> None:
        sky.report({"loss": 1.0, "weights": value})

    with pytest.raises(TypeError, match="'weights'"):
        bad([1.0, 2.0]) >> pool
    with pytest.raises(TypeError, match="'weights'"):
        bad(None) >> pool
    with pytest.raises(TypeError, match="'weights'"):
        bad(1 + 2j) >> pool
    assert not [r for r in pool.reports if "weights" in r.metrics]


def test_a_report_in_a_forked_child_on_the_node_is_ignored_with_a_warning(
    pool: sky.ComputePool,
) -> None:
    @sky.compute
    def fork_and_report() -> int:
        pid = os.fork()
        if pid == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sky.report({"tag": "from-child"})
            os._exit(0 if [str(w.message) for w in caught] else 1)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert fork_and_report() >> pool == 0
    assert not tagged(pool, "from-child")


def test_a_report_costs_the_node_microseconds(pool: sky.ComputePool) -> None:
    @sky.compute
    def cost(count: int) -> float:
        metrics = {"loss": 0.1, "accuracy": 0.9, "lr": 1e-3}
        samples = []
        for _ in range(count):
            began = time.perf_counter_ns()
            sky.report(metrics)
            samples.append(time.perf_counter_ns() - began)
        return sorted(samples)[count // 2] / 1e3

    assert cost(20_000) >> pool <= 50.0  # microseconds, the median on the node


def test_100k_reports_in_a_tight_loop_all_arrive_in_few_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frames_seen = []
    on_frame = NodeSession._on_frame

    def counting(self: NodeSession, message: messages.Message, segments: list[Any]) -> None:
        if type(message) is messages.Reported:
            frames_seen.append(len(message.entries))
        on_frame(self, message, segments)

    monkeypatch.setattr(NodeSession, "_on_frame", counting)
    with sky.ComputePool(nodes=1, stream_output=False) as running:
        assert steps("flood", 100_000) >> running == 100_000
        assert [r.metrics["step"] for r in running.reports] == list(range(100_000))
    assert sum(frames_seen) == 100_000
    assert len(frames_seen) <= 1000, f"{len(frames_seen)} frames for 100,000 reports"


def test_an_on_report_that_raises_is_logged_and_the_call_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def broken(report: sky.Report) -> None:
        calls.append(threading.current_thread().name)
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="skyward"):
        with sky.ComputePool(nodes=1, stream_output=False, on_report=broken) as running:
            assert steps("x", 3) >> running == 3
            assert steps("y", 2) >> running == 2
            assert len(running.reports) == 5
    assert len(calls) == 5
    logged = [r for r in caplog.records if r.name == "skyward"]
    assert len(logged) == 5
    assert "on_report raised" in logged[0].getMessage()
    assert logged[0].exc_info is not None and "callback bug" in str(logged[0].exc_info[1])


def test_report_outside_a_pool_warns_once_and_still_checks_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @sky.compute
    def train() -> int:
        sky.report({"loss": 0.125})
        return 1

    monkeypatch.setattr(reports, "_warned", False)
    with pytest.warns(UserWarning, match="outside a skyward node; ignored"):
        sky.report({"loss": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sky.report({"loss": 0.25}, checkpoint="/tmp/x")
        assert train.local() == 1  # `.local()` runs here: no node either
        with pytest.raises(TypeError, match="'loss'"):
            sky.report({"loss": object()})
        with pytest.raises(TypeError, match="names must be str"):
            sky.report({1: 0.5})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="mapping"):
            sky.report([0.5])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="checkpoint"):
            sky.report({}, checkpoint=5)  # type: ignore[arg-type]
