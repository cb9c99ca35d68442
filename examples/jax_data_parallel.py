"""Data-parallel training with JAX on a skyward pool.

    python examples/jax_data_parallel.py

Two nodes (here: two child processes of this script, `sky.Local()`) train one small MLP
together. Every node holds a full copy of the parameters; every global batch is split between
the nodes, each node producing and feeding only its own rows. Inside the jit-compiled train step
JAX sees one global batch spread over all devices of all nodes, so the gradient it computes is
the gradient of the whole batch: XLA inserts the cross-node all-reduce for us. Every node then
applies the same update to the same parameters, and the copies never drift apart.

The script exits with status 1 if the nodes end with different parameters.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import skyward as sky

FEATURES = 8
HIDDEN = 32
SEED = 0


def make_rows(step: int, node: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The `rows` examples that `node` contributes to global batch number `step`.

    Synthetic data, so nothing is downloaded: x is Gaussian and y a fixed smooth function of x.
    Seeding on (step, node) gives every node different rows (each node really does feed its
    own data) while a rerun of the script sees exactly the same data.
    """
    rng = np.random.default_rng([SEED, step, node])
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    # The function to learn. Its coefficients come from their own fixed seed, the same on
    # every node and in every run.
    a, b = np.random.default_rng(1234).normal(size=(2, FEATURES)).astype(np.float32)
    y = np.sin(x @ a / 2) + 0.5 * (x @ b) / np.sqrt(FEATURES)
    return x, y[:, None].astype(np.float32)


@sky.compute
def train(
    steps: int = 300, global_batch: int = 256, lr: float = 1e-2, log_every: int = 50
) -> dict[str, Any]:
    """Train on every node at once (run it with ``train(...) @ pool``)."""
    # Import inside the function: it runs on the nodes, where the JAX plugin has already
    # called jax.distributed.initialize, so jax.devices() lists every node's devices.
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    info = sky.instance_info()  # which node this is, and how many there are

    # One mesh axis, "data", over all devices of all nodes (one CPU device per node here).
    mesh = Mesh(jax.devices(), ("data",))
    batch_sharding = NamedSharding(mesh, P("data"))  # split the batch's rows over the devices
    replicated = NamedSharding(mesh, P())  # a full copy on every device

    def init(key: jax.Array) -> dict[str, jax.Array]:
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / jnp.sqrt(FEATURES),
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 1)) / jnp.sqrt(HIDDEN),
            "b2": jnp.zeros(1),
        }

    def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)

    optimizer = optax.adam(lr)

    # Same key on every node, and the output pinned to `replicated`: each node starts from the
    # same parameters, placed as one global array with a copy on every device.
    def init_state(key: jax.Array) -> tuple[Any, Any]:
        params = init(key)
        return params, optimizer.init(params)

    params, opt_state = jax.jit(init_state, out_shardings=replicated)(jax.random.key(SEED))

    # x and y arrive sharded over "data", params replicated. The mean in loss_fn is over the
    # global batch, so XLA adds the all-reduce across nodes, and the updated params come out
    # replicated again (pinned by out_shardings so that never depends on the compiler's choice).
    def step_fn(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, ...]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(step_fn, out_shardings=replicated)

    # Each node contributes an equal slice of every global batch.
    rows = global_batch // jax.process_count()
    print(f"node {info.node}/{info.total_nodes}: {rows} of {global_batch} rows per step")

    losses = []
    for step in range(steps):
        x_local, y_local = make_rows(step, info.node, rows)
        # Stitch the nodes' local rows into one global array sharded over the mesh; no node
        # ever holds (or sends) the other nodes' rows.
        x = jax.make_array_from_process_local_data(batch_sharding, x_local)
        y = jax.make_array_from_process_local_data(batch_sharding, y_local)
        params, opt_state, loss = train_step(params, opt_state, x, y)
        if step % log_every == 0 or step == steps - 1:
            # float() waits for the step to finish; do it only now and then, not every step.
            losses.append(float(loss))
            if info.is_head:  # the loss is the same everywhere: print it once
                print(f"step {step:4d}  loss {losses[-1]:.5f}")

    # The params are replicated, so every node has all of them locally: return plain numpy.
    return {
        "params": {name: np.asarray(value) for name, value in params.items()},
        "losses": losses,
    }


def params_agree(results: list[dict[str, Any]]) -> bool:
    """True when every node returned bit-for-bit the same parameters as node 0."""
    first = results[0]["params"]
    return all(
        node["params"].keys() == first.keys()
        and all(np.array_equal(node["params"][k], first[k]) for k in first)
        for node in results[1:]
    )


def main() -> int:
    with sky.ComputePool(
        provider=sky.Local(),
        nodes=2,
        # optax is already here, so Local runs the nodes on this very interpreter; on SSH or
        # AWS nodes the image is what gets installed (the JAX plugin adds the right jax wheel).
        image=sky.Image(pip=["optax"]),
        plugins=[sky.plugins.jax()],
    ) as pool:
        results = train(steps=300) @ pool  # one result per node, in node order

    if not params_agree(results):
        print("ERROR: the nodes ended with different parameters", file=sys.stderr)
        return 1
    print(f"final parameters are identical on all {len(results)} nodes")
    print(f"final loss: {results[0]['losses'][-1]:.5f} (first: {results[0]['losses'][0]:.5f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
