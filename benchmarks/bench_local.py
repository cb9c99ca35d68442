"""Local-provider benchmarks: each skyward figure beside a floor measured in the same run.

Run ``python benchmarks/bench_local.py`` (``--quick`` for fewer iterations, ``--busy N`` with N
busy-looping processes beside every figure and floor, ``--only NAME`` for one figure; NAME is
one of rtt, gather, broadcast, ranks, bulk, jax, run, step, output, output-tty, report,
stacks). It is a report, not a test: a MISS is printed, never turned into a
failing exit status. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib.metadata as metadata
import inspect
import io
import os
import pickle
import platform
import resource
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import cloudpickle

from skyward.calls import compute, gather
from skyward.plugins import Plugin
from skyward.plugins.jax_plugin import jax as jax_plugin
from skyward.pool import ComputePool
from skyward.reports import report

NAMES = (
    "rtt",
    "gather",
    "broadcast",
    "ranks",
    "bulk",
    "jax",
    "run",
    "step",
    "output",
    "output-tty",
    "report",
    "stacks",
)
PIPE_SIZE = 1 << 20  # the agent enlarges its control pipes to this; the floors use the same
BULK_BYTES = 100_000_000
HEADER = struct.Struct("!Q")
Op: TypeAlias = Callable[[], object]  # one timed operation
CALL = 2  # skyward's message kind for a call; the floor's replies imitate RESULT (14)

# A child process for the floors: frames are an 8-byte length then a body. "echo" unpickles each
# message and answers with a small pickled reply ("echo-poll" polls for the next message like a
# lingering agent, and its parent polls for the reply); "sink" reads the whole body and answers
# its length.
RAW_CHILD = textwrap.dedent(
    """
    import os, pickle, struct, sys, time
    H = struct.Struct("!Q")
    mode, wfd = sys.argv[1], int(sys.argv[3])
    inp = os.fdopen(int(sys.argv[2]), "rb", buffering=1 << 16)
    poll = mode == "echo-poll"
    while True:
        if poll:  # poll 200 us for the next message, as a lingering skyward agent does
            os.set_blocking(inp.fileno(), False)
            deadline = time.perf_counter() + 0.0002
            while not inp.peek(1) and time.perf_counter() < deadline:
                pass
            os.set_blocking(inp.fileno(), True)
        head = inp.read(8)
        if len(head) < 8:
            break
        (n,) = H.unpack(head)
        body = inp.read(n)
        if len(body) < n:
            sys.exit("short read")
        if mode != "sink":
            message = pickle.loads(body)
            reply = pickle.dumps((14, message[1]), 5)
        else:
            reply = H.pack(len(body))
        os.write(wfd, H.pack(len(reply)) + reply)
    """
)


# -- the functions the pools run --------------------------------------------------------------


@compute
def noop() -> None:
    return None


@compute
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
    by_process = NamedSharding(mesh, P("x"))  # type: ignore[no-untyped-call]
    replicated = NamedSharding(mesh, P())  # type: ignore[no-untyped-call]
    shards = jax.make_array_from_process_local_data(by_process, local)  # type: ignore[no-untyped-call]
    total = jax.jit(jnp.sum, out_shardings=replicated)(shards)
    return float(total)


sharded_sum_remote = compute(sharded_sum)

# The step's compiled function and input, per process: built on its first call, then reused.
_STEP: dict[str, Any] = {}


def jitted_step() -> float:
    """One jitted training-sized step on the process's first device, synchronised by reading
    back a scalar: a 4096x4096 bf16 matmul on a GPU, 512x512 float32 on the CPU."""
    import jax
    import jax.numpy as jnp

    if not _STEP:
        gpu = jax.devices()[0].platform == "gpu"
        n, dtype = (4096, jnp.bfloat16) if gpu else (512, jnp.float32)
        _STEP["x"] = jnp.ones((n, n), dtype)
        _STEP["step"] = jax.jit(lambda a: (a @ a).sum())
    return float(_STEP["step"](_STEP["x"]))


jitted_step_remote = compute(jitted_step)


@compute
def shout(lines: int) -> int:
    """Print `lines` lines of 100 bytes, as a training loop that logs freely does."""
    line = "x" * 99
    for _ in range(lines):
        print(line)
    return lines


@compute
def time_reports(count: int, block: int) -> tuple[list[int], list[int]]:
    """Per-call nanoseconds of `count` ``sky.report`` calls and of `count` appends of the same
    dict to a list (the floor: the least a call that queues its argument can cost), measured
    here on the node, in alternating blocks of `block`, while the sender thread sends."""
    metrics = {"loss": 0.25, "accuracy": 0.5, "lr": 1e-3}
    kept: list[dict[str, float]] = []
    reported: list[int] = []
    appended: list[int] = []
    clock = time.perf_counter_ns
    while len(reported) < count:
        for _ in range(block):
            began = clock()
            report(metrics)
            reported.append(clock() - began)
        for _ in range(block):
            began = clock()
            kept.append(metrics)
            appended.append(clock() - began)
        kept.clear()
    return reported, appended


@compute
def wait_on(node: int, seconds: float) -> None:
    """Node `node` waits, as a rank stuck in a collective does; the others return."""
    import threading

    from skyward import instance_info

    if instance_info().node == node:
        threading.Event().wait(seconds)


# The floor of `stacks`: a process whose main thread waits, with faulthandler writing every
# thread's stack to a pipe on SIGUSR2, as an agent has it (its dump ends with the main thread,
# whose oldest frame is the script's <module>).
STACKS_CHILD = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, threading
    out = os.fdopen(int(sys.argv[1]), "w")
    faulthandler.register(signal.SIGUSR2, out, all_threads=True)
    out.write("ready in <module>\\n")
    out.flush()
    threading.Event().wait()
    """
)


# The floor's child prints the same lines to a plain pipe.
SHOUT_CHILD = "import sys\nline = 'x' * 99\nfor _ in range(int(sys.argv[1])):\n    print(line)\n"


class LineSink(io.TextIOBase):
    """Where both sides' lines go during `output`: counted, then dropped."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return len(text)

    def isatty(self) -> bool:
        return False


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


# The script `run` launches, Kubeflow style: it reads the JAX_* variables its launcher sets (plain
# JAX reads only the coordinator's address from the environment, so by hand a bare initialize()
# would not do).
RUN_SCRIPT = textwrap.dedent(
    """
    import os

    import jax

    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    xs = jax.numpy.ones(jax.local_device_count())
    print("RESULT", jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(xs)[0], flush=True)
    jax.distributed.shutdown()
    """
)


# -- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    figure: str  # the measured figure, formatted
    floor: str  # the floor it is compared with, formatted
    ratio: float  # how many times worse than the floor (>= 1 means slower)
    target: str
    passed: bool | None  # None: a figure reported without a target
    detail: str = ""  # the spread of both samples, printed under the row


@dataclass
class Settings:
    calls: int  # round trips for rtt
    warmup: int
    batch: int  # calls per gather
    batches: int
    broadcasts: int
    bulk_runs: int
    jax_runs: int
    run_runs: int  # launches of each side for `run`
    output_lines: int  # lines of 100 bytes a node prints for `output`
    reports: int  # sky.report calls timed on the node for `report`
    stack_asks: int  # pool.stacks() calls for `stacks`
    busy: int = 0  # busy-looping processes beside every figure and floor (`--busy N`)


FULL = Settings(
    calls=2000,
    warmup=300,
    batch=1000,
    batches=10,
    broadcasts=1000,
    bulk_runs=5,
    jax_runs=3,
    run_runs=5,
    output_lines=2_000_000,
    reports=100_000,
    stack_asks=40,
)
QUICK = Settings(
    calls=500,
    warmup=100,
    batch=1000,
    batches=3,
    broadcasts=200,
    bulk_runs=2,
    jax_runs=1,
    run_runs=2,
    output_lines=200_000,
    reports=20_000,
    stack_asks=10,
)


def us(ns: float) -> str:
    return f"{ns / 1e3:,.1f} us"


def ms(ns: float) -> str:
    return f"{ns / 1e6:,.1f} ms"


def per_s(rate: float) -> str:
    return f"{rate:,.0f} calls/s"


def spread(samples: list[int] | list[float], fmt: Callable[[float], str]) -> str:
    """p10 / median / p90 of a sample (every value when there are only a few)."""
    ordered = sorted(samples)
    if len(ordered) <= 5:
        return "[" + ", ".join(fmt(x) for x in ordered) + "]"
    deciles = statistics.quantiles(ordered, n=10)
    return f"p10 {fmt(deciles[0])} / p50 {fmt(statistics.median(ordered))} / p90 {fmt(deciles[-1])}"


def timed(fn: Op, count: int) -> list[int]:
    """`count` timings of `fn()`, in nanoseconds."""
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return samples


def interleaved(ops: list[Op], count: int, warmup: int, blocks: int) -> list[list[int]]:
    """`count` timings of each op after `warmup` untimed runs, taken in alternating blocks.

    A floor and its figure are sampled turn about, so whatever else the machine is doing at a
    given moment weighs on both alike and their ratio stays meaningful. Each block starts with
    the next op in turn: the op that runs first after a switch pays for it (its processes wake
    with cold caches), and with a fixed order that would always be the same op (measured on
    2 cores: the first of four identical 8-node broadcasts read about 10% slower).
    """
    for op in ops:
        timed(op, warmup)
    samples: list[list[int]] = [[] for _ in ops]
    per_block = -(-count // blocks)
    block = 0
    while len(samples[0]) < count:
        first = block % len(ops)
        for i in [*range(first, len(ops)), *range(first)]:
            samples[i] += timed(ops[i], min(per_block, count - len(samples[i])))
        block += 1
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
        self._poll = mode == "echo-poll"
        self._poller = select.poll()
        self._poller.register(up_r, select.POLLIN)

    def send(self, body: bytes) -> None:
        if len(body) < 1 << 16:
            _write_all(self._down_w, HEADER.pack(len(body)) + body)
        else:
            _write_all(self._down_w, HEADER.pack(len(body)))
            _write_all(self._down_w, body)

    def receive(self) -> bytes:
        if self._poll:
            deadline = time.perf_counter() + 0.0002
            while not self._poller.poll(0) and time.perf_counter() < deadline:
                pass
        (n,) = HEADER.unpack(self._up.read(HEADER.size))
        body: bytes = self._up.read(n)
        return body

    def close(self) -> None:
        os.close(self._down_w)
        self._proc.wait(10)
        self._up.close()


@contextlib.contextmanager
def raw_children(count: int, mode: str = "echo") -> Iterator[list[RawChild]]:
    children: list[RawChild] = []
    try:
        children += (RawChild(mode) for _ in range(count))
        yield children
    finally:
        for child in children:
            child.close()


def raw_message(call_id: int) -> bytes:
    """What a no-op call carries, cloudpickled as skyward does: kind, ids, no function, args."""
    blob: bytes = cloudpickle.dumps((CALL, call_id, 1, None, ((), {})), 5)
    return blob


def raw_round_trip(child: RawChild) -> Op:
    def once() -> None:
        child.send(raw_message(7))
        pickle.loads(child.receive())

    return once


def raw_pipelined(children: list[RawChild], batch: int) -> Op:
    """`batch` messages written round-robin to the children, then every reply read."""

    def once() -> None:
        for i in range(batch):
            children[i % len(children)].send(raw_message(i))
        for i in range(batch):
            pickle.loads(children[i % len(children)].receive())

    return once


def raw_broadcast(children: list[RawChild]) -> Op:
    """One message pickled once and written to every child, then every reply read."""

    def once() -> None:
        message = raw_message(7)
        for child in children:
            child.send(message)
        for child in children:
            pickle.loads(child.receive())

    return once


def raw_bulk(child: RawChild, payload: bytes) -> Op:
    def once() -> None:
        child.send(payload)
        assert HEADER.unpack(child.receive())[0] == len(payload)

    return once


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- the skyward figures ----------------------------------------------------------------------


def pool(nodes: int, plugins: tuple[Plugin, ...] = (), ranks: int = 1) -> ComputePool:
    """A Local pool (the default provider), as the issue specifies: no output streaming;
    `ranks` agents on each node."""
    return ComputePool(nodes=nodes, plugins=plugins, stream_output=False, processes_per_node=ranks)


def sky_round_trip(p: ComputePool) -> Op:
    def once() -> None:
        noop() >> p

    return once


def sky_gather(p: ComputePool, batch: int) -> Op:
    def once() -> None:
        results = gather(*(noop() for _ in range(batch))) >> p
        assert len(results) == batch

    return once


def sky_broadcast(p: ComputePool) -> Op:
    def once() -> None:
        noop() @ p

    return once


def sky_bulk(p: ComputePool, payload: bytes) -> Op:
    def once() -> None:
        assert nbytes(payload) >> p == len(payload)

    return once


def sky_jax_once() -> int:
    start = time.perf_counter_ns()
    with pool(2, plugins=(jax_plugin(),)) as p:
        assert sharded_sum_remote() @ p == [3.0, 3.0]
        elapsed = time.perf_counter_ns() - start
    return elapsed


def hand_jax_once() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter_ns()
    # On the CPU, as the pool's nodes are (two processes on one GPU would make NCCL refuse).
    cpu_only = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JAX_CHILD, f"127.0.0.1:{port}", str(rank)],
            stdout=subprocess.PIPE,
            text=True,
            env=cpu_only,
        )
        for rank in range(2)
    ]
    results = [_result_line(proc) for proc in procs]
    elapsed = time.perf_counter_ns() - start
    for proc in procs:
        proc.communicate(timeout=60)
    assert results == ["3.0", "3.0"], results
    return elapsed


def run_once(script: str, by_hand: bool) -> int:
    """`skyward run --nodes 2 script` from launch to exit, or the same script launched by hand as
    two processes with the JAX_* variables set (a free coordinator port)."""
    cpu_only = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter_ns()
    if by_hand:
        procs = [
            subprocess.Popen(
                [sys.executable, script],
                stdout=subprocess.PIPE,
                text=True,
                env={
                    **cpu_only,
                    "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                    "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(rank),
                },
            )
            for rank in range(2)
        ]
    else:
        command = [sys.executable, "-m", "skyward.cli", "run", "--nodes", "2", script]
        procs = [
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cpu_only
            )
        ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    elapsed = time.perf_counter_ns() - start
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert "".join(outputs).count("RESULT 2.0") == 2, outputs
    return elapsed


def _result_line(proc: subprocess.Popen[str]) -> str:
    """The child's result (gloo prints its own lines on stdout too); "" if it ended without one."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return line.split()[1]
    return ""


# -- the figures, each with its floor and target ---------------------------------------------


def bench_rtt(s: Settings) -> Row:
    with raw_children(1) as (child,), raw_children(1, "echo-poll") as (poller,), pool(1) as p:
        raw, pooled, polled = interleaved(
            [raw_round_trip(child), sky_round_trip(p), raw_round_trip(poller)],
            s.calls,
            s.warmup,
            blocks=10,
        )
    floor, figure = statistics.median(raw), statistics.median(pooled)
    ratio = figure / floor
    # A loaded machine: every wait may cost a scheduler's slice, on both sides alike.
    target = 2.0 if s.busy else 1.5
    return Row(
        "rtt: noop() >> pool, 1 node (median)",
        us(figure),
        f"{us(floor)} raw pipe",
        ratio,
        f"<= {target:g}x",
        ratio <= target,
        f"skyward {spread(pooled, us)}; raw {spread(raw, us)}; n={len(pooled)} each; for "
        f"scale, a raw pipe whose ends both poll 200 us as skyward's do on Local: "
        f"{spread(polled, us)}",
    )


def bench_gather(s: Settings) -> Row:
    with raw_children(2) as children, pool(2) as p:
        raw_ns, pooled_ns = interleaved(
            [raw_pipelined(children, s.batch), sky_gather(p, s.batch)],
            s.batches,
            warmup=2,
            blocks=s.batches,
        )
    raw = [s.batch * 1e9 / ns for ns in raw_ns]
    pooled = [s.batch * 1e9 / ns for ns in pooled_ns]
    floor, figure = statistics.median(raw), statistics.median(pooled)
    return Row(
        f"gather: {s.batch} noops, 2 nodes",
        per_s(figure),
        f"{per_s(floor)} raw pipe",
        floor / figure,
        ">= 20,000 calls/s",
        figure >= 20_000,
        f"skyward {spread(pooled, per_s)}; raw {spread(raw, per_s)}; {len(pooled)} batches each",
    )


def bench_broadcast(s: Settings) -> Row:
    with raw_children(8) as children, pool(1) as one, pool(8) as eight:
        single, pooled, raw = interleaved(
            [sky_round_trip(one), sky_broadcast(eight), raw_broadcast(children)],
            s.broadcasts,
            s.warmup,
            blocks=10,
        )
    floor, figure = statistics.median(raw), statistics.median(pooled)
    ratio = figure / floor
    return Row(
        "broadcast: noop() @ pool, 8 nodes",
        us(figure),
        f"{us(floor)} raw 8-pipe bcast",
        ratio,
        "<= 1.5x",
        ratio <= 1.5,
        f"skyward {spread(pooled, us)}; raw 8 pipes {spread(raw, us)}; n={len(pooled)} each; "
        f"for scale, the 1-node >>: {spread(single, us)}",
    )


def bench_ranks(s: Settings) -> Row:
    """A broadcast to 8 ranks held as 2 nodes x 4 ranks beside one to 8 nodes x 1 rank: the
    same 8 agents, so the ranks' figure should be the nodes' (the floor here)."""
    with raw_children(8) as children, pool(8) as nodes, pool(2, ranks=4) as ranks:
        by_node, by_rank, raw = interleaved(
            [sky_broadcast(nodes), sky_broadcast(ranks), raw_broadcast(children)],
            s.broadcasts,
            s.warmup,
            blocks=10,
        )
    floor, figure = statistics.median(by_node), statistics.median(by_rank)
    ratio = figure / floor
    return Row(
        "ranks: noop() @ pool, 2 nodes x 4 ranks",
        us(figure),
        f"{us(floor)} 8 nodes x 1 rank",
        ratio,
        "<= 1.1x",
        ratio <= 1.1,
        f"2 x 4 ranks {spread(by_rank, us)}; 8 x 1 {spread(by_node, us)}; n={len(by_rank)} "
        f"each; for scale, raw 8 pipes {spread(raw, us)}",
    )


def bench_bulk(s: Settings) -> Row:
    payload = bytes(BULK_BYTES)
    with raw_children(1, "sink") as (child,), pool(1) as p:
        raw, pooled = interleaved(
            [raw_bulk(child, payload), sky_bulk(p, payload)], s.bulk_runs, 1, s.bulk_runs
        )
    floor, figure = statistics.median(raw), statistics.median(pooled)
    ratio = figure / floor
    return Row(
        "bulk: 100 MB bytes arg, 1 node",
        ms(figure),
        f"{ms(floor)} raw pipe",
        ratio,
        "<= 1.5x",
        ratio <= 1.5,
        f"skyward {spread(pooled, ms)}; raw {spread(raw, ms)}",
    )


def bench_step(s: Settings) -> Row:
    # This process and the node share the GPU: neither may take most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    accelerator = "GPU" if gpu else None  # the node gets this machine's GPU when it has one
    with ComputePool(nodes=1, accelerator=accelerator, stream_output=False) as p:

        def remote() -> None:
            jitted_step_remote() >> p

        here, there = interleaved([jitted_step, remote], s.calls // 4, s.warmup // 4, blocks=10)
    floor, figure = statistics.median(here), statistics.median(there)
    return Row(
        f"step: jitted matmul >> pool ({'GPU' if gpu else 'CPU'})",
        us(figure),
        f"{us(floor)} in-process",
        figure / floor,
        "(reported)",
        None,
        f"skyward {spread(there, us)}; in-process {spread(here, us)}; the call costs "
        f"{us(figure - floor)} around the step",
    )


def raw_output(lines: int, sink: LineSink) -> None:
    """A child prints `lines` lines; this process reads its pipe and writes each line, with a
    node's prefix, to `sink`: what a client must do at the least."""
    child = subprocess.Popen(
        [sys.executable, "-c", SHOUT_CHILD, str(lines)], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    partial = b""
    while chunk := child.stdout.read1(1 << 16):
        *whole, partial = (partial + chunk).split(b"\n")
        for line in whole:
            sink.write(f"(node 0) {line.decode()}\n")
    child.wait()


def bench_output(s: Settings) -> Row:
    lines = s.output_lines
    megabytes = lines * 100 / 1e6
    floor_sink, sink = LineSink(), LineSink()
    began = time.perf_counter_ns()
    raw_output(lines, floor_sink)
    floor_ns = time.perf_counter_ns() - began
    with ComputePool(nodes=1) as p, contextlib.redirect_stdout(sink):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        began = time.perf_counter_ns()
        shout(lines) >> p
        deadline = time.monotonic() + 600
        while sink.lines < lines and time.monotonic() < deadline:  # output trails the result
            time.sleep(0.01)
        figure_ns = time.perf_counter_ns() - began
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    rate, floor_rate = megabytes / (figure_ns / 1e9), megabytes / (floor_ns / 1e9)
    return Row(
        f"output: {megabytes:.0f} MB of lines, 1 node",
        f"{rate:,.1f} MB/s",
        f"{floor_rate:,.1f} MB/s raw pipe",
        floor_rate / rate,
        ">= 1/4 rate, RSS +<100 MB",
        rate * 4 >= floor_rate and grown_mb < 100,
        f"client peak RSS grew {grown_mb:.0f} MB; {sink.lines:,} of {lines:,} lines arrived",
    )


def bench_output_tty(s: Settings) -> Row:
    """`output` with the client on a terminal, so the live console is up: a child process on
    a pty whose other end this process reads as fast as it can (a terminal that is never the
    bottleneck). The floor is the same child writing the prefixed lines to that terminal."""
    import pty
    import termios
    import threading

    lines = s.output_lines
    megabytes = lines * 100 / 1e6
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    received = [0]

    def drain() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 1 << 16):
                received[0] += len(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen(
        [sys.executable, __file__, "--tty-child", str(lines), str(write_fd)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        pass_fds=(write_fd,),
        env={**os.environ, "TERM": "xterm-256color", "SKYWARD_QUIET": ""},
    )
    os.close(slave)
    os.close(write_fd)
    with os.fdopen(read_fd) as answer:
        floor_ns, figure_ns, live = (int(word) for word in answer.read().split())
    child.wait()
    os.close(master)
    rate, floor_rate = megabytes / (figure_ns / 1e9), megabytes / (floor_ns / 1e9)
    return Row(
        f"output-tty: {megabytes:.0f} MB of lines, 1 node",
        f"{rate:,.1f} MB/s",
        f"{floor_rate:,.1f} MB/s to the tty",
        floor_rate / rate,
        ">= 1/4 rate",
        rate * 4 >= floor_rate and bool(live),
        f"live console {'up' if live else 'NOT up'}; the terminal read {received[0] / 1e6:.0f} MB",
    )


def tty_child(lines: int, answer_fd: int) -> None:
    """`bench_output_tty`'s child, on the pty: the floor, then the pool, until the console
    has written every line (the pool's close drains it)."""
    began = time.perf_counter_ns()
    raw_output(lines, sys.stdout)  # type: ignore[arg-type]
    sys.stdout.flush()
    floor_ns = time.perf_counter_ns() - began
    p = ComputePool(nodes=1)
    with p:
        live = p.console._screen is not None
        began = time.perf_counter_ns()
        shout(lines) >> p
    figure_ns = time.perf_counter_ns() - began
    with os.fdopen(answer_fd, "w") as answer:
        answer.write(f"{floor_ns} {figure_ns} {int(live)}")


def bench_report(s: Settings) -> Row:
    with pool(1) as p:
        reported, appended = time_reports(s.reports, 1000) >> p
        arrived = len(p.reports)
    floor, figure = statistics.median(appended), statistics.median(reported)
    ordered = sorted(reported)
    return Row(
        "report: sky.report(3 floats) on node",
        us(figure),
        f"{us(floor)} list.append",
        figure / floor,
        "<= 50 us",
        figure <= 50_000,
        f"sky.report {spread(reported, us)}, p99 {us(ordered[len(ordered) * 99 // 100])}, max "
        f"{us(ordered[-1])}; list.append {spread(appended, us)}; n={len(reported)} each, back to "
        f"back; {arrived:,} reports reached the client with the result",
    )


@contextlib.contextmanager
def dumping_children(count: int) -> Iterator[list[tuple[subprocess.Popen[bytes], int]]]:
    """`count` STACKS_CHILD processes, each with the read end of its dump pipe."""
    children: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for _ in range(count):
            read, write = os.pipe()
            proc = subprocess.Popen(
                [sys.executable, "-c", STACKS_CHILD, str(write)], pass_fds=(write,)
            )
            os.close(write)
            children.append((proc, read))
        for _, read in children:
            _whole_dump(read)  # the child's "ready": SIGUSR2 no longer kills it
        yield children
    finally:
        for proc, read in children:
            proc.kill()
            proc.wait()
            os.close(read)


def raw_stacks(children: list[tuple[subprocess.Popen[bytes], int]]) -> Op:
    """SIGUSR2 to every child, then each one's whole dump read back: the least `pool.stacks()`
    can cost (no wire, no waiting to know a dump is complete)."""

    def once() -> None:
        for proc, _ in children:
            os.kill(proc.pid, signal.SIGUSR2)
        for _, read in children:
            _whole_dump(read)

    return once


def _whole_dump(read: int) -> bytes:
    dump = b""
    while not dump.endswith(b" in <module>\n"):
        chunk = os.read(read, 65536) if select.select([read], [], [], 10)[0] else b""
        if not chunk:
            raise RuntimeError(f"no whole dump in 10 s: {dump!r}")
        dump += chunk
    return dump


def bench_stacks(s: Settings) -> Row:
    """`pool.stacks()` on 2 nodes, node 1 stuck in a call (docs/failures.md cites it)."""
    with dumping_children(2) as children, pool(2) as p:
        stuck = p.submit(wait_on(1, 600), node=1)

        def ask() -> None:
            answers = p.stacks(timeout=5)
            assert sorted(answers) == [0, 1] and "wait_on" in answers[1], answers

        time.sleep(0.2)  # node 1 is in its call
        pooled, raw = interleaved([ask, raw_stacks(children)], s.stack_asks, 2, blocks=5)
        assert not stuck.done()
    floor, figure = statistics.median(raw), statistics.median(pooled)
    return Row(
        "stacks: pool.stacks(), 2 nodes",
        ms(figure),
        f"{us(floor)} SIGUSR2 + dump, 2 procs",
        figure / floor,
        "(reported)",
        None,
        f"skyward {spread(pooled, ms)}; raw {spread(raw, us)}; n={len(pooled)} each; the agent "
        "sends a dump once its pipe has been quiet for 50 ms, the client looks every 20 ms",
    )


def bench_jax(s: Settings) -> Row:
    # Warm the page cache so neither side pays for the first import of jax from disk.
    warm = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], check=True, env=warm)
    hand: list[int] = []
    pooled: list[int] = []
    for run in range(s.jax_runs):  # interleaved, each going first in turn
        if run % 2:
            pooled.append(sky_jax_once())
        hand.append(hand_jax_once())
        if not run % 2:
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
        f"skyward {spread(pooled, ms)}; hand-launched {spread(hand, ms)}",
    )


def bench_run(s: Settings) -> Row:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "jax_multiprocess.py")
        with open(script, "w") as handle:
            handle.write(RUN_SCRIPT)
        run_once(script, by_hand=True)  # warms the page cache for both sides
        hand: list[int] = []
        launched: list[int] = []
        for run in range(s.run_runs):  # interleaved, each going first in turn
            first, second = (hand, launched) if run % 2 else (launched, hand)
            first.append(run_once(script, by_hand=first is hand))
            second.append(run_once(script, by_hand=second is hand))
    floor, figure = statistics.median(hand), statistics.median(launched)
    ratio = figure / floor
    return Row(
        "run: skyward run --nodes 2 script.py",
        ms(figure),
        f"{ms(floor)} by hand",
        ratio,
        "<= 1.2x",
        ratio <= 1.2,
        f"skyward run {spread(launched, ms)}; by hand {spread(hand, ms)}; fastest of each: "
        f"{ms(min(launched))} vs {ms(min(hand))}",
    )


BENCHES: dict[str, Callable[[Settings], Row]] = {
    "rtt": bench_rtt,
    "gather": bench_gather,
    "broadcast": bench_broadcast,
    "ranks": bench_ranks,
    "bulk": bench_bulk,
    "jax": bench_jax,
    "run": bench_run,
    "step": bench_step,
    "output": bench_output,
    "output-tty": bench_output_tty,
    "report": bench_report,
    "stacks": bench_stacks,
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
        f"{platform.release()}\npython {platform.python_version()}, {versions}\n{load()}"
    )


def load() -> str:
    """The load average: other work on the machine makes every figure here noisier."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def main() -> None:
    if sys.argv[1:2] == ["--tty-child"]:
        tty_child(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N busy-looping processes beside every figure and its floor (a loaded machine)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=NAMES,
        metavar="NAME",
        help=f"run only this figure (repeatable): {', '.join(NAMES)}",
    )
    args = parser.parse_args()
    # The table is the report: the pools' own status lines would break it up (node output,
    # which `output` measures, is still printed; output-tty's child turns it back on).
    os.environ.setdefault("SKYWARD_QUIET", "1")
    settings = dataclasses.replace(QUICK if args.quick else FULL, busy=args.busy)
    chosen = [name for name in NAMES if not args.only or name in args.only]

    print(machine())
    print(f"mode: {'quick' if args.quick else 'full'}; {settings}\n")
    with busy_loops(args.busy):
        print_table(chosen, settings)


BUSY_LOOP = """\
import os
parent = os.getppid()
while os.getppid() == parent:  # ends with the benchmark, however it ends
    for _ in range(1_000_000):  # pure computation between looks, as a data loader's
        pass
"""


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """`count` processes that loop on the CPU meanwhile: a training node's data-loader workers
    and XLA threads, as the waiting sides see them. Each ends when this process is gone."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        if loops:
            print(f"busy: {count} busy-looping process(es) beside every figure and floor\n")
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(10)


def print_table(chosen: list[str], settings: Settings) -> None:
    header = (
        f"{'figure':<38} {'value':>16}  {'floor (same run)':<26} {'ratio':>7}  {'target':<20} "
        "result"
    )
    print(header)
    print("-" * len(header))
    began = time.perf_counter_ns()
    for name in chosen:
        try:
            row = BENCHES[name](settings)
        except Exception as exc:  # a report: say what broke and go on with the next figure
            print(f"{name:<38} ERROR {type(exc).__name__}: {exc}", flush=True)
            continue
        verdict = "-" if row.passed is None else "PASS" if row.passed else "MISS"
        print(
            f"{row.name:<38} {row.figure:>16}  {row.floor:<26} {row.ratio:>6.2f}x  "
            f"{row.target:<20} {verdict}",
            flush=True,
        )
        if row.detail:
            print(f"    {row.detail}", flush=True)
    print(f"\ntotal {ms(time.perf_counter_ns() - began)}; {load()}")


if __name__ == "__main__":
    main()
