"""The GCP provider: Compute Engine pools that never leave a VM behind (see `provider`).

The classes are imported when asked for, so reading this folder's registry entry (`entry`)
does not import Google's clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.gcp.provider import GCP
    from skyward.providers.gcp.provision import GCPCluster

__all__ = ["GCP", "GCPCluster"]


def __getattr__(name: str) -> Any:
    if name == "GCP":
        from skyward.providers.gcp.provider import GCP

        return GCP
    if name == "GCPCluster":
        from skyward.providers.gcp.provision import GCPCluster

        return GCPCluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
