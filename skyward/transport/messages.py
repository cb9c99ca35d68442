"""The messages of the client <-> agent wire: one frozen dataclass each, and their codec.

A conversation with one agent::

    client                                  agent
    Open(port_names)            ->                          (written right after the agent starts)
                                <-  Started(pid, hostname, python, skyward, ports)
    Hello(info) + plugins       ->
                                <-  HookStarted(plugin, hook) (before each plugin's around_app)
                                <-  Ready()  or  HookFailed(plugin, hook, ...) + exception
    Call(call_id, fn_id, fn) + args ->
                                <-  Reported(entries)        (sky.report, while the call runs)
                                <-  Result(call_id) + value  or  Raised(call_id, error) + exception
                                <-  Heartbeat()              (every 2 s while the agent lives)
    Ping()                      ->                          (over SSH, while the agent lives)
    Shutdown()                  ->                          (the agent unwinds its plugins, exits)

On the wire a message is a tuple ``(kind, *fields)``, a frame's metadata: pickled, or packed
for a `Call` without its function's bytes and a `Result` (see `frames`); large payloads
(arguments, values, plugins, exceptions) travel as the frame's segments, never inside the
message. Shared by the client and the agent: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Open:
    """client -> agent, first: the names of the ports the plugins need on the head node."""

    KIND: ClassVar[int] = 0
    port_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Hello:
    """client -> agent: the node's identity; segments: the pickled plugins. With
    `silence_timeout`, the client pings the agent and the agent stops after that many seconds
    without a word from it (a client cut off by the network); 0: it never does."""

    KIND: ClassVar[int] = 1
    info: Any  # skyward.info.InstanceInfo (typed loosely: this module imports nothing of ours)
    silence_timeout: float = 0.0


@dataclass(frozen=True, slots=True)
class Call:
    """client -> agent: run a function; segments: pickled (args, kwargs) and their buffers.
    `fn_bytes` is None when the agent already has function `fn_id`."""

    KIND: ClassVar[int] = 2
    call_id: int
    fn_id: int
    fn_bytes: bytes | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """client -> agent: finish the calls already sent, unwind the plugins, exit."""

    KIND: ClassVar[int] = 4


@dataclass(frozen=True, slots=True)
class Ping:
    """client -> agent: still here (every third of `Hello.silence_timeout`)."""

    KIND: ClassVar[int] = 5


@dataclass(frozen=True, slots=True)
class Started:
    """agent -> client: the agent runs; `ports` maps each name in `Open` to a free port."""

    KIND: ClassVar[int] = 10
    pid: int
    hostname: str
    python_version: str
    skyward_version: str
    ports: dict[str, int]


@dataclass(frozen=True, slots=True)
class HookStarted:
    """agent -> client: entering `hook` of `plugin` (so a hang can be pinned on it)."""

    KIND: ClassVar[int] = 11
    plugin: str
    hook: str


@dataclass(frozen=True, slots=True)
class Ready:
    """agent -> client: every plugin's around_app is entered; calls may come."""

    KIND: ClassVar[int] = 12


@dataclass(frozen=True, slots=True)
class ErrorReport:
    """An exception raised on the node, in words: enough to show it if it cannot be unpickled."""

    type_name: str  # module.QualName, or the bare name of a builtin
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class HookFailed:
    """agent -> client: a plugin hook raised; segments: the pickled exception, if it pickles."""

    KIND: ClassVar[int] = 13
    plugin: str
    hook: str
    error: ErrorReport


@dataclass(frozen=True, slots=True)
class Result:
    """agent -> client: call `call_id` returned; segments: the pickled value and its buffers."""

    KIND: ClassVar[int] = 14
    call_id: int


@dataclass(frozen=True, slots=True)
class Raised:
    """agent -> client: call `call_id` raised; segments: the pickled exception, if it pickles."""

    KIND: ClassVar[int] = 15
    call_id: int
    error: ErrorReport


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """agent -> client: still alive (sent while calls run, too)."""

    KIND: ClassVar[int] = 16


@dataclass(frozen=True, slots=True)
class Reported:
    """agent -> client: what `sky.report` was given, oldest first, as ``(time, metrics,
    checkpoint)`` tuples; a call's reports come before its `Result` or `Raised`."""

    KIND: ClassVar[int] = 17
    entries: list[tuple[float, dict[str, Any], str | None]]


@dataclass(frozen=True, slots=True)
class Stacks:
    """agent -> client: the Python stack of every thread of the agent, as faulthandler writes
    it when the agent gets SIGUSR2 (it answers even while the main thread is stuck in C), and
    the part of it that is the thread that runs the calls (the stall watch compares it)."""

    KIND: ClassVar[int] = 18
    text: str
    calls: str


@dataclass(frozen=True, slots=True)
class Preempting:
    """agent -> client: the node got a preemption notice (`sky.preempting()`): from where, and
    the seconds left when the notice said."""

    KIND: ClassVar[int] = 19
    source: str
    seconds_left: float | None


Message = (
    Open
    | Hello
    | Call
    | Shutdown
    | Ping
    | Started
    | HookStarted
    | Ready
    | HookFailed
    | Result
    | Raised
    | Heartbeat
    | Reported
    | Stacks
    | Preempting
)

_TYPES: tuple[type[Any], ...] = (
    Open,
    Hello,
    Call,
    Shutdown,
    Ping,
    Started,
    HookStarted,
    Ready,
    HookFailed,
    Result,
    Raised,
    Heartbeat,
    Reported,
    Stacks,
    Preempting,
)


# Each message type's field names, in order, and each kind's type.
_FIELDS: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in _TYPES
}
_BY_KIND: dict[int, type[Any]] = {cls.KIND: cls for cls in _TYPES}


class MessageError(Exception):
    """A frame's metadata is not a message of this protocol (another program, or a version
    mismatch)."""


def to_wire(message: Message) -> tuple[Any, ...]:
    """The tuple that travels for `message`: its kind, then its fields in order."""
    return (message.KIND, *(getattr(message, name) for name in _FIELDS[type(message)]))


def from_wire(meta: Any) -> Message:
    """The message a frame's metadata tuple holds."""
    try:
        cls = _BY_KIND[meta[0]]
        names = _FIELDS[cls]
        if len(meta) != len(names) + 1:
            raise MessageError(f"{cls.__name__} has {len(names)} field(s), got {len(meta) - 1}")
        message: Message = cls(*meta[1:])
    except (KeyError, IndexError, TypeError) as exc:
        raise MessageError(f"not a skyward message: {str(meta)[:200]} ({exc})") from None
    return message
