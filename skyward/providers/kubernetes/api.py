"""The calls skyward makes to a cluster's API server, and their failures in words.

A thin layer over the official asyncio client (`kubernetes_asyncio`): pods and the pool's
headless Service, created, listed, watched and deleted by skyward's labels only (a namespace
is shared; other users' pods are never selected), the scheduler's and kubelet's events, and the
RBAC check made before anything is created. An API error becomes a `ConfigError` where the user
must change something (a namespace that does not exist, a verb RBAC forbids, credentials the
server refuses) and a `ProvisionError` otherwise, each naming the call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from skyward.errors import ConfigError, ProvisionError
from skyward.providers.kubernetes.connection import Target

MANAGED_BY = "app.kubernetes.io/managed-by"
POOL = "skyward.dev/pool"
NODE = "skyward.dev/node"
USER = "skyward.dev/user"
POOL_ID = "skyward.dev/pool-id"  # annotation: the pool id as the pool names it
OURS = f"{MANAGED_BY}=skyward"

# What a pool does in its namespace, as (verb, resource, subresource): checked before the
# first object is made, so a Role that lacks one fails the pool with nothing to clean up.
NEEDED = (
    ("create", "pods", ""),
    ("get", "pods", ""),
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("delete", "pods", ""),
    # An exec over a websocket is an HTTP GET, which RBAC reads as ``get pods/exec``; API
    # servers from 1.35 on require ``create`` of it too, as for the older SPDY POST.
    ("get", "pods", "exec"),
    ("create", "pods", "exec"),
    ("create", "services", ""),
    ("list", "services", ""),
    ("delete", "services", ""),
    ("list", "events", ""),
)


def pool_selector(pool: str) -> str:
    """The label selector of one pool's objects."""
    return f"{OURS},{POOL}={pool}"


class KubeApi:
    """One cluster's API, for one pool's event loop (its HTTP session is that loop's)."""

    def __init__(self, target: Target, api_client: ApiClient) -> None:
        self.target = target
        self.client = api_client
        self.core = client.CoreV1Api(api_client)
        self.namespace = target.namespace

    @classmethod
    async def open(cls, target: Target) -> KubeApi:
        try:
            return cls(target, await target.client())
        except ConfigError:
            raise
        except Exception as exc:  # the loader's own errors: a bad file, a failed plugin
            raise ConfigError(f"the Kubernetes credentials of {target} failed: {exc}") from None

    @property
    def server(self) -> str:
        return str(self.client.configuration.host)

    async def close(self) -> None:
        await self.client.close()

    async def call(self, what: str, call: Any) -> Any:
        """Await `call` (a client coroutine); its failure as skyward's error, naming `what`."""
        try:
            return await call
        except ApiException as exc:
            raise self.error(what, exc) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ProvisionError(
                f"{what}: cannot reach the Kubernetes API server at {self.server} "
                f"({exc or type(exc).__name__})"
            ) from None

    def error(self, what: str, exc: ApiException) -> ConfigError | ProvisionError:
        message = status_message(exc)
        if exc.status == 401:
            return ConfigError(
                f"{what}: the API server at {self.server} refused the credentials of "
                f"{self.target} ({message}): renew them (kubectl would fail too)"
            )
        if exc.status == 403 and "exceeded quota" in message:
            return ProvisionError(
                f"{what}: the namespace's ResourceQuota refuses it ({message}): delete pods "
                f"you no longer need in namespace {self.namespace}, ask for a larger quota, or "
                "use fewer nodes"
            )
        if exc.status == 403 and " cannot " in message:
            return ConfigError(
                f"{what}: {message}. Ask the cluster's admins for the Role in docs/kubernetes.md "
                f"in namespace {self.namespace}"
            )
        if exc.status == 403:  # admission: Pod Security, a quota that needs requests, a policy
            return ConfigError(
                f"{what}: the cluster refused it ({message}); the pods' settings must meet the "
                f"namespace's policies (ask its admins what namespace {self.namespace} admits)"
            )
        if exc.status == 404 and "namespaces" in message and "not found" in message:
            return ConfigError(f"{what}: namespace {self.namespace!r} does not exist ({message})")
        return ProvisionError(f"{what}: {message} (HTTP {exc.status})")

    # -- before anything is made -------------------------------------------------------------

    async def check_namespace(self) -> None:
        """`ConfigError` when the namespace does not exist (a Role scoped to the namespace may
        not read namespaces: then the first create says so instead)."""
        try:
            await self.core.read_namespace(self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise ConfigError(
                    f"namespace {self.namespace!r} does not exist ({self.target}, API server "
                    f"{self.server}): create it, or pass namespace= one that does"
                ) from None
            if exc.status not in (401, 403):
                raise self.error(f"reading namespace {self.namespace}", exc) from None
            if exc.status == 401:
                raise self.error("reaching the cluster", exc) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ProvisionError(
                f"cannot reach the Kubernetes API server at {self.server} ({exc})"
            ) from None

    async def check_access(self) -> None:
        """`ConfigError` naming every verb the pool needs that RBAC forbids in the namespace
        (a SelfSubjectAccessReview each, all at once). A server that cannot answer the review
        leaves it to the calls themselves."""
        api = client.AuthorizationV1Api(self.client)

        async def allowed(verb: str, resource: str, sub: str) -> bool:
            attributes: dict[str, str] = {
                "namespace": self.namespace,
                "verb": verb,
                "resource": resource,
            }
            if sub:
                attributes["subresource"] = sub
            body: Any = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes},
            }
            try:
                review = await api.create_self_subject_access_review(body)
            except (ApiException, aiohttp.ClientError, OSError):
                return True
            return bool(review.status and review.status.allowed)

        answers = await asyncio.gather(*(allowed(*need) for need in NEEDED))
        denied = [
            f"{verb} {resource}{'/' + sub if sub else ''}"
            for (verb, resource, sub), ok in zip(NEEDED, answers, strict=True)
            if not ok
        ]
        if denied:
            raise ConfigError(
                f"RBAC forbids what a pool does in namespace {self.namespace!r} ({self.target}): "
                f"{', '.join(denied)}. Ask the cluster's admins for the Role in "
                "docs/kubernetes.md, or use a namespace where you have it"
            )

    async def node_labels(self) -> list[dict[str, str]] | None:
        """Every node's labels, or None where the user may not list nodes (a namespaced Role)."""
        try:
            nodes = await self.core.list_node()
        except ApiException:
            return None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        return [dict(n.metadata.labels or {}) for n in nodes.items]

    # -- objects -------------------------------------------------------------------------------

    async def create_pod(self, body: Any) -> Any:
        name = body["metadata"]["name"]
        return await self.call(
            f"creating pod {name}", self.core.create_namespaced_pod(self.namespace, body)
        )

    async def create_service(self, body: Any) -> Any:
        name = body["metadata"]["name"]
        return await self.call(
            f"creating service {name}", self.core.create_namespaced_service(self.namespace, body)
        )

    async def read_pod(self, name: str) -> Any | None:
        """The pod `name`, or None where it cannot be read (gone, or the server unreachable)."""
        try:
            return await self.core.read_namespaced_pod(name, self.namespace)
        except (ApiException, aiohttp.ClientError, OSError):
            return None

    async def list_pods(self, selector: str, namespace: str | None = None) -> list[Any]:
        where = namespace or self.namespace
        found = await self.call(
            f"listing pods in {where}",
            self.core.list_namespaced_pod(where, label_selector=selector),
        )
        return list(found.items)

    async def list_services(self, selector: str, namespace: str | None = None) -> list[Any]:
        where = namespace or self.namespace
        found = await self.call(
            f"listing services in {where}",
            self.core.list_namespaced_service(where, label_selector=selector),
        )
        return list(found.items)

    async def delete_pod(self, name: str, grace: int = 0) -> None:
        try:
            await self.core.delete_namespaced_pod(
                name, self.namespace, grace_period_seconds=grace, propagation_policy="Background"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise self.error(f"deleting pod {name}", exc) from None

    async def delete_pool(self, selector: str, grace: int = 0) -> list[str]:
        """Delete the pods and services `selector` picks (skyward's labels); what was deleted."""
        pods = await self.list_pods(selector)
        services = await self.list_services(selector)
        gone: list[str] = []
        for pod in pods:
            await self.delete_pod(pod.metadata.name, grace)
            gone.append(f"pod {pod.metadata.name}")
        for service in services:
            try:
                await self.core.delete_namespaced_service(service.metadata.name, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise self.error(f"deleting service {service.metadata.name}", exc) from None
            gone.append(f"service {service.metadata.name}")
        return gone

    async def wait_gone(self, selector: str, timeout: float) -> list[str]:
        """Wait until no pod `selector` picks is left; the names still there at `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = [p.metadata.name for p in await self.list_pods(selector)]
            if not left or loop.time() >= deadline:
                return left
            await asyncio.sleep(0.25)

    async def warnings(self, pod: str) -> list[str]:
        """The Warning events of `pod`, oldest first, as ``Reason: message``."""
        try:
            found = await self.core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.name={pod}"
            )
        except (ApiException, aiohttp.ClientError, OSError):
            return []
        events = [e for e in found.items if e.type == "Warning"]
        events.sort(key=lambda e: str(e.last_timestamp or e.first_timestamp or ""))
        return [f"{e.reason}: {e.message}" for e in events]

    async def log_tail(self, pod: str, lines: int = 20) -> str:
        try:
            text = await self.core.read_namespaced_pod_log(pod, self.namespace, tail_lines=lines)
        except (ApiException, aiohttp.ClientError, OSError):
            return ""
        return str(text or "")

    async def watch_pods(self, selector: str, timeout: int) -> AsyncGenerator[tuple[str, Any]]:
        """The pool's pods as they change: (event type, pod), for `timeout` seconds at most."""
        stream = watch.Watch()
        try:
            async for event in stream.stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=selector,
                timeout_seconds=timeout,
            ):
                yield str(event["type"]), event["object"]
        except ApiException as exc:
            raise self.error("watching the pool's pods", exc) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ProvisionError(
                f"watching the pool's pods: lost the API server at {self.server} ({exc})"
            ) from None
        finally:
            stream.stop()
            await stream.close()


def status_message(exc: ApiException) -> str:
    """The API server's own words for a failed call (its Status' message)."""
    try:
        body = json.loads(exc.body or "")
        return str(body.get("message") or exc.reason)
    except (ValueError, TypeError, AttributeError):
        return str(exc.reason or exc)
