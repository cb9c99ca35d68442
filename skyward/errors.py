"""The exception hierarchy: every error skyward raises derives from `SkywardError`.

User exceptions raised on a node are re-raised as themselves (see `compute`), not wrapped.
"""

from __future__ import annotations


class SkywardError(Exception):
    """Base class of every error skyward raises on its own behalf."""


class ConfigError(SkywardError, ValueError):
    """Bad input caught before anything is provisioned: a wrong argument, count or name."""


class SerializationError(SkywardError, TypeError):
    """A function, argument or plugin could not be pickled for the trip to the nodes."""


class ProvisionError(SkywardError):
    """The provider could not create the nodes; nothing it created is left behind."""


class NoCapacity(ProvisionError):
    """No location the pool may use could start it (capacity or quota, in every zone, region
    and provider it was given); `attempts` lists each location and what it answered."""

    def __init__(self, message: str, *, attempts: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.attempts = attempts


class BootstrapError(SkywardError):
    """A node's Python environment could not be built or its agent could not start."""

    def __init__(self, message: str, *, node: int | None = None, output: str = "") -> None:
        super().__init__(message)
        self.node = node
        self.output = output


class DataError(SkywardError):
    """Data for a call (`sky.Data`) or a pool's outputs could not be moved; `node` and `path`
    say where. Raised before the function runs; nothing half-written is left in a cache."""

    def __init__(self, message: str, *, node: int | None = None, path: str = "") -> None:
        super().__init__(message)
        self.node = node
        self.path = path


class PluginError(SkywardError):
    """A plugin hook failed; the message names the plugin, the hook and the node."""

    def __init__(self, message: str, *, plugin: str, hook: str, node: int | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
        self.node = node


class WorkerError(SkywardError):
    """A node's agent died or went silent, so the calls it held cannot finish."""

    def __init__(
        self,
        message: str,
        *,
        node: int,
        exit_status: int | None = None,
        output_tail: tuple[str, ...] = (),
        stopped: bool = False,
        preempted: bool = False,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.exit_status = exit_status
        self.output_tail = output_tail
        self.stopped = stopped  # True: skyward stopped this node because another one failed
        self.preempted = preempted  # True: the cloud reclaimed the node (a spot instance)


class RemoteError(SkywardError):
    """A user exception from a node that could not be rebuilt on the client."""

    def __init__(self, type_name: str, message: str, traceback: str, *, node: int) -> None:
        super().__init__(
            f"{type_name}: {message} (raised on node {node}; "
            "the exception could not be rebuilt on the client)"
        )
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = traceback
        self.node = node

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_remote_error,
            (self.type_name, self.remote_message, self.remote_traceback, self.node),
        )


def _rebuild_remote_error(type_name: str, message: str, traceback: str, node: int) -> RemoteError:
    return RemoteError(type_name, message, traceback, node=node)


class PoolClosedError(SkywardError):
    """The pool has been shut down, or lost a node, and cannot take more calls."""


class NotOnNodeError(SkywardError):
    """`instance_info()` was called outside a skyward worker."""


class BudgetExceeded(SkywardError):
    """The pool spent its `max_cost`: the running call was stopped and the pool torn down.
    `spent` is what it had cost by then (US dollars), `max_cost` the budget."""

    def __init__(self, message: str, *, spent: float, max_cost: float) -> None:
        super().__init__(message)
        self.spent = spent
        self.max_cost = max_cost
