"""Plugins: hooks that shape a pool's image and wrap its nodes' and client's lifetimes.

``sky.plugins.jax()``, ``sky.plugins.torch()`` and ``sky.plugins.keras()`` are the built-in
ones; `Plugin` is the base. Each name is imported on first use: an agent that unpickles a
plugin runs this file, and must not load the JAX, PyTorch and Keras plugins, the image and
packaging with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.plugins.base import Plugin
    from skyward.plugins.jax_plugin import JaxPlugin, jax
    from skyward.plugins.keras_plugin import KerasPlugin, keras
    from skyward.plugins.torch_plugin import TorchPlugin, torch

_HOMES = {
    "Plugin": "skyward.plugins.base",
    "JaxPlugin": "skyward.plugins.jax_plugin",
    "jax": "skyward.plugins.jax_plugin",
    "KerasPlugin": "skyward.plugins.keras_plugin",
    "keras": "skyward.plugins.keras_plugin",
    "TorchPlugin": "skyward.plugins.torch_plugin",
    "torch": "skyward.plugins.torch_plugin",
}

__all__ = ["JaxPlugin", "KerasPlugin", "Plugin", "TorchPlugin", "jax", "keras", "torch"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'skyward.plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
