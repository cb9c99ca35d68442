"""The provider registry: a provider living outside skyward is found by name, through
`registry.register` or a ``skyward.providers`` entry point, runs a pool, and works in
``skyward run/ls/down/status`` with its own flag; an unknown name lists the known ones, and a
provider that cannot list pools says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.cli import profiles
from skyward.errors import ConfigError
from skyward.providers import registry
from tests.example_provider.provider import ENTRY, Example

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def registered() -> Iterator[None]:
    registry.register(ENTRY)
    yield
    registry.unregister(ENTRY.name)


@sky.compute
def where() -> str:
    return sky.instance_info().provider


def test_a_registered_provider_runs_a_pool_from_a_profile(registered: None, tmp_path: Path) -> None:
    flags = {"provider": "example", "options": {"state_dir": str(tmp_path)}}
    provider = profiles.with_flags(profiles.Profile(), flags).build_provider()
    assert isinstance(provider, Example)
    with sky.ComputePool(provider=provider, nodes=1) as pool:
        assert (where() >> pool) == "example"
        assert list(provider.find()) == [pool.pool_id]
    assert provider.find() == {}  # the teardown removed its record


def installed_example(folder: Path) -> Path:
    """A tiny installed distribution in `folder` whose entry point names the example's entry
    (what ``pip install`` of a package declaring it leaves); `folder` goes on sys.path."""
    dist = folder / "skyward_example-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: skyward-example\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\nexample = tests.example_provider.provider:ENTRY\n"
    )
    return folder


def test_an_entry_point_makes_a_provider_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "example" not in registry.names()
    monkeypatch.setattr(sys, "path", [str(installed_example(tmp_path)), *sys.path])
    assert registry.provider_class("example") is Example


def skyward(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The ``skyward`` command in a new process (which finds the provider as a user's would)."""
    return subprocess.run(
        [sys.executable, "-m", "skyward.cli", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


CLIENT = """
import sys, time
import skyward as sky
from skyward.providers import registry
with sky.ComputePool(provider=registry.provider_class("example")(sys.argv[1]), nodes=2) as pool:
    print("POOL", pool.pool_id, flush=True)
    time.sleep(600)
"""


def test_a_provider_from_an_entry_point_works_in_run_ls_down_and_status(tmp_path: Path) -> None:
    """Installed through an entry point only: its flag is in `skyward run --help`, a pool whose
    client was killed is listed by `skyward ls` and `skyward status` (a profile naming it), and
    `skyward down` removes what it left."""
    state, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(installed_example(tmp_path / "site")), str(ROOT)]),
    }
    helped = skyward("run", "--help", env=env, cwd=work)
    assert "--example-dir" in helped.stdout and "example: where" in helped.stdout, helped.stdout
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(state)],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert client.stdout is not None
        line = client.stdout.readline()
        assert line.startswith("POOL "), line
        pool_id = line.split()[1]
    finally:
        os.killpg(client.pid, signal.SIGKILL)  # the laptop that crashed: no teardown ran
        client.wait(30)
    listed = skyward("ls", "--provider", "example", "--example-dir", str(state), env=env, cwd=work)
    assert listed.returncode == 0, listed.stderr
    assert f"{pool_id}  created " in listed.stdout, listed.stdout
    assert f"2 node(s), client pid {client.pid} (gone)" in listed.stdout, listed.stdout
    (work / "skyward.toml").write_text(
        f'[profile.default]\nprovider = "example"\nstate_dir = "{state}"\n'
    )
    status = skyward("status", env=env, cwd=work)
    assert f"example  {pool_id}  created " in status.stdout, status.stdout + status.stderr
    down = skyward("down", pool_id, env=env, cwd=work)  # the default profile's provider
    assert down.returncode == 0, down.stderr
    assert f"removed {pool_id}: its record {pool_id}.json" in down.stdout, down.stdout
    again = skyward("ls", env=env, cwd=work)
    assert "no skyward resources found by the example provider" in again.stdout, again.stdout
    assert list(state.iterdir()) == []


def test_ls_with_a_provider_that_cannot_list_says_which_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from skyward.cli.main import main

    monkeypatch.chdir(tmp_path)  # no profile here
    assert main(["ls", "--provider", "ssh"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("skyward ls: the ssh provider cannot list and clean up"), err
    assert "slurm" in err and "Traceback" not in err
    assert main(["ls"]) == 1  # no --provider and no default profile: the local one cannot
    assert "the local provider cannot" in capsys.readouterr().err
    assert main(["ls", "--provider", "nope"]) == 1
    assert "unknown provider 'nope'; use one of local, ssh" in capsys.readouterr().err


def test_an_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown provider 'nope'; use one of local, ssh"):
        registry.entry("nope")
    with pytest.raises(ConfigError, match="unknown provider 'nope'"):
        profiles.Profile(provider="nope").build_provider()


class _Plain(Example):
    """A provider that declares no capability."""

    capabilities = frozenset()


@pytest.mark.parametrize(
    ("feature", "needs"), [({"restarts": 1}, "replace"), ({"stall_timeout": 5}, "signals")]
)
def test_a_feature_its_provider_lacks_is_refused(feature: dict[str, float], needs: str) -> None:
    with pytest.raises(ConfigError, match=f"needs a provider that can .*{needs}"):
        sky.ComputePool(provider=_Plain("unused"), nodes=1, **feature)  # type: ignore[arg-type]


def installed(folder: Path, dist: str, points: dict[str, str], modules: dict[str, str]) -> Path:
    """An installed distribution `dist` in `folder` (which goes on the path) declaring
    `points` (name: ``module:attr``) in the providers' group, with `modules` (name: source)
    beside it."""
    info = folder / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in points.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(source)
    return folder


HELLO = "import skyward as sky\nprint('hello from', sky.instance_info().provider)\n"


def isolated_env(tmp_path: Path, site: Path) -> dict[str, str]:
    """The suite's environment for a ``skyward`` command with `site` on its path, a HOME of
    its own (no user's profile or pools) and the suite's SKYWARD_CACHE_DIR."""
    home = tmp_path / "home"
    home.mkdir()
    return {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_a_broken_entry_point_is_left_out_with_one_warning(tmp_path: Path) -> None:
    """A third party's provider whose module fails to import costs only itself: `skyward
    status` and `skyward run` on the local provider work, each saying once which package is
    broken and why."""
    site = installed(
        tmp_path / "site",
        "skyward-broken-k8s",
        {"k8s": "skyward_broken_k8s:ENTRY"},
        {"skyward_broken_k8s": "raise ImportError('kubernetes client 0.0 is too old')\n"},
    )
    env, work = isolated_env(tmp_path, site), tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text(HELLO)
    for argv in (["status"], ["run", "--nodes", "1", "hello.py"]):
        done = skyward(*argv, env=env, cwd=work)
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.count("skyward-broken-k8s") == 1, done.stderr
        assert "ImportError: kubernetes client 0.0 is too old" in done.stderr, done.stderr
    assert "hello from local" in done.stdout, done.stdout


def test_an_entry_point_cannot_take_the_name_of_skywards_own_provider(tmp_path: Path) -> None:
    imposter = (
        "from skyward.providers.registry import ProviderEntry\n"
        "ENTRY = ProviderEntry('local', 'tests.example_provider.provider', 'Example')\n"
    )
    site = installed(
        tmp_path / "site",
        "skyward-imposter",
        {"local": "skyward_imposter:ENTRY"},
        {"skyward_imposter": imposter},
    )
    env, work = isolated_env(tmp_path, site), tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text(HELLO)
    done = skyward("run", "--nodes", "1", "hello.py", env=env, cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hello from local" in done.stdout, done.stdout  # not the imposter's Example
    assert done.stderr.count("skyward-imposter") == 1, done.stderr
    assert "skyward's own 'local' is used" in done.stderr, done.stderr


def test_a_broken_entry_point_warns_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looked up again and again (every command reads the registry several times), a broken
    entry point is warned about once, and the known providers are there each time."""
    module = f"skyward_broken_{tmp_path.name.replace('-', '_')}"  # a name no other test took
    site = installed(
        tmp_path,
        "skyward-broken",
        {"broken": f"{module}:ENTRY"},
        {module: "raise SyntaxError('not python')\n"},
    )
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    with pytest.warns(RuntimeWarning, match="'skyward-broken'.*SyntaxError: not python") as seen:
        for _ in range(3):
            assert {"local", "ssh"} <= set(registry.names())
            assert "broken" not in registry.names()
    assert len([w for w in seen if "skyward-broken" in str(w.message)]) == 1
