"""`ComputePool(restarts=N)`: a broadcast that loses a node is run again on a replaced node,
resumed from the newest reported checkpoint (`sky.resume_from()`), with no user code for it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import skyward as sky

EVERY = 5  # a checkpoint every 5 steps


@sky.compute
def count(steps: int, die_at: int, marker: str) -> tuple[int, int]:
    """Sum the steps' numbers in lockstep, as ranks of a collective do (node 0 waits for node 1
    at every step), checkpointing (node 0) every EVERY steps; node 1 dies at step `die_at` the
    first time (the marker file says it already did). Returns (where it resumed, the sum)."""
    info = sky.instance_info()
    progress = Path(marker + ".progress")
    start, total = 0, 0
    resume = sky.resume_from()
    if resume is not None:
        start, total = (int(v) for v in (Path(resume) / "state").read_text().split())
    for step in range(start, steps):
        if info.node == 1:
            if step == die_at and not os.path.exists(marker):
                # The failure comes once the client has the checkpoint before it (the test's
                # on_report writes "<marker>.go"): where it resumes is then known, not a race
                # between the report's bytes and the death.
                go = Path(marker + ".go")
                deadline = time.monotonic() + 30
                while not go.exists() and time.monotonic() < deadline:
                    time.sleep(0.002)
                open(marker, "w").close()
                os._exit(9)  # the node dies mid-training
            progress.write_text(str(step))
        else:
            deadline = time.monotonic() + 30
            while int(progress.read_text() or -1) < step if progress.exists() else True:
                if time.monotonic() > deadline:  # (not assert: nodes lack pytest's rewrite)
                    raise TimeoutError(f"node 1 never reached step {step}")
                time.sleep(0.002)
        total += step
        if info.node == 0 and (step + 1) % EVERY == 0:
            ckpt = Path(sky.output_dir()) / f"ckpt-{step + 1}"
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "state").write_text(f"{step + 1} {total}")
            sky.report({"step": float(step + 1)}, checkpoint=str(ckpt))
    return start, total


@sky.compute
def agent_pid() -> int:
    return os.getpid()


def test_a_lost_node_is_replaced_and_the_call_resumes_from_the_last_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = str(tmp_path / "died")

    def on_report(report: sky.Report) -> None:
        if report.checkpoint is not None and report.metrics["step"] == 10:
            Path(marker + ".go").touch()

    with sky.ComputePool(
        nodes=2, restarts=1, output_dir=tmp_path / "runs", on_report=on_report
    ) as pool:
        first, pids = pool.nodes[0], agent_pid() @ pool
        results = count(40, die_at=12, marker=marker) @ pool
        survivor_kept = pool.nodes[0] is first
        pids_after = agent_pid() @ pool
    assert os.path.exists(marker), "node 1 never died: nothing was tested"
    # The same answer as a run without the failure (the steps are deterministic integers).
    assert [total for _, total in results] == [sum(range(40))] * 2
    # Both resumed from node 0's newest checkpoint before the death (steps 0-9 done).
    assert {start for start, _ in results} == {10}, results
    # The survivor keeps its node (on Local: its slot and GPUs); its agent is a new process,
    # as every agent is: the plugins initialize again on every rank (docs/recovery.md, step 3).
    assert survivor_kept
    assert pids_after[0] != pids[0] and pids_after[1] != pids[1], (pids, pids_after)
    err = capfd.readouterr().err
    assert "restart 1 of 1 after WorkerError" in err and "replacing node(s) [1]" in err, err
    assert "resuming from" in err and "ckpt-10" in err, err


@sky.compute
def always_dies_on(node: int) -> None:
    if sky.instance_info().node == node:
        os._exit(7)


def test_the_final_error_lists_every_failure_once_the_budget_is_spent() -> None:
    with sky.ComputePool(nodes=2, restarts=2, stream_output=False) as pool:
        with pytest.raises(sky.WorkerError) as caught:
            always_dies_on(1) @ pool
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "the call failed 3 times (restarts=2)" in notes, notes
    assert notes.count("node 1: WorkerError") == 3, notes


@sky.compute
def fails_with(kind: str) -> None:
    raise {"lookup": LookupError, "value": ValueError}[kind]("from the function")


def test_a_user_error_is_not_restarted_unless_asked() -> None:
    with sky.ComputePool(nodes=1, restarts=2, restart_on=[LookupError], stream_output=False) as p:
        with pytest.raises(ValueError):
            fails_with("value") @ p
        with pytest.raises(LookupError) as caught:
            fails_with("lookup") @ p
    assert "the call failed 3 times" in "\n".join(getattr(caught.value, "__notes__", []))


@sky.compute
def checkpoint_then_lose_node_1() -> tuple[str | None, str]:
    """First run: node 0 reports a checkpoint and works on; node 1 dies a moment later. After
    the restart: what every node resumes from, and where it runs."""
    import socket

    resume = sky.resume_from()
    if resume is not None:
        return (Path(resume) / "state").read_text(), socket.gethostname()
    if sky.instance_info().node == 0:
        ckpt = Path(sky.output_dir()) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "state").write_text("step 5")
        sky.report({"step": 5.0}, checkpoint=str(ckpt))
        time.sleep(120)  # stopped when node 1 dies
    else:
        time.sleep(1.0)  # after node 0's checkpoint (real ranks would be in lockstep)
        os._exit(9)
    return None, socket.gethostname()
