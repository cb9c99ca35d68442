"""The pool's everyday behaviour on the Local provider: calls, operators, output, lifecycle."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

import skyward as sky
from tests.contract import ends, zeros_with_marks


@sky.compute
def whoami(tag: str = "") -> tuple[int, int, str]:
    info = sky.instance_info()
    return info.node, os.getpid(), tag


@sky.compute
def double(x: int) -> int:
    return 2 * x


@sky.compute
def shout(text: str) -> str:
    print(text)
    print(f"err: {text}", file=__import__("sys").stderr)
    os.system(f"echo from-a-subprocess-{text}")
    return text


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    with sky.ComputePool(nodes=2, stream_output=False) as running:
        yield running


def test_broadcast_returns_one_result_per_node_in_node_order(pool: sky.ComputePool) -> None:
    results = whoami("b") @ pool
    assert [node for node, _, _ in results] == [0, 1]
    assert len({pid for _, pid, _ in results}) == 2
    assert all(tag == "b" for _, _, tag in results)
    assert os.getpid() not in {pid for _, pid, _ in results}


def test_rshift_spreads_successive_calls_over_nodes(pool: sky.ComputePool) -> None:
    nodes = {(whoami() >> pool)[0] for _ in range(6)}
    assert nodes == {0, 1}


def test_and_and_gather_run_calls_concurrently_in_call_order(pool: sky.ComputePool) -> None:
    assert (double(1) & double(2) & double(3)) >> pool == (2, 4, 6)
    assert sky.gather(*(double(i) for i in range(10))) >> pool == tuple(2 * i for i in range(10))
    owners = {node for node, _, _ in sky.gather(whoami(), whoami()) >> pool}
    assert owners == {0, 1}


def test_submit_returns_a_future_and_node_can_be_chosen(pool: sky.ComputePool) -> None:
    future = pool.submit(whoami("f"), node=1)
    assert future.result(timeout=30)[0] == 1
    assert pool.run(double(21), node=0) == 42


def test_local_runs_in_process() -> None:
    assert double(4).local() == 8
    assert double.local(5) == 10
    assert (double(1) & double(2)).local() == (2, 4)
    with pytest.raises(sky.NotOnNodeError):
        whoami().local()


def logs_once(pool: sky.ComputePool, ready: Callable[[list[str]], bool]) -> list[str]:
    """The pool's log lines once `ready` holds: output travels apart from results, so it may
    trail a call's result by a moment."""
    deadline = time.monotonic() + 10
    while not ready(lines := pool.logs()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines


def test_output_is_prefixed_kept_and_includes_subprocesses(pool: sky.ComputePool) -> None:
    assert shout("hello-1") >> pool == "hello-1"
    lines = logs_once(pool, lambda got: sum("hello-1" in line for line in got) >= 3)
    node_lines = [line for line in lines if "hello-1" in line]
    assert any(line.endswith(") hello-1") for line in node_lines), lines
    assert any("err: hello-1" in line for line in node_lines)
    assert any("from-a-subprocess-hello-1" in line for line in node_lines)
    assert all(line.startswith("(node ") for line in lines)


def test_output_streams_to_the_console_with_the_node_prefix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with sky.ComputePool(nodes=1) as running:
        shout("streamed") >> running
    out = capsys.readouterr().out
    assert "(node 0) streamed" in out
    assert "(node 0) from-a-subprocess-streamed" in out


def test_function_is_sent_and_unpickled_once_per_node(
    pool: sky.ComputePool, tmp_path: os.PathLike[str]
) -> None:
    journal = os.path.join(tmp_path, "unpickled")

    class Traced:
        """A callable that notes every time a node unpickles it."""

        def __init__(self, path: str) -> None:
            self.path = path

        def __setstate__(self, state: dict[str, str]) -> None:
            self.__dict__.update(state)
            with open(self.path, "a") as handle:
                handle.write(f"{os.getpid()}\n")

        def __call__(self, x: int) -> int:
            return x + 1

    traced = sky.compute(Traced(journal))
    assert [traced(i) >> pool for i in range(6)] == [1, 2, 3, 4, 5, 6]
    assert traced(0) @ pool == [1, 1]
    with open(journal) as handle:
        pids = handle.read().split()
    assert len(pids) == 2 and len(set(pids)) == 2, pids


def test_large_arguments_and_results_round_trip(pool: sky.ComputePool) -> None:
    @sky.compute
    def echo(blob: bytes) -> bytes:
        return blob[::-1]

    data = os.urandom(5_000_000)
    assert echo(data) >> pool == data[::-1]


def test_instance_info_fields(pool: sky.ComputePool) -> None:
    @sky.compute
    def info() -> sky.InstanceInfo:
        return sky.instance_info()

    infos = info() @ pool
    assert [i.node for i in infos] == [0, 1]
    assert [i.is_head for i in infos] == [True, False]
    for i in infos:
        assert i.total_nodes == 2
        assert i.head_addr == "127.0.0.1"
        assert 0 < i.head_port < 65536
        assert i.peers == ("127.0.0.1", "127.0.0.1")
        assert i.pool_id == pool.pool_id
        assert i.accelerator is None
    assert infos == pool.infos


def test_env_reaches_the_nodes() -> None:
    @sky.compute
    def read_env() -> tuple[str | None, str | None]:
        return os.environ.get("FROM_IMAGE"), os.environ.get("FROM_POOL")

    image = sky.Image(env={"FROM_IMAGE": "img"})
    with sky.ComputePool(
        nodes=1, image=image, env={"FROM_POOL": "pool"}, stream_output=False
    ) as running:
        assert read_env() >> running == ("img", "pool")


def test_nodes_poll_for_calls_only_when_each_has_a_core() -> None:
    from skyward.providers.local.provider import _usable_cores
    from skyward.worker.agent import LINGER_ENV

    @sky.compute
    def linger_setting() -> str | None:
        return os.environ.get(LINGER_ENV)

    cores = _usable_cores()
    if cores >= 2:
        with sky.ComputePool(nodes=1, stream_output=False) as one:
            assert linger_setting() >> one == "200"
            assert one._sessions[0].stream._linger > 0  # type: ignore[attr-defined]
    with sky.ComputePool(nodes=cores, stream_output=False) as crowded:
        assert linger_setting() @ crowded == ["0"] * cores
        assert all(c.stream._linger == 0 for c in crowded._sessions)  # type: ignore[attr-defined]


def test_plugin_hooks_run_in_order_and_unwind_in_reverse(tmp_path: os.PathLike[str]) -> None:
    import contextlib

    journal = os.path.join(tmp_path, "journal")

    def recorder(name: str):  # type: ignore[no-untyped-def]
        @contextlib.contextmanager
        def around(info: sky.InstanceInfo):  # type: ignore[no-untyped-def]
            with open(journal, "a") as handle:
                handle.write(f"enter {name} {info.node}\n")
            yield
            with open(journal, "a") as handle:
                handle.write(f"exit {name} {info.node}\n")

        return around

    seen: list[str] = []

    def transform(tag: str):  # type: ignore[no-untyped-def]
        def apply(image: sky.Image, cluster: sky.ClusterSpec) -> sky.Image:
            seen.append(tag)
            assert cluster.nodes == 1
            return image.with_env({"ORDER": image.env.get("ORDER", "") + tag})

        return apply

    @sky.compute
    def order() -> str:
        return os.environ["ORDER"]

    plugins = [
        sky.Plugin("a", transform=transform("a"), around_app=recorder("a")),
        sky.Plugin("b", transform=transform("b"), around_app=recorder("b")),
    ]
    with sky.ComputePool(nodes=1, plugins=plugins, stream_output=False) as running:
        assert order() >> running == "ab"
    assert seen == ["a", "b"]
    with open(journal) as handle:
        assert handle.read().split("\n")[:-1] == ["enter a 0", "enter b 0", "exit b 0", "exit a 0"]


def test_pool_cannot_be_used_after_close() -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as running:
        pass
    with pytest.raises(sky.PoolClosedError, match="not running"):
        double(1) >> running


def test_results_only_cloudpickle_can_carry_come_back(pool: sky.ComputePool) -> None:
    @sky.compute
    def make() -> object:
        class Point:
            def __init__(self, x: int) -> None:
                self.x = x

        return Point(3), (lambda y: y * 10)

    point, fn = make() >> pool
    assert point.x == 3 and fn(2) == 20


def test_very_long_lines_are_kept(pool: sky.ComputePool) -> None:
    @sky.compute
    def noisy() -> None:
        import sys

        sys.stdout.write("x" * 200_000 + "\n")
        sys.stdout.write("no newline at the end")
        sys.stdout.flush()

    noisy() >> pool
    lines = logs_once(pool, lambda got: sum(line.count("x") for line in got) >= 200_000)
    assert sum(line.count("x") for line in lines) >= 200_000


def test_functions_from_the_users_own_modules_travel_by_value(
    tmp_path: os.PathLike[str],
) -> None:
    import importlib
    import sys

    project = os.path.join(tmp_path, "myproject_3c1")
    os.makedirs(project)
    with open(os.path.join(project, "__init__.py"), "w") as handle:
        handle.write("SCALE = 3\n\ndef scaled(x):\n    return SCALE * x\n")
    sys.path.append(str(tmp_path))  # importable here only: the nodes never see this path
    try:
        module = importlib.import_module("myproject_3c1")
        with sky.ComputePool(nodes=1, stream_output=False) as running:
            assert sky.compute(module.scaled)(5) >> running == 15
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("myproject_3c1", None)


def test_stacked_plugins_each_get_their_own_head_port() -> None:
    @sky.compute
    def ports() -> tuple[int, dict[str, int]]:
        info = sky.instance_info()
        return info.head_port, info.ports

    plugins = [
        sky.Plugin("coordinator-a", ports=("a",)),
        sky.Plugin("coordinator-b", ports=("b", "a")),  # a name asked for twice is one port
    ]
    with sky.ComputePool(nodes=2, plugins=plugins, stream_output=False) as pool:
        (head0, ports0), (head1, ports1) = ports() @ pool
    assert set(ports0) == {"head", "a", "b"}
    assert ports0 == ports1 and head0 == head1 == ports0["head"], "every node sees node 0's"
    assert len(set(ports0.values())) == 3, f"the ports must differ: {ports0}"
    assert all(1024 <= port < 65536 for port in ports0.values())


def test_a_failing_around_app_names_the_plugin_and_node_and_unwinds_the_ones_entered(
    tmp_path: os.PathLike[str],
) -> None:
    import contextlib

    journal = os.path.join(tmp_path, "journal")

    @contextlib.contextmanager
    def first(info: sky.InstanceInfo):  # type: ignore[no-untyped-def]
        yield
        with open(journal, "a") as handle:
            handle.write(f"exit first {info.node}\n")

    def second(info: sky.InstanceInfo) -> None:
        if info.node == 1:
            raise RuntimeError("no coordinator here")

    plugins = [sky.Plugin("first", around_app=first), sky.Plugin("second", around_app=second)]
    with pytest.raises(sky.PluginError) as caught:
        with sky.ComputePool(nodes=2, plugins=plugins, stream_output=False):
            pass
    error = caught.value
    assert (error.plugin, error.hook, error.node) == ("second", "around_app", 1)
    assert "RuntimeError: no coordinator here" in str(error)
    assert "remote traceback of node 1" in str(error)
    with open(journal) as handle:  # node 1 unwound the plugin it had entered
        assert "exit first 1" in handle.read().split("\n")


@pytest.mark.slow
def test_a_value_over_2_gib_travels_both_ways() -> None:
    """Past every 32-bit length: frames carry 64-bit segment lengths and large bytes travel out
    of band, so a 2 GiB result comes back and goes out again whole (about 15 s here)."""
    n = (2 << 30) + 12_345
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        data = zeros_with_marks(n) >> pool
        assert (len(data), data[0], data[-1]) == (n, 1, 2)
        assert ends(data) >> pool == (n, 1, 2)


def test_threads_calling_one_pool_at_once_all_get_their_results(pool: sky.ComputePool) -> None:
    """Threads mixing `>>`, `@`, a gather and `submit` on one pool, with pauses long enough for
    the pipes' reader threads to take over between calls: every result is right, none hangs.
    The functions are new to the nodes, so the threads race to send them first: a call that
    goes without the function's bytes must never overtake the write that carries them."""
    import random
    import threading

    def make(k: int) -> sky.Compute[[int], int]:
        def times(x: int) -> int:
            return k * x

        return sky.compute(times)

    functions = [make(k) for k in range(2, 6)]
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait(30)
            for i in range(40):
                k = rng.randrange(len(functions))
                fn, x, want = functions[k], seed * 1000 + i, (k + 2) * (seed * 1000 + i)
                way = rng.randrange(4)
                if way == 0:
                    assert fn(x) >> pool == want
                elif way == 1:
                    assert fn(x) @ pool == [want, want]
                elif way == 2:
                    assert sky.gather(fn(x), fn(x)) >> pool == (want, want)
                else:
                    assert pool.submit(fn(x)).result(30) == want
                if rng.random() < 0.2:
                    time.sleep(0.003)  # past the readers' linger: they go back to waiting
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a caller hung"
    assert not errors, errors[0]


def test_calls_leave_no_garbage_for_the_collector(pool: sky.ComputePool) -> None:
    """A call's bookkeeping (its replies, their tally) is freed when the call returns, not left
    in reference cycles for the garbage collector to find: a pool making thousands of small
    calls a second would otherwise pay for a collection every few dozen of them. (Only those
    objects are counted: what other threads leave meanwhile is not the calls'.)"""
    import gc

    from skyward.client.dispatch import Reply, Tally

    for _ in range(3):  # warm: whatever is built once (functions, pipe groups) is built
        double(1) >> pool, double(1) @ pool, sky.gather(double(1), double(2)) >> pool
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds goes to gc.garbage, to be looked at
    try:
        for i in range(50):
            assert double(i) >> pool == 2 * i
            assert double(i) @ pool == [2 * i, 2 * i]
            assert sky.gather(double(i), double(i + 1)) >> pool == (2 * i, 2 * i + 2)
        gc.collect()
        left = sum(isinstance(found, (Reply, Tally)) for found in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == 0, f"150 calls left {left} replies and tallies in reference cycles"
