"""Plugins: hooks that shape a pool's image and wrap its nodes' and client's lifetimes.

``sky.plugins.jax()`` and ``sky.plugins.keras()`` are the built-in ones; `Plugin` is the base.
"""

from skyward.plugins.base import Plugin
from skyward.plugins.jax import JaxPlugin, jax
from skyward.plugins.keras import KerasPlugin, keras

__all__ = ["JaxPlugin", "KerasPlugin", "Plugin", "jax", "keras"]
