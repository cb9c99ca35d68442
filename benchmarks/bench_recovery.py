"""Recovery on Local: from a node's death to the first step after resuming, beside a cold pool
start measured in the same run.

Run ``python benchmarks/bench_recovery.py [--runs N] [--jax]``. Each run starts a 2-node pool
with ``restarts=1``; in its call node 0 reports a checkpoint and node 1 dies (``os._exit``),
noting the time; the pool replaces node 1, restarts both agents, places the checkpoint and
calls again, and each node notes when its first resumed step begins (after
``sky.resume_from()``). The figure is the later of the two, minus the death. Beside it: a cold
start of the same pool (entering it to the first result of a call), the two alternating. The
target: recovery costs no more than a start (the replacement's own) plus the checkpoint's copy
(none on Local: the path itself). With ``--jax`` both pools carry the JAX plugin, so both pay
for ``jax.distributed.initialize``.

A report: no targets enforced, it exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["SKYWARD_QUIET"] = "1"

import skyward as sky


@sky.compute
def first_result() -> int:
    return sky.instance_info().node


@sky.compute
def checkpoint_then_die(died: str) -> float:
    """First run: node 0 reports a checkpoint, node 1 notes the time and dies. After the
    restart: when this node's first resumed step began."""
    resume = sky.resume_from()
    if resume is not None:
        return time.time()
    if sky.instance_info().node == 0:
        ckpt = Path(sky.output_dir()) / "ckpt"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "state").write_text("step 5")
        sky.report({"step": 5.0}, checkpoint=str(ckpt))
        time.sleep(120)
    else:
        time.sleep(0.5)
        Path(died).write_text(repr(time.time()))
        os._exit(9)
    return 0.0


def cold_start(plugins: list[sky.Plugin]) -> float:
    began = time.perf_counter()
    with sky.ComputePool(nodes=2, plugins=plugins, stream_output=False) as pool:
        first_result() @ pool
        return time.perf_counter() - began


def recovery(plugins: list[sky.Plugin], scratch: Path) -> float:
    died = scratch / "died"
    with sky.ComputePool(
        nodes=2, plugins=plugins, restarts=1, output_dir=scratch / "runs", stream_output=False
    ) as pool:
        resumed = checkpoint_then_die(str(died)) @ pool
    return max(resumed) - float(died.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--jax", action="store_true", help="both pools carry the JAX plugin")
    args = parser.parse_args()
    plugins: list[sky.Plugin] = [sky.plugins.jax()] if args.jax else []
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)", flush=True)
    cold: list[float] = []
    recovered: list[float] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as scratch:
            first, second = ("cold", "recovery") if run % 2 == 0 else ("recovery", "cold")
            for side in (first, second):
                if side == "cold":
                    cold.append(cold_start(plugins))
                else:
                    recovered.append(recovery(plugins, Path(scratch) / str(run)))
        print(
            f"run {run + 1}/{args.runs}: cold start {cold[-1]:.2f} s, "
            f"death to resumed step {recovered[-1]:.2f} s",
            flush=True,
        )
    ratio = statistics.median(recovered) / statistics.median(cold)
    print()
    print(f"{'figure (median)':<40} {'recovery':>9} {'cold start':>11} {'ratio':>6}  target")
    print(
        f"{'death to the first resumed step':<40} {statistics.median(recovered):8.2f}s "
        f"{statistics.median(cold):10.2f}s {ratio:5.2f}x  <= 1x (+ the checkpoint's copy)"
    )


if __name__ == "__main__":
    main()
