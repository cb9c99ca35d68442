"""The Slurm provider passes the provider contract, on the real Slurm cluster of
tests/slurm/conftest.py, with this process as the login node."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import ProviderContract
from tests.slurm.conftest import queue, wait_for_empty_queue
from tests.support.slurmcluster import SlurmCluster

# An interpreter for the nodes that does not run on node1 (so skyward's host check fails
# there, and only there): a pool whose one node comes up and whose other cannot.
NODE1_CANNOT_START = """\
#!/bin/sh
if [ "$(hostname)" = node1 ]; then
    echo "this node cannot start (on purpose)" >&2
    exit 4
fi
exec {python} "$@"
"""


class TestSlurmContract(ProviderContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, login: SlurmCluster) -> None:
        self.cluster = login

    @pytest.fixture
    def make_provider(self) -> Callable[[], object]:
        return lambda: sky.Slurm(python=sys.executable)  # the nodes share this machine's

    @pytest.fixture
    def make_broken_provider(self, tmp_path: Path) -> Callable[[], object]:
        wrapper = tmp_path / "python-node1-cannot-start"
        wrapper.write_text(NODE1_CANNOT_START.format(python=sys.executable))
        wrapper.chmod(0o755)
        return lambda: sky.Slurm(python=str(wrapper))

    @pytest.fixture
    def nodes_available(self) -> int:
        return 3

    def _agents(self) -> list[int]:
        """The agents running on the cluster's nodes."""
        found = []
        for pid in self.cluster.processes():
            with contextlib.suppress(OSError):
                if b"skyward.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        assert wait_for_empty_queue(self.cluster, 10) == [], "the pool's job is still queued"
        assert not self._agents(), "agents of the pool still run on the nodes"

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        before = queue(self.cluster)
        yield
        assert queue(self.cluster) == before, "a job was submitted"
        assert not self._agents()
