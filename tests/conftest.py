"""Shared test helpers: process liveness checks and a quiet pool factory."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from skyward.errors import SkywardError
    from skyward.info import InstanceInfo
    from skyward.plugins.base import Plugin
    from tests.support.typecheck import MypyReport


# The suite's own skyward caches, made before any test: nothing an earlier run left in
# ~/.cache/skyward (environments, skyward's source, uv) changes a result. The client's is
# SKYWARD_CACHE_DIR; root's sessions on the test sshd servers, which share this machine's
# filesystem, get the hosts' one (tests/support/sshd.py).
_SUITE_CACHE = tempfile.mkdtemp(prefix="skyward-suite-")
atexit.register(shutil.rmtree, _SUITE_CACHE, True)
os.environ["SKYWARD_CACHE_DIR"] = os.path.join(_SUITE_CACHE, "client")
os.environ["SKYWARD_TEST_HOST_CACHE"] = os.path.join(_SUITE_CACHE, "hosts")


def start_with_node_1_stuck(pid_dir: Path, plugin: Plugin) -> SkywardError:
    """Start a 2-node Local pool whose node 1 hangs in a plugin before `plugin` (a framework's
    coordinator: a slow download, a hung mount, ...); the error the start failed with, once
    every agent is gone."""
    import skyward as sky

    def stall_node_1(info: InstanceInfo) -> None:  # nested: it travels by value, not by import
        Path(pid_dir, f"node{info.node}.pid").write_text(str(os.getpid()))
        if info.node == 1:
            print(f"node {info.node} is stuck in the slow plugin", flush=True)
            time.sleep(600)

    slow = sky.Plugin("slow", around_app=stall_node_1)
    plugins = [slow, plugin]
    with (
        pytest.raises(sky.SkywardError) as caught,
        sky.ComputePool(provider=sky.Local(), nodes=2, plugins=plugins, startup_timeout=60),
    ):
        pytest.fail("the pool must not start")
    pids = [int((pid_dir / f"node{i}.pid").read_text()) for i in range(2)]
    assert wait_gone(pids) == [], "agent processes were left behind"
    return caught.value


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path`, read a MiB at a time (the files compared are large)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def worker_children() -> list[int]:
    """Pids of skyward agents whose parent is this test process."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"skyward.worker" in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A skyward cache of this test's own (SKYWARD_CACHE_DIR), for it and the processes it
    starts: what it lists (runs, pools' history) is only what it made."""
    where = tmp_path / "cache"
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(where))
    return where


@pytest.fixture(autouse=True)
def fresh_prices() -> Iterable[None]:
    """Every test asks the price services afresh: a price a test's stand-in served is kept on
    disk for days and would otherwise be the next test's (a catalog with no SKU, too)."""
    from skyward.providers.cloud import pricecache

    shutil.rmtree(pricecache.folder(), ignore_errors=True)
    yield
    shutil.rmtree(pricecache.folder(), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def no_leftover_agents() -> Iterable[None]:
    """Every test module must leave no agent of this process running."""
    yield
    left = wait_gone(worker_children(), timeout=10)
    assert not left, f"agent processes left behind: {left}"


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.cache
def import_example(filename: str) -> ModuleType:
    """Import a script from examples/ (its functions travel to the nodes by value)."""
    path = EXAMPLES / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# The fixtures that need a debootstrapped root, by the Debian suite they need.
_ROOT_FIXTURES = {"bookworm_root": "bookworm", "instance_root": "bookworm", "trixie_root": "trixie"}
_root_builds: list[threading.Thread] = []


def _start_root_builds(items: list[pytest.Item]) -> None:
    """Build the Debian roots the selected tests need at once, in the background, as soon as
    they are collected: each takes about 45 s, mostly waiting on the archive, and the first
    test that needs one then waits only for what is left (tests/support/bareroots.py)."""
    suites = {
        _ROOT_FIXTURES[name]
        for item in items
        for name in getattr(item, "fixturenames", ())
        if name in _ROOT_FIXTURES
    }
    if not suites or os.geteuid() != 0:
        return
    from tests.support import bareroots

    def build(suite: str) -> None:
        with contextlib.suppress(Exception):  # the fixture that needs it says why, or skips
            bareroots.cached_root(suite)

    for suite in sorted(suites):
        thread = threading.Thread(target=build, args=(suite,), name=f"root-{suite}")
        thread.start()
        _root_builds.append(thread)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for thread in _root_builds:  # a build is never left half-done behind the suite
        thread.join()


_TESTS = Path(__file__).resolve().parent


def pytest_itemcollected(item: pytest.Item) -> None:
    """Put each test in the pytest-xdist group that must run in one worker process.

    A folder's tests (tests/ssh, tests/aws, tests/slurm, ...) share session fixtures that hold a
    fixed test subnet (its sshd hosts, its Slurm cluster, moto's machines): a second worker
    making the same set would wait on the subnet's lock for as long as the first one's session
    lives. So a folder is one group; a top-level module is one group, so that its module-scoped
    pools are started once. Marked as each test is collected, so the mark is there before any
    `pytest_collection_modifyitems`, pytest-xdist's (which reads it) included, whatever order
    the plugins' hooks run in. Without xdist the mark is inert.
    """
    relative = item.path.resolve().relative_to(_TESTS)
    group = relative.parts[0] if len(relative.parts) > 1 else relative.stem
    item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the Debian roots' builds the tests need (`_start_root_builds`); `gpu`-marked tests
    need a real NVIDIA GPU: skipped, saying so, where there is none."""
    _start_root_builds(items)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    from skyward.providers.local.provider import machine_gpus

    inventory = machine_gpus()
    if inventory.gpus:
        return
    reason = "no NVIDIA GPU on this machine" + (
        f" ({inventory.problem})" if inventory.problem else ""
    )
    for item in gpu_tests:
        item.add_marker(pytest.mark.skip(reason=reason))


def reported_pids(stream: IO[str], expected: int, timeout: float = 60.0) -> list[int]:
    """The pids a client's nodes print as ``PIDS <pid> ...`` lines on `stream`, read until
    `expected` of them came, the stream ended or `timeout` passed."""
    pids: list[int] = []
    deadline = time.monotonic() + timeout
    while len(pids) < expected and time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        if "PIDS" in line:
            pids += [int(p) for p in line.split("PIDS", 1)[1].split()]
    return pids


def sigint_default() -> None:
    """For `subprocess.Popen(preexec_fn=...)`: the child starts with SIGINT at its default, so
    Python turns it into KeyboardInterrupt, even when this suite runs from a shell that started
    it in the background with SIGINT ignored (a disposition children inherit)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_raises() -> Iterable[None]:
    """SIGINT raises KeyboardInterrupt in this process for the test, whatever the shell that
    started the suite left it at."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> MypyReport:
    """One mypy run over the package, the scripts and the examples (tests/support/typecheck.py)."""
    pytest.importorskip("mypy")
    from tests.support.typecheck import check

    return check(tmp_path_factory.mktemp("typed"))


@pytest.fixture(scope="session")
def instance_root() -> Path:
    """The cached debootstrapped root every simulated cloud machine (AWS, GCP) boots from,
    never written into; the suite starts building it as soon as tests are collected."""
    from tests.support import bareroots, sshd

    if not sshd.is_root():
        pytest.skip("cloud machines are network namespaces with chroots: that needs root")
    reason = sshd.netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    bareroots.remove_stale_bare_resources()  # only what crashed runs (dead owners) left
    try:
        return bareroots.cached_root(bareroots.MACHINE_SUITE)
    except Exception as exc:  # no network, no debootstrap: skip, do not fail
        pytest.skip(f"cannot build a Debian {bareroots.MACHINE_SUITE} root: {exc}")


@pytest.fixture(scope="session")
def instance_wheels(instance_root: Path) -> Path:
    """Read-only cache dir of the cloud machines' wheels (`bareroots.machine_requirements`)."""
    from tests.support import bareroots

    try:
        return bareroots.download_wheels(
            None,
            bareroots.machine_requirements(),
            python_version=bareroots.SUITE_PYTHON[bareroots.MACHINE_SUITE],
        )
    except Exception as exc:  # no network: skip, do not fail
        pytest.skip(f"cannot download wheels for the machines: {exc}")
