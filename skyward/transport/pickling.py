"""Pickling for the wire: protocol 5, large buffers out of band, cloudpickle where it is needed.

Shared by the client and the agent (it needs only cloudpickle besides the standard library).
"""

from __future__ import annotations

from typing import Any

import cloudpickle

from skyward.transport import frames


def cloud_dumps(value: Any) -> list[frames.Buffer]:
    """Segments for `value` with cloudpickle (functions, lambdas, classes of ``__main__``)."""
    return frames.dumps(value, cloudpickle.dumps)


def fast_dumps(value: Any) -> list[frames.Buffer]:
    """Segments for `value`: the standard pickler first (several times faster on plain data),
    cloudpickle for what only it can carry (lambdas, classes defined inside a function)."""
    try:
        return frames.dumps(value)
    except Exception:
        return cloud_dumps(value)


def try_dumps(value: Any) -> list[frames.Buffer]:
    """Segments for `value`, or none when it cannot be pickled (an exception to describe)."""
    try:
        return cloud_dumps(value)
    except Exception:
        return []
