"""Local node environments: reuse this interpreter, or build one with uv once per hash."""

from __future__ import annotations

import inspect
import os
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.environment import env_spec
from skyward.worker import envbuild, hostcheck


@sky.compute
def interpreter() -> tuple[str, str]:
    import tomli_w  # only in the built environment

    return sys.executable, tomli_w.dumps({"ok": True})


@sky.compute
def plain_interpreter() -> str:
    return sys.executable


def test_satisfied_image_reuses_this_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    image = sky.Image(
        pip=["cloudpickle>=1", "packaging"], setup=[f"echo ran >> {tmp_path}/setup-ran"]
    )
    for _ in range(2):
        with sky.ComputePool(nodes=1, image=image, stream_output=False) as pool:
            assert plain_interpreter() >> pool == sys.executable
    assert (tmp_path / "setup-ran").read_text() == "ran\n", "setup must run once per image hash"
    assert not (tmp_path / "envs").exists()


@pytest.mark.slow
def test_missing_package_builds_a_uv_environment_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    image = sky.Image(pip=["tomli-w==1.0.0"], setup=["echo built >> $VIRTUAL_ENV/setup-log"])
    with sky.ComputePool(nodes=2, image=image, stream_output=False) as pool:
        results = interpreter() @ pool
    env_dir = tmp_path / "envs" / env_spec(image).hash
    assert {python for python, _ in results} == {str(env_dir / "bin" / "python")}
    assert all(text.strip() == "ok = true" for _, text in results)
    marker = env_dir / envbuild.READY_MARKER
    first_build = marker.stat().st_mtime_ns
    with sky.ComputePool(nodes=1, image=image, stream_output=False) as pool:
        assert (interpreter() >> pool)[0] == str(env_dir / "bin" / "python")
    assert marker.stat().st_mtime_ns == first_build, "the second pool rebuilt the environment"
    assert (env_dir / "setup-log").read_text() == "built\n"


@pytest.mark.slow
def test_failed_install_is_a_bootstrap_error_with_the_installer_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    image = sky.Image(pip=["skyward-no-such-package-3f9c==1.0"])
    with pytest.raises(sky.BootstrapError) as caught:
        with sky.ComputePool(nodes=1, image=image, stream_output=False):
            pass
    assert "skyward-no-such-package-3f9c" in str(caught.value)
    assert "uv pip install failed" in str(caught.value)
    assert not (tmp_path / "envs" / env_spec(image).hash).exists(), "a half-built env was kept"


def test_missing_apt_package_is_reported_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    with pytest.raises(sky.BootstrapError, match="skyward-no-such-deb"):
        with sky.ComputePool(image=sky.Image(apt=["skyward-no-such-deb"]), stream_output=False):
            pass


def test_one_decision_for_every_provider() -> None:
    report = hostcheck.HostReport(
        python="/usr/bin/python3",
        version="3.12.3",
        uid=1000,
        src=True,
        uv=None,
        env=None,
        setup=False,
        apt_missing=(),
        satisfied=True,
    )
    assert hostcheck.decide(report, None, has_setup=True) == hostcheck.Decision(
        "/usr/bin/python3", setup=True
    )
    assert hostcheck.decide(replace(report, setup=True), "3.12", True).setup is False
    assert hostcheck.decide(report, "3.11", False).python is None, "wrong Python: build"
    assert hostcheck.decide(replace(report, satisfied=False), None, False).python is None
    assert hostcheck.decide(replace(report, satisfied=None), None, False).python is None
    assert hostcheck.decide(report, "3.1", False).python is None, "3.1 is not 3.12"
    assert hostcheck.decide(report, "3.12.3", False).python == "/usr/bin/python3"
    built = replace(report, env="/c/envs/h/bin/python")
    # One rule, whatever the cache holds: the interpreter that satisfies the image wins over an
    # environment an earlier pool left; the environment serves only where it does not.
    assert hostcheck.decide(built, "3.12", False) == hostcheck.Decision("/usr/bin/python3")
    for lacking in (replace(built, satisfied=False), replace(built, satisfied=None)):
        assert hostcheck.decide(lacking, "3.12", True) == hostcheck.Decision(built.env)
    assert hostcheck.decide(built, "3.11", True) == hostcheck.Decision(built.env)


def test_the_host_check_runs_as_its_own_source_with_any_interpreter(tmp_path: Path) -> None:
    """The remote hosts run the module's source with `python3 -c`; Local calls it in-process."""
    query = hostcheck.Query(
        cache=str(tmp_path), env="h", src="s", apt=("skyward-no-such-deb",), requirements=("x",)
    )
    source = inspect.getsource(hostcheck)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", source],  # no site: no skyward
        input=query.to_json(),  # on stdin, as the client sends it
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    )
    remote = hostcheck.HostReport.from_json(done.stdout)
    assert remote.src is False and remote.env is None and remote.uv is None
    assert remote.apt_missing == ("skyward-no-such-deb",)
    assert remote.satisfied is None, "skyward is not importable there: the probe must wait"
    (tmp_path / "envs" / "h").mkdir(parents=True)
    (tmp_path / "envs" / "h" / envbuild.READY_MARKER).write_text("{}")
    local = hostcheck.check(query)
    assert local.env == str(tmp_path / "envs" / "h" / "bin" / "python")
    assert local.satisfied is False, "a built environment does not spare the probe"
    assert (local.system, local.machine, local.libc) == (remote.system, remote.machine, "glibc")
    assert replace(remote, env=local.env, python=local.python, satisfied=False) == replace(
        local, version=remote.version
    )


@sky.compute
def numpy_interpreter() -> tuple[str, int]:
    import numpy  # in this interpreter, not in the leftover environment

    return sys.executable, int(numpy.arange(4).sum())


def test_an_environment_left_by_an_earlier_run_does_not_replace_this_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SSH pool on a host sharing this machine's home left a complete environment for the
    default image (cloudpickle and packaging only). A Local pool still runs this interpreter,
    which satisfies the image and has numpy: what a node runs never depends on what ran before."""
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path))
    leftover = tmp_path / "envs" / env_spec(sky.Image()).hash
    from skyward.providers.local.provider import _uv_binary

    subprocess.run([_uv_binary(), "venv", "-q", "--python", sys.executable, str(leftover)],
                   check=True)  # fmt: skip
    (leftover / envbuild.READY_MARKER).write_text("{}")
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        assert numpy_interpreter() >> pool == (sys.executable, 6)


def test_an_image_on_another_python_than_the_clients_fails_before_anything_starts() -> None:
    other = "3.10" if sys.version_info[:2] != (3, 10) else "3.12"
    with pytest.raises(sky.ConfigError) as caught:
        with sky.ComputePool(nodes=1, image=sky.Image(python=other), stream_output=False):
            pass
    message = str(caught.value)
    assert f"Python {other}" in message and platform.python_version() in message
    assert "cloudpickle" in message


def test_the_same_minor_with_a_patch_release_is_accepted() -> None:
    patch = "{}.{}.{}".format(*sys.version_info[:3])
    spec = env_spec(sky.Image(python=patch))
    assert spec.python == patch
    assert env_spec(sky.Image()).python == "{}.{}".format(*sys.version_info[:2])
    assert spec.hash != env_spec(sky.Image()).hash, "the Python is part of the environment key"


def test_a_node_on_another_python_is_refused_at_the_handshake_before_any_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handshake compares each agent's Python with the client's, as it does skyward's
    version. Real agents on this interpreter; the client is told it runs another minor."""
    from skyward.client import handshake

    monkeypatch.setattr(handshake, "client_python", lambda: "3.1")
    with pytest.raises(sky.BootstrapError) as caught:
        with sky.ComputePool(nodes=2, stream_output=False):
            raise AssertionError("the pool must not start")
    message = str(caught.value)
    assert f"runs Python {platform.python_version()}" in message
    assert "no call was sent" in message
