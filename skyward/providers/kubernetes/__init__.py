"""The Kubernetes provider: pools of pods on a cluster the user's kubeconfig reaches (see
`provider`).

`Kubernetes` is imported when asked for, so reading this folder's registry entry (`entry`) does
not import the Kubernetes client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.kubernetes.provider import Kubernetes

__all__ = ["Kubernetes"]


def __getattr__(name: str) -> Any:
    if name == "Kubernetes":
        from skyward.providers.kubernetes.provider import Kubernetes

        return Kubernetes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
