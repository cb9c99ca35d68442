"""The Keras plugin: unit tests of its arguments and transform, and real data-parallel
`model.fit` across Local nodes (slow)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import skyward as sky
from skyward.hardware import ClusterSpec
from tests.conftest import import_example
from tests.support.listeners import listeners

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "keras_fit.py"
SPEC = ClusterSpec(nodes=2, pool_id="pool-test")


def keras_pool() -> sky.ComputePool:
    return sky.ComputePool(
        provider=sky.Local(),
        nodes=2,
        plugins=[sky.plugins.jax(), sky.plugins.keras(backend="jax")],
    )


@pytest.fixture(scope="module")
def pool() -> Iterator[sky.ComputePool]:
    """A 2-node jax+keras pool, started from a client whose KERAS_BACKEND says otherwise."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KERAS_BACKEND", "numpy")  # the plugin must win on the nodes
        with keras_pool() as started:
            yield started


def load_example() -> ModuleType:
    return import_example("keras_fit.py")


# -- unit tests (no processes) -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch", "numpy"])
def test_known_backends_are_accepted(backend: str) -> None:
    assert sky.plugins.keras(backend=backend).backend == backend


@pytest.mark.parametrize("backend", ["JAX", "theano", "mlx", ""])
def test_unknown_backend_fails_at_construction(backend: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(backend))) as excinfo:
        sky.plugins.keras(backend=backend)
    assert isinstance(excinfo.value, sky.ConfigError)


def test_transform_adds_keras_3() -> None:
    original = sky.Image(pip=["numpy"])
    image = sky.plugins.keras().transform(original, SPEC)
    assert image.pip == ("numpy", "keras>=3")
    assert original.pip == ("numpy",)  # the user's image is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        image.pip = ()  # type: ignore[misc]


@pytest.mark.parametrize("spec", ["keras==3.3.3", "Keras>=3.5", "keras[extra]"])
def test_transform_keeps_the_users_own_keras(spec: str) -> None:
    image = sky.plugins.keras().transform(sky.Image(pip=[spec, "optax"]), SPEC)
    assert image.pip == (spec, "optax")


def test_jax_then_keras_transforms_compose() -> None:
    image = sky.Image(pip=["jax==0.4.1"])
    for plugin in (sky.plugins.jax(), sky.plugins.keras(backend="jax")):
        image = plugin.transform(image, SPEC)
    assert image.pip == ("jax[cpu]", "keras>=3")


def test_example_weights_agree_detects_a_difference() -> None:
    example = load_example()
    weights = [np.zeros((2, 2), np.float32), np.ones(2, np.float32)]
    changed = [weights[0], np.array([1.0, 1.0 + 1e-7], np.float32)]
    assert example.weights_agree([{"weights": weights}, {"weights": list(weights)}])
    assert not example.weights_agree([{"weights": weights}, {"weights": changed}])
    assert not example.weights_agree([{"weights": weights}, {"weights": weights[:1]}])


# -- on real nodes -------------------------------------------------------------------------------


@sky.compute
def keras_setup() -> dict[str, Any]:
    import keras

    distribution = keras.distribution.distribution()
    return {
        "env": os.environ.get("KERAS_BACKEND"),
        "backend": keras.backend.backend(),
        "distribution": type(distribution).__name__,
        "devices": len(distribution.device_mesh.devices.flat) if distribution else 0,
    }


@pytest.mark.slow
def test_keras_backend_and_distribution_are_set_on_the_nodes(pool: sky.ComputePool) -> None:
    expected = {"env": "jax", "backend": "jax", "distribution": "DataParallel", "devices": 2}
    assert keras_setup() @ pool == [expected, expected]


@pytest.mark.slow
def test_keras_alone_binds_its_coordinator_to_the_pools_address() -> None:
    """Without the JAX plugin Keras initializes jax.distributed itself: its coordinator too
    listens only where the nodes dial it (127.0.0.1 on Local), never on JAX's default [::]."""
    plugins = [sky.plugins.keras(backend="jax")]
    with sky.ComputePool(provider=sky.Local(), nodes=2, plugins=plugins) as alone:
        expected = {"env": "jax", "backend": "jax", "distribution": "DataParallel", "devices": 2}
        assert keras_setup() @ alone == [expected, expected]  # Keras's own initialize ran
        coordinator, listening = alone.run(listeners("keras"), node=0)
    assert coordinator.startswith("127.0.0.1:") and listening == [coordinator]


@sky.compute
def fit_own_data(seed: int | None, epochs: int = 4) -> dict[str, Any]:
    """Fit one small model, each node on its own rows (node-dependent, so they differ)."""
    import keras

    node = sky.instance_info().node
    if seed is not None:
        keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(node)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 1.0).astype(np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    initial = [np.asarray(w) for w in model.get_weights()]
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return {
        "initial": initial,
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
        "x0": x[0].tolist(),
    }


def assert_same_model(results: list[dict[str, Any]]) -> None:
    (a, b) = results
    assert a["x0"] != b["x0"]  # the nodes really fed different data
    for mine, theirs in zip(a["weights"], b["weights"], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    for start, end in zip(a["initial"], a["weights"], strict=True):
        assert not np.array_equal(start, end)  # and training did move every weight


@pytest.mark.slow
def test_fit_on_two_nodes_ends_with_identical_weights(pool: sky.ComputePool) -> None:
    results = fit_own_data(seed=7) @ pool
    assert_same_model(results)
    loss = results[0]["loss"]
    assert results[1]["loss"] == loss  # one global loss
    assert loss[-1] < 0.5 * loss[0], loss


@pytest.mark.slow
def test_unseeded_models_agree_across_nodes() -> None:
    # A fresh pool: the shared one has a Keras seed set by the tests above.
    with keras_pool() as fresh:
        results = fit_own_data(seed=None) @ fresh
    assert_same_model(results)


@pytest.mark.slow
def test_keras_example_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "final weights are identical on all 2 nodes" in done.stdout
    losses = re.search(r"^loss: ([0-9.]+) -> ([0-9.]+)$", done.stdout, re.M)
    assert losses, done.stdout
    first, last = map(float, losses.groups())
    assert last < 0.5 * first
    assert "(node 0) Epoch 1/" in done.stdout and "(node 1) Epoch" not in done.stdout


@pytest.mark.slow
def test_one_node_with_several_devices_trains_over_all_of_them() -> None:
    """A node that owns several devices (GPUs on a real machine; here XLA's forced CPU
    devices stand in for them) gets a DataParallel over its own devices."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    plugins = [sky.plugins.keras(backend="jax")]
    with sky.ComputePool(nodes=1, env=env, plugins=plugins, stream_output=False) as alone:
        setup = keras_setup() >> alone
    assert setup == {"env": "jax", "backend": "jax", "distribution": "DataParallel", "devices": 2}


@sky.compute
def fit_where() -> tuple[str, float]:
    import keras

    x = np.ones((64, 3), np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    loss = model.fit(x, x[:, :1], epochs=2, verbose=0).history["loss"][-1]
    (device,) = model.weights[0].value.devices()
    return str(device), float(loss)


@pytest.mark.gpu
def test_keras_trains_on_the_nodes_gpu() -> None:
    plugins = [sky.plugins.jax(), sky.plugins.keras(backend="jax")]
    with sky.ComputePool(nodes=1, accelerator="GPU", plugins=plugins, stream_output=False) as p:
        device, loss = fit_where() >> p
    assert device == "cuda:0"
    assert np.isfinite(loss)
