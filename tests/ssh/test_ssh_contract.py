"""The SSH provider passes the provider contract, against a real sshd on 127.0.0.1."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest

from tests.contract import ProviderContract
from tests.ssh.conftest import Server

pytestmark = pytest.mark.ssh


class TestSSHContract(ProviderContract):
    @pytest.fixture
    def make_provider(self, local_sshd: Server) -> Callable[[], object]:
        self.server = local_sshd
        # Two "hosts" that are the same sshd: two connections, two agents.
        return lambda: local_sshd.provider(count=2)

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        """Ask the host itself (over ssh) whether the agents still run."""
        server = self.server
        probe = " ".join(str(pid) for pid in pids)
        command = server.sshd.ssh_command(
            "root", server.key, server.known_hosts,
            f"for p in {probe}; do ps -o stat= -p $p | grep -qv Z && echo $p; done; true",
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
            left = out.stdout.split()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"remote agents still running: {left}"
