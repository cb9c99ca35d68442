"""`CloudCluster`: the per-pool state every provider that makes machines keeps (AWS, GCP)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyward.errors import ProvisionError
from skyward.providers.base import Cluster
from skyward.providers.bootscript import HostKey


@dataclass
class CloudCluster(Cluster):
    """What one pool has made so far; the cloud's tags or labels are the durable record."""

    key_dir: Path  # the pool's login key, removed with the pool
    host_key: HostKey  # the host key every machine of the pool presents
    cancel: threading.Event = field(default_factory=threading.Event)
    provisioning: Future[list[Any]] | None = None  # the launch's thread
    node_instances: dict[int, str] = field(default_factory=dict)  # node index -> machine
    removed: bool = False

    @property
    def pool_id(self) -> str:
        return self.spec.pool_id

    @property
    def key_path(self) -> Path:
        return self.key_dir / "id_ed25519"

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise ProvisionError(f"the launch of pool {self.pool_id} was cancelled")
