"""The agent: one per node, it runs the client's calls and answers over one byte stream.

The stream is the agent's inherited stdin/stdout. At start the agent moves it to private file
descriptors and points fds 1 and 2 at the node's output stream (the process's stderr), so
nothing a user's code prints, from Python, C or a subprocess, can corrupt a frame; and because
that output never passes through the agent's own memory, its last lines survive a hard kill.

Threads: the main thread runs calls one at a time in arrival order (user code often expects the
main thread); a reader thread takes frames off the stream; a heartbeat thread tells the client
the node is alive while a long call runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pickle
import platform
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from skyward import info as info_module
from skyward.errors import SerializationError
from skyward.transport import frames

HEARTBEAT_SECONDS = 2.0
# After the client disappears, how long a graceful exit (plugin hooks unwinding) may take.
ORPHAN_GRACE_SECONDS = 3.0

_Call = tuple[int, Callable[..., Any] | None, bytes]


class Agent:
    """The agent's state: the stream, the function cache and the call queue."""

    def __init__(self, channel: frames.SyncChannel) -> None:
        self._channel = channel
        self._write_lock = threading.Lock()
        self._functions: dict[int, Callable[..., Any]] = {}
        self._calls: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._cancelled: set[int] = set()

    def send(self, meta: frames.Meta, payload: bytes = b"") -> None:
        with self._write_lock:
            self._channel.write(meta, payload)

    def run(self) -> int:
        version = _skyward_version()
        self.send(
            (
                frames.STARTED,
                os.getpid(),
                socket.gethostname(),
                _free_port(),
                platform.python_version(),
                version,
            )
        )
        hello = self._channel.read()
        if hello is None:
            return 0
        (kind, instance, env), payload = hello[0][:3], hello[1]
        if kind != frames.HELLO:
            raise frames.FrameError(f"expected HELLO, got message kind {kind}")
        os.environ.update(env)
        info_module.set_current(instance)
        with contextlib.ExitStack() as hooks:
            if not self._enter_plugins(hooks, pickle.loads(payload), instance):
                return 3
            self.send((frames.READY,))
            threading.Thread(target=self._read_loop, name="skyward-reader", daemon=True).start()
            threading.Thread(target=self._heartbeat, name="skyward-heartbeat", daemon=True).start()
            self._call_loop()
        return 0

    def _enter_plugins(
        self, hooks: contextlib.ExitStack, plugins: list[Any], instance: info_module.InstanceInfo
    ) -> bool:
        for plugin in plugins:
            name = getattr(plugin, "name", type(plugin).__name__)
            self.send((frames.PROGRESS, name, "around_app"))
            try:
                manager = plugin.around_app(instance)
                if manager is not None:
                    hooks.enter_context(manager)
            except BaseException as exc:
                self.send(
                    (
                        frames.HOOK_FAILED,
                        name,
                        "around_app",
                        _type_name(exc),
                        str(exc),
                        traceback.format_exc(),
                    ),
                    _try_pickle(exc),
                )
                return False
        return True

    def _call_loop(self) -> None:
        while (item := self._calls.get()) is not None:
            call_id, fn_id, fn_bytes, payload = item
            if call_id in self._cancelled:
                self._cancelled.discard(call_id)
                continue
            self._run_call(call_id, fn_id, fn_bytes, payload)

    def _run_call(self, call_id: int, fn_id: int, fn_bytes: bytes | None, payload: bytes) -> None:
        try:
            fn = self._functions.get(fn_id)
            if fn is None:
                if fn_bytes is None:
                    raise RuntimeError(f"function {fn_id} was never sent to this node")
                fn = self._functions[fn_id] = pickle.loads(fn_bytes)
            args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
        except BaseException as exc:
            tb = traceback.format_exc()
            # sys.exit() or KeyboardInterrupt in the user's code fails that call only; the agent
            # keeps serving.
            self.send((frames.RAISED, call_id, _type_name(exc), str(exc), tb), _try_pickle(exc))
            return
        try:
            blob = _dumps(value)
        except Exception as exc:
            error = SerializationError(
                f"the return value ({type(value).__name__}) could not be pickled for the trip "
                f"back to the client: {exc}; return plain data (numbers, arrays, dicts) instead"
            )
            self.send(
                (frames.RAISED, call_id, _type_name(error), str(error), traceback.format_exc()),
                _try_pickle(error),
            )
            return
        self.send((frames.RESULT, call_id), blob)

    def _read_loop(self) -> None:
        try:
            while (frame := self._channel.read()) is not None:
                meta, payload = frame
                kind = meta[0]
                if kind == frames.CALL:
                    self._calls.put((meta[1], meta[2], meta[3], payload))
                elif kind == frames.CANCEL:
                    self._cancelled.add(meta[1])
                elif kind == frames.SHUTDOWN:
                    self._calls.put(None)
                    return
        except Exception:
            traceback.print_exc()
        # The client is gone: never wait for it. Unwind gracefully if the main thread is idle,
        # and cut everything down if it is stuck in a call.
        self._calls.put(None)
        time.sleep(ORPHAN_GRACE_SECONDS)
        _exit_hard(1)

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            try:
                self.send((frames.HEARTBEAT,))
            except OSError:
                return


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__name__


def _dumps(value: Any) -> bytes:
    """Pickle a result: the standard pickler first (several times faster on plain data), then
    cloudpickle for what only it can carry (lambdas, classes defined inside the function)."""
    try:
        return pickle.dumps(value, frames.PROTOCOL)
    except Exception:
        blob: bytes = cloudpickle.dumps(value, frames.PROTOCOL)
        return blob


def _try_pickle(exc: BaseException) -> bytes:
    try:
        blob: bytes = cloudpickle.dumps(exc, frames.PROTOCOL)
        return blob
    except Exception:
        return b""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _skyward_version() -> str:
    from skyward import __version__

    return __version__


def _exit_hard(status: int) -> None:
    """Exit now, taking down any process the user's code started in this agent's group."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if os.getpgrp() == os.getpid():
        # Spare this thread the SIGTERM sent to the group (signal.signal works only in the main
        # thread, and this may be the reader thread finding the client gone).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        with contextlib.suppress(ProcessLookupError):
            os.killpg(0, signal.SIGTERM)
    os._exit(status)


def _take_over_stdio() -> frames.SyncChannel:
    """Move the control stream off fds 0/1 and send fd 1 to the output stream (fd 2)."""
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    for fd in (ctl_in, ctl_out):
        # Bigger pipes mean fewer wake-ups for large arguments and results (best effort:
        # Linux pipes only; an SSH channel's descriptors may be sockets).
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True
    )
    return frames.SyncChannel(ctl_in, ctl_out)


def main() -> None:
    """Run the agent on this process's stdin/stdout."""
    channel = _take_over_stdio()
    signal.signal(signal.SIGTERM, lambda *_: _exit_hard(143))
    try:
        status = Agent(channel).run()
    except BaseException:
        traceback.print_exc()
        status = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
