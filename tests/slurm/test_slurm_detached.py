"""Detached runs on the real Slurm cluster of tests/slurm/conftest.py: the run is a batch job.

`skyward run --detach` runs in a process of its own, which ends once every rank has started;
the job then holds the run with no client left, and this process (the login node) follows it
with `skyward logs`, `status` and `stop`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skyward.cli.main import main
from tests.slurm.conftest import queue, wait_for_empty_queue
from tests.ssh.conftest import processes_with
from tests.support.slurmcluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]

JOB = """\
import os, socket, sys, time
rank = os.environ["JAX_PROCESS_ID"]
for step in range(int(sys.argv[1])):
    print(f"rank {rank} of {os.environ['JAX_NUM_PROCESSES']} on {socket.gethostname()}", flush=True)
    time.sleep(0.5)
"""


def _detach(tmp_path: Path, name: str, steps: int) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "skyward.toml").write_text(f'[profile.default]\npython = "{sys.executable}"\n')
    command = ["run", "--detach", "--provider", "slurm", "--nodes", "3", "--name", name]
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", *command, "job.py", str(steps)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _why(name: str, started: subprocess.CompletedProcess[str]) -> str:
    """The client's error, and what the job's leader wrote."""
    root = Path(os.environ["SKYWARD_CACHE_DIR"]) / "runs" / name
    said = [started.stderr]
    for path in [root / "batch.out", *root.glob("node-0/**/leader.log")]:
        if path.exists():
            said.append(f"{path.name}: {path.read_text()}")
    return "\n".join(said)


def _status_line(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["status"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(name)]
    assert lines
    return lines[0]


def test_a_detached_run_is_a_batch_job_that_needs_no_client(
    login: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "batch"
    started = _detach(tmp_path, name, 8)
    assert started.returncode == 0, _why(name, started)
    assert f"run {name} started on 3 node(s)" in started.stdout
    jobs = queue(login)
    assert [j.split()[1:] for j in jobs] == [[f"skyward-run-{name}", "RUNNING"]], jobs
    assert not processes_with("--detach")  # nothing of the client is left on the login node
    assert "running" in _status_line(name, capsys)
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in range(3):
        assert f"(node {rank}) rank {rank} of 3 on node{rank}" in out, out
        assert out.count(f"(node {rank}) ") == 8
    assert wait_for_empty_queue(login, 10) == []
    assert "succeeded" in _status_line(name, capsys)


def test_stop_cancels_a_detached_batch_job(
    login: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "cancelled"
    started = _detach(tmp_path, name, 1200)
    assert started.returncode == 0, _why(name, started)
    begun = time.monotonic()
    assert main(["stop", name]) == 0
    assert time.monotonic() - begun < 20
    assert wait_for_empty_queue(login, 10) == []
    assert "stopped" in _status_line(name, capsys)


# torchrun's variables in every rank, and one gloo group over all of them: 0+1+2+3 = 6.
RANKS = """\
import os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(os.environ["RANK"])])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "JAX_PROCESS_ID")
told = " ".join(f"{name}={os.environ[name]}" for name in names)
print(f"{told} sum={int(total.item())} on {socket.gethostname()}", flush=True)
dist.destroy_process_group()
"""


def test_a_detached_batch_job_holds_several_ranks_a_node(
    login: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "ranked"
    (tmp_path / "ranks.py").write_text(RANKS)
    (tmp_path / "skyward.toml").write_text(f'[profile.default]\npython = "{sys.executable}"\n')
    command = ["run", "--detach", "--provider", "slurm", "--nodes", "2", "--nproc-per-node", "2"]
    started = subprocess.run(
        [sys.executable, "-m", "skyward.cli", *command, "--name", name, "ranks.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert started.returncode == 0, _why(name, started)
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in range(4):
        node, local = divmod(rank, 2)
        told = f"RANK={rank} LOCAL_RANK={local} NODE_RANK={node} WORLD_SIZE=4 LOCAL_WORLD_SIZE=2"
        line = f"(node {node} rank {rank}) {told} JAX_PROCESS_ID={rank} sum=6 on node{node}"
        assert line in out, out
    assert wait_for_empty_queue(login, 10) == []
    assert "succeeded" in _status_line(name, capsys)
    root = Path(os.environ["SKYWARD_CACHE_DIR"]) / "runs" / name
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("node-*/rank-*")) == [
        "node-0/rank-0",
        "node-0/rank-1",
        "node-1/rank-2",
        "node-1/rank-3",
    ]
