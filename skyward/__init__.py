"""skyward: run Python functions on pools of accelerator machines.

    import skyward as sky

    @sky.compute
    def train(steps): ...

    with sky.ComputePool(nodes=2, plugins=[sky.plugins.jax()]) as pool:
        losses = train(100) @ pool

Public names are imported lazily, so the node agent (which imports this package too) starts
without the client's dependencies. Nothing in skyward imports this module: every module imports
the one it needs (`skyward.version` for the version). skyward's own providers (`sky.AWS`) are
the registry's (`skyward.providers.registry`): a provider's folder adds its class here, with no
edit of this file.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from skyward.version import __version__ as __version__

_EXPORTS = {
    "ComputePool": "skyward.pool",
    "submit": "skyward.detached.submit",
    "Run": "skyward.detached.run",
    "RunStatus": "skyward.detached.run",
    "compute": "skyward.calls",
    "gather": "skyward.calls",
    "Compute": "skyward.calls",
    "PendingCall": "skyward.calls",
    "Gather": "skyward.calls",
    "Data": "skyward.data",
    "resume_from": "skyward.data",
    "preempting": "skyward.preemption",
    "on_preemption": "skyward.preemption",
    "Preemption": "skyward.preemption",
    "Image": "skyward.image",
    "Index": "skyward.image",
    "InstanceInfo": "skyward.info",
    "instance_info": "skyward.info",
    "output_dir": "skyward.info",
    "Report": "skyward.reports",
    "report": "skyward.reports",
    "Plugin": "skyward.plugins.base",
    "ClusterSpec": "skyward.hardware",
    "SkywardError": "skyward.errors",
    "BudgetExceeded": "skyward.errors",
    "Cost": "skyward.cost",
    "Price": "skyward.cost",
    "ConfigError": "skyward.errors",
    "SerializationError": "skyward.errors",
    "ProvisionError": "skyward.errors",
    "NoCapacity": "skyward.errors",
    "BootstrapError": "skyward.errors",
    "PluginError": "skyward.errors",
    "DataError": "skyward.errors",
    "WorkerError": "skyward.errors",
    "RemoteError": "skyward.errors",
    "PoolClosedError": "skyward.errors",
    "NotOnNodeError": "skyward.errors",
    "plugins": "skyward.plugins",
}


if TYPE_CHECKING:
    from skyward import plugins
    from skyward.calls import Compute, Gather, PendingCall, compute, gather
    from skyward.cost import Cost, Price
    from skyward.data import Data, resume_from
    from skyward.detached.run import Run, RunStatus
    from skyward.detached.submit import submit
    from skyward.errors import (
        BootstrapError,
        BudgetExceeded,
        ConfigError,
        DataError,
        NoCapacity,
        NotOnNodeError,
        PluginError,
        PoolClosedError,
        ProvisionError,
        RemoteError,
        SerializationError,
        SkywardError,
        WorkerError,
    )
    from skyward.hardware import ClusterSpec
    from skyward.image import Image, Index
    from skyward.info import InstanceInfo, instance_info, output_dir
    from skyward.plugins.base import Plugin
    from skyward.pool import ComputePool
    from skyward.preemption import Preemption, on_preemption, preempting
    from skyward.providers.aws.provider import AWS
    from skyward.providers.gcp.provider import GCP
    from skyward.providers.local.provider import Local
    from skyward.providers.slurm.provider import Slurm
    from skyward.providers.ssh.provider import SSH
    from skyward.reports import Report, report

    # What a type checker sees (`mypy --strict` on a user's script), which cannot run the
    # registry: a provider not listed here is `Any` to it (through `__getattr__`). At run
    # time `__all__` is the table's names and the registry's own providers' (`_public`).
    __all__ = [
        "AWS",
        "GCP",
        "SSH",
        "BootstrapError",
        "BudgetExceeded",
        "ClusterSpec",
        "Compute",
        "ComputePool",
        "ConfigError",
        "Cost",
        "Data",
        "DataError",
        "Gather",
        "Image",
        "Index",
        "InstanceInfo",
        "Local",
        "NoCapacity",
        "NotOnNodeError",
        "PendingCall",
        "Plugin",
        "PluginError",
        "PoolClosedError",
        "Preemption",
        "Price",
        "ProvisionError",
        "RemoteError",
        "Report",
        "Run",
        "RunStatus",
        "SerializationError",
        "SkywardError",
        "Slurm",
        "WorkerError",
        "compute",
        "gather",
        "instance_info",
        "on_preemption",
        "output_dir",
        "plugins",
        "preempting",
        "report",
        "resume_from",
        "submit",
    ]


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = _public()
    elif name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if name == "plugins" else getattr(module, name)
    elif name[:1].isupper():  # a class's name: one of skyward's own providers, or nothing
        value = _own_provider(name)
    else:  # a submodule being imported asks too: no registry for it
        raise AttributeError(f"module 'skyward' has no attribute {name!r}")
    globals()[name] = value
    return value


def _public() -> list[str]:
    """The public names: the table's, and skyward's own providers' (`sky.AWS`) as their
    registry entries name their classes, so a new provider's folder adds its own."""
    from skyward.providers import registry

    return [*_EXPORTS, *(entry.attr for entry in registry.own_entries())]


def _own_provider(name: str) -> Any:
    """`sky.AWS` and the rest: skyward's own providers, by the class names their registry
    entries give; one whose extra is missing says which to install."""
    from skyward.providers import registry

    own = {entry.attr: entry for entry in registry.own_entries()}
    if name not in own:
        raise AttributeError(f"module 'skyward' has no attribute {name!r}")
    entry = own[name]
    try:
        return getattr(importlib.import_module(entry.module), name)
    except ModuleNotFoundError as exc:
        if entry.extra is None or exc.name == entry.module:
            raise
        raise ModuleNotFoundError(
            f"sky.{name} needs {exc.name}, which is not installed: "
            f"pip install 'skyward[{entry.extra}]'",
            name=exc.name,
        ) from exc


def __dir__() -> list[str]:
    return sorted({*globals(), *_public()})
