"""Failure semantics on the Local provider (DESIGN.md section 6), with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import skyward as sky
from skyward.providers.base import NodeLoss
from tests.conftest import alive, reported_pids, sigint_default, wait_gone, worker_children


class NeedsTwoArgs(Exception):
    """Pickles fine but cannot be rebuilt: its __init__ wants two arguments."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


@sky.compute
def fail_with(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad value 42")
    if kind == "custom":
        raise NeedsTwoArgs("left", "right")
    raise KeyError(kind)


@sky.compute
def die(how: str, node_to_die: int = 0) -> str:
    info = sky.instance_info()
    if info.node != node_to_die:
        time.sleep(120)  # the survivor: stuck, as a rank in a collective would be
        return "survived"
    print(f"last words of node {info.node}", flush=True)
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@sky.compute
def pid() -> int:
    return os.getpid()


def _check_positive(value: int) -> int:
    if value < 0:
        raise ArithmeticError(f"negative: {value}")
    return value


@sky.compute
def through_a_helper(value: int) -> int:
    return _check_positive(value) + 1


def test_the_remote_traceback_shows_this_files_lines_for_code_sent_by_value() -> None:
    """The nodes run this module's functions from their pickled code, which cloudpickle names
    ``<dynamic-code>``: the client puts back the file and the source line of every frame."""
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(ArithmeticError, match="negative: -3") as caught:
            through_a_helper(-3) >> pool
    text = str(caught.value.__cause__)
    assert "<dynamic-code>" not in text
    for function, source in (
        ("through_a_helper", "return _check_positive(value) + 1"),
        ("_check_positive", 'raise ArithmeticError(f"negative: {value}")'),
    ):
        assert f'File "{__file__}", line ' in text and f"in {function}\n" in text
        assert f"\n    {source}\n" in text, text


def test_user_exception_keeps_type_message_node_and_remote_traceback() -> None:
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        with pytest.raises(ValueError, match="bad value 42") as caught:
            fail_with("value") >> pool
        cause = caught.value.__cause__
        assert cause is not None and "Traceback on node" in str(cause)
        assert 'raise ValueError("bad value 42")' in str(cause)
        assert any("raised on node" in note for note in caught.value.__notes__)
        # the pool survives a user exception
        assert pid() >> pool != os.getpid()


def test_unrebuildable_exception_becomes_remote_error() -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.RemoteError) as caught:
            fail_with("custom") >> pool
    error = caught.value
    assert error.type_name.endswith("NeedsTwoArgs")
    assert "left/right" in error.remote_message
    assert "NeedsTwoArgs" in error.remote_traceback
    assert error.node == 0
    assert isinstance(error, sky.SkywardError)


@pytest.mark.parametrize(
    ("how", "status_text"), [("exit", "exit status 7"), ("kill", "killed by SIGKILL")]
)
def test_dead_node_fails_the_call_fast_with_status_and_last_output(
    how: str, status_text: str
) -> None:
    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        started = time.monotonic()
        with pytest.raises(sky.WorkerError) as caught:
            die(how) >> pool
        elapsed = time.monotonic() - started
        error = caught.value
        assert error.node == 0
        assert status_text in str(error)
        assert "last words of node 0" in str(error)
        assert "last words of node 0" in error.output_tail
        assert elapsed < 10, f"a dead node took {elapsed:.1f} s to report"
        with pytest.raises(sky.PoolClosedError):
            pid() >> pool


def test_dead_node_in_a_broadcast_stops_the_others() -> None:
    with sky.ComputePool(nodes=3, stream_output=False) as pool:
        pids = pid() @ pool
        started = time.monotonic()
        with pytest.raises(sky.WorkerError) as caught:
            die("exit", node_to_die=1) @ pool
        assert time.monotonic() - started < 10
        assert caught.value.node == 1
        assert not wait_gone(pids, timeout=5), "the surviving nodes were not stopped"
        with pytest.raises(sky.PoolClosedError, match="node 1 failed"):
            pid() @ pool


def test_user_exception_in_a_broadcast_stops_stragglers_after_grace() -> None:
    @sky.compute
    def one_fails() -> None:
        if sky.instance_info().node == 0:
            raise RuntimeError("rank 0 gave up")
        time.sleep(120)

    with sky.ComputePool(nodes=2, broadcast_grace=0.5, stream_output=False) as pool:
        with pytest.raises(RuntimeError, match="rank 0 gave up"):
            one_fails() @ pool
        with pytest.raises(sky.PoolClosedError, match="node 0 failed"):
            pid() >> pool


def test_bad_input_fails_before_any_process_starts() -> None:
    before = set(worker_children())
    with pytest.raises(sky.ConfigError):
        sky.ComputePool(nodes=0)
    with pytest.raises(ValueError):
        sky.ComputePool(nodes=-1)
    with pytest.raises(ValueError, match="cuda"):
        sky.plugins.jax(cuda="cuda11")
    with pytest.raises(sky.ConfigError):
        sky.ComputePool(accelerator="A100:64")  # more GPUs than this machine has
    with pytest.raises(sky.ConfigError):
        sky.ComputePool(plugins=["jax"])  # type: ignore[list-item]
    assert set(worker_children()) == before


def test_unpicklable_function_or_argument_is_named_before_sending() -> None:
    lock = threading.Lock()

    @sky.compute
    def uses_lock() -> bool:
        return lock.locked()

    @sky.compute
    def takes(x: object, y: object = None) -> None:
        return None

    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.SerializationError, match="uses_lock"):
            uses_lock() >> pool
        with pytest.raises(sky.SerializationError, match="argument 1"):
            takes(1, lock) >> pool
        with pytest.raises(sky.SerializationError, match="argument y="):
            takes(1, y=lock) >> pool
        assert pid() >> pool > 0  # nothing was sent, the pool is fine


def test_unpicklable_result_is_a_clear_error() -> None:
    @sky.compute
    def returns_lock() -> object:
        return threading.Lock()

    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.SerializationError, match="return value"):
            returns_lock() >> pool


def test_failing_plugin_is_named_with_its_hook_and_node() -> None:
    def broken(info: sky.InstanceInfo) -> None:
        if info.node == 1:
            raise OSError("no such device")

    with (
        pytest.raises(sky.PluginError) as caught,
        sky.ComputePool(
            nodes=2, plugins=[sky.Plugin("gpu-check", around_app=broken)], stream_output=False
        ),
    ):
        pass
    error = caught.value
    assert (error.plugin, error.hook, error.node) == ("gpu-check", "around_app", 1)
    assert "no such device" in str(error)

    def bad_transform(image: sky.Image, cluster: sky.ClusterSpec) -> sky.Image:
        raise RuntimeError("cannot shape image")

    with pytest.raises(sky.PluginError, match="'shaper' failed in transform"):
        sky.ComputePool(
            plugins=[sky.Plugin("shaper", transform=bad_transform)], stream_output=False
        ).__enter__()


def test_exception_inside_the_block_tears_down() -> None:
    with pytest.raises(ZeroDivisionError):
        with sky.ComputePool(nodes=2, stream_output=False) as pool:
            pids = pid() @ pool
            1 / 0  # noqa: B018
    assert not wait_gone(pids, timeout=5)


CLIENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import skyward as sky

    @sky.compute
    def hang():
        child = subprocess.Popen(["sleep", "300"])
        print("PIDS", os.getpid(), child.pid, flush=True)
        time.sleep(300)

    def slow_start(info):
        print("PIDS", os.getpid(), flush=True)
        time.sleep(300)

    phase = sys.argv[1]
    plugins = [sky.Plugin("slow", around_app=slow_start)] if phase == "startup" else []
    with sky.ComputePool(nodes=2, plugins=plugins) as pool:
        if phase == "one":  # one node, and this thread reading its pipe itself
            hang() >> pool
        hang() @ pool
    """
)


@pytest.mark.parametrize(
    ("phase", "sig"),
    [
        ("call", signal.SIGINT),
        ("one", signal.SIGINT),
        ("call", signal.SIGTERM),
        ("startup", signal.SIGINT),
        # the client dies without unwinding: the agents find their stream closed and go
        ("call", signal.SIGKILL),
    ],
)
def test_signals_to_the_client_leave_no_process_behind(
    tmp_path: Path, phase: str, sig: signal.Signals
) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen(
        [sys.executable, str(script), phase],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).parent.parent,
        preexec_fn=sigint_default,
    )
    assert client.stdout is not None
    expected = {"call": 4, "one": 2, "startup": 2}[phase]
    pids = reported_pids(client.stdout, expected)
    assert pids, "the client never reported its nodes' pids"
    assert all(alive(p) for p in pids)
    client.send_signal(sig)
    try:
        client.wait(timeout=30)
    finally:
        client.kill()
    assert client.returncode != 0
    assert not wait_gone(pids, timeout=10), "processes left behind"


@pytest.mark.slow
def test_rank_dying_during_a_jax_collective_does_not_leave_the_other_blocked() -> None:
    @sky.compute
    def allreduce_then_die() -> float:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        info = sky.instance_info()
        mesh = Mesh(np.array(jax.devices()), ("data",))
        sharding = NamedSharding(mesh, P("data"))
        total = jax.jit(jnp.sum)
        local = np.ones(1, dtype=np.float32)
        first = float(total(jax.make_array_from_process_local_data(sharding, local)))
        if info.node == 1:
            os._exit(5)
        # node 0 enters the next collective alone: without skyward it would wait for JAX's
        # heartbeat timeout (100 s by default)
        return first + float(total(jax.make_array_from_process_local_data(sharding, local)))

    with sky.ComputePool(nodes=2, plugins=[sky.plugins.jax()], stream_output=False) as pool:
        pids = pid() @ pool
        started = time.monotonic()
        with pytest.raises(sky.WorkerError) as caught:
            allreduce_then_die() @ pool
        assert time.monotonic() - started < 20
        assert caught.value.node == 1 and "exit status 5" in str(caught.value)
        assert not wait_gone(pids, timeout=5)


def test_a_silent_node_is_declared_dead_after_the_heartbeat_timeout() -> None:
    @sky.compute
    def freeze() -> None:
        os.kill(os.getpid(), signal.SIGSTOP)  # no more heartbeats, as on a hung host

    with sky.ComputePool(nodes=1, heartbeat_timeout=1.5, stream_output=False) as pool:
        started = time.monotonic()
        with pytest.raises(sky.WorkerError, match="heartbeat_timeout"):
            freeze() >> pool
        assert time.monotonic() - started < 15


def test_sys_exit_in_a_call_fails_that_call_only() -> None:
    @sky.compute
    def bail() -> None:
        raise SystemExit(3)

    with sky.ComputePool(nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.RemoteError, match="SystemExit"):
            bail() >> pool
        assert pid() >> pool > 0


def test_a_failing_call_in_a_gather_does_not_stop_the_others() -> None:
    @sky.compute
    def slow_ok(seconds: float) -> str:
        time.sleep(seconds)
        return "ok"

    with sky.ComputePool(nodes=2, broadcast_grace=0.1, stream_output=False) as pool:
        with pytest.raises(ValueError, match="bad value"):
            sky.gather(fail_with("value"), slow_ok(1.0)) >> pool
        assert (slow_ok(0) & slow_ok(0)) >> pool == ("ok", "ok")


def test_around_client_failures_name_the_plugin() -> None:
    import contextlib

    @contextlib.contextmanager
    def tracker(pool: sky.ComputePool):  # type: ignore[no-untyped-def]
        raise ConnectionError("tracker server down")
        yield

    with pytest.raises(sky.PluginError, match="'tracker' failed entering around_client") as caught:
        with sky.ComputePool(
            plugins=[sky.Plugin("tracker", around_client=tracker)], stream_output=False
        ):
            pass
    assert caught.value.hook == "around_client"


def test_the_providers_account_of_a_lost_node_reaches_the_error() -> None:
    class Reclaimed(sky.Local):
        """Local nodes, with a provider that says the node was reclaimed (as EC2 says)."""

        async def explain(self, cluster: object, node: object) -> NodeLoss:  # type: ignore[override]
            return NodeLoss(
                "instance i-123 was preempted: EC2 reclaimed the spot instance", preempted=True
            )

    with sky.ComputePool(provider=Reclaimed(), nodes=1, stream_output=False) as pool:
        with pytest.raises(sky.WorkerError, match="was preempted") as caught:
            die("kill") >> pool
    assert caught.value.preempted and "killed by SIGKILL" in str(caught.value)


def test_a_dead_node_can_be_replaced_and_the_pool_goes_on() -> None:
    with sky.ComputePool(nodes=2, stream_output=False) as pool:
        before = pid() @ pool
        with pytest.raises(sky.WorkerError):
            die("exit", node_to_die=1) @ pool
        with pytest.raises(sky.PoolClosedError):
            pid() @ pool
        with pytest.raises(sky.ConfigError, match=r"node 0 is not lost .* \[1\]"):
            pool.replace(0)  # stopped because node 1 died: every agent restarts anyway
        pool.replace(1)
        after = pid() @ pool
        assert len(after) == 2 and not set(after) & set(before)
        assert any("last words of node 1" in line for line in pool.logs(1))


@pytest.mark.slow
def test_a_replaced_node_rejoins_a_new_jax_coordinator() -> None:
    @sky.compute
    def psum_of_ranks() -> float:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("data",))
        rank = np.array([sky.instance_info().node + 1.0], np.float32)
        sharded = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rank)
        return float(jax.jit(jnp.sum)(sharded))

    with sky.ComputePool(nodes=2, plugins=[sky.plugins.jax()], stream_output=False) as pool:
        assert psum_of_ranks() @ pool == [3.0, 3.0]
        with pytest.raises(sky.WorkerError):
            die("kill", node_to_die=0) @ pool  # the head (the coordinator) is lost
        pool.replace(0)
        assert psum_of_ranks() @ pool == [3.0, 3.0]


class _LeakyLocal(sky.Local):
    """Local nodes whose provider reports a teardown it could not finish, as a cloud's can."""

    async def terminate(self, cluster: object) -> None:  # type: ignore[override]
        raise sky.ProvisionError(
            "pool x could not be fully removed: key pair k. Run `skyward down x`"
        )


def test_a_teardown_problem_is_a_note_on_the_error_that_ended_the_pool() -> None:
    with pytest.raises(LookupError, match="the user's own") as caught:
        with sky.ComputePool(provider=_LeakyLocal(), nodes=1, stream_output=False):
            raise LookupError("the user's own")
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "removing the pool then failed too" in notes and "skyward down x" in notes


def test_a_teardown_problem_after_a_clean_block_is_raised() -> None:
    with pytest.raises(sky.ProvisionError, match="skyward down x"):
        with sky.ComputePool(provider=_LeakyLocal(), nodes=1, stream_output=False):
            pass


def test_a_start_that_fails_keeps_its_own_error_when_teardown_fails_too() -> None:
    bad = sky.Plugin("boom", around_app=lambda info: 1 / 0)
    with pytest.raises(sky.PluginError, match="ZeroDivisionError") as caught:
        with sky.ComputePool(provider=_LeakyLocal(), nodes=1, plugins=[bad], stream_output=False):
            pass
    assert "skyward down x" in "\n".join(getattr(caught.value, "__notes__", []))
