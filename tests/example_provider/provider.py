"""`Example`: a provider defined outside skyward, known to it only through the registry.

It runs its nodes as processes here (it is `Local` underneath) and names itself ``example``.
Like a cloud, it keeps a record of each pool it launched (a JSON file in `state_dir`, removed
by the pool's teardown), so a pool whose client died leaves something that ``skyward ls
--provider example`` lists and ``skyward down --provider example`` removes: the registry's
command-line half, with its own flag (``--example-dir``), and not a line of skyward changed.
"""

from __future__ import annotations

import getpass
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from skyward.console.progress import Progress
from skyward.hardware import ClusterSpec
from skyward.providers.base import Capability, Cluster, LivePool, Provider
from skyward.providers.local.provider import Local
from skyward.providers.registry import Option, ProviderEntry


@dataclass(frozen=True)
class ExamplePool:
    """One pool's record, as `find` reads it."""

    pool_id: str
    created_at: datetime | None
    created_by: str | None
    client: int
    nodes: int

    def describe(self) -> list[str]:
        try:
            os.kill(self.client, 0)
            state = "running"
        except ProcessLookupError:
            state = "gone"
        return [f"{self.nodes} node(s), client pid {self.client} ({state})"]


class Example(Local):
    """Local processes under another name that keep a record of each pool (see the module)."""

    name = "example"
    capabilities = Local.capabilities | {Capability.LIST}

    def __init__(self, state_dir: str, **local: object) -> None:
        super().__init__(**local)  # type: ignore[arg-type]
        self.state_dir = Path(state_dir)

    def _record(self, pool_id: str) -> Path:
        return self.state_dir / f"{pool_id}.json"

    async def launch(self, spec: ClusterSpec, progress: Progress) -> Cluster:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "created_at": datetime.now(UTC).isoformat(),
            "created_by": getpass.getuser(),
            "client": os.getpid(),
            "nodes": spec.nodes,
        }
        self._record(spec.pool_id).write_text(json.dumps(record))
        return await super().launch(spec, progress)

    async def terminate(self, cluster: Cluster) -> None:
        await super().terminate(cluster)
        self._record(cluster.spec.pool_id).unlink(missing_ok=True)

    def find(self) -> dict[str, ExamplePool]:
        found = {}
        for path in sorted(self.state_dir.glob("*.json")):
            record = json.loads(path.read_text())
            found[path.stem] = ExamplePool(
                path.stem,
                datetime.fromisoformat(record["created_at"]),
                record["created_by"],
                int(record["client"]),
                int(record["nodes"]),
            )
        return found

    def live_pools(self) -> list[LivePool] | None:
        # The base class's: every pool `find` lists (Local's says none, as `skyward status`
        # lists this machine's processes itself).
        return Provider.live_pools(self)

    def cleanup(self, pool: str | None = None) -> list[str]:
        removed = []
        for pool_id in [pool] if pool is not None else list(self.find()):
            path = self._record(pool_id)
            if path.exists():
                path.unlink()
                removed.append(f"{pool_id}: its record {path.name}")
        return removed


ENTRY = ProviderEntry(
    "example",
    "tests.example_provider.provider",
    "Example",
    options=(
        Option(
            "--example-dir", "state_dir", "where the example's pools are recorded", listing=True
        ),
    ),
)
