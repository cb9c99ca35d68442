"""`Plugin`: the three optional hooks a plugin may have, and how the pool calls them.

Hooks are plain callables. `transform` runs on the client in plugin order; `around_app` is
entered in every agent in plugin order and exited in reverse; `around_client` wraps the pool's
life on the client. A failing hook is reported with the plugin's name and the hook's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from skyward import checks
from skyward.errors import ConfigError

if TYPE_CHECKING:
    # For the annotations only: an agent unpickles every plugin, which imports this module,
    # and must not load the image (and packaging) or the cluster spec that only the client uses.
    from skyward.hardware import ClusterSpec
    from skyward.image import Image
    from skyward.info import InstanceInfo


class ClientPool(Protocol):
    """What an `around_client` hook gets: the pool itself (a `sky.ComputePool`), read through
    what a client-side hook needs of it."""

    @property
    def pool_id(self) -> str: ...
    @property
    def spec(self) -> ClusterSpec: ...
    @property
    def image(self) -> Image: ...


# Strings: the aliases are evaluated at import, and their names exist for the type checker only.
Transform = Callable[["Image", "ClusterSpec"], "Image"]
AroundApp = Callable[["InstanceInfo"], AbstractContextManager[Any] | None]
AroundClient = Callable[[ClientPool], AbstractContextManager[Any] | None]


class Plugin:
    """A pool extension. Subclass and override hooks, or pass callables::

        sky.Plugin("wandb", around_app=lambda info: wandb_run(info.node))

    A plugin object travels to every node with cloudpickle, so keep its state small and plain.
    `ports` names the ports the plugin needs on the head node (a coordinator); each arrives
    free and distinct in ``info.ports[name]``.
    """

    name: str = "plugin"
    ports: tuple[str, ...] = ()

    def __init__(
        self,
        name: str | None = None,
        *,
        transform: Transform | None = None,
        around_app: AroundApp | None = None,
        around_client: AroundClient | None = None,
        ports: tuple[str, ...] = (),
    ) -> None:
        if name is not None:
            self.name = checks.text(name, "Plugin(name=)")
        if ports != ():
            self.ports = checks.texts(ports, "Plugin(ports=)")
        for hook, given in (
            ("transform", transform),
            ("around_app", around_app),
            ("around_client", around_client),
        ):
            if given is not None and not callable(given):
                raise ConfigError(f"Plugin({hook}=) must be a function, got {given!r}")
        self._transform = transform
        self._around_app = around_app
        self._around_client = around_client

    def transform(self, image: Image, cluster: ClusterSpec) -> Image:
        """Return the image the nodes need (on the client, before any environment is built)."""
        return self._transform(image, cluster) if self._transform else image

    def around_app(self, info: InstanceInfo) -> AbstractContextManager[Any] | None:
        """A context entered in every agent before the first call and exited at shutdown."""
        return self._around_app(info) if self._around_app else None

    def around_client(self, pool: ClientPool) -> AbstractContextManager[Any] | None:
        """A context entered on the client around the pool's life."""
        return self._around_client(pool) if self._around_client else None

    @property
    def rank_per_gpu(self) -> bool:
        """Whether the plugin's framework runs one process per GPU (PyTorch does): a pool that
        does not say ``processes_per_node`` then starts one rank for each GPU of a node."""
        return False

    def for_script(self) -> Plugin | None:
        """This plugin as a pool needs it when the script initializes its framework itself
        (``skyward run``, a detached run: the script calls ``init_process_group`` or
        ``jax.distributed.initialize()``): the same wheels, variables and ranks a node, but
        no runtime the agent would initialize first. None where every such pool has what
        the plugin gives already (the launchers' variables). By default the plugin itself."""
        return self

    def __repr__(self) -> str:
        return f"<skyward plugin {self.name!r}>"
