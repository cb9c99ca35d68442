"""Secrets stay off command lines on SSH hosts: `env=` and `build_env` values travel on stdin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import skyward as sky
from tests.ssh.conftest import Hosts
from tests.support import cmdlines

pytestmark = [pytest.mark.ssh]

AGENT = " -m skyward.worker "  # the agent's command line, as `cmdlines.Watch` joins it


@sky.compute
def canary_here() -> str:
    return os.environ["SKYWARD_CANARY"]


def test_env_values_never_reach_a_command_line(netns_hosts: Hosts, tmp_path: Path) -> None:
    """No process on the client or the host ever shows the value in its command line while the
    pool starts, runs a call and ends; the node still has it in its environment.

    The hosts' sshd run in network namespaces of this machine, which share its process table:
    the sampler reads every process of the client and of the hosts alike (and proves it saw
    the host's agent). A fresh cache on the host makes the bootstrap unpack skyward there: a
    step that runs without an `exec`, its shell's command line there for all of it.
    """
    value = cmdlines.canary()
    env = {"SKYWARD_CANARY": value, "SKYWARD_CACHE_DIR": str(tmp_path / "host-cache")}
    provider = netns_hosts.provider(1, build_env=env)
    with cmdlines.Watch(value, markers=[AGENT]) as watch:
        with sky.ComputePool(provider=provider, nodes=1, env=env, stream_output=False) as pool:
            seen = canary_here() >> pool
    assert seen == value
    assert watch.leaks == [], watch.leaks[:3]
    assert AGENT in watch.seen, f"the sampler never saw the agent ({watch.samples} samples)"
    assert (tmp_path / "host-cache" / "src").is_dir(), "the host was bootstrapped afresh"
