"""The JAX plugin: its image transform (fast unit tests) and real `jax.distributed` across Local
nodes (slow: real child processes, gloo collectives on the CPU)."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import skyward as sky
from skyward.hardware import Accelerator, ClusterSpec
from skyward.plugins.jax_plugin import JAX_RELEASES, LIBTPU_RELEASES
from skyward.worker import jaxenv
from tests.conftest import import_example, start_with_node_1_stuck
from tests.support.listeners import listeners

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "jax_data_parallel.py"
JAX_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


# -- helpers -------------------------------------------------------------------------------------


def cluster(accelerator: str | None = None, nodes: int = 2, cuda: str | None = None) -> ClusterSpec:
    return ClusterSpec(
        nodes=nodes,
        pool_id="pool-test",
        accelerator=Accelerator.parse(accelerator) if accelerator else None,
        cuda=cuda,
    )


def jax_pool(nodes: int, **plugin_kwargs: Any) -> sky.ComputePool:
    return sky.ComputePool(
        provider=sky.Local(), nodes=nodes, plugins=[sky.plugins.jax(**plugin_kwargs)]
    )


@pytest.fixture(scope="module")
def pool2() -> Iterator[sky.ComputePool]:
    """One 2-node JAX pool shared by the tests that only run calls on it."""
    with jax_pool(2) as pool:
        yield pool


def load_example() -> ModuleType:
    return import_example("jax_data_parallel.py")


# -- the transform hook (no processes) -----------------------------------------------------------


def test_cpu_pool_gets_the_cpu_wheel_and_no_index() -> None:
    image = sky.plugins.jax().transform(sky.Image(pip=["numpy"]), cluster())
    assert image.pip == ("numpy", "jax[cpu]")
    assert image.indexes == ()


def test_gpu_accelerator_gets_cuda12_and_the_jax_index_scoped_to_jax() -> None:
    image = sky.plugins.jax().transform(sky.Image(), cluster("A100:8"))
    assert image.pip == ("jax[cuda12]",)
    assert image.indexes == (sky.Index(JAX_RELEASES, packages=("jax", "jaxlib"), flat=True),)


@pytest.mark.parametrize("accelerator", ["A100:8", "TPU-V5E:4"])
def test_an_image_whose_default_index_is_a_mirror_gets_no_release_index(accelerator: str) -> None:
    """A private network's mirror serves jax too: a scoped release index would be the only
    place uv looked for jax, and such hosts cannot reach it. An extra index for everything
    is not a mirror (PyPI stays): the release index stays too."""
    mirror = sky.Index("http://10.0.0.1:8000/simple/", default=True)
    image = sky.plugins.jax().transform(sky.Image(indexes=[mirror]), cluster(accelerator))
    assert image.indexes == (mirror,)
    assert image.pip[-1].startswith("jax[")
    extra = sky.Index("http://10.0.0.1:8000/simple/")
    image = sky.plugins.jax().transform(sky.Image(indexes=[extra]), cluster(accelerator))
    assert image.indexes[0] == extra and JAX_RELEASES in {i.url for i in image.indexes}
    scoped = sky.Index("http://10.0.0.1:8000/mine/", packages=["mypkg"])
    image = sky.plugins.jax().transform(sky.Image(indexes=[scoped]), cluster(accelerator))
    assert image.indexes[0] == scoped and JAX_RELEASES in {i.url for i in image.indexes}


@pytest.mark.parametrize(
    ("driver_cuda", "wheel"),
    [
        ("13.0", "jax[cuda13]"),
        ("13.1", "jax[cuda13]"),
        ("12.4", "jax[cuda12]"),
        (None, "jax[cuda12]"),
    ],
)
def test_gpu_wheel_follows_what_the_nodes_driver_supports(
    driver_cuda: str | None, wheel: str
) -> None:
    image = sky.plugins.jax().transform(sky.Image(), cluster("H100", cuda=driver_cuda))
    assert image.pip == (wheel,)
    # an explicit cuda= still wins over the driver
    pinned = sky.plugins.jax(cuda="cuda12").transform(sky.Image(), cluster("H100", cuda="13.0"))
    assert pinned.pip == ("jax[cuda12]",)


@pytest.mark.parametrize(
    ("cuda", "wheel"),
    [
        ("cuda12", "jax[cuda12]"),
        ("cuda13", "jax[cuda13]"),
        ("CUDA-13", "jax[cuda13]"),
        ("cu121", "jax[cuda12]"),
        ("cu124", "jax[cuda12]"),
        ("cu12", "jax[cuda12]"),
        # normalize_cuda maps the old cu1xy spelling by its major version: cu130 -> cuda13.
        ("cu130", "jax[cuda13]"),
        ("cpu", "jax[cpu]"),
    ],
)
def test_explicit_cuda_picks_the_wheel(cuda: str, wheel: str) -> None:
    image = sky.plugins.jax(cuda=cuda).transform(sky.Image(), cluster())
    assert image.pip == (wheel,)
    expected = () if wheel == "jax[cpu]" else (sky.Index(JAX_RELEASES, ("jax", "jaxlib"), True),)
    assert image.indexes == expected


def test_explicit_cuda_wins_over_the_accelerator() -> None:
    image = sky.plugins.jax(cuda="cpu").transform(sky.Image(), cluster("A100"))
    assert image.pip == ("jax[cpu]",)


@pytest.mark.parametrize("how", ["cuda", "accelerator"])
def test_tpu_gets_the_tpu_wheel_and_libtpu_index(how: str) -> None:
    plugin = sky.plugins.jax(cuda="tpu") if how == "cuda" else sky.plugins.jax()
    image = plugin.transform(sky.Image(), cluster("TPU-V5E:4" if how == "accelerator" else None))
    assert image.pip == ("jax[tpu]",)
    assert image.indexes == (
        sky.Index(JAX_RELEASES, packages=("jax", "jaxlib"), flat=True),
        sky.Index(LIBTPU_RELEASES, packages=("libtpu",), flat=True),
    )


def test_version_pins_the_wheel() -> None:
    image = sky.plugins.jax(version="0.4.35").transform(sky.Image(), cluster("H100"))
    assert image.pip == ("jax[cuda12]==0.4.35",)


@pytest.mark.parametrize("cuda", ["cuda11", "rocm", "cu118", "cu1245", "gpu", ""])
def test_unknown_cuda_fails_at_construction(cuda: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(cuda))) as excinfo:
        sky.plugins.jax(cuda=cuda)
    assert isinstance(excinfo.value, sky.ConfigError)
    assert "cuda12" in str(excinfo.value)  # the message says what would work


def test_users_jax_pins_are_dropped_and_other_packages_kept() -> None:
    original = sky.Image(
        pip=["jax==0.4.1", "JAXLIB>=0.4.1", "jax[cuda12]==0.4.2", "jaxtyping", "flax", "optax"],
        env={"A": "1"},
    )
    before = (original.pip, original.indexes, dict(original.env), original.content_hash)

    image = sky.plugins.jax().transform(original, cluster("A100"))

    assert image.pip == ("jaxtyping", "flax", "optax", "jax[cuda12]")
    assert dict(image.env) == {"A": "1"}
    # The image the user passed is untouched, and the new one is just as frozen.
    assert (original.pip, original.indexes, dict(original.env), original.content_hash) == before
    assert image is not original and image.content_hash != original.content_hash
    with pytest.raises(dataclasses.FrozenInstanceError):
        image.pip = ()  # type: ignore[misc]


def test_transform_is_idempotent() -> None:
    plugin = sky.plugins.jax()
    once = plugin.transform(sky.Image(pip=["jax==0.4.1"]), cluster("A100"))
    twice = plugin.transform(once, cluster("A100"))
    assert twice == once
    assert twice.pip == ("jax[cuda12]",) and len(twice.indexes) == 1


# -- instance_info -------------------------------------------------------------------------------


def test_instance_info_outside_a_pool_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYWARD_INSTANCE_INFO", raising=False)
    with pytest.raises(sky.NotOnNodeError, match="ComputePool") as excinfo:
        sky.instance_info()
    assert isinstance(excinfo.value, sky.SkywardError)


@sky.compute
def node_identity() -> dict[str, Any]:
    import jax

    info = sky.instance_info()
    # A process the user's code starts on the node knows the node too.
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import skyward as s; i = s.instance_info(); print(i.node, i.pool_id)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        "info": info,
        "child": child,
        "env": {name: os.environ.get(name) for name in JAX_VARS},
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "pid": os.getpid(),
    }


@pytest.mark.slow
def test_instance_info_on_nodes(pool2: sky.ComputePool) -> None:
    results = node_identity() @ pool2
    assert len(results) == 2
    infos = [r["info"] for r in results]
    head_port = infos[0].head_port
    assert 1024 <= head_port <= 65535
    for i, (result, info) in enumerate(zip(results, infos, strict=True)):
        assert info == pool2.infos[i]
        assert (info.node, info.total_nodes, info.is_head) == (i, 2, i == 0)
        assert (info.head_addr, info.head_port) == ("127.0.0.1", head_port)
        # the JAX coordinator has a port of its own, beside the head port, the same everywhere
        assert info.ports == infos[0].ports and info.ports["jax"] != head_port
        assert info.peers == ("127.0.0.1", "127.0.0.1")
        assert info.pool_id == pool2.pool_id
        assert result["child"] == [str(i), pool2.pool_id]
        # The JAX plugin exported the launcher variables and initialized JAX with them.
        assert result["env"] == {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{info.ports['jax']}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        assert (result["process_index"], result["process_count"]) == (i, 2)
    assert results[0]["pid"] != results[1]["pid"]


# -- collectives across nodes --------------------------------------------------------------------


def node_rows(node: int, rows: int) -> np.ndarray:
    """What node `node` contributes: different on every node, so a wrong sharding shows."""
    return (1000 * (node + 1) + np.arange(rows)).astype(np.int32)


@sky.compute
def sharded_sums(rows: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    info = sky.instance_info()
    mesh = Mesh(jax.devices(), ("data",))
    replicated = NamedSharding(mesh, P())
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), node_rows(info.node, rows)
    )
    total = jax.jit(jnp.sum, out_shardings=replicated)(x)
    # Weighting by global position makes the sum depend on where each node's rows landed.
    weighted = jax.jit(
        lambda a: jnp.sum(a * jnp.arange(a.shape[0], dtype=a.dtype)), out_shardings=replicated
    )(x)
    return {
        "shape": tuple(x.shape),
        "devices": len(jax.devices()),
        "total": int(total),
        "weighted": int(weighted),
    }


def test_the_coordinator_listens_only_on_the_pools_address(pool2: sky.ComputePool) -> None:
    # Local nodes share one network: 127.0.0.1, never JAX's default [::] (every interface).
    coordinator, listening = pool2.run(listeners("jax"), node=0)
    assert coordinator.startswith("127.0.0.1:") and listening == [coordinator]


def test_the_knock_refuses_a_listener_that_is_not_the_coordinator() -> None:
    # A plain TCP server on the coordinator's port: accepts, and never answers gRPC.
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(RuntimeError, match=f"something listens at {address}.*not a JAX"):
            jaxenv.wait_for_listener(address, 0.5)
    jaxenv.wait_for_listener(address, 0.2)  # nobody there: JAX itself will say so


def test_the_knock_leaves_a_late_listener_to_jax() -> None:
    """Nothing there at first, then a listener that does not answer within a look (a
    coordinator coming up late on a loaded node reads so too): not called a stranger."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"

    def listen_late() -> None:
        time.sleep(0.3)
        with socket.create_server(("127.0.0.1", port)):
            time.sleep(2.5)

    late = threading.Thread(target=listen_late)
    late.start()
    try:
        jaxenv.wait_for_listener(address, 1.5)  # returns: JAX decides what that listener is
    finally:
        late.join()


def check_sharded_sums(pool: sky.ComputePool, nodes: int, rows: int = 3) -> None:
    everything = np.concatenate([node_rows(i, rows) for i in range(nodes)]).astype(np.int64)
    expected = {
        "shape": (nodes * rows,),
        "devices": nodes,
        "total": int(everything.sum()),
        "weighted": int((everything * np.arange(everything.size)).sum()),
    }
    assert sharded_sums(rows) @ pool == [expected] * nodes


@pytest.mark.slow
def test_sharded_sum_across_two_nodes(pool2: sky.ComputePool) -> None:
    check_sharded_sums(pool2, 2)


@pytest.mark.slow
def test_sharded_sum_across_four_nodes() -> None:
    with jax_pool(4) as pool:
        check_sharded_sums(pool, 4)


# -- the example ---------------------------------------------------------------------------------


def test_example_params_agree_detects_a_one_ulp_difference() -> None:
    example = load_example()
    params = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    nudged = {"w": np.array([1.0, np.nextafter(np.float32(2.0), np.float32(3.0))])}
    assert example.params_agree([{"params": params}, {"params": dict(params)}])
    assert not example.params_agree([{"params": params}, {"params": nudged}])
    assert not example.params_agree([{"params": params}, {"params": {"v": params["w"]}}])


@pytest.mark.slow
def test_example_training_converges_with_identical_params(pool2: sky.ComputePool) -> None:
    example = load_example()
    results = example.train(steps=120, log_every=20) @ pool2
    assert len(results) == 2
    losses = results[0]["losses"]
    assert len(losses) == 7  # steps 0, 20, ..., 100 and the last one
    assert losses[-1] < 0.2 * losses[0], losses
    assert results[1]["losses"] == losses  # one global loss, not one per node
    assert example.params_agree(results)
    assert results[0]["params"]["w1"].shape == (example.FEATURES, example.HIDDEN)


@pytest.mark.slow
def test_example_script_runs_as_in_the_readme() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "final parameters are identical on all 2 nodes" in out
    logged = [float(v) for v in re.findall(r"^\(node 0\) step +\d+ +loss ([0-9.]+)$", out, re.M)]
    assert len(logged) == 7, out
    assert "(node 1) step" not in out  # the loss is printed by node 0 only
    final = float(re.search(r"^final loss: ([0-9.]+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert final == pytest.approx(logged[-1], abs=1e-5)
    assert final < 0.05 * logged[0]


# -- a script written for another launcher (Kubeflow style) -------------------------------------


@sky.compute
def launcher_style_allgather(explicit: bool) -> dict[str, Any]:
    import jax
    from jax.experimental import multihost_utils

    # What a Kubeflow/JAXJob-style script does: the launcher sets these variables.
    coordinator = os.environ["JAX_COORDINATOR_ADDRESS"]
    count = int(os.environ["JAX_NUM_PROCESSES"])
    rank = int(os.environ["JAX_PROCESS_ID"])
    if explicit:
        jax.distributed.initialize(coordinator, num_processes=count, process_id=rank)
    else:
        jax.distributed.initialize()
    try:
        gathered = multihost_utils.process_allgather(np.array([10 * (rank + 1), rank]))
        return {
            "rank": rank,
            "index": jax.process_index(),
            "count": jax.process_count(),
            "gathered": np.asarray(gathered).tolist(),
        }
    finally:
        jax.distributed.shutdown()


@pytest.mark.slow
def test_launcher_style_script_initializes_jax_itself() -> None:
    with jax_pool(2, initialize=False) as pool:
        results = launcher_style_allgather(True) @ pool
    gathered = [[10, 0], [20, 1]]
    assert results == [
        {"rank": 0, "index": 0, "count": 2, "gathered": gathered},
        {"rank": 1, "index": 1, "count": 2, "gathered": gathered},
    ]


@pytest.mark.slow
def test_launcher_style_script_initializes_jax_with_no_arguments() -> None:
    with jax_pool(2, initialize=False) as pool:
        results = launcher_style_allgather(False) @ pool
    assert [r["gathered"] for r in results] == [[[10, 0], [20, 1]]] * 2


# -- a node that never reaches jax.distributed.initialize ---------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_node_that_never_reaches_jax_initialize_is_named(tmp_path: Path) -> None:
    started = time.monotonic()
    error = start_with_node_1_stuck(tmp_path, sky.plugins.jax(initialization_timeout=5))
    # Whatever the report says, it came quickly and took every agent down with it.
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"took {elapsed:.1f} s"

    message = str(error)
    # Node 0 is the one that fails (XLA aborts it when initialize times out), but the culprit
    # is node 1: the error must name it, say where it was stuck, and show its last output.
    assert isinstance(error, sky.PluginError | sky.WorkerError), message
    assert "node 1 never reached plugin 'jax': it was in plugin 'slow'" in message
    assert "node 1 is stuck in the slow plugin" in message
