"""Secrets stay off command lines on a real Slurm cluster: not in srun's on the login node (it
lives as long as the pool), not in a step's on a node."""

from __future__ import annotations

import os
from pathlib import Path

import skyward as sky
from tests.slurm.conftest import wait_for_empty_queue
from tests.support import cmdlines
from tests.support.slurmcluster import SlurmCluster

AGENT = " -m skyward.worker "  # the agent's command line, as `cmdlines.Watch` joins it
SRUN = "srun --jobid="  # a step started from the login node


@sky.compute
def canary_here() -> str:
    return os.environ["SKYWARD_CANARY"]


def test_env_values_never_reach_a_command_line(login: SlurmCluster, tmp_path: Path) -> None:
    """No process on the login node (this machine: the client runs there) or on a node shows
    the value in its command line while the pool starts, runs a call and ends; the node still
    has it in its environment.

    slurmctld and the slurmd run in network namespaces of this machine, which share its process
    table: the sampler reads srun's command line on the login node and every step's on the
    nodes (and proves it saw both). A fresh cache on the node makes the bootstrap unpack
    skyward there, a step without an `exec`.
    """
    value = cmdlines.canary()
    env = {"SKYWARD_CANARY": value, "SKYWARD_CACHE_DIR": str(tmp_path / "node-cache")}
    provider = sky.Slurm(build_env=env)
    with cmdlines.Watch(value, markers=[AGENT, SRUN]) as watch:
        with sky.ComputePool(provider=provider, nodes=1, env=env, stream_output=False) as pool:
            seen = canary_here() >> pool
    assert seen == value
    assert watch.leaks == [], watch.leaks[:3]
    assert {AGENT, SRUN} <= watch.seen, f"the sampler saw only {watch.seen}"
    assert (tmp_path / "node-cache" / "src").is_dir(), "the node was bootstrapped afresh"
    assert wait_for_empty_queue(login, 5) == []
