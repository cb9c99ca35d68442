"""A pool's cache and outputs are the user's alone: nothing in them open to group or others.

The SSH side (a host's cache, with uv sent there and an environment built) is
tests/ssh/test_ssh_e2e.py's, with `open_to_others` from here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import skyward as sky
from tests.contract import offline_image


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
    """An environment built with uv (its venv, its locks, `.skyward-ready` with the image's
    env=, the bytecode the agents write as they import), skyward's copy of itself and the
    outputs: all owner-only, though the client's umask is the usual 022."""
    cache, outputs = tmp_path / "cache", tmp_path / "outputs"
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(cache))
    monkeypatch.setenv("UV_OFFLINE", "1")  # every requirement is a local wheel
    # Bytecode as most machines write it: the agents' imports make __pycache__ in the cache.
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    built = offline_image(tmp_path / "wheels", "private")
    image = sky.Image(pip=built.pip, env={"SKYWARD_CANARY": "a secret"})
    pool = sky.ComputePool(provider=sky.Local(), nodes=2, output_dir=outputs, image=image)
    previous = os.umask(0o022)  # most users' umask: the pool must not rely on a stricter one
    try:
        with pool:
            written = write_output() @ pool
    finally:
        os.umask(previous)
    assert all(Path(p).read_text() == "computed" for p in written)
    assert list((cache / "envs").glob("*/.skyward-ready")), "the pool built an environment"
    assert list(cache.glob("envs/*/lib/*/site-packages/*/__pycache__/*.pyc")), "no bytecode"
    assert cache.is_dir() and open_to_others(cache) == []
    assert open_to_others(outputs) == []
