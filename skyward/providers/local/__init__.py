"""The Local provider: every node is a child process on this machine (see `provider`).

`Local` is imported when asked for, so reading this folder's registry entry (`entry`) is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.local.provider import Local

__all__ = ["Local"]


def __getattr__(name: str) -> Any:
    if name == "Local":
        from skyward.providers.local.provider import Local

        return Local
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
