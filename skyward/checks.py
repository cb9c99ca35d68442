"""The checks the public constructors make of their arguments, one rule each, so that a bad
value is a `ConfigError` where it is given, naming the parameter and what it accepts, before
anything starts.

Each takes the value and its name as the error should show it (``"heartbeat_timeout"``,
``"sky.SSH(port=)"``) and returns the value in the form the caller keeps. A bool is never a
number here (``True`` is an int to Python, never a count or a time to a user), and NaN and
infinity are never a time or an amount of money.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import TypeVar

from skyward.errors import ConfigError

T = TypeVar("T")


def seconds(value: object, name: str, *, zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 with `zero`)."""
    return _real(value, name, "number of seconds", zero)


def dollars(value: object, name: str, *, zero: bool = True) -> float:
    """A finite amount of US dollars, >= 0 (> 0 without `zero`)."""
    return _real(value, name, "number of US dollars", zero)


def whole(value: object, name: str, *, minimum: int) -> int:
    """A whole number >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def text(value: object, name: str) -> str:
    """A string with something in it."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def optional_text(value: object, name: str) -> str | None:
    """None, or `text`."""
    return None if value is None else text(value, name)


def optional_texts(owner: str, **values: object) -> None:
    """`optional_text` of each keyword argument, named ``owner(name=)``."""
    for name, value in values.items():
        optional_text(value, f"{owner}({name}=)")


def texts(value: object, name: str) -> tuple[str, ...]:
    """A list of non-empty strings (one string is not a list of them)."""
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Iterable)
        or isinstance(value, Mapping)
    ):
        raise ConfigError(f"{name} must be a list of strings, got {value!r}")
    items = tuple(value)
    for item in items:
        text(item, f"each of {name}")
    return items


def environment(value: object, name: str) -> dict[str, str]:
    """None or a mapping of variable names (non-empty, without ``=``) to string values."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a mapping of names to strings, got {value!r}")
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ConfigError(
                f"{name}: {key!r} is not an environment variable name (a non-empty string "
                "without '=')"
            )
        if not isinstance(item, str):
            raise ConfigError(f"{name}[{key!r}] must be a string, got {item!r}")
    return dict(value)


def flag(value: object, name: str) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def one_of(value: T, name: str, choices: Iterable[object]) -> T:
    """One of `choices` (compared by type too: ``1`` is not ``True``)."""
    allowed = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in allowed):
        *others, last = map(repr, allowed)
        raise ConfigError(f"{name} must be {', '.join(others)} or {last}, got {value!r}")
    return value


def _real(value: object, name: str, what: str, zero: bool) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        kind = f"a {what} >= 0" if zero else f"a positive {what}"
        raise ConfigError(f"{name} must be {kind} (finite), got {value!r}")
    return float(value)
