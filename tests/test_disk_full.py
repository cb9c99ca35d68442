"""A full disk on a Local node, for real: a small tmpfs as skyward's cache while an environment
is built, and as the pool's output directory while the function writes. Needs root (mount)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import offline_image
from tests.support import sshd
from tests.support.disks import fill, tmpfs

pytestmark = pytest.mark.skipif(not sshd.is_root(), reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small-disk", "8m") as mount:
        yield mount


@sky.compute
def write_megabytes(count: int) -> int:
    path = Path(sky.output_dir()) / "big.bin"
    with path.open("wb") as out:
        for _ in range(count):
            out.write(b"x" * (1 << 20))
    return count


def test_a_full_disk_while_building_is_a_bootstrap_error_and_the_cache_stays_consistent(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(small_disk))
    # skyward's own copy fits (a pool that builds nothing puts it there); then the disk fills.
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        assert write_megabytes(0) >> pool == 0
    fill(small_disk, leave=64 << 10)
    image = offline_image(tmp_path / "wheels", uuid.uuid4().hex)
    with pytest.raises(sky.BootstrapError) as caught:
        with sky.ComputePool(nodes=1, image=image, stream_output=False):
            pass
    message = str(caught.value)
    assert "No space left on device" in message or "ENOSPC" in message, message
    assert str(small_disk) in message, "the error must say where"
    envs = small_disk / "envs"
    assert not [p for p in envs.iterdir() if p.is_dir()], "a half-built environment was left"
    # With room again, the same image builds and runs.
    (small_disk / "filler").unlink()
    with sky.ComputePool(nodes=1, image=image, stream_output=False) as pool:
        assert write_megabytes(0) >> pool == 0


def test_a_full_disk_while_the_function_writes_is_its_own_os_error(small_disk: Path) -> None:
    with sky.ComputePool(nodes=1, output_dir=small_disk / "runs", stream_output=False) as pool:
        with pytest.raises(OSError, match="No space left on device") as caught:
            write_megabytes(64) >> pool
        assert caught.value.errno == 28  # ENOSPC: the node's own error, as the function saw it
        assert any("node 0" in note for note in getattr(caught.value, "__notes__", []))
        # The pool goes on: the next call works once there is room.
        (small_disk / "runs" / "node-0" / "big.bin").unlink()
        assert write_megabytes(1) >> pool == 1
