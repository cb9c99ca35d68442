"""The frame codec and the messages of the client <-> agent wire.

A frame is a 12-byte header (``!IQ``: metadata length, payload length), a small pickled
metadata tuple whose first item is the message kind, and a raw payload. Large objects (call
arguments, results) travel in the payload, which is written and read as it is, never pickled a
second time: a broadcast writes the same payload bytes to every node.

This module is shared by the client and the worker agent, so it imports only the standard library.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any, BinaryIO, Protocol

HEADER = struct.Struct("!IQ")
PROTOCOL = 5

# client -> agent
HELLO = 1  # (HELLO, InstanceInfo, env: dict[str, str]); payload: pickled plugins
CALL = 2  # (CALL, call_id, fn_id, fn_bytes | None); payload: pickled (args, kwargs)
CANCEL = 3  # (CANCEL, call_id)
SHUTDOWN = 4  # (SHUTDOWN,)

# agent -> client
STARTED = 10  # (STARTED, pid, hostname, free_port, python_version, skyward_version)
PROGRESS = 11  # (PROGRESS, plugin_name, hook)
READY = 12  # (READY,)
HOOK_FAILED = 13  # (HOOK_FAILED, plugin, hook, type_name, message, traceback); payload: exc
RESULT = 14  # (RESULT, call_id); payload: pickled value
RAISED = 15  # (RAISED, call_id, type_name, message, traceback); payload: pickled exc or b""
HEARTBEAT = 16  # (HEARTBEAT,)

Meta = tuple[Any, ...]

_COALESCE_LIMIT = 1 << 16


class FrameError(Exception):
    """The byte stream does not hold a valid frame (truncated, or not a skyward agent)."""


def encode(meta: Meta, payload: bytes | memoryview = b"") -> tuple[bytes, bytes | memoryview]:
    """Return the two byte strings to write for one frame: header + metadata, then payload."""
    blob = pickle.dumps(meta, PROTOCOL)
    return HEADER.pack(len(blob), len(payload)) + blob, payload


class AsyncReader(Protocol):
    """What `read_frame` needs from a stream: asyncio's StreamReader and asyncssh's SSHReader."""

    async def readexactly(self, n: int) -> bytes: ...


async def read_frame(reader: AsyncReader) -> tuple[Meta, bytes]:
    """Read one frame from an asyncio-style reader (raises `asyncio.IncompleteReadError` at EOF)."""
    meta_len, payload_len = HEADER.unpack(await reader.readexactly(HEADER.size))
    meta = pickle.loads(await reader.readexactly(meta_len))
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return meta, payload


class SyncChannel:
    """Blocking frame I/O over two file descriptors (the agent's side of the stream)."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self._in: BinaryIO = os.fdopen(fd_in, "rb", buffering=1 << 16)
        self._out_fd = fd_out

    def read(self) -> tuple[Meta, bytes] | None:
        """Read one frame; None when the stream has closed."""
        header = self._in.read(HEADER.size)
        if len(header) < HEADER.size:
            if header:
                raise FrameError("stream closed in the middle of a frame header")
            return None
        meta_len, payload_len = HEADER.unpack(header)
        meta_bytes = self._in.read(meta_len)
        payload = self._in.read(payload_len) if payload_len else b""
        if len(meta_bytes) < meta_len or len(payload) < payload_len:
            raise FrameError("stream closed in the middle of a frame")
        return pickle.loads(meta_bytes), payload

    def write(self, meta: Meta, payload: bytes | memoryview = b"") -> None:
        """Write one frame. Not thread-safe: callers serialize writes."""
        head, body = encode(meta, payload)
        if len(body) < _COALESCE_LIMIT:
            # one write for small frames: a syscall costs more than copying a few kilobytes
            _write_all(self._out_fd, head + body)
        else:
            _write_all(self._out_fd, head)
            _write_all(self._out_fd, body)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
