"""The agent: one per node, it runs the client's calls and answers over one byte stream.

The stream is the agent's inherited stdin/stdout. At start the agent moves it to private file
descriptors and points fds 1 and 2 at the node's output stream (the process's stderr), so
nothing a user's code prints, from Python, C or a subprocess, can corrupt a frame; and because
that output never passes through the agent's own memory, its last lines survive a hard kill.

Threads: the main thread reads frames and runs each call as it arrives (user code often expects
the main thread, and no hand-off between threads stands between a call and its result); a
watcher thread sends heartbeats while a long call runs and notices when the client is gone; a
sender thread (`reports.Outbox`) sends what the calls give `sky.report`, so a call never waits
on the wire to report.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import io
import os
import pickle
import platform
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from skyward import info as info_module
from skyward import preemption, reports
from skyward.cachedir import keep_private
from skyward.errors import PluginError, SerializationError
from skyward.transport import frames, messages
from skyward.transport.agentwire import LINGER_ENV, AgentWire
from skyward.version import __version__
from skyward.worker import hookrunner, notices

HEARTBEAT_SECONDS = 2.0
# After the client disappears, how long a graceful exit (plugin hooks unwinding) may take.
ORPHAN_GRACE_SECONDS = 3.0

M = TypeVar("M", messages.Open, messages.Hello)


class Agent:
    """The agent's state: the stream and the function cache."""

    def __init__(self, wire: AgentWire) -> None:
        self._wire = wire
        self.functions: dict[int, Callable[..., Any]] = {}
        self._linger = _linger_seconds()
        self.reports = reports.Outbox(lambda entries: self.send(messages.Reported(entries)))

    def send(self, message: messages.Message, segments: frames.Segments = ()) -> None:
        self._wire.send(message, segments)

    def run(self) -> int:
        first = self._expect(messages.Open)
        if first is None:
            return 0
        opened, _ = first
        self.send(
            messages.Started(
                os.getpid(),
                socket.gethostname(),
                platform.python_version(),
                __version__,
                _free_ports(opened.port_names),
            )
        )
        second = self._expect(messages.Hello)
        if second is None:
            return 0
        hello, plugins = second
        info_module.set_current(hello.info)
        stacks = _dump_stacks_on_sigusr2()
        signal.signal(signal.SIGUSR1, self._preemption_signal)
        watch = os.environ.get(notices.NOTICES_ENV, "")
        if watch:  # the provider's preemption notice, watched on the node
            threading.Thread(
                target=notices.watcher(watch),
                args=(self._preempted,),
                name="skyward-notices",
                daemon=True,
            ).start()
        watcher = threading.Thread(
            target=self._watch,
            args=(hello.silence_timeout, stacks),
            name="skyward-watcher",
            daemon=True,
        )
        watcher.start()
        reports.install(self.reports.put)
        self.reports.start()
        with contextlib.ExitStack() as stack:
            if not self._enter_plugins(stack, frames.loads(plugins), hello.info):
                return 3
            self.send(messages.Ready())
            # the watcher reads ahead only when the client pings (see `_watch`)
            self._wire.serve(self, _not_shutdown, self._linger, hello.silence_timeout > 0)
        with contextlib.suppress(OSError):  # what the plugins reported while unwinding
            self.reports.flush()
        return 0

    def _expect(self, kind: type[M]) -> tuple[M, list[bytes]] | None:
        """The next message, which must be a `kind`, and its segments; None if the client went
        away first."""
        frame = self._wire.read()
        if frame is None:
            return None
        message, segments = frame
        if not isinstance(message, kind):
            raise frames.FrameError(f"expected {kind.__name__}, got {type(message).__name__}")
        return message, segments

    def _enter_plugins(
        self, stack: contextlib.ExitStack, plugins: list[Any], info: info_module.InstanceInfo
    ) -> bool:
        current = ["?"]

        def progress(name: str) -> None:
            current[0] = name
            self.send(messages.HookStarted(name, "around_app"))

        try:
            hookrunner.enter_hooks(
                stack,
                plugins,
                "around_app",
                lambda plugin: plugin.around_app(info),
                node=info.node,
                before=progress,
            )
        except BaseException as exc:
            # The plugin's own exception is what the client shows, with its own traceback.
            cause = exc.__cause__ if isinstance(exc, PluginError) and exc.__cause__ else exc
            failed = messages.HookFailed(current[0], "around_app", _report(cause))
            self.send(failed, frames.try_dumps(cause))
            return False
        return True

    # -- what AgentWire.serve needs of the agent (a `CallHost`) --

    def load_function(self, fn_id: int, fn_bytes: bytes | None) -> Callable[..., Any]:
        if fn_bytes is None:
            raise RuntimeError(f"function {fn_id} was never sent to this node")
        fn: Callable[..., Any] = pickle.loads(fn_bytes)
        self.functions[fn_id] = fn
        return fn

    def dump_result(self, call_id: int, value: Any) -> frames.Segments | None:
        try:
            return frames.fast_dumps(value)
        except Exception as exc:
            error = SerializationError(
                f"the return value ({type(value).__name__}) could not be pickled for the trip "
                f"back to the client: {exc}; return plain data (numbers, arrays, dicts) instead"
            )
            # the pickler's own traceback says what in the value could not travel
            self.fail_call(call_id, error, traceback.format_exc())
            return None

    def _preemption_signal(self, signum: int, frame: object) -> None:
        """SIGUSR1: a preemption notice (Slurm's ``--signal=USR1@...``, ``scancel --signal``).
        Handled in a thread: this handler runs on the main thread between two bytecodes, maybe
        in the middle of writing a frame, which a message of ours must not cut into."""
        threading.Thread(
            target=self._preempted, args=("SIGUSR1",), name="skyward-preempted", daemon=True
        ).start()

    def _preempted(self, source: str, seconds_left: float | None = None) -> None:
        """Record the notice (`sky.preempting()`, the callbacks) and tell the client."""
        notice = preemption.notice(source, seconds_left)
        if notice is not None:
            with contextlib.suppress(OSError):
                self.send(messages.Preempting(source, notice.seconds_left))

    def fail_call(self, call_id: int, exc: BaseException, tb: str | None = None) -> None:
        self.reports.flush()
        self.send(messages.Raised(call_id, _report(exc, tb)), frames.try_dumps(exc))

    def _watch(self, silence_timeout: float, stacks: int) -> None:
        """Heartbeats while calls run; the threads' stacks when they are asked for; and a hard
        exit when the client has gone away.

        The client's end closing shows as POLLHUP on the control input without reading from it,
        so this works while the main thread is stuck in a call. An idle main thread sees the end
        of the stream itself and unwinds the plugins; this thread gives it a grace period.

        A client cut off by the network closes nothing: with `silence_timeout`, the client
        pings, and this thread takes what arrived while the main thread runs a call
        (`read_ahead`, which sends heartbeats while a frame is slow to come); no word for that
        long and the agent stops. Every chunk of input is word, in the middle of a frame too
        (`AgentWire.last_input`): a large argument over a slow link is the client speaking.
        A heartbeat is skipped while another frame is being written (`AgentWire.heartbeat`):
        its bytes are word from the node, and this thread goes on listening meanwhile.

        `stacks` is the pipe faulthandler writes every thread's stack to on SIGUSR2 (from the
        signal handler, in C: it works while the main thread is stuck); this thread sends it.
        """
        calls_thread = threading.main_thread().ident  # `run` serves the calls on it
        poller = select.poll()
        poller.register(self._wire.fileno_in, 0)  # 0: only hang-ups and errors wake us
        poller.register(stacks, select.POLLIN)
        while True:
            ready = poller.poll(HEARTBEAT_SECONDS * 1000)
            if any(fd == stacks for fd, _ in ready):
                try:
                    dump = _read_dump(stacks)
                    self.send(messages.Stacks(dump, _thread_in(dump, calls_thread)))
                except OSError:
                    break
            if any(fd != stacks for fd, _ in ready):
                break
            if ready:
                continue
            if silence_timeout > 0:
                try:
                    self._wire.read_ahead(_not_a_ping, HEARTBEAT_SECONDS)
                except (OSError, frames.FrameError):  # the stream broke: the client is gone
                    break
                quiet = time.monotonic() - self._wire.last_input
                if quiet > silence_timeout:
                    print(
                        f"[skyward] no word from the client for {quiet:.0f} s (more than its "
                        f"heartbeat_timeout of {silence_timeout:g} s): it is gone or cut off, "
                        "so this agent stops",
                        file=sys.stderr,
                        flush=True,
                    )
                    break
            try:
                self._wire.heartbeat()
            except OSError:
                break
        time.sleep(ORPHAN_GRACE_SECONDS)
        _exit_hard(1)


def _dump_stacks_on_sigusr2() -> int:
    """Have faulthandler write every thread's stack to a pipe on SIGUSR2; the pipe's read end
    (SIGUSR1 stays free: Slurm sites and submitit use it for a preemption notice).
    Its write end does not block: a dump larger than the pipe is cut short, rather than the
    signal handler waiting on a reader that may need the thread it interrupted."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    faulthandler.register(signal.SIGUSR2, file=os.fdopen(write, "w"), all_threads=True)
    return read


def _thread_in(dump: str, ident: int | None) -> str:
    """Thread `ident`'s part of a faulthandler dump (a header line with its id in hex, then its
    frames, a blank line between threads); the whole dump if it is not there (cut short)."""
    for block in dump.split("\n\n"):
        header = block.lstrip("\n").partition("\n")[0]
        if " 0x" in header and int(header.split(" 0x")[1].split()[0], 16) == ident:
            return block.strip("\n")
    return dump


def _read_dump(fd: int) -> str:
    """What faulthandler wrote to `fd`: read until it has been quiet for a moment (it writes a
    line at a time)."""
    chunks = []
    while select.select([fd], [], [], 0.05)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _not_shutdown(message: messages.Message, segments: list[bytes]) -> bool:
    return type(message) is not messages.Shutdown


def _not_a_ping(message: messages.Message) -> bool:
    return not isinstance(message, messages.Ping)


def _linger_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(LINGER_ENV, "0")) / 1e6)
    except ValueError:
        return 0.0


def _report(exc: BaseException, tb: str | None = None) -> messages.ErrorReport:
    """`exc` in words, with its own traceback unless `tb` is given."""
    cls = type(exc)
    name = f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__name__
    text = tb if tb is not None else "".join(traceback.format_exception(exc))
    return messages.ErrorReport(name, str(exc), text)


def _free_ports(names: tuple[str, ...]) -> dict[str, int]:
    """A distinct free port for each name (all held open while choosing, so none repeats)."""
    with contextlib.ExitStack() as stack:
        ports = {}
        for name in names:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("", 0))
            ports[name] = int(sock.getsockname()[1])
        return ports


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


def _take_over_stdio() -> AgentWire:
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
    return AgentWire(ctl_in, ctl_out)


def main() -> None:
    """Run the agent on this process's stdin/stdout."""
    keep_private()
    wire = _take_over_stdio()
    signal.signal(signal.SIGTERM, lambda *_: _exit_hard(143))
    try:
        status = Agent(wire).run()
    except BaseException:
        traceback.print_exc()
        status = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
