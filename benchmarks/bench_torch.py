"""The PyTorch plugin's start-up: a pool to its first DDP all-reduce, beside torchrun by hand.

``python benchmarks/bench_torch.py [--runs N]`` (default 5). Two rows, each the median of N
samples, the two sides alternating and each going first in turn; a report, it always exits 0.

- pool: from ``sky.ComputePool(provider=sky.Local(), nodes=2, plugins=[sky.plugins.torch()])``
  to the result of the first DDP step on both nodes (the model wrapped in
  ``DistributedDataParallel``, whose construction broadcasts rank 0's parameters, then one
  backward whose gradients are all-reduced over gloo), the pool's teardown not counted.
- torchrun by hand: two ``python`` processes launched with the variables torchrun gives
  (``MASTER_ADDR``, ``MASTER_PORT`` on a free port, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``), each calling ``init_process_group("gloo")`` and the same step, from
  launch to both results.

Target: the pool within 1.2x of the by-hand pair. Both sides run on the CPU (gloo), as the
pool's nodes do without ``accelerator=``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import skyward as sky

TARGET = 1.2

# One DDP step: the same code on both sides (the pool's node runs `first_step`).
STEP = """\
def first_step():
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 1))
    x = torch.full((8, 64), float(torch.distributed.get_rank() + 1))
    model(x).sum().backward()  # the gradients are all-reduced (averaged) across the ranks
    return float(model.module.weight.grad.sum())
"""

HAND = (
    STEP
    + """
import torch.distributed as dist

dist.init_process_group("gloo")
print("RESULT", first_step(), flush=True)
dist.destroy_process_group()
"""
)

_namespace: dict[str, object] = {}
exec(STEP, _namespace)
first_step = sky.compute(_namespace["first_step"])  # type: ignore[arg-type]


def pool_once() -> tuple[int, list[float]]:
    start = time.perf_counter_ns()
    plugins = [sky.plugins.torch()]
    with sky.ComputePool(provider=sky.Local(), nodes=2, plugins=plugins, stream_output=False) as p:
        results = first_step() @ p
        elapsed = time.perf_counter_ns() - start
    return elapsed, results


def hand_once() -> tuple[int, list[float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter_ns()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HAND],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "CUDA_VISIBLE_DEVICES": "",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            },
        )
        for rank in range(2)
    ]
    results = [_result(proc) for proc in procs]
    elapsed = time.perf_counter_ns() - start
    for proc in procs:
        proc.communicate(timeout=60)
    return elapsed, results


def _result(proc: subprocess.Popen[str]) -> float:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return float(line.split()[1])
    raise RuntimeError(f"a by-hand rank ended without a result (exit status {proc.wait()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="samples of each side (default 5)")
    runs = parser.parse_args().runs
    os.environ.setdefault("SKYWARD_QUIET", "1")
    print(f"load average at start: {os.getloadavg()[0]:.2f}; torch on the CPU (gloo)")
    pool_ns: list[int] = []
    hand_ns: list[int] = []
    sides = [(pool_once, pool_ns), (hand_once, hand_ns)]
    for run in range(runs):
        for fn, samples in sides[run % 2 :] + sides[: run % 2]:  # each side first in turn
            elapsed, results = fn()
            # Both ranks end with the same all-reduced gradient: the step really crossed.
            assert len(results) == 2 and results[0] == results[1], results
            samples.append(elapsed)
    pool, hand = statistics.median(pool_ns), statistics.median(hand_ns)
    ratio = pool / hand
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"{'name':<8} {'figure':>9} {'floor':>9} {'ratio':>6}  target")
    figures = f"{pool / 1e9:>8.2f}s {hand / 1e9:>8.2f}s {ratio:>5.2f}x"
    print(f"{'torch':<8} {figures}  <= {TARGET}x {verdict}")
    print(f"  pool samples: {' '.join(f'{s / 1e9:.2f}' for s in pool_ns)} s")
    print(f"  hand samples: {' '.join(f'{s / 1e9:.2f}' for s in hand_ns)} s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
