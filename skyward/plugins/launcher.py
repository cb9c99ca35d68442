"""`LauncherEnv`: the launchers' environment variables on every node, and nothing else.

What ``skyward run`` uses without ``--plugin``: a script written for any launcher finds its
variables, JAX's (``JAX_COORDINATOR_ADDRESS``, ...) and torchrun's (``RANK``, ``MASTER_PORT``,
...), each coordinator on its own free port of node 0. No wheel is installed and nothing is
initialized: the script does that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyward.plugins.base import Plugin
from skyward.plugins.jax_plugin import export_launcher_env
from skyward.plugins.torch_plugin import export_torch_env

if TYPE_CHECKING:
    from skyward.info import InstanceInfo


class LauncherEnv(Plugin):
    """Exports the JAX_* and torchrun variables (no wheel, no initialization)."""

    name = "launcher-env"
    ports = ("jax", "torch")

    def for_script(self) -> None:
        """Every script's pool has the launchers' variables already (see `Plugin`)."""
        return None

    def around_app(self, info: InstanceInfo) -> None:
        export_launcher_env(info)
        export_torch_env(info)
