"""Two pools from two client processes on the same SSH hosts at the same time.

Real parts: two client processes, one real sshd, a real environment build (from local wheels,
no index). Both pools need the same new environment at once: the build must happen once, under
its lock, and both must run in it; neither pool may disturb the other's agents.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.conftest import wait_gone
from tests.contract import offline_image
from tests.ssh.conftest import BUILD_ENV, Server

pytestmark = pytest.mark.ssh

CLIENT = textwrap.dedent(
    """
    import json, sys
    import skyward as sky

    config = json.loads(sys.argv[1])

    @sky.compute
    def where():
        import os, sys
        import skyward_contract_probe
        return sys.prefix, skyward_contract_probe.TOKEN, sky.instance_info().pool_id, os.getpid()

    provider = sky.SSH([config["host"]] * 2, key=config["key"], known_hosts=config["known"],
                       python=sys.executable, build_env=config["build_env"])
    image = sky.Image(pip=config["pip"])
    with sky.ComputePool(provider=provider, nodes=2, image=image, stream_output=False) as pool:
        print("RESULT " + json.dumps(where() @ pool), flush=True)
    """
)


def test_two_clients_build_and_run_on_the_same_hosts_at_once(
    local_sshd: Server, tmp_path: Path
) -> None:
    token = uuid.uuid4().hex
    image = offline_image(tmp_path / "wheels", token)
    config = json.dumps(
        {
            "host": local_sshd.host(),
            "key": str(local_sshd.key.private_path),
            "known": str(local_sshd.known_hosts),
            "build_env": BUILD_ENV,
            "pip": list(image.pip),
        }
    )
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, config],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).parents[2],
        )
        for _ in range(2)
    ]
    outputs = []
    prefixes: set[str] = set()
    agents: list[int] = []
    try:
        for client in clients:
            out, _ = client.communicate(timeout=400)
            outputs.append(out)
            assert client.returncode == 0, out
        results = [
            json.loads(line.split(" ", 1)[1])
            for out in outputs
            for line in out.splitlines()
            if line.startswith("RESULT ")
        ]
        assert len(results) == 2, outputs
        rows = [row for result in results for row in result]
        prefixes = {row[0] for row in rows}
        # One environment, built once and used by all four agents of both pools.
        assert len(prefixes) == 1 and sys.prefix not in prefixes, rows
        assert {row[1] for row in rows} == {token}
        # Two pools, each with its own two agents.
        assert len({row[2] for row in rows}) == 2
        agents = [row[3] for row in rows]
        assert len(set(agents)) == 4
    finally:
        for client in clients:
            client.kill()
        for prefix in prefixes:
            shutil.rmtree(prefix, ignore_errors=True)
            Path(f"{prefix}.lock").unlink(missing_ok=True)
    # Both pools are gone from the host (the loopback sshd's host is this machine): no agent
    # of either still runs.
    assert not wait_gone(agents, timeout=10), "agents left behind"
