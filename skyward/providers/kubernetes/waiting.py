"""Waiting for a pool's pods to run, and saying plainly why they do not.

While a pod pends, its node's line on the console shows the scheduler's reason (the pod's
``PodScheduled`` condition, the words of its ``FailedScheduling`` event). What cannot get
better fails the start at once with the kubelet's words: an image that cannot be pulled
(``ErrImagePull``, ``ImagePullBackOff``, an invalid name), a container that cannot be created or
that ended. A pod the scheduler cannot place fails it after `pending` seconds (a cluster whose
autoscaler adds nodes needs longer: ``pending_timeout=``), with the scheduler's message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skyward.console.progress import Phase, Progress
from skyward.errors import NoCapacity, ProvisionError
from skyward.providers.kubernetes.api import KubeApi

# Container states that do not get better by waiting.
FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
}


class Unschedulable(NoCapacity):
    """The scheduler could not place a pod in time: no room for the pool in this context
    (failover tries the next context, and a pool's next provider after the last)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, attempts=[("the cluster", message)])


@dataclass
class Running:
    """A pod that runs: its name and IP."""

    name: str
    ip: str


def scheduling_message(pod: Any) -> str | None:
    """The scheduler's reason for a pending pod, or None when it is placed."""
    for condition in (pod.status and pod.status.conditions) or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.message or condition.reason or "waiting for the scheduler")
    return None


def container_problem(pod: Any) -> str | None:
    """What makes a pod's container fail for good, or None."""
    status = pod.status
    if status is None:
        return None
    image = pod.spec.containers[0].image if pod.spec and pod.spec.containers else "?"
    for container in status.container_statuses or []:
        state = container.state
        if state is None:
            continue
        if state.waiting is not None and state.waiting.reason in FATAL_WAITING:
            return f"image {image!r}: {state.waiting.reason}" + (
                f" ({state.waiting.message})" if state.waiting.message else ""
            )
        if state.terminated is not None:
            term = state.terminated
            return (
                f"its container (image {image!r}) ended: {term.reason or 'terminated'}, exit "
                f"code {term.exit_code}" + (f" ({term.message})" if term.message else "")
            )
    if status.phase in ("Failed", "Succeeded"):
        return f"it is {status.phase}" + (f": {status.message}" if status.message else "")
    return None


async def wait_running(
    api: KubeApi,
    selector: str,
    names: Sequence[str],
    progress: Progress,
    pending: float,
    boot: float,
    indices: Sequence[int] | None = None,
    on_running: Callable[[str], None] | None = None,
) -> list[Running]:
    """Wait until every pod of `names` runs with an IP; they in `names`' order, each given to
    `on_running` as soon as it runs (its hold). Raises `ProvisionError` (`Unschedulable` for
    the scheduler) naming the pod and the reason."""
    watch = _PodWatch(names, indices, progress, on_running)
    loop = asyncio.get_running_loop()
    started = loop.time()
    while len(watch.running) < len(names):
        watch.check_deadlines(loop.time() - started, pending, boot)
        try:
            # A short watch, ended by the server, so the deadlines above are looked at; the
            # timeout around it only guards against a server that does not end it.
            with contextlib.suppress(TimeoutError):
                async with (
                    asyncio.timeout(10),
                    contextlib.aclosing(api.watch_pods(selector, timeout=2)) as events,
                ):
                    async for _, pod in events:
                        watch.look(pod)
                        if len(watch.running) == len(names):
                            break
            if len(watch.running) < len(names):
                # The watch may have ended between events; one list catches what it missed.
                for pod in await api.list_pods(selector):
                    watch.look(pod)
        except _CannotStart as failed:
            raise ProvisionError(
                f"pod {failed.pod} cannot start: {failed.problem}{await _explain(api, failed.pod)}"
            ) from None
    return [watch.running[name] for name in names]


class _PodWatch:
    """What `wait_running` has seen of the pods: which run, why the others wait, and what the
    user was last told of each."""

    def __init__(
        self,
        names: Sequence[str],
        indices: Sequence[int] | None,
        progress: Progress,
        on_running: Callable[[str], None] | None,
    ) -> None:
        self.names = names
        self.index = dict(zip(names, indices or range(len(names)), strict=True))
        self.running: dict[str, Running] = {}
        self.shown: dict[str, str] = {}
        self.last_reason: dict[str, str] = {}
        self.progress = progress
        self.on_running = on_running

    def look(self, pod: Any) -> None:
        """Take in one pod's state: running, waiting (with the scheduler's reason), or unable
        to start (`_CannotStart`)."""
        name = pod.metadata.name
        if name not in self.index:
            return
        if pod.metadata.deletion_timestamp is not None:
            raise ProvisionError(f"pod {name} was deleted while the pool started")
        problem = container_problem(pod)
        if problem is not None:
            raise _CannotStart(name, problem)
        waiting = scheduling_message(pod)
        if waiting is not None:
            self.last_reason[name] = waiting
            if self.shown.get(name) != waiting:
                self.shown[name] = waiting
                self.progress.phase(self.index[name], Phase.REQUESTED, f"pending: {waiting}")
            return
        self.last_reason.pop(name, None)
        if pod.status.phase == "Running" and pod.status.pod_ip and name not in self.running:
            self.running[name] = Running(name, pod.status.pod_ip)
            if self.on_running is not None:
                self.on_running(name)
            self.progress.phase(self.index[name], Phase.CONNECTING, pod.status.pod_ip)
        elif name not in self.running and self.shown.get(name) != "scheduled":
            self.shown[name] = "scheduled"
            where = pod.spec.node_name or "a node"
            self.progress.phase(
                self.index[name], Phase.BOOTING, f"on {where}: pulling and starting"
            )

    def check_deadlines(self, waited: float, pending: float, boot: float) -> None:
        """Raise when a pod has waited for the scheduler past `pending` seconds, or any pod is
        not running after `boot`."""
        if waited >= pending and self.last_reason:
            name, reason = next(iter(self.last_reason.items()))
            raise Unschedulable(
                f"pod {name} could not be scheduled within {pending:g} s "
                f"(pending_timeout=): {reason}"
            )
        if waited >= boot:
            late = [n for n in self.names if n not in self.running]
            raise ProvisionError(
                f"pod(s) {', '.join(late)} did not run within {boot:g} s (boot_timeout=)"
            )


async def why_ended(api: KubeApi, pod: str) -> str | None:
    """Why `pod`'s container cannot run commands any more (it crashed, its image went, the pod
    ended), with the cluster's words, or None where nothing says so. An exec refused by the API
    server asks this: a container that ended is refused with a bare HTTP 400."""
    found = await api.read_pod(pod)
    problem = None if found is None else container_problem(found)
    if problem is None:
        return None
    return f"pod {pod} cannot start: {problem}{await _explain(api, pod)}"


class _CannotStart(Exception):
    def __init__(self, pod: str, problem: str) -> None:
        super().__init__(problem)
        self.pod, self.problem = pod, problem


async def _explain(api: KubeApi, pod: str) -> str:
    """What the cluster said of a pod that cannot start, for its error: the last Warning
    events (the kubelet's words) and the container's last lines (a crash's traceback)."""
    events = await api.warnings(pod)
    tail = (await api.log_tail(pod)).strip()
    said = ""
    if events:
        said += "\nevents: " + "; ".join(events[-3:])
    if tail:
        said += "\n--- its last lines ---\n" + tail
    return said
