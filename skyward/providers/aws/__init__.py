"""The AWS provider: EC2 pools that never leave an instance behind (see `provider`).

The classes are imported when asked for, so reading this folder's registry entry (`entry`)
does not import boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyward.providers.aws.provider import AWS, AWSCluster

__all__ = ["AWS", "AWSCluster"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from skyward.providers.aws import provider

        return getattr(provider, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
