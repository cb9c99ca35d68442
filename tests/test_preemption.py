"""`sky.preempting()` and `sky.on_preemption()`: a preemption notice (SIGUSR1, as Slurm's
``--signal`` and ``scancel --signal`` send it) reaches the user's code on the node, whose
callback's checkpoint reaches the client; a node that then goes is a preempted WorkerError."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import skyward as sky


@sky.compute
def work_until_preempted(then_die: bool) -> tuple[str, float]:
    """Register a callback that saves and reports a checkpoint, then wait for the notice: its
    source and when it came. After a restart: what the checkpoint says, and 0."""
    resume = sky.resume_from()
    if resume is not None:
        return (Path(resume) / "state").read_text(), 0.0

    def save_now(notice: sky.Preemption) -> None:
        path = Path(sky.output_dir()) / "ckpt-on-notice"
        path.mkdir(parents=True, exist_ok=True)
        (path / "state").write_text(f"saved after {notice.source}")
        sky.report({"saved": 1.0}, checkpoint=str(path))

    sky.on_preemption(save_now)
    deadline = time.time() + 30
    while (notice := sky.preempting()) is None:
        if time.time() > deadline:  # (no assert: pytest rewrites them, and nodes lack pytest)
            raise TimeoutError("no notice came")
        time.sleep(0.01)
    time.sleep(0.5)  # the callback runs in its own thread
    if then_die:
        os._exit(0)  # the machine goes, as the notice said
    return notice.source, notice.noticed_at


def notify(pool: sky.ComputePool, node: int) -> float:
    """What a provider's notice does to a node: SIGUSR1 to its agent. When it was sent."""
    sent = time.time()
    pool._sessions[node].stream.signal(signal.SIGUSR1)
    return sent


def test_a_notice_reaches_the_callback_and_its_checkpoint_the_client(tmp_path: Path) -> None:
    with sky.ComputePool(nodes=1, output_dir=tmp_path / "runs", stream_output=False) as pool:
        future = pool.submit(work_until_preempted(False), node=0)
        time.sleep(0.5)
        sent = notify(pool, 0)
        source, noticed_at = future.result(timeout=30)
        assert source == "SIGUSR1"
        assert noticed_at - sent < 1.0  # the notice reached the user's code within a second
        saved = [r for r in pool.reports if r.checkpoint]
        assert saved and saved[-1].time - sent < 1.0, pool.reports
        assert "got a preemption notice (SIGUSR1)" in "\n".join(pool.logs(0))
        checkpoint = pool.latest_checkpoint()
        assert checkpoint is not None
        assert (Path(checkpoint.source) / "state").read_text() == "saved after SIGUSR1"


def test_a_node_that_goes_after_its_notice_is_preempted() -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        future = pool.submit(work_until_preempted(True), node=0)
        time.sleep(0.5)
        notify(pool, 0)
        with pytest.raises(sky.WorkerError) as caught:
            future.result(timeout=30)
    assert caught.value.preempted, str(caught.value)
    assert "node 0 was preempted (SIGUSR1)" in str(caught.value)


def test_outside_a_node_there_is_no_notice() -> None:
    assert sky.preempting() is None
