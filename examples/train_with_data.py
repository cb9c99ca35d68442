"""Train on a dataset passed with `sky.Data`, checkpoint with Orbax, report metrics, lose a node
and let the pool replace it and resume from the last checkpoint (`restarts=2`: no try/except);
every node's outputs end up in runs/.

    pip install -e '.[jax]' orbax-checkpoint && python examples/train_with_data.py

The same script runs on SSH hosts or EC2 by changing `provider=`: the dataset is then synced to
every node (only what changed), and the checkpoints are copied back to runs/ as they are
reported, so they outlive the node that wrote them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import skyward as sky

TRUE_W = np.array([1.0, -2.0, 0.5], np.float32)
CHECKPOINT_EVERY = 10


def make_dataset(root: Path, shards: int = 4, rows: int = 256) -> Path:
    """A regression dataset as .npz shards, the way a real one sits on disk."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        x = rng.normal(size=(rows, 3)).astype(np.float32)
        np.savez(root / f"shard-{i:03d}.npz", x=x, y=x @ TRUE_W)
    return root


@sky.compute
def train(data: str, steps: int, lose_node_at: int | None) -> tuple[float, list[float]]:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    info = sky.instance_info()
    # Each node reads its own shards from the path `sky.Data` gave it.
    mine = sorted(Path(data).glob("shard-*.npz"))[info.node :: info.total_nodes]
    x_local = np.concatenate([np.load(f)["x"] for f in mine])
    y_local = np.concatenate([np.load(f)["y"] for f in mine])
    rows = NamedSharding(Mesh(jax.devices(), ("data",)), P("data"))
    x = jax.make_array_from_process_local_data(rows, x_local)
    y = jax.make_array_from_process_local_data(rows, y_local)

    @jax.jit
    def step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - 0.1 * grad, loss

    w, start = jnp.zeros(3), 0
    resume = sky.resume_from()  # after a restart: the newest reported checkpoint, on every node
    if resume is not None:
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(Path(resume).absolute())
        w, start = jnp.asarray(state["w"]), int(state["step"])
        print(f"resumed from step {start}")

    loss = jnp.inf
    for i in range(start, steps):
        w, loss = step(w, x, y)
        done = i + 1
        if done % CHECKPOINT_EVERY == 0:
            # Every process takes part in an Orbax save; the primary one (node 0) writes the
            # checkpoint into its own output directory.
            path = Path(sky.output_dir()) / "checkpoints" / f"step-{done:05d}"
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(path, {"w": np.asarray(w), "step": done}, force=True)
            if info.is_head:
                sky.report({"step": done, "loss": float(loss)}, checkpoint=str(path))
        if lose_node_at == done and resume is None and info.node == info.total_nodes - 1:
            os._exit(1)  # stands in for a machine that goes away mid-run (once)
    return float(loss), np.asarray(w).tolist()


def show(report: sky.Report) -> None:
    print(f"  node {report.node}: step {report.metrics['step']} loss {report.metrics['loss']:.2e}")


def main(
    provider: sky.Local | sky.SSH | sky.AWS | None = None,
    runs: str = "runs/train",
    lose_node_at: int | None = 35,
) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory() as scratch:
        dataset = sky.Data(make_dataset(Path(scratch) / "dataset"))
        with sky.ComputePool(
            provider=provider or sky.Local(),
            nodes=2,
            plugins=[sky.plugins.jax()],
            image=sky.Image(pip=["orbax-checkpoint"]),
            output_dir=runs,
            on_report=show,
            restarts=2,  # a lost node is replaced and the call resumed from its checkpoint
        ) as pool:
            (loss, w), _ = train(dataset, 60, lose_node_at) @ pool
    print(f"final loss {loss:.2e}; w {w}; checkpoints in {runs}/node-0/checkpoints")
    return loss, w


if __name__ == "__main__":
    main(runs=sys.argv[1] if len(sys.argv) > 1 else "runs/train")
