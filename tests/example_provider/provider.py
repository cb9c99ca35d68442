"""`Example`: a provider defined outside skyward, known to it only through the registry.

It runs its nodes as processes here (it is `Local` underneath) and names itself ``example``.
"""

from __future__ import annotations

from skyward.providers.local import Local
from skyward.providers.registry import ProviderEntry


class Example(Local):
    """Local processes under another name: what a third-party provider looks like to skyward."""

    name = "example"


ENTRY = ProviderEntry("example", "tests.example_provider.provider", "Example")
