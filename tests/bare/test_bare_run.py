"""`skyward run` on a host that looks like a fresh cloud VM (python3 and a shell), whose script
names its packages in PEP 723 metadata and whose only reachable index is given with --index."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from skyward.cli.main import main
from tests.bare.conftest import MakeBareHosts
from tests.support import bareroots

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

SCRIPT = """\
# /// script
# requires-python = ">=3.11"
# dependencies = ["numpy"]
# ///
import os
import sys

import numpy

print("numpy on rank", os.environ["RANK"], "sums to", int(numpy.arange(10).sum()), sys.executable)
"""


def test_skyward_run_of_a_pep723_script_on_a_bare_host_with_only_a_local_index(
    make_bare_hosts: MakeBareHosts,
    bare_wheels: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bare = make_bare_hosts(1)
    (tmp_path / "skyward.toml").write_text(
        textwrap.dedent(
            f"""
            [profile.default]
            provider = "ssh"
            hosts = ["{bare.addresses[0]}"]
            user = "root"
            key = "{bare.key.private_path}"
            known_hosts = "{bare.known_hosts}"
            build_env = {{ UV_HTTP_RETRIES = "0" }}  # nothing but the index answers
            """
        )
    )
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    with bareroots.PackageIndex(bare_wheels, host=bare.net.bridge_address) as index:
        status = main(["run", "--provider", "ssh", "--index", index.simple_url, "train.py"])
        asked = " ".join(index.requests)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "(node 0) numpy on rank 0 sums to 45 /root/.cache/skyward/envs/" in captured.out
    assert "/files/numpy-" in asked, "numpy came from the index given with --index"
