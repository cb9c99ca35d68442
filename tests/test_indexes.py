"""`Image(indexes=...)` honoured for real: uv installs offline from a local index, and uv itself
is fetched from one with the standard library (`skyward.worker.uvinstall`).

Every index here is a real HTTP server on 127.0.0.1 (`tests.support.bareroots.PackageIndex`),
serving wheels made on the spot; the default index is pointed at a port where nothing listens
(``UV_DEFAULT_INDEX``), so an index uv ignored, or a package asked of the default index, fails
the build instead of quietly coming from PyPI.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.remote import hoststeps
from skyward.worker import uvinstall
from tests.support import wheels
from tests.support.bareroots import PackageIndex

DEAD_INDEX = "http://127.0.0.1:9/simple/"  # the discard port: nothing listens


@pytest.fixture(autouse=True)
def no_default_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UV_DEFAULT_INDEX", DEAD_INDEX)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # nothing from earlier runs


def _alpha(directory: Path, token: str) -> Path:
    """A wheel of `skyward-alpha` 1.0 whose module says `token`."""
    return wheels.make_wheel(
        directory, "skyward-alpha", "1.0", {"skyward_alpha/__init__.py": f"TOKEN = {token!r}\n"}
    )


@pytest.fixture
def index(tmp_path: Path) -> Iterator[PackageIndex]:
    """An index with skyward-alpha (token "unscoped") and the agent's own requirements."""
    folder = tmp_path / "index"
    _alpha(folder, "unscoped")
    for name in ("cloudpickle", "packaging"):
        wheels.wheel_of_installed(folder, name)
    with PackageIndex(folder) as served:
        yield served


@sky.compute
def alpha_token() -> tuple[str, str]:
    import skyward_alpha  # type: ignore[import-not-found]  # only in the built environment

    return sys.prefix, skyward_alpha.TOKEN


def _run_alpha(image: sky.Image) -> tuple[str, str]:
    with sky.ComputePool(nodes=1, image=image, stream_output=False) as pool:
        return alpha_token() >> pool


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "pep503"])
def test_an_unscoped_index_serves_every_package_of_the_build(
    index: PackageIndex, flat: bool
) -> None:
    url = index.flat_url if flat else index.simple_url
    image = sky.Image(pip=["skyward-alpha"], indexes=[sky.Index(url, flat=flat)])
    prefix, token = _run_alpha(image)
    assert token == "unscoped" and prefix != sys.prefix, "a built environment runs it"
    asked = " ".join(index.requests)
    assert "skyward_alpha-1.0" in asked and "cloudpickle-" in asked and "packaging-" in asked


def test_an_index_scoped_to_a_package_serves_it_ahead_of_the_unscoped_one(
    index: PackageIndex, tmp_path: Path
) -> None:
    _alpha(tmp_path / "scoped", "scoped")
    with PackageIndex(tmp_path / "scoped") as scoped:
        image = sky.Image(
            pip=["skyward-alpha"],
            indexes=[
                sky.Index(index.flat_url, flat=True),  # listed first, and it has alpha too
                sky.Index(scoped.simple_url, packages=["skyward-alpha"]),
            ],
        )
        assert _run_alpha(image)[1] == "scoped"
        assert not any(".whl" in path and "alpha" not in path for path in scoped.requests)


def test_a_default_index_replaces_the_hosts_default_one(
    index: PackageIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Index(default=True)` is uv's --default-index: a package it lacks is not taken from the
    host's default index (PyPI, or here UV_DEFAULT_INDEX, which has it), so no public package
    stands in for a private one of the same name."""
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    folder = tmp_path / "private"
    for name in ("cloudpickle", "packaging"):  # the agent's own, but not skyward-alpha
        wheels.wheel_of_installed(folder, name)
    with PackageIndex(folder) as private:
        monkeypatch.setenv("UV_DEFAULT_INDEX", index.simple_url)  # it has skyward-alpha
        replaced = sky.Image(
            pip=["skyward-alpha"], indexes=[sky.Index(private.simple_url, default=True)]
        )
        assert replaced.default_index == sky.Index(private.simple_url, default=True)
        with pytest.raises(sky.BootstrapError) as caught:
            _run_alpha(replaced)
        assert "skyward-alpha was not found" in caught.value.output
        assert "/simple/skyward-alpha/" in private.requests
        assert index.requests == [], "the host's default index is never asked"
        # As an extra index the same one is asked first, and the default one after it.
        extra = sky.Image(pip=["skyward-alpha"], indexes=[sky.Index(private.simple_url)])
        assert _run_alpha(extra)[1] == "unscoped"
        assert "/simple/skyward-alpha/" in index.requests


def test_one_default_index_an_image(tmp_path: Path) -> None:
    first, second = "http://a.example/simple/", "http://me:pw@b.example/simple/"
    with pytest.raises(sky.ConfigError, match=r"more than one index replaces the default index"):
        sky.Image(indexes=[sky.Index(first, default=True), sky.Index(second, default=True)])
    with pytest.raises(sky.ConfigError, match=r"default=True\) replaces PyPI .* drop packages="):
        sky.Index(first, packages=["torch"], default=True)
    # Merging, the other image's default index wins, as its other settings do.
    mine = sky.Image(indexes=[sky.Index(first, default=True), "http://extra.example/"])
    merged = mine.merge(sky.Image(indexes=[sky.Index(second, default=True)]))
    assert merged.default_index == sky.Index(second, default=True)
    assert "pw" not in repr(merged.default_index)
    assert (
        sky.Image(indexes=[first]).content_hash
        != sky.Image(indexes=[sky.Index(first, default=True)]).content_hash
    )


def test_a_package_no_index_serves_fails_the_build_naming_it(
    index: PackageIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What no index serves stays unserved: uv's retries of the lookup would only take seconds.
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    image = sky.Image(
        pip=["skyward-alpha", "skyward-beta-nowhere"],
        indexes=[sky.Index(index.simple_url)],
    )
    with pytest.raises(sky.BootstrapError) as caught:
        _run_alpha(image)
    assert "skyward-beta-nowhere" in caught.value.output


# -- uv itself ----------------------------------------------------------------------------------

UV_VERSION = hoststeps.metadata.version("uv")


@pytest.fixture(scope="module")
def uv_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PackageIndex]:
    """An index with this client's uv wheel (its real binary) and a decoy for another OS."""
    folder = tmp_path_factory.mktemp("uv-index")
    wheels.wheel_of_installed(folder, "uv")
    decoy = folder / f"uv-{UV_VERSION}-py3-none-macosx_11_0_arm64.whl"
    decoy.write_bytes(b"not a wheel for this machine")
    with PackageIndex(folder) as served:
        yield served


def _uvinstall(dest: Path, *args: str, input: bytes = b"") -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "skyward.worker.uvinstall", str(dest), UV_VERSION, *args],
        input=input,
        capture_output=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(sky.__file__).parent.parent)},
    )
    result: dict[str, str] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert (done.returncode == 0) == ("uv" in result), done
    return result


def _fetch(dest: Path, *indexes: tuple[str, bool] | tuple[str, bool, bool]) -> dict[str, str]:
    """``uvinstall --fetch``, the (url, flat[, default]) indexes on its stdin as the client
    sends them."""
    listed = [[*i, False][:3] for i in indexes]
    return _uvinstall(dest, "--fetch", input=json.dumps(listed).encode())


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "pep503"])
def test_uv_is_fetched_from_an_index_with_the_standard_library(
    uv_index: PackageIndex, tmp_path: Path, flat: bool
) -> None:
    dest = tmp_path / "bootstrap" / f"uv-{UV_VERSION}" / "bin" / "uv"
    url = uv_index.flat_url if flat else uv_index.simple_url
    before = len(uv_index.requests)
    assert _fetch(dest, (url, flat)) == {"uv": str(dest)}
    said = subprocess.run([dest, "--version"], capture_output=True, text=True, check=True)
    assert said.stdout.split()[:2] == ["uv", UV_VERSION]
    fetched = [p for p in uv_index.requests[before:] if p.startswith("/files/")]
    assert len(fetched) == 1 and "manylinux" in fetched[0], "only this platform's wheel"
    # Once there, it is not fetched again.
    assert _fetch(dest, (url, flat)) == {"uv": str(dest)}
    assert len([p for p in uv_index.requests[before:] if p.startswith("/files/")]) == 1


def test_no_index_with_uv_is_an_error_naming_each_index_and_leaving_nothing(
    index: PackageIndex, tmp_path: Path
) -> None:
    dest = tmp_path / "bootstrap" / f"uv-{UV_VERSION}" / "bin" / "uv"
    private = "http://me:s3cr3t-pw@127.0.0.1:9/private/"  # nothing listens there either
    result = _fetch(dest, (index.flat_url, True), (private, False))
    assert result["error"] == f"no index served uv {UV_VERSION} for Linux/x86_64/glibc"
    assert f"{index.flat_url}: no uv {UV_VERSION} wheel" in result["output"]
    # The private index is named, its password hidden.
    assert "s3cr3t-pw" not in json.dumps(result)
    assert "http://***@127.0.0.1:9/private/: " in result["output"]
    assert DEAD_INDEX in result["output"], "the default index is tried last"
    assert not dest.parent.parent.exists(), "nothing that looks like an installed uv"


def test_uv_is_fetched_from_the_images_default_index_in_place_of_the_hosts(
    index: PackageIndex, uv_index: PackageIndex, tmp_path: Path
) -> None:
    dest = tmp_path / "bootstrap" / f"uv-{UV_VERSION}" / "bin" / "uv"
    result = _fetch(dest, (index.simple_url, False, True), (index.flat_url, True, False))
    assert result["error"] == f"no index served uv {UV_VERSION} for Linux/x86_64/glibc"
    tried = result["output"].splitlines()
    assert tried[0].startswith(index.flat_url) and tried[-1].startswith(index.simple_url)
    assert DEAD_INDEX not in result["output"], "the host's default index is replaced"
    assert _fetch(dest, (uv_index.simple_url, False, True)) == {"uv": str(dest)}


def test_the_clients_uv_binary_is_received_and_a_wrong_one_refused(tmp_path: Path) -> None:
    sendable = hoststeps.client_uv(UV_VERSION)
    assert sendable is not None and sendable[0] == uvinstall.platform_key()
    dest = tmp_path / "bootstrap" / f"uv-{UV_VERSION}" / "bin" / "uv"
    wrong = _uvinstall(dest, "--receive", input=gzip.compress(b"#!/bin/sh\necho uv 0.0.1\n"))
    assert wrong["error"] == f"the uv binary says uv 0.0.1, not uv {UV_VERSION}"
    assert not dest.parent.parent.exists()
    assert hoststeps.client_uv("0.0.1") is None, "another version is fetched, not sent"
    sent = _uvinstall(dest, "--receive", input=hoststeps.compressed_uv(sendable[1]))
    assert sent == {"uv": str(dest)} and os.access(dest, os.X_OK)


def test_wheel_tags_pick_the_hosts_platform() -> None:
    v = "0.13.9"
    linux = ("Linux", "x86_64", "glibc")
    many = f"uv-{v}-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    assert uvinstall.wheel_fits(many, v, linux)
    assert not uvinstall.wheel_fits(many, "0.13.8", linux)
    assert not uvinstall.wheel_fits(many, v, ("Linux", "aarch64", "glibc"))
    assert not uvinstall.wheel_fits(many, v, ("Linux", "x86_64", ""))  # musl: musllinux
    assert uvinstall.wheel_fits(
        f"uv-{v}-py3-none-musllinux_1_1_x86_64.whl", v, ("Linux", "x86_64", "")
    )
    arm = ("Darwin", "arm64", "")
    assert uvinstall.wheel_fits(f"uv-{v}-py3-none-macosx_11_0_arm64.whl", v, arm)
    assert not uvinstall.wheel_fits(f"uv-{v}-py3-none-macosx_10_12_x86_64.whl", v, arm)
    assert not uvinstall.wheel_fits(f"uv-{v}.tar.gz", v, linux)


def _old_python() -> str | None:
    """A Python 3.8 or 3.9 on this machine (pyenv's, where there is one), as on an Ubuntu 20.04
    or Debian 11 host; None where there is none."""
    import glob

    for version in ("3.8", "3.9"):
        candidates = sorted(glob.glob(f"/root/.pyenv/versions/{version}*/bin/python{version}"))
        candidates += [f"/usr/bin/python{version}"]
        for found in candidates:
            if os.access(found, os.X_OK):
                return found
    return None


def test_the_host_side_runs_with_an_old_python3_and_builds_the_clients_python(
    index: PackageIndex, tmp_path: Path
) -> None:
    """A host whose python3 is 3.8 (Ubuntu 20.04): the check, uv's fetch and the build run
    with it (standard library only), and the environment is the client's Python, which uv
    finds on the host."""
    old = _old_python()
    if old is None:
        pytest.skip("no Python 3.8 or 3.9 on this machine to play an old host's python3")
    env = {**os.environ, "PYTHONPATH": str(Path(sky.__file__).parent.parent)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the client's Python is there
    query = json.dumps({"cache": "", "env": "h", "src": "", "uv": UV_VERSION, "apt": [],
                        "requirements": ["cloudpickle"], "probe": True, "gpus": True})  # fmt: skip
    checked = subprocess.run(
        [old, "-m", "skyward.worker.hostcheck", str(tmp_path / "cache")],
        input=query, capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    report = json.loads(checked.stdout)
    assert report["version"].startswith(("3.8", "3.9")) and report["satisfied"] is False
    spec = {"hash": "h", "python": "{}.{}".format(*sys.version_info[:2]),
            "pip": ["skyward-alpha"], "indexes": [[index.simple_url, [], False]],
            "setup": [], "env": {}}  # fmt: skip
    uv = hoststeps.client_uv(UV_VERSION)
    assert uv is not None
    built = subprocess.run(
        [old, "-m", "skyward.worker.envbuild", str(tmp_path / "cache"), uv[1]],
        input=json.dumps(spec), capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    python = json.loads(built.stdout.splitlines()[-1])["python"]
    said = subprocess.run(
        [python, "-c", "import sys, skyward_alpha as a; print(sys.version_info[:2], a.TOKEN)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert said.stdout.strip() == f"{tuple(sys.version_info[:2])} unscoped"
