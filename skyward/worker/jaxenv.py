"""Make a bare ``jax.distributed.initialize()`` read ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

JAX reads only ``JAX_COORDINATOR_ADDRESS`` from the environment by itself; the process count and
id come from a cluster environment it detects (SLURM, MPI, ...). Registering one for skyward lets
launcher-style scripts call ``initialize()`` with no arguments. The registration waits until the
script imports JAX (importing it first would read JAX's environment before the script sets it),
and the hook is JAX-internal: without it, such scripts must pass the variables themselves.

Runs on the nodes: standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_taught = False


def teach_jax() -> None:
    """Register skyward's JAX cluster environment now (imports JAX)."""
    global _taught
    if _taught:
        return
    try:
        from jax._src import clusters
    except ImportError:
        return

    class SkywardCluster(clusters.ClusterEnv):  # type: ignore[no-untyped-call]  # registers itself
        name = "skyward"

        @classmethod
        def is_env_present(cls) -> bool:
            return "JAX_NUM_PROCESSES" in os.environ and "JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(
            cls, timeout_secs: int | None, override_coordinator_port: str | None = None
        ) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["JAX_PROCESS_ID"])

    _taught = SkywardCluster is not None


def teach_jax_when_imported() -> None:
    """`teach_jax` as soon as JAX is imported (at once if it already is)."""
    if "jax" in sys.modules:
        teach_jax()
    elif not any(isinstance(f, _AfterJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterJaxImport())


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Finds ``jax`` through the other finders and registers the cluster once it is loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            teach_jax()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
