"""The PyTorch plugin on two SSH hosts (network namespaces, gloo over their network): one
process group across the hosts, and DDP on each host's own data ends bit-identical."""

from __future__ import annotations

import cloudpickle
import pytest

import skyward as sky
import tests.test_torch
from tests.ssh.conftest import Hosts
from tests.test_torch import group_and_env, local_step, train_ddp

pytestmark = [pytest.mark.ssh, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _torch_calls_by_value() -> None:
    cloudpickle.register_pickle_by_value(tests.test_torch)  # the hosts cannot import the tests


def test_ddp_across_two_ssh_hosts_ends_with_bit_identical_parameters(netns_hosts: Hosts) -> None:
    provider = netns_hosts.provider(2)  # the client's interpreter, which has torch
    plugins = [sky.plugins.torch()]
    with sky.ComputePool(provider=provider, plugins=plugins, stream_output=False) as pool:
        seen = group_and_env() @ pool
        first, second = train_ddp(30) @ pool
        alone = local_step(1000) @ pool
    head = netns_hosts.net.addresses[0].split("@")[-1].split(":")[0]
    for node, found in enumerate(seen):
        assert (found["backend"], found["rank"], found["world"]) == ("gloo", node, 2)
        assert found["env"]["MASTER_ADDR"] == head
    assert first == second
    assert alone[0] != alone[1]  # each host's own data: without DDP they drift apart
