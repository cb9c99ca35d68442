"""`skyward ls/down --provider slurm`, `skyward status` and `skyward run --provider slurm`, and
the JAX plugin, on the real Slurm cluster of tests/slurm/conftest.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

import skyward as sky
import tests.support.listeners
from skyward.cli import runner
from skyward.cli.main import main
from skyward.cli.profiles import Profile
from tests.slurm.conftest import queue, wait_for_empty_queue
from tests.support.listeners import listeners
from tests.support.slurmcluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]


def test_ls_lists_a_pools_job_and_down_cancels_it(
    login: SlurmCluster,
    running_pool: tuple[str, subprocess.Popen[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    pool_id, client = running_pool
    assert main(["ls", "--provider", "slurm"]) == 0
    listed = capsys.readouterr().out
    assert pool_id in listed and "running on node[0-1]" in listed, listed
    assert (
        runner.print_live_pools(Profile(provider="slurm").build_provider()) == 1
    )  # `skyward status`
    assert f"slurm  here  {pool_id}" in capsys.readouterr().out
    assert main(["down", "--provider", "slurm", pool_id]) == 0
    assert "removed job" in capsys.readouterr().out
    assert wait_for_empty_queue(login, 10) == []
    client.wait(60)  # its nodes are gone: the call fails and the client ends
    assert client.returncode != 0
    assert client.stderr is not None and "WorkerError" in client.stderr.read()
    assert main(["down", "--provider", "slurm", "--all"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


@sky.compute
def psum_of_ranks() -> float:
    import jax
    import jax.numpy as jnp

    total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(
        jnp.full(jax.local_device_count(), float(jax.process_index() + 1))
    )
    return float(total[0])


@pytest.mark.slow
def test_the_jax_plugin_spans_the_allocation(login: SlurmCluster) -> None:
    cloudpickle.register_pickle_by_value(tests.support.listeners)
    provider = sky.Slurm(python=sys.executable)  # the nodes share this machine's Python
    with sky.ComputePool(
        provider=provider, nodes=3, plugins=[sky.plugins.jax()], env={"JAX_PLATFORMS": "cpu"}
    ) as pool:
        assert psum_of_ranks() @ pool == [6.0, 6.0, 6.0]  # 1 + 2 + 3 on every node
        # Node 0's coordinator listens on node 0's own address only, not on [::] or 0.0.0.0
        # (`ss` in its network namespace, where the function runs).
        coordinator, listening = pool.run(listeners("jax"), node=0)
        assert not coordinator.startswith("127.") and listening == [coordinator], listening
    assert wait_for_empty_queue(login, 5) == []


SCRIPT = """\
import socket
import jax

jax.distributed.initialize()  # bare: it must see the pool, not the step's one-task world
total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(jax.numpy.ones(1))
print("rank", jax.process_index(), "of", jax.process_count(), total, socket.gethostname())
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_skyward_run_on_slurm_with_a_bare_jax_initialize(
    login: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    profile = Profile(
        provider="slurm", options={"python": sys.executable}, nodes=3, env={"JAX_PLATFORMS": "cpu"}
    )
    assert runner.run(profile, str(script), []) == runner.RunEnd(0)
    out = capsys.readouterr().out
    for rank in range(3):
        assert f"rank {rank} of 3 [3.] node" in out, out
    assert wait_for_empty_queue(login, 5) == []
    assert queue(login) == []


JOB_SCRIPT = """\
import os
import subprocess

out = subprocess.run(
    ["scontrol", "-o", "show", "job", os.environ["SKYWARD_SLURM_JOB_ID"]],
    capture_output=True, text=True, check=True,
).stdout
job = dict(word.split("=", 1) for word in out.split() if "=" in word)
print("JOB", job["Partition"], job["Account"], job["TimeLimit"], job["NumNodes"])
"""


def test_skyward_run_takes_the_slurm_profile_and_flags(
    login: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A skyward.toml profile names the provider, the partition and the account; the command
    line's flags set the nodes and the time limit and win over the profile's partition."""
    (tmp_path / "skyward.toml").write_text(
        "[profile.default]\n"
        'provider = "slurm"\n'
        'partition = "restricted"\n'  # refuses every account: the flag must win
        'account = "lab"\n'
        f"python = {sys.executable!r}\n"
    )
    (tmp_path / "job.py").write_text(JOB_SCRIPT)
    monkeypatch.chdir(tmp_path)
    args = ["run", "--nodes", "2", "--partition", "debug", "--time-limit", "0:07:00", "job.py"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("JOB debug lab 00:07:00 2") == 2, out
    assert wait_for_empty_queue(login, 5) == []


def test_skyward_status_lists_the_job_of_a_slurm_profiles_pool(
    login: SlurmCluster,
    running_pool: tuple[str, subprocess.Popen[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pool_id, _ = running_pool
    (tmp_path / "skyward.toml").write_text('[profile.hpc]\nprovider = "slurm"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"slurm  here  {pool_id}" in out, out
