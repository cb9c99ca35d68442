"""Local-provider benchmarks: each skyward figure beside a floor measured in the same run.

Run ``python benchmarks/bench_local.py`` (``--quick`` for fewer iterations, ``--only NAME`` for
one figure; NAME is one of rtt, gather, broadcast, bulk, jax). It is a report, not a test: a
MISS is printed, never turned into a failing exit status. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata as metadata
import inspect
import os
import pickle
import platform
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cloudpickle

import skyward as sky

NAMES = ("rtt", "gather", "broadcast", "bulk", "jax")
PIPE_SIZE = 1 << 20  # the agent enlarges its control pipes to this; the floors use the same
BULK_BYTES = 100_000_000
HEADER = struct.Struct("!Q")
CALL, RESULT = 2, 14  # the skyward message kinds the floor messages imitate

# A child process for the floors: frames are an 8-byte length then a body. "echo" unpickles each
# message and answers with a small pickled reply; "sink" reads the whole body and answers its
# length.
RAW_CHILD = textwrap.dedent(
    """
    import os, pickle, struct, sys
    H = struct.Struct("!Q")
    mode, wfd = sys.argv[1], int(sys.argv[3])
    inp = os.fdopen(int(sys.argv[2]), "rb", buffering=1 << 16)
    while True:
        head = inp.read(8)
        if len(head) < 8:
            break
        (n,) = H.unpack(head)
        body = inp.read(n)
        if len(body) < n:
            sys.exit("short read")
        if mode == "echo":
            message = pickle.loads(body)
            reply = pickle.dumps((14, message[1]), 5)
        else:
            reply = H.pack(len(body))
        os.write(wfd, H.pack(len(reply)) + reply)
    """
)


# -- the functions the pools run --------------------------------------------------------------


@sky.compute
def noop() -> None:
    return None


@sky.compute
def nbytes(data: bytes) -> int:
    return len(data)


def sharded_sum() -> float:
    """A cross-process collective: every process holds one shard; the jitted sum spans both."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    local = np.full((jax.local_device_count(),), float(jax.process_index() + 1), np.float32)
    shards = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(shards)
    return float(total)


sharded_sum_remote = sky.compute(sharded_sum)

# The hand-launched JAX baseline runs the very same function source.
JAX_CHILD = (
    "import sys\nimport jax\n"
    + textwrap.dedent(inspect.getsource(sharded_sum))
    + textwrap.dedent(
        """
        jax.distributed.initialize(
            coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])
        )
        print("RESULT", sharded_sum(), flush=True)
        jax.distributed.shutdown()
        """
    )
)


# -- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    figure: str  # the measured figure, formatted
    floor: str  # the floor it is compared with, formatted
    ratio: float  # how many times worse than the floor (>= 1 means slower)
    target: str
    passed: bool


@dataclass
class Settings:
    calls: int  # round trips for rtt
    warmup: int
    batch: int  # calls per gather
    batches: int
    broadcasts: int
    bulk_runs: int
    jax_runs: int


FULL = Settings(
    calls=2000, warmup=300, batch=1000, batches=10, broadcasts=1000, bulk_runs=5, jax_runs=3
)
QUICK = Settings(calls=500, warmup=100, batch=1000, batches=3, broadcasts=200, bulk_runs=2, jax_runs=1)


def us(ns: float) -> str:
    return f"{ns / 1e3:,.1f} us"


def ms(ns: float) -> str:
    return f"{ns / 1e6:,.1f} ms"


def per_s(rate: float) -> str:
    return f"{rate:,.0f} calls/s"


def timed(fn: Callable[[], object], count: int) -> list[int]:
    """`count` timings of `fn()`, in nanoseconds."""
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return samples


# -- the raw pipe floors ----------------------------------------------------------------------


class RawChild:
    """A child process at the other end of two plain pipes (the floors' counterpart of a node)."""

    def __init__(self, mode: str) -> None:
        down_r, self._down_w = os.pipe()
        up_r, up_w = os.pipe()
        for fd in (self._down_w, up_r):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", RAW_CHILD, mode, str(down_r), str(up_w)],
            pass_fds=(down_r, up_w),
        )
        os.close(down_r)
        os.close(up_w)
        self._up = os.fdopen(up_r, "rb", buffering=1 << 16)

    def send(self, body: bytes) -> None:
        if len(body) < 1 << 16:
            _write_all(self._down_w, HEADER.pack(len(body)) + body)
        else:
            _write_all(self._down_w, HEADER.pack(len(body)))
            _write_all(self._down_w, body)

    def receive(self) -> bytes:
        (n,) = HEADER.unpack(self._up.read(HEADER.size))
        return self._up.read(n)

    def close(self) -> None:
        os.close(self._down_w)
        self._proc.wait(10)
        self._up.close()


@contextlib.contextmanager
def raw_children(count: int, mode: str) -> Iterator[list[RawChild]]:
    children = [RawChild(mode) for _ in range(count)]
    try:
        yield children
    finally:
        for child in children:
            child.close()


def raw_message(call_id: int) -> bytes:
    """What a no-op call carries, cloudpickled as skyward does: kind, ids, no function, args."""
    return cloudpickle.dumps((CALL, call_id, 1, None, ((), {})), 5)


def raw_round_trips(s: Settings) -> list[int]:
    with raw_children(1, "echo") as (child,):

        def once() -> None:
            child.send(raw_message(7))
            pickle.loads(child.receive())

        timed(once, s.warmup)
        return timed(once, s.calls)


def raw_pipelined(s: Settings, nodes: int) -> list[float]:
    """Throughputs (calls/s) of batches written to `nodes` children, then all replies read."""
    with raw_children(nodes, "echo") as children:

        def batch() -> None:
            for i in range(s.batch):
                children[i % nodes].send(raw_message(i))
            for i in range(s.batch):
                pickle.loads(children[i % nodes].receive())

        timed(batch, 2)
        return [s.batch * 1e9 / ns for ns in timed(batch, s.batches)]


def raw_bulk(s: Settings, payload: bytes) -> list[int]:
    with raw_children(1, "sink") as (child,):

        def once() -> None:
            child.send(payload)
            assert HEADER.unpack(child.receive())[0] == len(payload)

        timed(once, 1)
        return timed(once, s.bulk_runs)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- the skyward figures ----------------------------------------------------------------------


def pool(nodes: int, **kwargs: object) -> sky.ComputePool:
    return sky.ComputePool(nodes=nodes, stream_output=False, **kwargs)  # type: ignore[arg-type]


def sky_round_trips(s: Settings) -> list[int]:
    with pool(1) as p:

        def once() -> None:
            noop() >> p

        timed(once, s.warmup)
        return timed(once, s.calls)


def sky_gather(s: Settings) -> list[float]:
    with pool(2) as p:

        def batch() -> None:
            results = sky.gather(*(noop() for _ in range(s.batch))) >> p
            assert len(results) == s.batch

        timed(batch, 2)
        return [s.batch * 1e9 / ns for ns in timed(batch, s.batches)]


def sky_broadcast(s: Settings) -> list[int]:
    with pool(8) as p:

        def once() -> None:
            noop() @ p

        timed(once, s.warmup)
        return timed(once, s.broadcasts)


def sky_bulk(s: Settings, payload: bytes) -> list[int]:
    with pool(1) as p:

        def once() -> None:
            assert nbytes(payload) >> p == len(payload)

        timed(once, 1)
        return timed(once, s.bulk_runs)


def sky_jax_once() -> int:
    start = time.perf_counter_ns()
    with pool(2, plugins=[sky.plugins.jax()]) as p:
        assert sharded_sum_remote() @ p == [3.0, 3.0]
        elapsed = time.perf_counter_ns() - start
    return elapsed


def hand_jax_once() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter_ns()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JAX_CHILD, f"127.0.0.1:{port}", str(rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = [_result_line(proc) for proc in procs]
    elapsed = time.perf_counter_ns() - start
    for proc in procs:
        proc.communicate(timeout=60)
    assert results == ["3.0", "3.0"], results
    return elapsed


def _result_line(proc: subprocess.Popen[str]) -> str:
    """The child's result (gloo prints its own lines on stdout too); "" if it ended without one."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return line.split()[1]
    return ""


# -- the figures, each with its floor and target ---------------------------------------------


def bench_rtt(s: Settings, cache: dict[str, float]) -> Row:
    floor = statistics.median(raw_round_trips(s))
    figure = statistics.median(sky_round_trips(s))
    cache["rtt"] = figure
    ratio = figure / floor
    return Row(
        "rtt: noop() >> pool, 1 node (median)",
        us(figure),
        f"{us(floor)} raw pipe",
        ratio,
        "<= 100 us and <= 4x",
        figure <= 100_000 and ratio <= 4,
    )


def bench_gather(s: Settings, cache: dict[str, float]) -> Row:
    floor = statistics.median(raw_pipelined(s, 2))
    figure = statistics.median(sky_gather(s))
    return Row(
        f"gather: {s.batch} noops, 2 nodes",
        per_s(figure),
        f"{per_s(floor)} raw pipe",
        floor / figure,
        ">= 20,000 calls/s",
        figure >= 20_000,
    )


def bench_broadcast(s: Settings, cache: dict[str, float]) -> Row:
    if "rtt" not in cache:
        cache["rtt"] = statistics.median(sky_round_trips(s))
    floor = cache["rtt"]
    figure = statistics.median(sky_broadcast(s))
    ratio = figure / floor
    return Row(
        "broadcast: noop() @ pool, 8 nodes",
        us(figure),
        f"{us(floor)} 1-node >>",
        ratio,
        "<= 2x",
        ratio <= 2,
    )


def bench_bulk(s: Settings, cache: dict[str, float]) -> Row:
    payload = bytes(BULK_BYTES)
    floor = statistics.median(raw_bulk(s, payload))
    figure = statistics.median(sky_bulk(s, payload))
    ratio = figure / floor
    return Row(
        "bulk: 100 MB bytes arg, 1 node",
        ms(figure),
        f"{ms(floor)} raw pipe",
        ratio,
        "<= 1.5x",
        ratio <= 1.5,
    )


def bench_jax(s: Settings, cache: dict[str, float]) -> Row:
    # Warm the page cache so neither side pays for the first import of jax from disk.
    subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], check=True)
    hand: list[int] = []
    pooled: list[int] = []
    for _ in range(s.jax_runs):  # interleaved, so drift hits both sides alike
        hand.append(hand_jax_once())
        pooled.append(sky_jax_once())
    floor, figure = statistics.median(hand), statistics.median(pooled)
    ratio = figure / floor
    return Row(
        "jax: pool start -> 2-node psum",
        ms(figure),
        f"{ms(floor)} hand-launched",
        ratio,
        "<= 1.2x",
        ratio <= 1.2,
    )


BENCHES: dict[str, Callable[[Settings, dict[str, float]], Row]] = {
    "rtt": bench_rtt,
    "gather": bench_gather,
    "broadcast": bench_broadcast,
    "bulk": bench_bulk,
    "jax": bench_jax,
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = ", ".join(
        f"{name} {_version(name)}" for name in ("skyward", "jax", "jaxlib", "cloudpickle")
    )
    return (
        f"machine: {usable} usable cores of {os.cpu_count()} ({cpu}), {platform.system()} "
        f"{platform.release()}\npython {platform.python_version()}, {versions}"
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument(
        "--only",
        action="append",
        choices=NAMES,
        metavar="NAME",
        help=f"run only this figure (repeatable): {', '.join(NAMES)}",
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    chosen = [name for name in NAMES if not args.only or name in args.only]

    print(machine())
    print(f"mode: {'quick' if args.quick else 'full'}; {settings}\n")
    header = f"{'figure':<38} {'value':>16}  {'floor (same run)':<26} {'ratio':>7}  {'target':<20} "
    print(header)
    print("-" * len(header))
    cache: dict[str, float] = {}
    began = time.perf_counter_ns()
    for name in chosen:
        try:
            row = BENCHES[name](settings, cache)
        except Exception as exc:  # a report: say what broke and go on with the next figure
            print(f"{name:<38} ERROR {type(exc).__name__}: {exc}", flush=True)
            continue
        verdict = "PASS" if row.passed else "MISS"
        print(
            f"{row.name:<38} {row.figure:>16}  {row.floor:<26} {row.ratio:>6.2f}x  "
            f"{row.target:<20} {verdict}",
            flush=True,
        )
    print(f"\ntotal {ms(time.perf_counter_ns() - began)}")


if __name__ == "__main__":
    main()
