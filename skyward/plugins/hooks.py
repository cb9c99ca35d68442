"""The plugins' hooks as the client calls them: `transform` over every plugin, and the hook
runner (`skyward.worker.hookrunner`, which the agent shares) for `around_client`.

Hooks run in plugin order on the way in and in reverse order on the way out; a failure names
the plugin and the hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from skyward.worker.hookrunner import call_hook, enter_hooks

if TYPE_CHECKING:
    from skyward.hardware import ClusterSpec
    from skyward.image import Image
    from skyward.plugins.base import Plugin

__all__ = ["call_hook", "enter_hooks", "transform"]


def transform(plugins: Sequence[Plugin], image: Image, spec: ClusterSpec) -> Image:
    """`image` through every plugin's `transform` for `spec`, in plugin order."""
    for plugin in plugins:
        image = call_hook(plugin.name, "transform", plugin.transform, image, spec)
    return image
