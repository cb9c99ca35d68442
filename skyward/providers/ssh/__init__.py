"""The SSH provider: pools on machines the user already has, reached over SSH (see `provider`).

`SSH` is imported when asked for, so reading this folder's registry entry (`entry`) does not
import asyncssh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.ssh.provider import SSH

__all__ = ["SSH"]


def __getattr__(name: str) -> Any:
    if name == "SSH":
        from skyward.providers.ssh.provider import SSH

        return SSH
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
