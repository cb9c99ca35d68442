"""The provider contract: every provider passes these (launch, run, broadcast, fail, terminate,
build an image once, fail half-way and leave nothing, name a failing plugin), and each
capability it declares (`skyward.providers.base.Capability`) is exercised through the public
API: signals (`pool.stacks()` names what a node is doing), replace (a dead node replaced and
the pool whole again), list (`find` sees a live pool and not a closed one), and its verbs are
its own (`skyward.providers.base.CAPABILITY_VERBS`). A capability it does not declare is refused
where a feature needs it (`ConfigError`), never a silent no-op.

A provider's test module subclasses `ProviderContract` and supplies the `make_provider` fixture
(a fresh provider object each call), `make_broken_provider` (a provider whose 2-node pool fails
half-way: one node launches or starts, the other cannot) and `nodes_available` (how many nodes it
can launch). It overrides the checks of what "nothing remains" means for it: `assert_gone` (these
agents no longer run), `assert_nothing_left` (nothing of this pool remains: no agent, no
connection, no cloud resource) and `expect_nothing_launched` (the pool created nothing at all).
Everything here goes through the public API only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.base import Capability, Provider, missing_verbs
from tests.support import wheels

PROBE = "skyward-contract-probe"
READY_MARKER = ".skyward-ready"  # written last into a built environment (worker/envbuild.py)


@sky.compute
def identity() -> tuple[int, int, str, str]:
    info = sky.instance_info()
    return info.node, os.getpid(), info.head_addr, info.pool_id


@sky.compute
def add(a: int, b: int) -> int:
    return a + b


@sky.compute
def crash_node(node: int) -> str:
    if sky.instance_info().node == node:
        print("about to crash", flush=True)
        os._exit(9)
    time.sleep(60)
    return "late"


@sky.compute
def wait_a_while(seconds: float) -> str:
    threading.Event().wait(seconds)  # a rank waiting for a peer, say
    return "waited"


@sky.compute
def raise_error(message: str) -> None:
    raise LookupError(message)


@sky.compute
def probe_environment() -> tuple[int, str, str, str, int, int]:
    """Node, host, environment prefix, the probe package's token, and the ready marker's
    identity."""
    import socket

    import skyward_contract_probe  # type: ignore[import-not-found]  # only in the built env

    marker = Path(sys.prefix) / READY_MARKER
    stat = marker.stat()
    return (
        sky.instance_info().node,
        socket.gethostname(),
        sys.prefix,
        skyward_contract_probe.TOKEN,
        stat.st_ino,
        stat.st_mtime_ns,
    )


@sky.compute
def describe_tree(path: str) -> tuple[int, dict[str, tuple[str, int, int, str]]]:
    """The node, and what it sees under `path`: kind, mode, mtime and content or link target."""
    return sky.instance_info().node, tree_listing(Path(path))


def tree_listing(root: Path) -> dict[str, tuple[str, int, int, str]]:
    """Kind, owner permission bits, mtime and content of everything under `root`. The owner's
    bits only: a node's copy keeps those and drops group and other (docs/security.md)."""
    if root.is_file():
        stat = root.stat()
        return {".": ("file", stat.st_mode & 0o700, stat.st_mtime_ns, root.read_text())}
    found: dict[str, tuple[str, int, int, str]] = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        name = str(path.relative_to(root))
        mode, mtime = stat.st_mode & 0o700, stat.st_mtime_ns
        if path.is_symlink():
            found[name] = ("link", 0, 0, os.readlink(path))
        elif path.is_dir():
            found[name] = ("dir", mode, 0 if any(path.iterdir()) else mtime, "")
        else:
            found[name] = ("file", mode, mtime, path.read_text())
    return found


def make_tree(root: Path) -> Path:
    """A small dataset with what a sync must keep: nesting, an empty directory, a symlink, an
    executable, an old mtime."""
    (root / "shards" / "deep").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "shards" / "a.txt").write_text("alpha")
    (root / "shards" / "deep" / "b.txt").write_text("beta")
    tool = root / "run.sh"
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    os.symlink("shards/a.txt", root / "link-to-a")
    os.utime(root / "shards" / "a.txt", ns=(1_600_000_000_000_000_000,) * 2)
    return root


@sky.compute
def zeros_with_marks(n: int) -> bytes:
    """`n` zero bytes but the first (1) and the last (2)."""
    data = bytearray(n)
    data[0], data[-1] = 1, 2
    return bytes(data)


@sky.compute
def ends(data: bytes) -> tuple[int, int, int]:
    return len(data), data[0], data[-1]


@sky.compute
def write_outputs(tag: str) -> str:
    out = Path(sky.output_dir())
    assert os.environ["SKYWARD_OUTPUT_DIR"] == str(out)
    (out / "ckpt").mkdir(exist_ok=True)
    (out / "ckpt" / "state.txt").write_text(f"{tag} from node {sky.instance_info().node}")
    return str(out)


@sky.compute
def write_then_fail(tag: str) -> None:
    (Path(sky.output_dir()) / "last.txt").write_text(tag)
    raise RuntimeError(f"{tag} failed after writing")


def offline_image(directory: Path, token: str) -> sky.Image:
    """An image that needs a real build and no package index: every requirement is a local wheel.

    The probe package exists nowhere but in `directory`; the agent's own requirements
    (cloudpickle, packaging) are this interpreter's, packed again, so the build works on hosts
    with no route to an index. The path in the requirement makes the image hash new every run.
    """
    probe = wheels.make_wheel(
        directory, PROBE, "1.0", {"skyward_contract_probe/__init__.py": f"TOKEN = {token!r}\n"}
    )
    pins = [
        wheels.requirement(n, wheels.wheel_of_installed(directory, n))
        for n in wheels.AGENT_PACKAGES
    ]
    return sky.Image(pip=[wheels.requirement(PROBE, probe), *pins])


class ProviderContract:
    """Subclass with `make_provider`, `make_broken_provider` and `nodes_available` fixtures."""

    @pytest.fixture
    def make_provider(self) -> Callable[[], object]:
        raise NotImplementedError

    @pytest.fixture
    def make_broken_provider(self) -> Callable[[], object]:
        """A provider whose 2-node pool fails half-way (one node up, the other cannot be)."""
        raise NotImplementedError

    @pytest.fixture
    def nodes_available(self) -> int:
        return 2

    def probe_image(self, directory: Path, token: str) -> sky.Image:
        """An image that needs a real build, of the probe package saying `token`. By default
        its wheels are files under `directory` on this machine (`offline_image`); a provider
        whose hosts cannot see this machine's files serves them from an index instead."""
        return offline_image(directory, token)

    def _pool(self, make_provider: Callable[[], object], nodes: int) -> sky.ComputePool:
        return sky.ComputePool(
            provider=make_provider(),
            nodes=nodes,  # type: ignore[arg-type]
            stream_output=False,
        )

    def test_launch_run_and_broadcast(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        nodes = min(2, nodes_available)
        with self._pool(make_provider, nodes) as pool:
            results = identity() @ pool
            assert [r[0] for r in results] == list(range(nodes))
            assert len({r[3] for r in results}) == 1 and results[0][3] == pool.pool_id
            assert len({r[2] for r in results}) == 1, "every node must agree on the head"
            assert add(2, 3) >> pool == 5
            assert (add(1, 1) & add(2, 2)) >> pool == (2, 4)

    def test_user_exception_comes_back_as_itself(self, make_provider: Callable[[], object]) -> None:
        with self._pool(make_provider, 1) as pool:
            with pytest.raises(LookupError, match="contract-42"):
                raise_error("contract-42") >> pool

    def test_node_death_fails_the_broadcast_and_stops_the_others(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        nodes = min(2, nodes_available)
        with self._pool(make_provider, nodes) as pool:
            with pytest.raises(sky.WorkerError) as caught:
                crash_node(nodes - 1) @ pool
            assert caught.value.node == nodes - 1
            assert "about to crash" in str(caught.value)
            assert "exit status 9" in str(caught.value)

    def test_terminate_leaves_nothing(self, make_provider: Callable[[], object]) -> None:
        provider = make_provider()
        with sky.ComputePool(
            provider=provider,
            nodes=1,  # type: ignore[arg-type]
            stream_output=False,
        ) as pool:
            pid = (identity() >> pool)[1]
        self.assert_gone(provider, [pid])

    def test_failed_environment_build_leaves_nothing(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        # The nodes are launched (connected, booted), then their environment cannot be built.
        provider = make_provider()
        setup = f"echo contract-{uuid.uuid4().hex[:8]} breaks the build; exit 3"
        pool = sky.ComputePool(
            provider=provider,  # type: ignore[arg-type]
            nodes=min(2, nodes_available),
            image=sky.Image(setup=[setup]),
            stream_output=False,
        )
        with pytest.raises(sky.BootstrapError, match="exit status 3"):
            pool.start()
        self.assert_nothing_left(provider, pool)

    def test_launch_failing_half_way_leaves_nothing(
        self, make_broken_provider: Callable[[], object]
    ) -> None:
        provider = make_broken_provider()
        pool = sky.ComputePool(provider=provider, nodes=2, stream_output=False)  # type: ignore[arg-type]
        with pytest.raises(sky.SkywardError) as caught:
            pool.start()
        error = caught.value
        assert isinstance(error, (sky.ProvisionError, sky.BootstrapError, sky.WorkerError)), (
            f"a half-finished start must say what failed, not {type(error).__name__}: {error}"
        )
        assert str(error).strip()
        self.assert_nothing_left(provider, pool)

    def test_image_is_built_once_and_reused(
        self, make_provider: Callable[[], object], nodes_available: int, tmp_path: Path
    ) -> None:
        token = uuid.uuid4().hex
        image = self.probe_image(tmp_path / "wheels", token)
        nodes = min(2, nodes_available)
        seen: list[list[tuple[int, str, str, str, int, int]]] = []
        try:
            for _ in range(2):
                with sky.ComputePool(
                    provider=make_provider(),  # type: ignore[arg-type]
                    nodes=nodes,
                    image=image,
                    stream_output=False,
                ) as pool:
                    seen.append(probe_environment() @ pool)
        finally:
            for prefix in {row[2] for rows in seen for row in rows}:
                self.discard_environment(prefix)
        first, second = seen
        assert [row[0] for row in first] == list(range(nodes))
        assert all(row[3] == token for row in first), "the nodes do not see the built package"
        assert all(row[2] != sys.prefix for row in first), "the client's interpreter was used"
        # The second pool found every host's environment complete and built nothing: the same
        # directory, and the marker written last by the first build is the very same file.
        # Compared per host, not per node: a cloud may give node i another host the second
        # time (moto hands a new pool the freed addresses in any order).
        assert sorted(row[1:] for row in second) == sorted(row[1:] for row in first)

    def test_plugin_failing_on_one_node_is_named_and_leaves_nothing(
        self, make_provider: Callable[[], object], nodes_available: int
    ) -> None:
        nodes = min(2, nodes_available)
        failing = nodes - 1

        def boom(info: sky.InstanceInfo) -> None:
            if info.node == failing:
                raise OSError(f"contract boom on node {info.node}")

        provider = make_provider()
        pool = sky.ComputePool(
            provider=provider,  # type: ignore[arg-type]
            nodes=nodes,
            plugins=[sky.Plugin("boom", around_app=boom)],
            stream_output=False,
        )
        with pytest.raises(sky.PluginError) as caught:
            pool.start()
        error = caught.value
        assert (error.plugin, error.hook, error.node) == ("boom", "around_app", failing)
        message = str(error)
        assert "'boom'" in message and "around_app" in message and f"node {failing}" in message
        assert f"contract boom on node {failing}" in message
        assert "Traceback" in message and "in boom" in message, "no remote traceback"
        self.assert_nothing_left(provider, pool)

    @pytest.mark.parametrize("hook", ["transform", "around_client"])
    def test_client_side_plugin_failure_is_named_before_anything_launches(
        self, make_provider: Callable[[], object], hook: str
    ) -> None:
        def fail(*args: object) -> None:
            raise RuntimeError(f"contract {hook} failure")

        provider = make_provider()
        pool = sky.ComputePool(
            provider=provider,  # type: ignore[arg-type]
            nodes=1,
            plugins=[sky.Plugin("boom", **{hook: fail})],  # type: ignore[arg-type]
            stream_output=False,
        )
        with self.expect_nothing_launched(provider, pool):
            with pytest.raises(sky.PluginError) as caught:
                pool.start()
        assert pool.nodes == [], "the pool launched nodes after a client-side hook failed"
        assert (caught.value.plugin, caught.value.hook) == ("boom", hook)
        assert "'boom'" in str(caught.value) and hook in str(caught.value)
        assert f"contract {hook} failure" in str(caught.value)

    def test_data_reaches_every_node_as_a_path(
        self, make_provider: Callable[[], object], nodes_available: int, tmp_path: Path
    ) -> None:
        nodes = min(2, nodes_available)
        tree = make_tree(tmp_path / "dataset")
        single = tmp_path / "labels.csv"
        single.write_text("0,1\n")
        with self._pool(make_provider, nodes) as pool:
            seen = describe_tree(sky.Data(tree)) @ pool
            assert [node for node, _ in seen] == list(range(nodes))
            assert all(listing == tree_listing(tree) for _, listing in seen), seen
            assert describe_tree(sky.Data(single)) >> pool == (0, tree_listing(single))
            # A changed file is seen by the next call.
            (tree / "shards" / "deep" / "b.txt").write_text("beta, second version")
            _, listing = describe_tree(sky.Data(str(tree))) >> pool
            assert listing["shards/deep/b.txt"][3] == "beta, second version"
            with pytest.raises(sky.DataError, match="does not exist") as caught:
                describe_tree(sky.Data(tmp_path / "missing")) >> pool
            assert caught.value.path == str(tmp_path / "missing")

    def test_outputs_are_collected_even_when_a_call_fails(
        self, make_provider: Callable[[], object], nodes_available: int, tmp_path: Path
    ) -> None:
        nodes = min(2, nodes_available)
        runs = tmp_path / "runs" / "exp1"
        with pytest.raises(RuntimeError, match="second failed"):
            with sky.ComputePool(
                provider=make_provider(),  # type: ignore[arg-type]
                nodes=nodes,
                output_dir=runs,
                stream_output=False,
            ) as pool:
                write_outputs("first") @ pool
                pool.collect_outputs()
                for node in range(nodes):
                    state = runs / f"node-{node}" / "ckpt" / "state.txt"
                    assert state.read_text() == f"first from node {node}"
                write_then_fail("second") >> pool
        assert (runs / "node-0" / "last.txt").read_text() == "second"

    def test_outputs_are_collected_on_ctrl_c(
        self, make_provider: Callable[[], object], tmp_path: Path
    ) -> None:
        runs = tmp_path / "runs"
        with pytest.raises(KeyboardInterrupt):
            with sky.ComputePool(
                provider=make_provider(),  # type: ignore[arg-type]
                nodes=1,
                output_dir=runs,
                stream_output=False,
            ) as pool:
                write_outputs("interrupted") >> pool
                raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        assert (runs / "node-0" / "ckpt" / "state.txt").read_text() == "interrupted from node 0"

    def test_outputs_without_output_dir_go_with_the_pool(
        self, make_provider: Callable[[], object]
    ) -> None:
        with self._pool(make_provider, 1) as pool:
            where = write_outputs("gone") >> pool
            with pytest.raises(sky.ConfigError, match="output_dir"):
                pool.collect_outputs()
        self.assert_outputs_removed(where)

    # -- the declared capabilities ----------------------------------------------------------

    def _refused_without(
        self, make_provider: Callable[[], object], capability: Capability, **feature: float
    ) -> bool:
        """Whether the provider lacks `capability` for a 1-node pool (what these tests make; a
        TPU slice rules out some); when it does, a pool asking for `feature` (which needs it)
        must be refused when it is made, naming the capability."""
        provider = make_provider()
        assert isinstance(provider, Provider)
        pool = sky.ComputePool(provider=provider, nodes=1, stream_output=False)  # made, not started
        if capability in provider.capabilities_for(pool.spec):
            return False
        with pytest.raises(sky.ConfigError, match=re.escape(capability.value)):
            sky.ComputePool(provider=make_provider(), nodes=1, **feature)  # type: ignore[arg-type]
        return True

    def test_signals_reach_every_agent_or_stall_timeout_is_refused(
        self, make_provider: Callable[[], object]
    ) -> None:
        if self._refused_without(make_provider, Capability.SIGNALS, stall_timeout=30):
            return
        with self._pool(make_provider, 1) as pool:
            call = pool.submit(wait_a_while(8), node=0)
            deadline = time.monotonic() + 6
            stacks = pool.stacks(timeout=5)
            while "wait_a_while" not in stacks.get(0, "") and time.monotonic() < deadline:
                time.sleep(0.2)  # the call may not have reached the agent's thread yet
                stacks = pool.stacks(timeout=5)
            assert "wait_a_while" in stacks[0], stacks
            assert call.result(timeout=30) == "waited"  # asking did not disturb the call

    def test_a_dead_node_is_replaced_or_restarts_are_refused(
        self, make_provider: Callable[[], object]
    ) -> None:
        if self._refused_without(make_provider, Capability.REPLACE, restarts=1):
            return
        with self._pool(make_provider, 1) as pool:
            before = identity() >> pool
            with pytest.raises(sky.WorkerError):
                crash_node(0) >> pool
            pool.replace(0)
            after = identity() >> pool
            assert after[0] == 0 and after[3] == pool.pool_id
            assert after[1] != before[1] or after[2] != before[2], "the same agent answered"

    def test_each_declared_capability_has_its_verbs(
        self, make_provider: Callable[[], object]
    ) -> None:
        """A capability declared without the verbs it needs would be a silent no-op (`LIST`
        without `find` lists nothing): the provider writes each one itself."""
        provider = make_provider()
        assert isinstance(provider, Provider)
        assert missing_verbs(type(provider)) == []

    def test_a_live_pool_is_found_and_a_closed_one_is_not_or_listing_is_refused(
        self, make_provider: Callable[[], object]
    ) -> None:
        provider = make_provider()
        assert isinstance(provider, Provider)
        if Capability.LIST not in provider.capabilities:
            with pytest.raises(sky.ConfigError, match="list"):
                provider.find()
            with pytest.raises(sky.ConfigError, match="list"):
                provider.cleanup("pool-none")
            return
        with sky.ComputePool(provider=provider, nodes=1, stream_output=False) as pool:
            assert identity() >> pool
            assert pool.pool_id in provider.find()
        deadline = time.monotonic() + 30  # a queue or an API may take a moment to forget it
        while pool.pool_id in provider.find() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pool.pool_id not in provider.find()

    # -- what "nothing remains" means; override for each provider ----------------------------

    def assert_outputs_removed(self, where: str) -> None:
        """A node's output directory is gone with its pool. Every provider's test hosts share
        this machine's files, so the directory can be looked at from here."""
        assert not Path(where).exists(), f"{where} was left behind"

    def assert_gone(self, provider: object, pids: list[int]) -> None:
        """Check the agents with `pids` no longer run (override for remote nodes)."""
        from tests.conftest import wait_gone

        assert not wait_gone(pids, timeout=10)

    def assert_nothing_left(self, provider: object, pool: sky.ComputePool) -> None:
        """Nothing of `pool` remains: no agent process (override for remote nodes)."""
        from tests.conftest import wait_gone, worker_children

        assert not wait_gone(worker_children(), timeout=10), "agents of the pool still run"

    @contextlib.contextmanager
    def expect_nothing_launched(self, provider: object, pool: sky.ComputePool) -> Iterator[None]:
        """The body creates nothing of `pool` at all: no agent process was ever started."""
        from tests.conftest import worker_children

        before = set(worker_children())
        yield
        assert set(worker_children()) <= before

    def discard_environment(self, prefix: str) -> None:
        """Remove an environment the contract built (its hash is new every run).

        Every provider tested here builds on this machine's disk; a truly remote one overrides
        this (or leaves the environment to its cache).
        """
        path = Path(prefix)
        shutil.rmtree(path, ignore_errors=True)
        path.with_name(f"{path.name}.lock").unlink(missing_ok=True)
