"""`@compute` and the pending calls it makes, with their operators.

``fn(...) @ pool`` runs on every node (a list, in node order); ``fn(...) >> pool`` runs on one node;
``(a & b) >> pool`` or ``gather(a, b) >> pool`` runs several at once (a tuple, in call order).
Nothing is pickled or sent until a call meets a pool.
"""

from __future__ import annotations

import functools
import itertools
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, TypeVarTuple, overload

import cloudpickle

from skyward.client import sources
from skyward.data import Stager, collecting
from skyward.errors import SerializationError, SkywardError
from skyward.transport.frames import PROTOCOL, Buffer, cloud_dumps

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
T1 = TypeVar("T1")
T2 = TypeVar("T2")
T3 = TypeVar("T3")
T4 = TypeVar("T4")
T5 = TypeVar("T5")
T6 = TypeVar("T6")
Ts = TypeVarTuple("Ts")
Ts2 = TypeVarTuple("Ts2")


class Runner(Protocol):
    """What the operators ask of a pool (`sky.ComputePool` is one): run a call on one node,
    on every node, or several calls at once."""

    def run(self, call: PendingCall[T]) -> T: ...
    def broadcast(self, call: PendingCall[T]) -> list[T]: ...
    def gather(self, calls: Sequence[PendingCall[Any]]) -> tuple[Any, ...]: ...


_function_ids = itertools.count(1)
_EMPTY_ARGS: list[Buffer] = [bytes(segment) for segment in cloud_dumps(((), {}))]


class Compute(Generic[P, R]):
    """A function that can run on a pool's nodes; calling it returns a `PendingCall`.

    The function is pickled once, at its first remote call, and sent once to each node: module
    globals it uses are captured then (as Ray does), so pass changing values as arguments.
    """

    def __init__(self, fn: Callable[P, R]) -> None:
        if not callable(fn):
            raise TypeError(f"@sky.compute needs a function, got {fn!r}")
        self.fn = fn
        self.id = next(_function_ids)
        self._pickled: bytes | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> PendingCall[R]:
        return PendingCall(self, args, kwargs)

    def local(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here, in this process (for debugging)."""
        return self.fn(*args, **kwargs)

    def serialized(self) -> tuple[int, bytes]:
        """The function's id and its pickled bytes (made once)."""
        if self._pickled is None:
            with self._lock:
                if self._pickled is None:
                    _ship_by_value(self.fn)
                    try:
                        self._pickled = cloudpickle.dumps(self.fn, PROTOCOL)
                    except Exception as exc:
                        raise SerializationError(
                            f"{_name(self.fn)} cannot be pickled for the nodes: {exc}. It may "
                            "close over an object that cannot travel (a lock, a file, a client); "
                            "create that object inside the function instead."
                        ) from exc
        return self.id, self._pickled

    def __repr__(self) -> str:
        return f"<sky.compute {_name(self.fn)}>"


class PendingCall(Generic[R]):
    """A call of a `@compute` function waiting for a pool: use ``@``, ``>>`` or ``&``."""

    __slots__ = ("args", "function", "kwargs")

    def __init__(
        self, function: Compute[Any, R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs

    def serialized_args(self, stager: Stager | None = None) -> list[Buffer]:
        """The pickled ``(args, kwargs)`` as wire segments (large buffers out of band); raises
        `SerializationError` naming the culprit.

        `stager` places every `sky.Data` found in the arguments (the pool syncs it to the
        nodes) and says whether any placement changed; the arguments are then pickled again.
        """
        self.function.serialized()
        if not self.args and not self.kwargs:
            return _EMPTY_ARGS
        try:
            with collecting() as found:
                segments = cloud_dumps((self.args, self.kwargs))
            if found and stager is not None and stager(found):
                with collecting():
                    segments = cloud_dumps((self.args, self.kwargs))
            return segments
        except SkywardError:
            raise
        except Exception as exc:
            raise SerializationError(self._culprit(exc)) from exc

    def _culprit(self, exc: Exception) -> str:
        labelled = [(f"argument {i}", a) for i, a in enumerate(self.args)]
        labelled += [(f"argument {k}=", v) for k, v in self.kwargs.items()]
        for label, value in labelled:
            try:
                cloudpickle.dumps(value, PROTOCOL)
            except Exception as inner:
                return (
                    f"{label} of {_name(self.function.fn)} ({type(value).__name__}) cannot be "
                    f"pickled for the nodes: {inner}. Pass data that pickles, or build the "
                    "object inside the function."
                )
        return f"the arguments of {_name(self.function.fn)} cannot be pickled: {exc}"

    def local(self) -> R:
        """Run this call here, in this process (for debugging)."""
        return self.function.fn(*self.args, **self.kwargs)

    def __matmul__(self, pool: Runner) -> list[R]:
        return pool.broadcast(self)

    def __rshift__(self, pool: Runner) -> R:
        return pool.run(self)

    @overload
    def __and__(self, other: PendingCall[T2]) -> Gather[R, T2]: ...
    @overload
    def __and__(self, other: Gather[*Ts]) -> Gather[R, *Ts]: ...
    def __and__(self, other: PendingCall[Any] | Gather[*tuple[Any, ...]]) -> Gather[Any]:
        return Gather(self) & other

    def __repr__(self) -> str:
        return f"<pending call of {_name(self.function.fn)}>"


class Gather(Generic[*Ts]):
    """Several pending calls to run at once: ``(a & b & c) >> pool`` -> ``(ra, rb, rc)``.

    Typed per call: ``gather(f(1), g(2)) >> pool`` is a ``tuple[F, G]`` for a type checker.
    """

    __slots__ = ("calls",)

    def __init__(self, *calls: PendingCall[Any]) -> None:
        for call in calls:
            if not isinstance(call, PendingCall):
                raise TypeError(
                    f"gather takes pending calls (fn(...) of a @sky.compute fn), got {call!r}"
                )
        self.calls: tuple[PendingCall[Any], ...] = calls

    @overload
    def __and__(self, other: PendingCall[T2]) -> Gather[*Ts, T2]: ...
    @overload
    def __and__(self, other: Gather[*Ts2]) -> Gather[*tuple[Any, ...]]: ...
    def __and__(
        self, other: PendingCall[Any] | Gather[*tuple[Any, ...]]
    ) -> Gather[*tuple[Any, ...]]:
        more = other.calls if isinstance(other, Gather) else (other,)
        return Gather(*self.calls, *more)

    def __rshift__(self, pool: Runner) -> tuple[*Ts]:
        return pool.gather(self.calls)

    def local(self) -> tuple[*Ts]:
        """Run every call here, one after another (for debugging)."""
        return tuple(call.local() for call in self.calls)

    def __len__(self) -> int:
        return len(self.calls)


def compute(fn: Callable[P, R]) -> Compute[P, R]:
    """Decorate a function so its calls can run on a `ComputePool`."""
    return Compute(fn)


@overload
def gather(a: PendingCall[T1], /) -> Gather[T1]: ...
@overload
def gather(a: PendingCall[T1], b: PendingCall[T2], /) -> Gather[T1, T2]: ...
@overload
def gather(a: PendingCall[T1], b: PendingCall[T2], c: PendingCall[T3], /) -> Gather[T1, T2, T3]: ...
@overload
def gather(
    a: PendingCall[T1], b: PendingCall[T2], c: PendingCall[T3], d: PendingCall[T4], /
) -> Gather[T1, T2, T3, T4]: ...
@overload
def gather(
    a: PendingCall[T1],
    b: PendingCall[T2],
    c: PendingCall[T3],
    d: PendingCall[T4],
    e: PendingCall[T5],
    /,
) -> Gather[T1, T2, T3, T4, T5]: ...
@overload
def gather(
    a: PendingCall[T1],
    b: PendingCall[T2],
    c: PendingCall[T3],
    d: PendingCall[T4],
    e: PendingCall[T5],
    f: PendingCall[T6],
    /,
) -> Gather[T1, T2, T3, T4, T5, T6]: ...
@overload
def gather(*calls: PendingCall[Any]) -> Gather[*tuple[Any, ...]]: ...
def gather(*calls: PendingCall[Any]) -> Gather[*tuple[Any, ...]]:
    """Group calls to run concurrently across a pool's nodes: ``sky.gather(a, b) >> pool``
    (typed per call for up to six; more are ``tuple[Any, ...]``)."""
    return Gather(*calls)


def _installed_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return tuple(Path(root).resolve() for root in roots)


def _ship_by_value(fn: Callable[..., Any]) -> None:
    """Send the user's own modules by value: other machines cannot import them.

    cloudpickle pickles functions of importable modules by reference, which works on this
    machine but fails on an SSH or cloud node that lacks the user's project. Installed
    packages (site-packages, the standard library) stay by reference.
    """
    top = (getattr(fn, "__module__", None) or "__main__").split(".")[0]
    if top == "skyward" or sources.is_shipped(top):
        return
    module = sys.modules.get(top)
    origin = getattr(module, "__file__", None)
    if module is None or origin is None:
        return
    path = Path(origin).resolve()
    if any(path.is_relative_to(root) for root in _installed_roots()):
        return
    cloudpickle.register_pickle_by_value(module)
    sources.ship(top)


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__qualname__', repr(fn))}()"
