"""Make a bare ``jax.distributed.initialize()`` read ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

JAX reads only ``JAX_COORDINATOR_ADDRESS`` from the environment by itself; the process count and
id come from a cluster environment it detects (SLURM, MPI, ...). Registering one for skyward lets
launcher-style scripts call ``initialize()`` with no arguments. The registration waits until the
script imports JAX (importing it first would read JAX's environment before the script sets it),
and the hook is JAX-internal: without it, such scripts must pass the variables themselves.

``initialize`` also knocks on the coordinator first, on every process but the first: a process
that dials the coordinator before it listens is refused, and gRPC then waits about a second
before it tries again, which is most of a start-up where processes import JAX at slightly
different speeds. The knock checks that the coordinator answers (gRPC's HTTP/2 greeting), not
just that something listens. The arguments and the outcome are JAX's own.

Where a node holds several ranks, each rank's share of the node's GPUs travels in
``SKYWARD_JAX_LOCAL_DEVICES`` and a bare ``initialize()`` passes it as ``local_device_ids``.

`bind_coordinator` makes node 0's coordinator listen only where the other nodes dial it, for
the JAX plugin and for Keras when it initializes ``jax.distributed`` itself.

Runs on the nodes: standard library only.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_taught = False

# The GPUs of its node a rank's JAX uses where the node holds several ranks ("0,1"): a bare
# ``initialize()`` passes them as ``local_device_ids``, as the JAX plugin does.
LOCAL_DEVICES_ENV = "SKYWARD_JAX_LOCAL_DEVICES"


def teach_jax() -> None:
    """Register skyward's JAX cluster environment now (imports JAX)."""
    global _taught
    if _taught:
        return
    try:
        from jax._src import clusters
    except ImportError:
        return

    class SkywardCluster(clusters.ClusterEnv):  # registers itself on subclassing
        name = "skyward"

        @classmethod
        def is_env_present(cls) -> bool:
            return "JAX_NUM_PROCESSES" in os.environ and "JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(
            cls, timeout_secs: int | None, override_coordinator_port: str | None = None
        ) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["JAX_PROCESS_ID"])

    _taught = SkywardCluster is not None
    _knock_first()


def _knock_first() -> None:
    """Wrap ``jax.distributed.initialize`` so a process other than the first waits until the
    coordinator accepts connections before it dials it."""
    import jax.distributed as distributed

    real = distributed.initialize

    @functools.wraps(real)
    def initialize(
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
        rank = process_id if process_id is not None else os.environ.get("JAX_PROCESS_ID")
        if address and rank not in (None, 0, "0"):
            wait_for_listener(address, float(kwargs.get("initialization_timeout", 300)))
        shared = os.environ.get(LOCAL_DEVICES_ENV)
        if shared and not args and kwargs.get("local_device_ids") is None:
            kwargs["local_device_ids"] = [int(index) for index in shared.split(",")]
        return real(coordinator_address, num_processes, process_id, *args, **kwargs)

    distributed.initialize = initialize


# An HTTP/2 client's first bytes: the connection preface and an empty SETTINGS frame. JAX's
# coordinator is a gRPC server, which answers with a SETTINGS frame of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def bind_coordinator(address: str) -> None:
    """Make a ``jax.distributed.initialize`` on node 0 that is not told where to listen
    (JAX's own, Keras's) serve its coordinator at `address` (``host:port``) only."""
    # JAX's default is [::], every interface: anyone else on the pool's network could end its
    # tasks or read and write the key-value store NCCL bootstraps from. JAX reads this variable
    # when initialize() is given no coordinator_bind_address.
    os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = address


def wait_for_listener(address: str, timeout: float) -> None:
    """Return once the JAX coordinator answers at ``host:port``, or `timeout` seconds have
    passed with nothing there (JAX then says what is wrong). Something else listening there the
    whole time (the port freed for the coordinator taken by another program) is an error: a
    process must not hand its rank and data to a stranger's server."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # JAX will say what is wrong with it
    deadline = time.monotonic() + timeout
    # Judged on every look, not the last: a coordinator that came up late and, on a loaded
    # node, answered slower than a look waits, reads as "something else" at the end; only a
    # stranger is there at every look (nothing listening at any look: JAX decides).
    stranger = nothing = False
    while time.monotonic() < deadline:
        answer = _coordinator_answers(host.strip("[]"), int(port))
        if answer:
            return
        stranger |= answer is False
        nothing |= answer is None
        time.sleep(0.02)
    if stranger and not nothing:
        raise RuntimeError(
            f"something listens at {address}, the pool's JAX coordinator address, but it is not "
            f"a JAX coordinator (it does not answer gRPC's HTTP/2 greeting): another program "
            f"took the port node 0 chose. Restart the pool (a new port is chosen), and look "
            f"for what listens there on node 0"
        )


def _coordinator_answers(host: str, port: int) -> bool | None:
    """True when ``host:port`` answers as an HTTP/2 (gRPC) server, None when nothing listens,
    False when something else does."""
    try:
        sock = socket.create_connection((host, port), timeout=1.0)
    except OSError:
        return None
    head = b""
    with sock:
        try:
            sock.sendall(_HTTP2_HELLO)
            while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
                head += chunk
        except OSError:
            return False
    # A frame header: length (3 bytes), type, flags, stream 0 (4 bytes).
    return len(head) == 9 and head[3] == _SETTINGS and head[5:] == bytes(4)


def teach_jax_when_imported() -> None:
    """`teach_jax` as soon as JAX is imported (at once if it already is)."""
    if "jax" in sys.modules:
        teach_jax()
    elif not any(isinstance(f, _AfterJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterJaxImport())


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Finds ``jax`` through the other finders and registers the cluster once it is loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            teach_jax()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
