"""A full disk on an SSH host while it is prepared, for real: the host's skyward cache is a
small tmpfs, named by `SKYWARD_CACHE_DIR` in its login environment (sshd's SetEnv, as a host's
/etc/environment would set it). Needs root (mount), as every SSH test does."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import offline_image
from tests.ssh.conftest import Server
from tests.support import sshd, wheels
from tests.support.disks import fill, tmpfs

pytestmark = pytest.mark.ssh


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    # room for skyward's copy of itself, uv and a small environment; no more
    with tmpfs(tmp_path / "small-disk", "160m") as mount:
        yield mount


@sky.compute
def probe_token() -> str:
    import skyward_contract_probe  # type: ignore[import-not-found]

    return str(skyward_contract_probe.TOKEN)


def test_a_full_disk_while_a_host_is_prepared_is_a_bootstrap_error_and_leaves_nothing(
    keys: sshd.KeyPair, small_disk: Path, tmp_path: Path
) -> None:
    house = wheels.wheelhouse(tmp_path / "wheelhouse")
    server = sshd.SshdServer(
        authorized_keys=[keys], extra_config=[f"SetEnv SKYWARD_CACHE_DIR={small_disk}"]
    )
    with server:
        host = Server(server, keys, server.write_known_hosts(tmp_path / "known_hosts"))
        # Offline (the wheelhouse), so what fails is the disk, never the network.
        provider = host.provider(build_env=wheels.offline_build_env(house))
        # skyward's own copy fits (a pool that builds nothing puts it there); then the disk fills.
        with sky.ComputePool(provider=provider, nodes=1, stream_output=False):
            pass
        filler = fill(small_disk, leave=64 << 10)
        token = uuid.uuid4().hex
        image = offline_image(tmp_path / "wheels", token)
        with pytest.raises(sky.BootstrapError) as caught:
            with sky.ComputePool(provider=provider, nodes=1, image=image, stream_output=False):
                pass
        message = str(caught.value)
        # The tools that fail do not always say ENOSPC: the error says what the disk has.
        assert f"the host's skyward cache {small_disk} has only" in message, message
        assert "the disk is probably full" in message, message
        assert f"127.0.0.1:{server.port}" in message, "the error must name the host"
        # Nothing half-made stays to be mistaken for a finished uv or environment.
        left = [p.name for p in (small_disk / "bootstrap").glob("uv-*") if p.is_dir()]
        assert not left, f"a half-installed uv was left: {left}"
        envs = small_disk / "envs"
        assert not envs.exists() or not [p for p in envs.iterdir() if p.is_dir()]
        # With room again, the same image builds on that host and runs.
        filler.unlink()
        with sky.ComputePool(provider=provider, nodes=1, image=image, stream_output=False) as pool:
            assert probe_token() >> pool == token
