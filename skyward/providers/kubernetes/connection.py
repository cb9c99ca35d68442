"""Which cluster, as whom, in which namespace: a kubeconfig context, or the pod's own service
account when the client itself runs in a pod.

The kubeconfig is the one ``kubectl`` reads: the files ``KUBECONFIG`` names (merged), else
``~/.kube/config``. Everything a kubeconfig can hold for a user (a token, client certificates,
an ``exec`` credential plugin such as ``aws eks get-token`` or ``gke-gcloud-auth-plugin``) is
the official asyncio client's to load (`kubernetes_asyncio`); the file is never written back.
A context that is not in it, or no kubeconfig and no service account, is a `ConfigError` before
anything is asked of a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration

from skyward.errors import ConfigError

# What a pod's service account is given (the in-cluster configuration).
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Target:
    """One cluster to use: the kubeconfig files and context (None: in-cluster), and the
    namespace the pool's objects go to."""

    files: tuple[str, ...]
    context: str | None
    namespace: str

    @property
    def in_cluster(self) -> bool:
        return not self.files

    def __str__(self) -> str:
        where = "in-cluster" if self.in_cluster else f"context {self.context}"
        return f"{where}, namespace {self.namespace}"

    async def client(self) -> ApiClient:
        """A client of the cluster, made on the running event loop (its HTTP session is the
        loop's); close it with ``await client.close()``."""
        configuration = Configuration()
        if self.in_cluster:
            load: Any = kube_config.load_incluster_config  # untyped in the client
            load(
                client_configuration=configuration,
                token_filename=str(SERVICE_ACCOUNT / "token"),
                cert_filename=str(SERVICE_ACCOUNT / "ca.crt"),
            )
        else:
            await kube_config.load_kube_config(
                config_file=os.pathsep.join(self.files),
                context=self.context,
                client_configuration=configuration,
                persist_config=False,
            )
        return ApiClient(configuration)


def kubeconfig_files() -> tuple[str, ...]:
    """The kubeconfig files kubectl would read now, those that exist."""
    named = os.environ.get("KUBECONFIG")
    paths = named.split(os.pathsep) if named else [str(Path("~/.kube/config").expanduser())]
    return tuple(p for p in paths if p and Path(p).expanduser().is_file())


def resolve(context: str | None, namespace: str | None) -> Target:
    """The `Target` for a context (None: the current one) and namespace (None: the context's,
    else ``default``); `ConfigError` naming what is missing."""
    files = kubeconfig_files()
    if not files:
        if (SERVICE_ACCOUNT / "token").is_file() and os.environ.get("KUBERNETES_SERVICE_HOST"):
            if context is not None:
                raise ConfigError(
                    f"context={context!r}, but there is no kubeconfig to find it in (KUBECONFIG "
                    "or ~/.kube/config); in a pod, leave context out to use its service account"
                )
            own = SERVICE_ACCOUNT / "namespace"
            found = own.read_text().strip() if own.is_file() else "default"
            return Target((), None, namespace or found)
        raise ConfigError(
            "no kubeconfig found: set KUBECONFIG or write ~/.kube/config (as kubectl reads it), "
            "or run the client in a pod with a service account"
        )
    contexts, current = _contexts(files)
    names = [str(c.get("name")) for c in contexts]
    chosen = context if context is not None else (current or {}).get("name")
    if chosen is None:
        raise ConfigError(
            f"the kubeconfig ({', '.join(files)}) has no current context: pass context= "
            f"(one of {', '.join(names) or 'none'})"
        )
    if chosen not in names:
        raise ConfigError(
            f"context {chosen!r} is not in the kubeconfig ({', '.join(files)}); its contexts: "
            f"{', '.join(names) or 'none'}"
        )
    entry = next(c for c in contexts if c.get("name") == chosen)
    own_namespace = (entry.get("context") or {}).get("namespace")
    return Target(files, str(chosen), namespace or own_namespace or "default")


def _contexts(files: tuple[str, ...]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    try:
        contexts, current = kube_config.list_kube_config_contexts(os.pathsep.join(files))
    except (kube_config.ConfigException, OSError, ValueError) as exc:
        raise ConfigError(f"the kubeconfig ({', '.join(files)}) could not be read: {exc}") from None
    return list(contexts or []), current
