"""``ForwardAgent yes`` in an ssh config (say, one a profile in the current directory names)
does not forward the user's SSH agent to a pool's hosts: a host's root could use it to log in
wherever the user's keys open."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from skyward.transport.sshhost import Endpoint, connect, load_known_hosts
from tests.ssh.conftest import Server


def test_forward_agent_in_a_config_is_ignored(
    local_sshd: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = tmp_path / "agent.sock"
    agent = subprocess.run(
        ["ssh-agent", "-a", str(sock)], capture_output=True, text=True, check=True
    )
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n    ForwardAgent yes\n")

    async def remote_sock() -> str:
        host = await connect(
            Endpoint.parse(local_sshd.host()),
            known_hosts=load_known_hosts(str(local_sshd.known_hosts)),
            key=str(local_sshd.key.private_path),
            config=[str(config)],
        )
        try:
            done = await host.run("echo ${SSH_AUTH_SOCK:-none}")
        finally:
            await host.close()
        return done.stdout.decode().strip()

    try:
        assert asyncio.run(remote_sock()) == "none"
    finally:
        os.kill(pid, signal.SIGTERM)
