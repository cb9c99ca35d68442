"""Fixtures for the tests of slow links: SSH hosts in network namespaces whose links a test
throttles (`tests.support.sshd.throttle`), on a subnet of their own.

These tests spend most of their time waiting on transfers that must outlast a timeout; on
hosts of their own they run beside the rest of the SSH suite (pytest-xdist takes a folder as
one group) instead of after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ssh.conftest import Hosts, _functions_by_value, hosts_on, keys, ssh_ready
from tests.support import sshd

__all__ = ["_functions_by_value", "keys", "netns_hosts", "ssh_ready"]


@pytest.fixture(scope="session")
def netns_hosts(keys: sshd.KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Two hosts on 10.213.16.0/24, each a network namespace running sshd."""
    yield from hosts_on("10.213.16.0/24", 2, keys, tmp_path_factory)
