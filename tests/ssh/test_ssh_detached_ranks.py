"""Detached runs of several ranks a node on SSH hosts (network namespaces): 2 hosts x 2 ranks,
node 1's ranks each reached by node 0's leader over ``ssh`` with a key of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward.cli.main import main
from skyward.detached import record
from tests.ssh.conftest import Hosts, detached_project, processes_with, wait_until

pytestmark = [pytest.mark.ssh]

# Each rank prints three steps and its torchrun variables; with $FAIL, rank 3 exits with it
# while the others would go on for a minute.
JOB = """\
import os, sys, time
rank = os.environ["RANK"]
env = os.environ
told = f"local {env['LOCAL_RANK']} node {env['NODE_RANK']} of {env['WORLD_SIZE']}"
for step in range(3):
    print(f"rank {rank} step {step} {told}", flush=True)
    time.sleep(0.3)
if os.environ.get("FAIL"):
    if rank == "3":
        sys.exit(int(os.environ["FAIL"]))
    time.sleep(60)
open(os.path.join(os.environ["SKYWARD_OUTPUT_DIR"], "done.txt"), "w").write(rank)
"""


@pytest.fixture
def project(netns_hosts: Hosts, tmp_path: Path) -> Iterator[Path]:
    with detached_project(netns_hosts, tmp_path, JOB) as directory:
        yield directory


def _authorized_lines(name: str) -> list[str]:
    path = Path("/root/.ssh/authorized_keys")
    text = path.read_text() if path.exists() else ""
    return [line for line in text.splitlines() if f"skyward-run:{name}:" in line]


@pytest.mark.slow
def test_two_hosts_of_two_ranks_each(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "ssh-ranks"
    command = ["run", "--detach", "--nproc-per-node", "2", "--name", name]
    assert main([*command, "--output-dir", "out", "job.py", f"token-{name}"]) == 0
    assert main(["logs", "-f", name]) == 0
    out = capsys.readouterr().out
    for rank in range(4):
        node, local = divmod(rank, 2)
        tag = f"(node {node} rank {rank})"
        lines = [line for line in out.splitlines() if line.startswith(tag)]
        told = f"local {local} node {node} of 4"
        assert lines == [f"{tag} rank {rank} step {s} {told}" for s in range(3)], out
        kept = project / "out" / f"node-{node}" / f"rank-{rank}" / "done.txt"
        assert kept.read_text() == str(rank)
    directories = record.load(name).directories
    assert [Path(d).relative_to(Path(d).parents[2]).as_posix() for d in directories] == [
        f"{name}/node-0/rank-0",
        f"{name}/node-0/rank-1",
        f"{name}/node-1/rank-2",
        f"{name}/node-1/rank-3",
    ]
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert _authorized_lines(name) == []
    for directory in directories:
        assert not (Path(directory) / "spec.json").exists()


@pytest.mark.slow
def test_a_failing_rank_on_the_second_host_stops_every_rank(
    netns_hosts: Hosts, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "ssh-ranks-fail"
    command = ["run", "--detach", "--nproc-per-node", "2", "--name", name, "--env", "FAIL=3"]
    assert main([*command, "job.py", f"token-{name}"]) == 0
    capsys.readouterr()
    assert main(["logs", "-f", name]) == 3
    assert "node 1 rank 3 exited with status 3" in capsys.readouterr().err
    assert wait_until(lambda: not processes_with(f"token-{name}"), 20)
    assert wait_until(lambda: not processes_with(f"runs/{name}/"), 10)
    assert _authorized_lines(name) == []
