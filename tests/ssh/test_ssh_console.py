"""The live console in a real terminal (tmux) for a pool on two network-namespace SSH hosts.

The same demo and checks as the Local test in tests/test_console.py; here the phases the SSH
provider reports (connecting, building environment with each bootstrap step) are checked in
the ``skyward`` log, and the teardown line is the SSH provider's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.ssh.conftest import Hosts
from tests.test_console import assert_logged_in_order, check_terminal_run, run_in_terminal

pytestmark = [pytest.mark.ssh]


def test_live_console_on_ssh_hosts_in_a_terminal(netns_hosts: Hosts, tmp_path: Path) -> None:
    config = {
        "provider": "ssh",
        "hosts": netns_hosts.net.addresses[:2],
        "key": str(netns_hosts.key.private_path),
        "known_hosts": str(netns_hosts.known_hosts),
        "python": sys.executable,
    }
    screens, last, log = run_in_terminal(config, tmp_path)
    check_terminal_run(screens, last, "closed 2 connections")
    for node, host in enumerate(config["hosts"]):
        assert f"node {node} connecting (root@{host}" in log, log
    assert_logged_in_order(
        log,
        [
            "launching 2 node(s) on ssh",
            "connecting",
            "building environment",
            "starting agent",
            "ready: 2 node(s)",
            "stopping",
            "closed 2 connections in",
        ],
    )
