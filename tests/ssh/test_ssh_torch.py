"""The PyTorch plugin on two SSH hosts (network namespaces, gloo over their network): one
process group across the hosts, DDP on each host's own data ends bit-identical, and two ranks on
each host make one group of four, each rank on its own host's address."""

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


@sky.compute
def where_and_sum() -> tuple[int, int, str, float]:
    """This rank's RANK and NODE_RANK, the address its host speaks from (the host it runs on),
    and the all-reduce of every rank's RANK."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet is sent: a route is chosen
        source = probe.getsockname()[0]
    return int(os.environ["RANK"]), int(os.environ["NODE_RANK"]), source, total.item()


def test_two_ranks_on_each_of_two_ssh_hosts_are_one_group_of_four(netns_hosts: Hosts) -> None:
    provider = netns_hosts.provider(2)
    plugins = [sky.plugins.torch()]
    with sky.ComputePool(
        provider=provider, processes_per_node=2, plugins=plugins, stream_output=False
    ) as pool:
        seen = where_and_sum() @ pool
    hosts = [address.split("@")[-1].split(":")[0] for address in netns_hosts.net.addresses[:2]]
    assert [(rank, node) for rank, node, _, _ in seen] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [source for _, _, source, _ in seen] == [hosts[0], hosts[0], hosts[1], hosts[1]]
    assert [total for *_, total in seen] == [6.0] * 4
