"""Kubernetes-provider benchmarks: each skyward figure beside a baseline measured in the same run.

Run as root: ``python benchmarks/bench_kubernetes.py [--quick] [--only rtt|start] [--rounds N]
[--calls N]``. It starts its own Kubernetes stand-in (tests/support/fakek8s.py: an HTTPS API
server of our own whose pods are bare Debian roots in network namespaces, on 10.213.46.0/24) in
a temp dir, with skyward's client cache (``SKYWARD_CACHE_DIR``) in that temp dir too, and a
package index on the stand-in's bridge, the only address the pods reach. Everything it made goes
at the end, on an error, Ctrl-C or SIGTERM too. A report: a MISS is printed, never an exit
status (non-zero only when it cannot run: not root, no namespaces, no Debian root or wheels).

- rtt: ``noop() >> pool`` on a 1-pod pool (median and p90), through the stand-in's exec
  websocket, beside a round trip of a message of the call's frame size through ``cat`` in the
  same pod over an exec websocket opened with aiohttp directly (v5.channel.k8s.io, no
  compression, the kubeconfig's CA and bearer token), sampled in alternating blocks. The same
  echo over `kubernetes_asyncio`'s own `WsApiClient` stream is printed for scale: why skyward
  speaks the stream itself. Target: within 1.5x.
- start: ``sky.ComputePool(provider=sky.Kubernetes(...), nodes=3)`` from its construction to
  ready, beside 3 pods made by hand with the same client (`kubernetes_asyncio`: created at
  once, ``restartPolicy: Never``, a watch until each runs, then ``python3 -c pass`` in each over
  exec), alternating, each side going first in turn. Measured on a warm image (its python3
  already has the agent's packages, as an image built for the pool would: skyward copies its
  source and runs the image's python3, nothing built), the realistic figure, and on the bare
  image (``python:3.11-slim``, whose python3 has none: skyward builds a uv environment in every
  pod from the index). Target: the warm start within 1.3x.

What the stand-in cannot show: a real cluster's API server (etcd writes, admission, the
apiserver-to-kubelet hop of every exec), its network and the kubelet's own latency (image
pulls, container runtime, CNI). Both sides here share this machine's cores with the server and
the pods.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["SKYWARD_QUIET"] = "1"  # no status lines between the table's

import aiohttp

import skyward as sky
from skyward.console.progress import Progress
from skyward.hardware import ClusterSpec, Hardware
from skyward.image import Image
from skyward.providers.base import Cluster
from skyward.providers.environment import worker_pins
from skyward.providers.kubernetes import Kubernetes, execstream
from tests.support import bareroots, sshd
from tests.support.fakek8s import FakeCluster

SUBNET = "10.213.46.0/24"  # the tests' clusters use 10.213.40-45
PYTHON = bareroots.SUITE_PYTHON[bareroots.MACHINE_SUITE]
BARE = f"python:{PYTHON}-slim"  # the provider's default image for this client
WARM = f"localhost/python-skyward-deps:{PYTHON}-slim"  # BARE with the agent's packages
NAMESPACE = "default"
OURS = "app.kubernetes.io/managed-by=skyward"
BY_HAND = "bench=by-hand"
V5 = execstream.V5
CONTAINER = execstream.CONTAINER


@sky.compute
def noop() -> None:
    return None


@sky.compute
def interpreter() -> str:
    import sys

    return sys.executable


# ================================================================== figures


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "MISS"


def spread(samples: Sequence[float], scale: float, unit: str) -> str:
    return ", ".join(f"{s * scale:.2f}" for s in samples) + f" {unit}"


class DestroyedTasks(logging.Filter):
    """Counts asyncio's "Task was destroyed but it is pending!" errors instead of printing
    each, so that a pool that leaves tasks pending (the exec streams' writers once did: see
    benchmarks/README.md) is said once and the table stays readable."""

    count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Task was destroyed but it is pending"):
            self.count += 1
            return False
        return True


# ================================================================== the stand-in


@dataclass(frozen=True)
class Credentials:
    """What a client needs from the kubeconfig's current context: the server, its CA, a token."""

    server: str
    ca: str
    token: str

    @classmethod
    def read(cls, path: Path) -> Credentials:
        # The stand-in writes its kubeconfig as JSON (which YAML readers accept too).
        body = json.loads(path.read_text())
        context = next(c for c in body["contexts"] if c["name"] == body["current-context"])
        cluster = next(c for c in body["clusters"] if c["name"] == context["context"]["cluster"])
        user = next(u for u in body["users"] if u["name"] == context["context"]["user"])
        ca = base64.b64decode(cluster["cluster"]["certificate-authority-data"]).decode()
        return cls(cluster["cluster"]["server"], ca, user["user"]["token"])

    def exec_url(self, pod: str, argv: Sequence[str]) -> str:
        query = [("command", a) for a in argv]
        query += [
            ("container", CONTAINER),
            ("stdin", "true"),
            ("stdout", "true"),
            ("stderr", "true"),
        ]
        base = "wss" + self.server.removeprefix("https")
        return f"{base}/api/v1/namespaces/{NAMESPACE}/pods/{pod}/exec?{urlencode(query)}"


def warm_layer(wheels: Path, dest: Path) -> Path:
    """A layer over the bare root whose python3 then has the agent's packages (skyward's
    pins), as an image built ``FROM python:3.11-slim`` with ``pip install`` of them would:
    their pure-Python wheels unpacked into /usr/local/lib/python3.X/dist-packages (on
    Debian's sys.path)."""
    site = dest / "usr" / "local" / "lib" / f"python{PYTHON}" / "dist-packages"
    site.mkdir(parents=True)
    for pin in worker_pins():
        name, _, version = pin.partition("==")
        found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version or '*'}-py3-none-any.whl"))
        if not found:
            raise RuntimeError(f"no pure-Python wheel for {pin} in {wheels}")
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(site)
    return dest


@contextlib.contextmanager
def stand_in(work: Path) -> Iterator[tuple[FakeCluster, bareroots.PackageIndex]]:
    """The stand-in with both images, KUBECONFIG pointing at it, and the pods' index."""
    bare = bareroots.cached_root(bareroots.MACHINE_SUITE)
    wheels = bareroots.download_wheels(
        None, bareroots.machine_requirements(), python_version=PYTHON
    )
    warm = warm_layer(wheels, work / "warm-layer")
    # An image is a list of layers, top first, as the stand-in's kubelet overlays them.
    images: dict[str, str | list[str]] = {BARE: str(bare), WARM: [str(warm), str(bare)]}
    cluster = FakeCluster(work / "k8s", subnet=SUBNET, images=images)
    cluster.start()
    try:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        with bareroots.PackageIndex(wheels, host=cluster.bridge) as index:
            yield cluster, index
    finally:
        cluster.stop()


def wait_gone(cluster: FakeCluster, selector: str, timeout: float = 60) -> None:
    """Until no pod `selector` picks is left: a pod still ending would load the next sample."""
    deadline = time.monotonic() + timeout
    while cluster.pods(NAMESPACE, selector):
        if time.monotonic() > deadline:
            raise RuntimeError(f"pods {selector} still there after {timeout:g} s")
        time.sleep(0.1)


class TimedKubernetes(Kubernetes):
    """`sky.Kubernetes` that keeps how long each step of its last start took."""

    steps: dict[str, float]

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        self.steps = {}
        began = time.perf_counter()
        try:
            return await super().launch(spec, progress)
        finally:
            self.steps["pods made, running"] = time.perf_counter() - began

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        began = time.perf_counter()
        try:
            return await super().survey(cluster, image, progress)
        finally:
            self.steps["host check"] = time.perf_counter() - began

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        began = time.perf_counter()
        try:
            await super().prepare(cluster, image, progress)
        finally:
            self.steps["source, env"] = time.perf_counter() - began


def provider(index: bareroots.PackageIndex, image: str) -> TimedKubernetes:
    return TimedKubernetes(
        image=image, build_env={"UV_INDEX": index.simple_url, "UV_HTTP_RETRIES": "0"}
    )


# ================================================================== rtt

Opened = tuple[aiohttp.ClientWebSocketResponse, Callable[[], Awaitable[object]]]


class Echo:
    """Round trips of one frame through ``cat`` on an open exec websocket, timed inside an
    event loop that this thread runs one block at a time, so blocks alternate with the pool's
    (whose calling thread runs the pool's loop too while it waits for a reply)."""

    def __init__(self, opener: Callable[[], Awaitable[Opened]], size: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.frame = bytes([execstream.STDIN]) + b"x" * size
        self.size = size
        try:
            self.ws, self._closer = self.loop.run_until_complete(opener())
        except BaseException:
            self.loop.close()
            raise

    async def _block(self, runs: int) -> list[float]:
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            await self.ws.send_bytes(self.frame)
            got = 0
            while got < self.size:  # cat may answer in pieces
                msg = await self.ws.receive()
                if msg.type != aiohttp.WSMsgType.BINARY:
                    raise RuntimeError(f"the echo's stream ended: {msg.type} {msg.data!r}")
                if msg.data[:1] == bytes([execstream.STDOUT]):
                    got += len(msg.data) - 1
            times.append(time.perf_counter() - began)
        return times

    def block(self, runs: int) -> list[float]:
        result: list[float] = self.loop.run_until_complete(self._block(runs))
        return result

    def close(self) -> None:
        async def shut() -> None:
            with contextlib.suppress(Exception):
                await self.ws.close()
            with contextlib.suppress(Exception):
                await self._closer()

        self.loop.run_until_complete(shut())
        self.loop.close()


def raw_echo(creds: Credentials, pod: str, size: int) -> Echo:
    """The floor: aiohttp alone, opened as skyward opens its streams (v5, no compression)."""

    async def opener() -> Opened:
        context = ssl.create_default_context(cadata=creds.ca)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))
        try:
            ws = await session.ws_connect(
                creds.exec_url(pod, ["cat"]),
                protocols=(V5,),
                headers={"Authorization": f"Bearer {creds.token}"},
                compress=0,
                max_msg_size=0,
            )
        except BaseException:
            await session.close()
            raise
        return ws, session.close

    return Echo(opener, size)


def library_echo(kubeconfig: Path, pod: str, size: int) -> Echo:
    """The same echo through `kubernetes_asyncio`'s `WsApiClient` stream, with its defaults."""
    from kubernetes_asyncio import config
    from kubernetes_asyncio.client import Configuration, CoreV1Api
    from kubernetes_asyncio.stream import WsApiClient

    async def opener() -> Opened:
        configuration = Configuration()
        await config.load_kube_config(
            config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
        )
        client = WsApiClient(configuration=configuration)
        try:
            # With _preload_content=False the call hands back aiohttp's ws_connect, unawaited.
            # Its stubs type `command` as one string; the stream client takes a list.
            api: Any = CoreV1Api(api_client=client)
            connecting = await api.connect_get_namespaced_pod_exec(
                pod,
                NAMESPACE,
                command=["cat"],
                container=CONTAINER,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
            )
            ws: aiohttp.ClientWebSocketResponse = await connecting
        except BaseException:
            await client.close()
            raise
        return ws, client.close

    return Echo(opener, size)


def call_frame_size(pool: sky.ComputePool) -> int:
    """The bytes one no-op call writes to its agent's stdin (the frame the echo copies)."""
    sizes: list[int] = []
    real = execstream.Exec.send

    def send(self: execstream.Exec, data: Any) -> None:
        sizes.append(memoryview(data).nbytes)
        real(self, data)

    execstream.Exec.send = send  # type: ignore[method-assign]
    try:
        noop() >> pool
    finally:
        execstream.Exec.send = real  # type: ignore[method-assign]
    return sum(sizes)


def rtt(cluster: FakeCluster, index: bareroots.PackageIndex, calls: int) -> None:
    print(f"\nrtt: noop() >> pool on 1 pod, {calls} calls a side, in alternating blocks")
    print(
        "    both go client -> the stand-in's exec websocket -> a process in the pod and back; "
        "the floor's\n    process is cat (no framing, pickling or agent), its message the "
        "size of a call's frame"
    )
    with sky.ComputePool(provider=provider(index, WARM), nodes=1, stream_output=False) as pool:
        for _ in range(50):
            noop() >> pool
        size = call_frame_size(pool)
        (pod,) = [p["metadata"]["name"] for p in cluster.pods(NAMESPACE, OURS)]
        echoes: dict[str, Echo] = {}
        try:
            echoes["aiohttp"] = raw_echo(Credentials.read(cluster.kubeconfig), pod, size)
            try:
                echoes["kubernetes_asyncio"] = library_echo(cluster.kubeconfig, pod, size)
            except ImportError:
                print("    kubernetes_asyncio.stream is not installed: its echo is left out")
            samples: dict[str, list[float]] = {"skyward": [], **{name: [] for name in echoes}}

            def run_block(name: str, runs: int, keep: bool = True) -> None:
                if name == "skyward":
                    got = []
                    for _ in range(runs):
                        began = time.perf_counter()
                        noop() >> pool
                        got.append(time.perf_counter() - began)
                else:
                    got = echoes[name].block(runs)
                if keep:
                    samples[name] += got

            for name in samples:
                run_block(name, 50, keep=False)
            block = max(1, calls // 10)
            order = list(samples)
            turn = 0
            while len(samples["skyward"]) < calls:
                for name in order[turn % len(order) :] + order[: turn % len(order)]:
                    run_block(name, block)
                turn += 1
            compression = {name: echo.ws.compress for name, echo in echoes.items()}
        finally:
            for echo in echoes.values():
                echo.close()
    us = 1e6
    ours, floor = samples["skyward"], samples["aiohttp"]
    ratio = statistics.median(ours) / statistics.median(floor)
    print(f"{'':<46} {'median':>9} {'p90':>9}")
    print(
        f"{'skyward: noop() >> pool (1 pod)':<46} {statistics.median(ours) * us:7.0f}us "
        f"{percentile(ours, 0.9) * us:7.0f}us"
    )
    print(
        f"{f'floor: {size} B echo, aiohttp exec ws (v5)':<46} "
        f"{statistics.median(floor) * us:7.0f}us {percentile(floor, 0.9) * us:7.0f}us"
    )
    print(
        f"    ratio {ratio:.2f}x (target <= 1.5x) {verdict(ratio, 1.5)}; "
        f"p90 ratio {percentile(ours, 0.9) / percentile(floor, 0.9):.2f}x"
    )
    if "kubernetes_asyncio" in samples:
        lib = samples["kubernetes_asyncio"]
        deflate = compression["kubernetes_asyncio"]
        print(
            f"{'for scale: kubernetes_asyncio WsApiClient echo':<46} "
            f"{statistics.median(lib) * us:7.0f}us {percentile(lib, 0.9) * us:7.0f}us "
            f"({statistics.median(lib) / statistics.median(floor):.2f}x the floor; "
            f"v4.channel.k8s.io, permessage-deflate "
            f"{'negotiated' if deflate else 'not negotiated'})"
        )


# ================================================================== start


async def exec_status(core: Any, pod: str, argv: list[str]) -> str:
    """Run `argv` in `pod` over `kubernetes_asyncio`'s exec stream; its channel-3 Status."""
    connecting = await core.connect_get_namespaced_pod_exec(
        pod,
        NAMESPACE,
        command=argv,
        container=CONTAINER,
        stdin=False,
        stdout=True,
        stderr=True,
        tty=False,
        _preload_content=False,
    )
    status = b""
    async with connecting as ws:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY and msg.data[:1] == b"\x03":
                status += msg.data[1:]
    return str(json.loads(status or b"{}").get("status", "no status"))


async def by_hand(kubeconfig: Path, image: str, tag: str) -> dict[str, float]:
    """3 pods made by hand with `kubernetes_asyncio`: seconds to each step, from the start."""
    from kubernetes_asyncio import config, watch
    from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
    from kubernetes_asyncio.stream import WsApiClient

    began = time.perf_counter()
    configuration = Configuration()
    await config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    names = [f"by-hand-{tag}-{i}" for i in range(3)]
    marks: dict[str, float] = {}
    async with ApiClient(configuration) as api_client, WsApiClient(configuration) as ws_client:
        core: Any = CoreV1Api(api_client)  # its stubs want models; it takes plain dicts
        try:
            manifests = [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "labels": {"bench": "by-hand"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {"name": CONTAINER, "image": image, "command": ["sleep", "infinity"]}
                        ],
                    },
                }
                for name in names
            ]
            await asyncio.gather(*(core.create_namespaced_pod(NAMESPACE, m) for m in manifests))
            marks["created"] = time.perf_counter() - began
            running: set[str] = set()
            async with watch.Watch() as pods:
                async for event in pods.stream(
                    core.list_namespaced_pod, NAMESPACE, label_selector=BY_HAND, timeout_seconds=60
                ):
                    pod = event["object"]
                    if pod.status and pod.status.phase == "Running":
                        running.add(pod.metadata.name)
                    if running >= set(names):
                        break
            if running < set(names):
                raise RuntimeError(f"by-hand pods not running within 60 s: {sorted(running)}")
            marks["running"] = time.perf_counter() - began
            ws_core = CoreV1Api(ws_client)
            said = await asyncio.gather(
                *(exec_status(ws_core, n, ["python3", "-c", "pass"]) for n in names)
            )
            marks["python3 -c pass in each"] = time.perf_counter() - began
            if said != ["Success"] * 3:
                raise RuntimeError(f"python3 -c pass in the by-hand pods: {said}")
        finally:
            for name in names:
                with contextlib.suppress(Exception):
                    await core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    return marks


@dataclass
class Start:
    total: float
    steps: dict[str, float]
    end: float
    python: str


def skyward_start(index: bareroots.PackageIndex, image: str) -> Start:
    """Seconds from ComputePool(...) to ready, its steps, the pool's end; the nodes' python."""
    kube = provider(index, image)
    began = time.perf_counter()
    pool = sky.ComputePool(provider=kube, nodes=3, stream_output=False)
    try:
        pool.start()
        total = time.perf_counter() - began
        pythons = set(interpreter() @ pool)
    finally:
        ending = time.perf_counter()
        pool.close()
    end = time.perf_counter() - ending
    steps = dict(kube.steps)
    steps["agents, handshake"] = total - sum(steps.values())
    return Start(total, steps, end, ", ".join(sorted(pythons)))


def start(cluster: FakeCluster, index: bareroots.PackageIndex, rounds: int) -> None:
    print(f"\nstart: 3-pod pool to ready beside 3 pods by hand, {rounds} rounds, alternating")
    print(
        "    skyward: the namespace and RBAC checks, a Service and 3 pods, a watch until they "
        "run, then in\n    each pod the host check, skyward's source, the package check "
        "(and on the bare image uv and\n    the environment's build), the agent and its "
        "handshake. By hand: 3 pods, a watch until they\n    run, python3 -c pass in each "
        "over exec (kubernetes_asyncio's WsApiClient)"
    )
    # One of each first, not counted: the client's one-time work (skyward's source packed,
    # uv's binary compressed for the bare image's pods, the clients' imports) is a process's,
    # not a start's.
    first = skyward_start(index, WARM)
    wait_gone(cluster, OURS)
    first_bare = skyward_start(index, BARE)
    wait_gone(cluster, OURS)
    asyncio.run(by_hand(cluster.kubeconfig, WARM, "warm-up"))
    wait_gone(cluster, BY_HAND)
    print(
        f"    warm-up (not counted): this process's first pool {first.total:.2f} s (warm image), "
        f"{first_bare.total:.2f} s (bare image)"
    )
    sides: dict[str, list[Any]] = {"warm": [], "by hand": [], "bare": []}
    names = list(sides)
    for number in range(rounds):
        order = names[number % 3 :] + names[: number % 3]
        for side in order:
            if side == "by hand":
                sides[side].append(asyncio.run(by_hand(cluster.kubeconfig, WARM, str(number))))
                wait_gone(cluster, BY_HAND)
            else:
                sides[side].append(skyward_start(index, WARM if side == "warm" else BARE))
                wait_gone(cluster, OURS)
        print(
            f"    round {number + 1}/{rounds} ({', '.join(order)}): "
            f"warm {sides['warm'][-1].total:.2f} s, by hand "
            f"{sides['by hand'][-1]['python3 -c pass in each']:.2f} s, "
            f"bare {sides['bare'][-1].total:.2f} s",
            flush=True,
        )
    hand = [m["python3 -c pass in each"] for m in sides["by hand"]]
    print(f"\n{'':<50} {'best':>7} {'median':>7}")
    for label, side in (
        ("skyward, warm image (env in the image)", "warm"),
        ("skyward, bare image (env built in each pod)", "bare"),
    ):
        totals = [s.total for s in sides[side]]
        print(
            f"{label:<50} {min(totals):6.2f}s {statistics.median(totals):6.2f}s   "
            f"nodes' python: {sides[side][-1].python}"
        )
        for step in sides[side][0].steps:
            values = [s.steps[step] for s in sides[side]]
            print(f"{'    ' + step:<50} {min(values):6.2f}s {statistics.median(values):6.2f}s")
        print(
            f"{'    (pool end, not counted)':<50} {min(s.end for s in sides[side]):6.2f}s "
            f"{statistics.median(s.end for s in sides[side]):6.2f}s"
        )
    print(
        f"{'by hand: 3 pods, watch to Running, exec python3':<50} {min(hand):6.2f}s "
        f"{statistics.median(hand):6.2f}s"
    )
    for step in ("created", "running"):
        values = [m[step] for m in sides["by hand"]]
        print(
            f"{'    ' + step + ' (from the start)':<50} {min(values):6.2f}s "
            f"{statistics.median(values):6.2f}s"
        )
    warm = [s.total for s in sides["warm"]]
    ratio = statistics.median(warm) / statistics.median(hand)
    best = min(warm) / min(hand)
    print(
        f"    warm / by hand: median {ratio:.2f}x, best {best:.2f}x (target <= 1.3x) "
        f"{verdict(ratio, 1.3)}"
    )
    bare = [s.total for s in sides["bare"]]
    print(
        f"    bare / by hand: median {statistics.median(bare) / statistics.median(hand):.2f}x "
        "(no target: the environment's build in every pod)"
    )
    print(
        f"    every sample: warm {spread(warm, 1, 's')}; by hand {spread(hand, 1, 's')}; "
        f"bare {spread(bare, 1, 's')}"
    )


# ================================================================== main


def cannot_run() -> str | None:
    if not sshd.is_root():
        return "bench_kubernetes needs root (the stand-in's pods are network namespaces)"
    if sys.version_info[:2] != tuple(int(p) for p in PYTHON.split(".")):
        return f"the stand-in's pods have Python {PYTHON}: run this with Python {PYTHON}"
    if shutil.which("nsenter") is None or shutil.which("unshare") is None:
        return "the stand-in's pods need nsenter and unshare (util-linux)"
    return sshd.netns_unavailable_reason()


def _terminated(signum: int, _: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: the stand-in goes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument("--only", choices=("rtt", "start"), help="run one part")
    parser.add_argument("--rounds", type=int, help="start rounds (default 5, 3 with --quick)")
    parser.add_argument("--calls", type=int, help="round trips a side (default 2000, 400 quick)")
    args = parser.parse_args()
    reason = cannot_run()
    if reason:
        sys.exit(f"cannot run: {reason}")
    signal.signal(signal.SIGTERM, _terminated)
    destroyed = DestroyedTasks()
    logging.getLogger("asyncio").addFilter(destroyed)
    calls = args.calls or (400 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="skyward-bench-k8s-"))
    os.environ["SKYWARD_CACHE_DIR"] = str(work / "cache")  # no earlier cache weighs on a figure
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)", flush=True)
    try:
        bareroots.remove_stale_bare_resources()  # only what crashed runs (dead owners) left
        with stand_in(work) as (cluster, index):
            if args.only in (None, "rtt"):
                rtt(cluster, index, calls)
            if args.only in (None, "start"):
                start(cluster, index, rounds)
    except (KeyboardInterrupt, SystemExit):
        print("\nstopped: the stand-in, its pods and the temp dir are being removed", flush=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    if destroyed.count:
        print(
            f"asyncio logged 'Task was destroyed but it is pending!' {destroyed.count} times "
            "(tasks a pool left pending, collected: see benchmarks/README.md)"
        )
    print(
        "What the stand-in cannot show: a real API server (etcd, admission, the hop to the "
        "kubelet on every exec), its network and the kubelet's own latency (pulls, the "
        "runtime, CNI). Both sides here share this machine's cores with the server and pods."
    )


if __name__ == "__main__":
    main()
