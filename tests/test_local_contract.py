"""The Local provider passes the provider contract."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import ProviderContract

# Imported by every Python started with the directory on PYTHONPATH: the first agent to start
# takes the token file, any later one dies at once, as a node that cannot start would.
ONE_AGENT_ONLY = """\
import os, sys
if sys.orig_argv[-2:] == ["-m", "skyward.worker"]:
    try:
        os.close(os.open({token!r}, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        print("this node cannot start (on purpose)", file=sys.stderr, flush=True)
        os._exit(4)
"""


class TestLocalContract(ProviderContract):
    @pytest.fixture
    def make_provider(self) -> Callable[[], object]:
        return sky.Local

    @pytest.fixture
    def make_broken_provider(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> Callable[[], object]:
        """Local nodes of which only the first agent can start: the second exits at once."""
        shim = tmp_path / "one-agent-only"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(ONE_AGENT_ONLY.format(token=str(tmp_path / "taken")))
        paths = [str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
        return sky.Local
