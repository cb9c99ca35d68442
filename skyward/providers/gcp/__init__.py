"""The GCP provider: Compute Engine pools that never leave a VM behind (see `provider`)."""

from skyward.providers.gcp.provider import GCP
from skyward.providers.gcp.provision import GCPCluster

__all__ = ["GCP", "GCPCluster"]
