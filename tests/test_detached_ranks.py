"""Detached runs with several ranks a node (``skyward run --detach --nproc-per-node P``,
`sky.submit(processes_per_node=P)`), on Local: a node is a process group of this machine, each
rank a process of its own with torchrun's variables, under the run's supervisor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import skyward as sky
from skyward.detached import record
from skyward.worker import supervisor
from tests.conftest import alive, wait_gone

ROOT = Path(__file__).resolve().parents[1]

# A torchrun-style script: the group from torchrun's variables, an all_reduce of the ranks
# (0+1+2+3 = 6 in every rank), and what each rank was told.
TORCHRUN = """\
import os, pathlib
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(os.environ["RANK"])])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
told = " ".join(f"{name}={os.environ[name]}" for name in names)
print(f"{told} sum={int(total.item())}", flush=True)
out = pathlib.Path(os.environ["SKYWARD_OUTPUT_DIR"])
(out / "rank.txt").write_text(os.environ["RANK"])
dist.destroy_process_group()
"""

# Every rank says it is up, then waits to be stopped; the one named by argv[1] exits 3 once
# every rank is up (each writes a file into argv[2]).
FAILING = """\
import os, pathlib, sys, time
rank = os.environ["RANK"]
pathlib.Path(sys.argv[2], rank).write_text(str(os.getpid()))
print(f"rank {rank} up", flush=True)
if rank == sys.argv[1]:
    deadline = time.monotonic() + 30
    while len(os.listdir(sys.argv[2])) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


def skyward(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """A `skyward` command as a user types it, in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def expected_lines() -> list[str]:
    lines = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        told = (
            f"RANK={rank} LOCAL_RANK={local} NODE_RANK={node} GROUP_RANK={node} "
            "WORLD_SIZE=4 LOCAL_WORLD_SIZE=2"
        )
        lines.append(f"(node {node} rank {rank}) {told} sum=6")
    return lines


def rank_pids(name: str) -> list[int]:
    """The pid of every rank of run `name` its followers recorded (its process group's)."""
    directories = record.load(name).directories
    return [int(supervisor.read_json(Path(d) / supervisor.NODE_STATE)["pid"]) for d in directories]


def run_processes(name: str) -> list[int]:
    """This machine's processes whose command line names run `name`'s directories: the
    leader, its guard and the followers (the ranks are their children, in their groups)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(f"runs/{name}/".encode() in word for word in words):
                found.append(int(entry.name))
    return [pid for pid in found if alive(pid)]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_run_detached_as_torchrun_would(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TORCHRUN)
    started = skyward(
        "run",
        "--detach",
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--name",
        "four",
        "--output-dir",
        "out",
        "train.py",
        cwd=tmp_path,
    )
    assert started.returncode == 0, started.stderr
    assert "started on 2 node(s), 4 ranks" in started.stdout
    followed = skyward("logs", "-f", "four", cwd=tmp_path)
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    assert sorted(line for line in lines if line.startswith("(node")) == expected_lines()
    status = skyward("status", cwd=tmp_path)
    row = next(line for line in status.stdout.splitlines() if line.startswith("four "))
    assert "succeeded" in row and " 2 " in row  # the nodes, not the ranks
    for rank in range(4):
        kept = tmp_path / "out" / f"node-{rank // 2}" / f"rank-{rank}" / "rank.txt"
        assert kept.read_text() == str(rank)
    fetched = skyward("fetch", "four", "--to", "again", cwd=tmp_path)
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "again" / "node-1" / "rank-3" / "rank.txt").read_text() == "3"
    assert run_processes("four") == []


@pytest.mark.slow
def test_a_rank_that_fails_stops_every_rank_on_every_node(tmp_path: Path) -> None:
    """The ranks per node from a profile's key, as from the flag."""
    (tmp_path / "job.py").write_text(FAILING)
    (tmp_path / "up").mkdir()
    (tmp_path / "skyward.toml").write_text("[profile.default]\nnodes = 2\nprocesses_per_node = 2\n")
    up = str(tmp_path / "up")
    started = skyward("run", "--detach", "--name", "gang", "job.py", "3", up, cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    followed = skyward("logs", "-f", "gang", cwd=tmp_path)
    assert followed.returncode == 3, followed.stdout + followed.stderr
    assert "node 1 rank 3 exited with status 3" in followed.stderr
    for rank in range(4):
        assert f"(node {rank // 2} rank {rank}) rank {rank} up" in followed.stdout
    status = sky.Run("gang").status()
    assert (status.state, status.rank, status.exit_status) == ("failed", 3, 3)
    ranks = [int((tmp_path / "up" / str(rank)).read_text()) for rank in range(4)]
    assert wait_gone(ranks, timeout=20) == [], "a rank outlived the gang rule"
    assert wait_gone(run_processes("gang"), timeout=10) == []
    for directory in record.load("gang").directories:
        assert not (Path(directory) / supervisor.SPEC).exists()


@pytest.mark.slow
def test_submit_with_processes_per_node_starts_a_rank_a_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN)
    run = sky.submit(str(script), nodes=2, processes_per_node=2, name="api-ranks")
    assert run.wait(timeout=120) == 0
    lines: list[str] = []
    run.logs(out=lines.append)
    assert sorted(lines) == expected_lines()
    placed = run.fetch(tmp_path / "out")
    assert [p.relative_to(tmp_path / "out").as_posix() for p in placed] == [
        "node-0/rank-0",
        "node-0/rank-1",
        "node-1/rank-2",
        "node-1/rank-3",
    ]


JAX_WORLD = """\
import jax
jax.distributed.initialize()
print(f"{jax.process_index()} of {jax.process_count()}", flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_jax_sees_a_process_a_rank_in_a_detached_run(tmp_path: Path) -> None:
    script = tmp_path / "world.py"
    script.write_text(JAX_WORLD)
    run = sky.submit(
        str(script),
        nodes=2,
        processes_per_node=2,
        plugins=[sky.plugins.jax()],
        env={"JAX_PLATFORMS": "cpu"},
        name="jax-ranks",
    )
    assert run.wait(timeout=120) == 0
    lines: list[str] = []
    run.logs(out=lines.append)
    assert sorted(lines) == [f"(node {r // 2} rank {r}) {r} of 4" for r in range(4)]


@pytest.mark.slow
def test_stop_ends_every_rank_on_every_node(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(FAILING)
    (tmp_path / "up").mkdir()
    run = sky.submit(
        str(tmp_path / "job.py"),
        ["none", str(tmp_path / "up")],
        nodes=2,
        processes_per_node=2,
        name="halt",
        grace=2,
    )
    deadline = time.monotonic() + 30
    while len(os.listdir(tmp_path / "up")) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = rank_pids("halt")
    assert len(ranks) == 4 and all(alive(pid) for pid in ranks)
    assert len(run_processes("halt")) >= 5  # the leader, its guard, a follower a rank
    status = run.stop()
    assert status.state == "stopped"
    assert wait_gone(ranks, timeout=20) == []
    assert wait_gone(run_processes("halt"), timeout=10) == []
    assert json.loads((Path(run.record.directories[0]) / "run.json").read_text())["state"] == (
        "stopped"
    )


@pytest.mark.parametrize(
    ("value", "accelerator"),
    [(0, None), (-2, None), (2.5, None), ("2", None), (True, None), (4, "A100:2")],
)
def test_a_bad_processes_per_node_is_refused_before_anything_starts(
    tmp_path: Path, value: object, accelerator: str | None
) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('never run')\n")
    with pytest.raises(sky.ConfigError, match="processes_per_node"):
        sky.submit(
            str(script),
            nodes=2,
            processes_per_node=value,  # type: ignore[arg-type]
            accelerator=accelerator,
            name="refused",
        )
    assert not record.exists("refused")
    assert not supervisor.run_root("refused").exists()  # no leader was started ahead


def test_skyward_run_detach_refuses_a_bad_nproc_per_node(tmp_path: Path) -> None:
    (tmp_path / "noop.py").write_text("print('never run')\n")
    for value in ("0", "-1"):
        refused = skyward("run", "--detach", "--nproc-per-node", value, "noop.py", cwd=tmp_path)
        assert refused.returncode != 0
        assert "--nproc-per-node (processes_per_node)" in refused.stderr, refused.stderr
        assert "never run" not in refused.stdout


# -- what a detached run takes of each plugin (no processes) -------------------------------------


@pytest.mark.parametrize(
    ("plugins", "expected"),
    [
        ([sky.plugins.torch()], 8),  # as the attached pool: a rank per GPU
        ([sky.plugins.torch(initialize=False, per_gpu=True)], 8),  # `skyward run --plugin torch`
        ([sky.plugins.torch(per_gpu=False)], 1),
        ([sky.plugins.torch(initialize=False)], 1),
        ([sky.plugins.jax()], 1),
        ([], 1),
    ],
)
def test_a_detached_run_keeps_the_plugins_ranks_a_node(
    plugins: list[sky.Plugin], expected: int
) -> None:
    from skyward.client.plan import ranks_per_node
    from skyward.detached.submit import launcher_plugins
    from skyward.hardware import Accelerator, ClusterSpec

    cluster = ClusterSpec(nodes=2, pool_id="pool-test", accelerator=Accelerator.parse("H100:8"))
    assert ranks_per_node(None, launcher_plugins(plugins), cluster) == expected


def test_a_detached_run_leaves_the_frameworks_initialization_to_the_script() -> None:
    from skyward.detached.submit import launcher_plugins
    from skyward.plugins.launcher import LauncherEnv

    given = [LauncherEnv(), sky.plugins.torch(), sky.plugins.jax(), sky.Plugin("mine")]
    chosen = launcher_plugins(given)
    assert [p.name for p in chosen] == ["launcher-env", "torch", "jax", "mine"]
    assert [getattr(p, "initialize", None) for p in chosen] == [None, False, False, None]
    assert chosen[3] is given[3]  # a plugin with nothing to leave out is taken as it is
    assert [getattr(p, "initialize", None) for p in given[1:3]] == [True, True]  # not changed
