"""The Kubernetes provider: one bare pod per node, reached through the API server alone.

`launch` checks what it can before making anything (the kubeconfig's context, the namespace,
RBAC for every verb a pool uses), then makes the pool's headless Service and its pods at once
(`podspec`) and waits until each runs (`waiting`: the scheduler's reasons on the console, the
kubelet's errors at once, an unschedulable pod after ``pending_timeout``). Every command in a
pod, the agent included, goes through the exec stream (`execstream`, `podhost`): no sshd in the
image, no Service port, no kubectl. `survey` and `prepare` are the remote bootstrap every
remote provider shares (`remote.bootstrap`): the image's python3 is used directly when it has
what the pool's `Image` asks, else the environment is built in the pod with uv.

The pool's end deletes its pods and Service. A client that dies leaves pods that end
themselves (`skyward.worker.podkeeper`, ``idle_timeout`` after their agents), and ``skyward
ls/down --provider kubernetes`` finds and removes what is left, by skyward's labels only.
A lost pod is replaced by a new pod of the same spec (``restarts=``); a list of contexts is
tried in order, the next one when the scheduler cannot place the pool's pods on one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from skyward import checks
from skyward.console.progress import Phase, Progress
from skyward.cost import Price
from skyward.errors import ConfigError, NoCapacity
from skyward.hardware import ClusterSpec, Hardware
from skyward.image import Image
from skyward.providers.base import (
    Capability,
    Cluster,
    DetachedReach,
    FoundPool,
    NodeCommands,
    count,
    given_rate,
)
from skyward.providers.kubernetes import connection, podspec, waiting
from skyward.providers.kubernetes.api import NODE, OURS, POOL, POOL_ID, USER, KubeApi, pool_selector
from skyward.providers.kubernetes.connection import Target
from skyward.providers.kubernetes.holding import Holds
from skyward.providers.kubernetes.podhost import PodHost, PodNode
from skyward.providers.remote import bootstrap
from skyward.providers.remote.datasync import RemoteData
from skyward.providers.remote.hoststeps import Bootstrap
from skyward.providers.remote.replacing import (
    Made,
    ReplacingCluster,
    ReplacingProvider,
    drop_spares,
)


@dataclass(kw_only=True)
class PodCluster(ReplacingCluster):
    """A pool's pods: the API they live behind, the Service, the spec each pod is made from."""

    api: KubeApi
    service: str
    selector: str
    holds: Holds
    gpu_labels: dict[str, list[str]] | None = None
    generations: dict[int, int] = field(default_factory=dict)  # node -> replacements made
    pods: dict[int, str] = field(default_factory=dict)  # node -> its pod's name
    removed: bool = False


@dataclass
class KubePool:
    """A pool found in a namespace (``skyward ls``): its pods and Service."""

    pool_id: str
    created_at: datetime | None = None
    created_by: str | None = None
    lines: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        return self.lines


class Kubernetes(RemoteData, ReplacingProvider):
    """Nodes as pods of a Kubernetes cluster, one pod per node.

    Args:
        namespace: where the pods go (default: the context's namespace, else ``default``).
        context: the kubeconfig context (default: the current one), or a list of them, tried
            in order: one whose scheduler cannot place the pods is left for the next.
        image: the pods' image (default ``python:3.X-slim`` of the client's Python); any image
            with a ``python3`` of the client's minor version (a CUDA image with jax or torch
            installed is used as it is when it has what the pool's `Image` asks).
        pending_timeout: seconds a pod may wait for the scheduler before the start fails with
            its reason (default 45: the start fails within a minute; give a cluster whose
            autoscaler adds nodes several minutes).
        boot_timeout: seconds for every pod to run once placed (pulling a large image).
        idle_timeout: seconds a pod outlives its last skyward process (a client that died).
        python: the interpreter in the image (default ``python3``).
        build_env: environment variables for the build steps in the pods (proxies, a mirror).
        price_per_hour: what one pod costs you per hour, in US dollars, if anything: the pool
            then counts its spend and can keep a ``max_cost``.
        image_pull_policy: the pods' ``imagePullPolicy`` (default: the cluster's).
        cpus: the CPUs each pod requests (default: none, which the scheduler places anywhere
            and evicts first).
        memory: the memory each pod requests and is limited to, as a Kubernetes quantity
            (``"32Gi"``).
        queue: a Kueue LocalQueue in the namespace: the pool's pods are admitted by it as one
            group (all of them or none).
    """

    name = "kubernetes"
    capabilities = frozenset({Capability.REPLACE, Capability.SIGNALS, Capability.LIST})

    def __init__(
        self,
        namespace: str | None = None,
        context: str | Sequence[str] | None = None,
        image: str | None = None,
        *,
        pending_timeout: float = 45.0,
        boot_timeout: float = 900.0,
        idle_timeout: float = 30.0,
        python: str | None = None,
        build_env: Mapping[str, str] | None = None,
        price_per_hour: float | None = None,
        image_pull_policy: str | None = None,
        cpus: float | None = None,
        memory: str | None = None,
        queue: str | None = None,
    ) -> None:
        checks.optional_text(namespace, "namespace")
        checks.optional_text(image, "image")
        contexts: list[str | None]
        if context is None or isinstance(context, str):
            contexts = [context]
        elif isinstance(context, Sequence) and context and all(isinstance(c, str) for c in context):
            contexts = list(context)
        else:
            raise ConfigError(f"context must be a context's name or a list of names: {context!r}")
        self.pods = podspec.PodSettings(
            image=image or podspec.default_image(),
            idle=checks.seconds(idle_timeout, "idle_timeout"),
            pull_policy=image_pull_policy,
            cpus=cpus,
            memory=memory,
            queue=queue,
        )
        self.targets = [connection.resolve(c, namespace) for c in contexts]
        self.image = self.pods.image
        self.idle_timeout = self.pods.idle
        self.pending_timeout = checks.seconds(pending_timeout, "pending_timeout")
        self.boot_timeout = checks.seconds(boot_timeout, "boot_timeout")
        self.bootstrap = Bootstrap(
            python, build_env=checks.environment(build_env, "build_env"), fresh_hosts=True
        )
        self._price = given_rate(price_per_hour, "sky.Kubernetes")

    def validate(self, spec: ClusterSpec) -> None:
        if spec.accelerator is not None and spec.accelerator.is_tpu:
            raise ConfigError(
                f"accelerator={spec.accelerator}: the Kubernetes provider asks for NVIDIA GPUs "
                "(nvidia.com/gpu); use sky.GCP for TPU slices"
            )

    async def price(self, spec: ClusterSpec) -> Price:
        return self._price

    # -- launch --------------------------------------------------------------------------------

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        if len(self.targets) == 1:
            return await self._launch_in(self.targets[0], spec, progress)
        attempts: list[tuple[str, str]] = []
        for number, target in enumerate(self.targets):
            try:
                return await self._launch_in(target, spec, progress)
            except waiting.Unschedulable as exc:
                attempts.append((str(target), str(exc)))
                if number < len(self.targets) - 1:
                    progress(f"{target}: {exc}; trying {self.targets[number + 1]}")
        raise NoCapacity(
            "no context could place the pool's pods; nothing was left there:\n"
            + "\n".join(f"  {where}: {said}" for where, said in attempts),
            attempts=attempts,
        )

    async def _launch_in(self, target: Target, spec: ClusterSpec, progress: Progress) -> PodCluster:
        api = await KubeApi.open(target)
        try:
            await api.check_namespace()
            await api.check_access()
            labels = None
            acc = spec.accelerator
            if acc is not None and acc.name != podspec.ANY_GPU:
                labels = podspec.gpu_values(acc.name, await api.node_labels())
            pool = PodCluster(
                spec,
                [],
                api=api,
                service=podspec.service_name(spec.pool_id),
                selector=pool_selector(podspec.pool_label(spec.pool_id)),
                holds=Holds(api),
                gpu_labels=labels,
            )
            pool.tell = progress
            try:
                await api.create_service(podspec.service(spec.pool_id, pool.service))
                names = [podspec.pod_name(spec.pool_id, i) for i in range(spec.nodes)]
                for index, name in enumerate(names):
                    progress.phase(index, Phase.REQUESTED, f"pod {name}")
                await asyncio.gather(
                    *(api.create_pod(self._manifest(pool, i, n)) for i, n in enumerate(names))
                )
                running = await waiting.wait_running(
                    api,
                    pool.selector,
                    names,
                    progress,
                    self.pending_timeout,
                    self.boot_timeout,
                    on_running=pool.holds.hold,
                )
            except BaseException:
                await asyncio.shield(self._remove(pool, wait=True))
                raise
            pool.nodes = [self._node(pool, i, r) for i, r in enumerate(running)]
            pool.pods = {i: r.name for i, r in enumerate(running)}
            return pool
        except BaseException:
            await api.close()
            raise

    def _manifest(self, pool: PodCluster, index: int, name: str) -> dict[str, Any]:
        return podspec.pod(
            name=name,
            pool=pool.spec.pool_id,
            index=index,
            nodes=pool.spec.nodes,
            service=pool.service,
            settings=self.pods,
            python=self.bootstrap.python or "python3",
            accelerator=pool.spec.accelerator,
            gpu_labels=pool.gpu_labels,
            env={},
        )

    def _node(self, pool: PodCluster, index: int, pod: waiting.Running) -> PodNode:
        # Node i's stable name under the headless Service: JAX's coordinator and torch's store
        # are reached by it (the search domain adds the cluster's domain).
        address = f"{pod.name}.{pool.service}.{pool.api.namespace}.svc"
        return PodNode(index, PodHost(pool.api, pod.name, pod.ip), address)

    async def survey(self, cluster: Cluster, image: Image, progress: Progress) -> Hardware:
        return await bootstrap.survey_nodes(cluster, image, self.bootstrap, progress)

    async def prepare(self, cluster: Cluster, image: Image, progress: Progress) -> None:
        await bootstrap.prepare_nodes(cluster, image, self.bootstrap, progress)

    # -- replacing a lost pod ------------------------------------------------------------------

    async def make_node(self, pool: ReplacingCluster, index: int) -> Made:
        own = self._own(pool)
        generation = own.generations.get(index, 0) + 1
        own.generations[index] = generation
        name = podspec.pod_name(own.spec.pool_id, index, generation)
        await own.api.create_pod(self._manifest(own, index, name))
        try:
            (running,) = await waiting.wait_running(
                own.api,
                own.selector,
                [name],
                own.tell,
                self.pending_timeout,
                self.boot_timeout,
                [index],
                on_running=own.holds.hold,
            )
        except BaseException:
            await asyncio.shield(own.holds.release(name))
            await asyncio.shield(own.api.delete_pod(name))
            raise
        return Made(self._node(own, index, running), name)

    def place(self, pool: ReplacingCluster, index: int, made: Made) -> None:
        super().place(pool, index, made)
        self._own(pool).pods[index] = made.machine

    async def retire_node(self, pool: ReplacingCluster, index: int) -> None:
        own = self._own(pool)
        lost = own.pods.get(index)
        if lost is not None:
            await own.holds.release(lost)
            with contextlib.suppress(Exception):
                await own.api.delete_pod(lost)

    # -- the end -------------------------------------------------------------------------------

    async def terminate(self, cluster: Cluster) -> None:
        pool = self._own(cluster)
        if pool.removed:
            return
        await bootstrap.close_hosts(pool)
        await drop_spares(pool)
        await asyncio.shield(self._remove(pool, wait=False))

    async def _remove(self, pool: PodCluster, wait: bool) -> None:
        """Delete the pool's pods and Service (no grace: the pool stopped its agents); with
        `wait`, until no pod is left (a failed start says so only once they are gone)."""
        try:
            await pool.holds.close()
            await pool.api.delete_pool(pool.selector)
            if wait:
                left = await pool.api.wait_gone(pool.selector, 30)
                if left:
                    pool.tell(f"pods still being deleted: {', '.join(left)}")
        finally:
            pool.removed = True
            if not pool.nodes or not wait:
                await pool.api.close()

    def teardown_summary(self, cluster: Cluster) -> str:
        pool = self._own(cluster)
        return f"deleted {count(len(pool.nodes), 'pod')} and service {pool.service}"

    def _own(self, cluster: Cluster) -> PodCluster:
        if not isinstance(cluster, PodCluster):
            raise TypeError(f"{cluster!r} is not a pool of the kubernetes provider")
        return cluster

    # -- what pools left, for the command line -------------------------------------------------

    def find(self) -> Mapping[str, FoundPool]:
        """Every skyward pool in the namespace of each context given (any user's)."""

        async def every() -> dict[str, KubePool]:
            found: dict[str, KubePool] = {}
            for target in self.targets:
                found.update(await self._find(target))
            return found

        return asyncio.run(every())

    async def _find(self, target: Target) -> dict[str, KubePool]:
        api = await KubeApi.open(target)
        try:
            pods = await api.list_pods(OURS)
            services = await api.list_services(OURS)
        finally:
            await api.close()
        pools: dict[str, KubePool] = {}
        for item in [*pods, *services]:
            meta = item.metadata
            pool_id = (meta.annotations or {}).get(POOL_ID) or (meta.labels or {}).get(POOL, "?")
            pool = pools.setdefault(pool_id, KubePool(pool_id))
            made = meta.creation_timestamp
            if made is not None and (pool.created_at is None or made < pool.created_at):
                pool.created_at = made
            pool.created_by = pool.created_by or (meta.labels or {}).get(USER)
            if item.kind == "Service" or hasattr(item.spec, "cluster_ip"):
                pool.lines.append(f"service {meta.name} ({target.namespace})")
            else:
                node = (meta.labels or {}).get(NODE, "?")
                phase = item.status.phase if item.status else "?"
                ip = (item.status.pod_ip if item.status else None) or "no IP"
                pool.lines.append(f"pod {meta.name} (node {node}, {phase}, {ip})")
        return pools

    def cleanup(self, pool: str | None = None) -> list[str]:
        """Delete pool `pool`'s pods and Service in each context given; without one, every
        pool this user made there (another user's skyward pools in a shared namespace are
        theirs: name one to remove it)."""

        async def every() -> list[str]:
            removed: list[str] = []
            for target in self.targets:
                removed += await self._cleanup(target, pool)
            return removed

        return asyncio.run(every())

    async def _cleanup(self, target: Target, pool: str | None) -> list[str]:
        api = await KubeApi.open(target)
        try:
            if pool is None:
                selector = f"{OURS},{USER}={podspec.user_label()}"
            else:
                selector = pool_selector(podspec.pool_label(pool))
            return await api.delete_pool(selector)
        finally:
            await api.close()

    # -- detached runs (docs/detach.md, "Kubernetes"; the parts: kubernetes/podruns.py) ------

    def detached_kind(self) -> str:
        # No sshd in a pod and no API credentials: node 0's leader reaches each other pod at a
        # door the run opens on the pod network, and the client reaches them by exec.
        return "tcp"

    def detached_reach(self, cluster: Cluster) -> DetachedReach:
        """Where the run's pods are (the kubeconfig, context and namespace of this pool, each
        node's pod), and the pool to delete once the run has ended."""
        from skyward.providers.kubernetes import podruns

        pool = self._own(cluster)
        pods = [pool.pods[index] for index in range(len(pool.nodes))]
        return podruns.reach_of(pool.api.target, pods, pool.spec.pool_id)

    @classmethod
    def detached_commands(cls, data: Mapping[str, Any]) -> NodeCommands:
        from skyward.providers.kubernetes import podruns

        return podruns.PodCommands(data)

    async def release(self, cluster: Cluster) -> None:
        """A detached run holds the pods: only this client's streams and API session go. The
        pods end themselves once the run has (their keeper), and the later command that sees
        its end deletes them and the Service (`detached_reach`'s kept pool)."""
        pool = self._own(cluster)
        await pool.holds.close()  # the run's processes hold the pods from here on
        await bootstrap.close_hosts(pool)
        await drop_spares(pool)
        pool.removed = True  # the run's now: a terminate after this deletes nothing
        await pool.api.close()
