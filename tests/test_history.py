"""The pools' history the dashboard reads (`skyward.history`), and `sky.report` in scripts
that `skyward run` starts: written by real pools and real scripts on Local, each test with its
own skyward cache."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import skyward as sky
from skyward import history, reports

REPORTING = """\
import skyward as sky
for step in range(8):
    sky.report({"loss": 1.0 / (step + 1), "step": step})
print("reported", flush=True)
"""


@sky.compute
def noisy(steps: int) -> int:
    for step in range(steps):
        print(f"line {step}", flush=True)
        sky.report({"loss": 1.0 / (step + 1), "step": step})
    return steps


def test_a_pool_keeps_its_history_owner_only_and_ends_succeeded(own_cache: Path) -> None:
    with sky.ComputePool(nodes=2, name="kept") as pool:
        assert noisy(3) @ pool == [3, 3]
    (info,) = history.runs()
    assert (info["name"], info["state"], info["nodes"], info["provider"]) == (
        "kept",
        "succeeded",
        2,
        "local",
    )
    assert info["ended"] >= info["started"] and info["cost"] == 0.0
    lines, _ = history.records(info["id"], "output")
    assert sorted((r["who"], r["line"]) for r in lines) == [
        (f"node {node}", f"line {step}") for node in range(2) for step in range(3)
    ]
    metrics, _ = history.records(info["id"], "metrics")
    assert sorted((m["node"], m["metrics"]["step"]) for m in metrics) == [
        (node, step) for node in range(2) for step in range(3)
    ]
    events, _ = history.records(info["id"], "events")
    assert any(e["text"].startswith("ready: 2 node(s)") for e in events)
    directory = own_cache / "history" / info["id"]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((own_cache / "history").stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_pool_whose_block_raised_is_failed_with_the_error(own_cache: Path) -> None:
    with pytest.raises(ZeroDivisionError), sky.ComputePool(nodes=1):
        print(1 / 0)
    (info,) = history.runs()
    assert info["state"] == "failed" and info["reason"] == "ZeroDivisionError: division by zero"
    assert info["name"] == info["id"]  # no name=: listed by its id


def test_records_after_a_number_and_output_bounded_by_dropping_the_older_half(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "OUTPUT_BYTES", 20_000)
    recorder = history.Recorder("bounded-1", "bounded", "local", 1)
    for i in range(2000):
        recorder.line("node 0", f"line {i:05d}")
        if i % 100 == 99:
            recorder.flush()
    recorder.end("succeeded")
    size = (recorder.directory / "output.jsonl").stat().st_size
    assert size <= 20_000 + 100 * 60  # bounded: at most a flush's worth past the limit
    kept, offset = history.records("bounded-1", "output")
    numbers = [r["n"] for r in kept]
    assert numbers == list(range(numbers[0], 2001)) and numbers[0] > 1000
    assert kept[-1]["line"] == "line 01999"
    later, _ = history.records("bounded-1", "output", after=1990)
    assert [r["n"] for r in later] == list(range(1991, 2001))
    recorder = history.Recorder("bounded-1", "bounded", "local", 1)  # more, read from `offset`
    assert history.records("bounded-1", "output", after=2000, offset=offset) == ([], offset)


def test_a_skyward_run_scripts_reports_reach_the_pools_history(
    own_cache: Path, tmp_path: Path
) -> None:
    script = tmp_path / "reporting.py"
    script.write_text(REPORTING)
    ran = subprocess.run(
        [sys.executable, "-m", "skyward.cli", "run", "--nodes", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "outside a skyward node" not in ran.stderr
    (info,) = history.runs()
    assert info["name"] == f"reporting.py ({info['id']})" and info["state"] == "succeeded"
    metrics, _ = history.records(info["id"], "metrics")
    assert sorted((m["who"], m["metrics"]["step"]) for m in metrics) == [
        (f"node {node}", step) for node in range(2) for step in range(8)
    ]


def test_a_detached_scripts_reports_are_kept_by_rank(own_cache: Path, tmp_path: Path) -> None:
    script = tmp_path / "reporting.py"
    script.write_text(REPORTING)
    run = sky.submit(str(script), nodes=2, name="kept-reports")
    assert run.wait(timeout=60) == 0
    for node in range(2):
        lines = (own_cache / "runs/kept-reports" / f"node-{node}" / "reports.jsonl").read_text()
        steps = [json.loads(line)["metrics"]["step"] for line in lines.splitlines()]
        assert steps == list(range(8))
        # and for TensorBoard, under the rank's outputs (which come back with the run's)
        (events,) = (own_cache / "runs/kept-reports" / f"node-{node}").rglob("events.out.*")
        expected = [("loss", step, pytest.approx(1.0 / (step + 1))) for step in range(8)]
        assert _scalars(events.parent) == expected


def test_an_inherited_reports_variable_whose_pipe_is_not_there_is_not_written_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    other = os.open(tmp_path / "another-file", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        # A process the script started: the variable names a pipe this process does not have.
        monkeypatch.setenv(reports.REPORTS_FD_ENV, f"{other}:1")
        monkeypatch.setattr(reports, "_put", None)
        monkeypatch.setattr(reports, "_warned", False)
        with pytest.warns(UserWarning, match="outside a skyward node"):
            sky.report({"loss": 1.0})
        assert (tmp_path / "another-file").read_bytes() == b""
    finally:
        os.close(other)


def _scalars(directory: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in `directory`'s TensorBoard event files, read as
    TensorBoard reads them: TFRecords (a length, its CRC, an Event, its CRC)."""
    from tensorboardX.proto import event_pb2

    found = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return found


def test_reports_are_written_for_tensorboard_under_the_output_dir(
    own_cache: Path, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboardX")
    with sky.ComputePool(nodes=2, output_dir=str(tmp_path / "out")) as pool:
        noisy(4) @ pool
    for node in range(2):
        scalars = _scalars(tmp_path / "out" / "tensorboard" / f"node-{node}")
        assert scalars == [("loss", step, pytest.approx(1.0 / (step + 1))) for step in range(4)]


def test_the_dashboard_reads_a_slurm_runs_reports_from_the_shared_cache(
    own_cache: Path, tmp_path: Path
) -> None:
    from skyward.dashboard.runs import Runs
    from skyward.detached import record

    directories = []
    for rank in range(2):
        directory = tmp_path / "shared" / f"node-{rank}"
        directory.mkdir(parents=True)
        lines = [json.dumps({"time": 1.0 + s, "metrics": {"loss": s}}) for s in range(3)]
        (directory / "reports.jsonl").write_text("\n".join(lines) + "\n")
        directories.append(str(directory))
    record.save(
        record.RunRecord(
            name="on-slurm",
            provider="slurm",
            kind="slurm",
            nodes=2,
            script="train.py",
            args=[],
            created_at=1.0,
            directories=directories,
            reach={"job_id": "1"},
        )
    )
    runs = Runs()
    try:
        found = runs.records("detached", "on-slurm", "metrics", 0)
    finally:
        runs.close()
    assert sorted((m["who"], m["metrics"]["loss"]) for m in found) == [
        (f"node {rank}", s) for rank in range(2) for s in range(3)
    ]
