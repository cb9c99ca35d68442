"""`skyward run` on SSH hosts (network namespaces): the work directory travels, the script runs
unchanged in its copy on every host, JAX initialized by the script across the hosts."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import runner
from skyward.cli.profiles import Profile
from tests.ssh.conftest import Hosts, Server

pytestmark = [pytest.mark.ssh]

SCRIPT = """\
import os
import sys

import jax

from helper import greeting  # a sibling module: the work directory travelled

jax.distributed.initialize()
total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(jax.numpy.ones(1))
print(greeting(jax.process_index()), jax.process_count(), total, sys.argv[1:], flush=True)
jax.distributed.shutdown()
sys.exit(int(os.environ["JAX_PROCESS_ID"]) * int(sys.argv[1]))
"""


@pytest.mark.slow
def test_skyward_run_on_ssh_hosts_with_a_workdir(
    netns_hosts: Hosts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    (work / "helper.py").write_text(
        textwrap.dedent(
            """
            def greeting(rank):
                return f"hello from {rank}"
            """
        )
    )
    profile = Profile(
        provider="ssh",
        options={
            "hosts": netns_hosts.net.addresses[:2],
            "user": "root",
            "key": str(netns_hosts.key.private_path),
            "known_hosts": str(netns_hosts.known_hosts),
            "python": sys.executable,
        },
        env={"JAX_PLATFORMS": "cpu"},
        workdir=str(work),
    )
    assert runner.run(profile, str(work / "train.py"), ["0"]) == runner.RunEnd(0)
    out = capsys.readouterr().out
    for node in (0, 1):
        assert f"(node {node}) hello from {node} 2 [2.] ['0']" in out, out
    # rank 1 exits with 5; rank 0 with 0
    outcome = runner.run(profile, str(work / "train.py"), ["5"])
    assert outcome == runner.RunEnd(5, "rank 1 exited with status 5")


def test_status_lists_this_logins_agents_on_each_ssh_host(
    local_sshd: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = Profile(
        provider="ssh",
        options={
            "hosts": [local_sshd.host()],
            "key": str(local_sshd.key.private_path),
            "known_hosts": str(local_sshd.known_hosts),
            "python": sys.executable,
        },
    )
    # This sshd is this machine's: its root login also owns the agents of pools that other
    # tests (the other pytest-xdist worker) hold right now, so the line is read for this pool's
    # agent, not for a count.
    with sky.ComputePool(provider=profile.build_provider(), stream_output=False) as pool:
        pid = agent_pid() >> pool
        assert runner.print_live_pools(profile.build_provider()) == 1
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"ssh    {local_sshd.host()}: "), line
        assert pid in listed_agents(line) and ", up " in line, line
    runner.print_live_pools(profile.build_provider())
    assert pid not in listed_agents(capsys.readouterr().out)
    down = Profile(provider="ssh", options={**profile.options, "hosts": ["root@127.0.0.1:1"]})
    assert runner.print_live_pools(down.build_provider()) == 1  # said unreachable
    assert "root@127.0.0.1:1: unreachable" in capsys.readouterr().out


def listed_agents(out: str) -> list[int]:
    """The agent pids `skyward status` printed for SSH hosts: ``... N agent(s) [pid, ...] ...``."""
    return [
        int(p) for group in re.findall(r"agent\(s\) \[([0-9, ]*)\]", out) for p in group.split(",")
    ]


@sky.compute
def agent_pid() -> int:
    import os

    return os.getpid()
