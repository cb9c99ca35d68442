"""A pool's cache and outputs are the user's alone: nothing in them open to group or others."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import skyward as sky


@sky.compute
def write_output() -> str:
    out = Path(sky.output_dir()) / "deep" / "result.txt"
    out.parent.mkdir(parents=True)
    out.write_text("computed")
    return str(out)


def open_to_others(root: Path) -> list[str]:
    """Every path under `root` (itself included) with a group or other permission bit."""
    found = []
    for directory, dirs, files in os.walk(root):
        for path in [directory, *(os.path.join(directory, n) for n in dirs + files)]:
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                found.append(f"{stat.filemode(mode)} {path}")
    return found


def test_a_fresh_cache_and_the_outputs_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, outputs = tmp_path / "cache", tmp_path / "outputs"
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(cache))
    image = sky.Image(env={"SKYWARD_CANARY": "a secret"})  # in .skyward-ready when built
    pool = sky.ComputePool(provider=sky.Local(), nodes=2, output_dir=outputs, image=image)
    previous = os.umask(0o022)  # most users' umask: the pool must not rely on a stricter one
    try:
        with pool:
            written = write_output() @ pool
    finally:
        os.umask(previous)
    assert all(Path(p).read_text() == "computed" for p in written)
    assert cache.is_dir() and open_to_others(cache) == []
    assert open_to_others(outputs) == []
