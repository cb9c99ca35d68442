"""The hook runner, for the client and the agent alike.

Hooks run in plugin order on the way in and in reverse order on the way out (an `ExitStack`);
any failure, entering or leaving, becomes a `PluginError` that names the plugin, the hook and,
on a node, the node, with the original exception as its ``__cause__``. It lives with the worker,
not with the plugins, because the agent runs it: the agent imports nothing above the worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar

from skyward.errors import PluginError, SkywardError

T = TypeVar("T")
# A plugin, to the runner: whatever `open_hook` takes (the runner reads only its `name`), so the
# worker names no class of the plugins'.
P = TypeVar("P")


def call_hook(
    plugin: str, hook: str, fn: Callable[..., T], *args: Any, node: int | None = None
) -> T:
    """`fn(*args)`, with a failure reported as plugin `plugin`'s in `hook`."""
    return _guarded(plugin, hook, "failed in", node, fn, *args)


def _guarded(
    plugin: str, hook: str, how: str, node: int | None, fn: Callable[..., T], *args: Any
) -> T:
    try:
        return fn(*args)
    except SkywardError:
        raise
    except Exception as exc:
        raise _failure(plugin, hook, how, exc, node) from exc


def enter_hooks(
    stack: contextlib.ExitStack,
    plugins: Sequence[P],
    hook: str,
    open_hook: Callable[[P], AbstractContextManager[Any] | None],
    *,
    node: int | None = None,
    before: Callable[[str], None] | None = None,
) -> None:
    """Enter `open_hook(plugin)` for every plugin, in order, onto `stack` (which exits them in
    reverse); `before(name)` runs ahead of each plugin's hook (the agent reports progress)."""
    for plugin in plugins:
        name = getattr(plugin, "name", type(plugin).__name__)
        if before is not None:
            before(name)
        manager = call_hook(name, hook, open_hook, plugin, node=node)
        if manager is not None:
            stack.enter_context(_Named(name, hook, manager, node))


class _Named(contextlib.AbstractContextManager[Any]):
    """A plugin's context whose failures, entering or leaving, name the plugin."""

    def __init__(
        self, plugin: str, hook: str, inner: AbstractContextManager[Any], node: int | None
    ) -> None:
        self._plugin, self._hook, self._inner, self._node = plugin, hook, inner, node

    def __enter__(self) -> Any:
        return _guarded(
            self._plugin, self._hook, "failed entering", self._node, self._inner.__enter__
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return self._inner.__exit__(exc_type, exc, tb)
        except SkywardError:
            raise
        except Exception as error:
            if error is exc:  # the exception passing through, re-raised: not the hook's own
                raise
            raise _failure(self._plugin, self._hook, "failed leaving", error, self._node) from error


def _failure(plugin: str, hook: str, how: str, exc: BaseException, node: int | None) -> PluginError:
    where = f" on node {node}" if node is not None else ""
    return PluginError(
        f"plugin {plugin!r} {how} {hook}{where}: {type(exc).__name__}: {exc}",
        plugin=plugin,
        hook=hook,
        node=node,
    )
