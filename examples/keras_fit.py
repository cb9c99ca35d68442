"""Keras 3 `model.fit` data-parallel on two nodes, each node feeding its own data.

    python examples/keras_fit.py

The JAX plugin joins the nodes into one JAX runtime; the Keras plugin selects the jax backend
and installs `keras.distribution.DataParallel` over every device of every node. Each node then
builds the same model and calls `fit` on its own part of the data: Keras stitches the nodes'
batches into one global batch, so all nodes compute the same gradient and their copies of the
model stay identical. The script exits with status 1 if the nodes end with different weights.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import skyward as sky

SEED = 0
FEATURES = 4


def node_data(node: int, rows: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """This node's own training rows (synthetic, so nothing is downloaded).

    Every node must hold the same number of rows: the nodes take every training step together,
    so they must agree on how many steps an epoch has.
    """
    rng = np.random.default_rng([SEED, node])
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    true_w = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)[:, None]
    y = np.tanh(x @ true_w) + 0.05 * rng.normal(size=(rows, 1)).astype(np.float32)
    return x, y


@sky.compute
def fit(epochs: int = 6, batch_size: int = 32) -> dict[str, Any]:
    """Fit on every node at once (``fit() @ pool``); `batch_size` is per node."""
    # Imported here, on the node, after the Keras plugin has set KERAS_BACKEND=jax.
    import keras

    info = sky.instance_info()

    # Same seed on every node: every node builds the same initial weights.
    keras.utils.set_random_seed(SEED)

    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    x, y = node_data(info.node)
    # The loss is the same on every node (one global batch), so let node 0 report it.
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=2 if info.is_head else 0
    )
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
    }


def weights_agree(results: list[dict[str, Any]]) -> bool:
    """True when every node returned bit-for-bit the same weights as node 0."""
    first = results[0]["weights"]
    return all(
        len(node["weights"]) == len(first)
        and all(np.array_equal(a, b) for a, b in zip(node["weights"], first, strict=True))
        for node in results[1:]
    )


def main() -> int:
    with sky.ComputePool(
        provider=sky.Local(),
        nodes=2,
        # Order matters: jax first initializes jax.distributed, keras then builds on it.
        plugins=[sky.plugins.jax(), sky.plugins.keras(backend="jax")],
    ) as pool:
        results = fit() @ pool

    if not weights_agree(results):
        print("ERROR: the nodes ended with different weights", file=sys.stderr)
        return 1
    loss = results[0]["loss"]
    print(f"final weights are identical on all {len(results)} nodes")
    print(f"loss: {loss[0]:.4f} -> {loss[-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
