"""The SSH provider passes the provider contract, against a real sshd on 127.0.0.1."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

import skyward as sky
from tests.contract import ProviderContract
from tests.ssh.conftest import Server, wait_until
from tests.support import sshd

pytestmark = pytest.mark.ssh


class TestSSHContract(ProviderContract):
    @pytest.fixture
    def make_provider(self, local_sshd: Server) -> Callable[[], object]:
        self.server = local_sshd
        # Two "hosts" that are the same sshd: two connections, two agents.
        return lambda: local_sshd.provider(count=2)

    @pytest.fixture
    def make_broken_provider(self, local_sshd: Server) -> Callable[[], object]:
        """The real host, then one where nothing listens: the first connects, the second fails."""
        self.server = local_sshd
        return lambda: sky.SSH(
            [local_sshd.host(), f"root@127.0.0.1:{sshd.free_port()}"],
            key=str(local_sshd.key.private_path),
            known_hosts=str(local_sshd.known_hosts),
            python=sys.executable,
            connect_timeout=5,
        )

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

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        """No connection to the host remains: sshd has no per-connection process (and so no
        session, no agent) left under it."""
        sessions = self.server.sshd.session_processes
        assert wait_until(lambda: not sessions(), 10), f"sshd sessions left: {sessions()}"

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        """No login reached the host: its sshd logs no accepted key meanwhile."""
        before = self._logins()
        yield
        assert self._logins() == before, "the pool logged in before its plugin failed"
        assert not self.server.sshd.session_processes()

    def _logins(self) -> int:
        return self.server.sshd.log_path.read_text(errors="replace").count("Accepted publickey")
