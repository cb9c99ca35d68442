"""One node's ``python -m skyward.worker.treestore`` process, seen from the client.

A `Peer` is that process, started by its node (an SSH exec channel, or a Slurm job step whose
stdio is srun's pipes): what is written to it (counted), its replies (``!I`` length + JSON, the
wire of `skyward.worker.treestore`) with its errors raised as a `DataError` naming the node, and
its end. Its process group is its starter's (`SSHHost.start` adopts it), so closing that ends
it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from typing import Any

import asyncssh

from skyward.errors import DataError
from skyward.providers.remote.bootstrap import RemoteNode, module_command
from skyward.providers.remote.host import StreamedProcess

MODULE = "skyward.worker.treestore"
# The treestore wire's 4-byte fields: a reply's length, a chunk's, a pulled file's index.
U32 = struct.Struct("!I")


class Peer:
    """One node's treestore process, its replies, and what one transfer wrote to it."""

    def __init__(self, node: RemoteNode, proc: StreamedProcess, what: str, *args: str) -> None:
        self.node, self.proc, self.what, self.args = node, proc, what, args
        self.kept = False  # a push finished on this process: it is reused, and may have died
        self.reset()

    def reset(self) -> None:
        """Forget what the last transfer wrote and needed."""
        self.sent = 0
        self.files = 0
        self.need: set[str] = set()
        self.final: asyncio.Task[dict[str, Any]] | None = None

    @classmethod
    async def start(cls, node: RemoteNode, what: str, *args: str) -> Peer:
        """Start ``treestore *args`` on `node`; `what` names the transfer in errors."""
        return cls(node, await _launch(node, what, *args), what, *args)

    async def reopen(self) -> None:
        """Replace a broken process with a new one."""
        await self.close(abort=True)
        self.proc = await _launch(self.node, self.what, *self.args)
        self.kept = False
        self.reset()

    def error(self, message: str, path: str = "") -> DataError:
        """A `DataError` naming the transfer, the node and `path`."""
        where = f" ({path})" if path and path not in message else ""
        return DataError(
            f"{self.what} on node {self.node.index} ({self.node.host}) failed: {message}{where}",
            node=self.node.index,
            path=path,
        )

    def write(self, data: bytes) -> None:
        self.proc.process.stdin.write(data)
        self.sent += len(data)

    async def drain(self) -> None:
        await self.proc.process.stdin.drain()

    async def reply(self) -> dict[str, Any]:
        """The node's next message; its error (or a broken channel) as a `DataError`."""
        try:
            size = U32.unpack(await self.proc.process.stdout.readexactly(U32.size))[0]
            message: dict[str, Any] = json.loads(await self.proc.process.stdout.readexactly(size))
        except asyncio.IncompleteReadError:
            raise self.error(await self.ended()) from None
        except (OSError, asyncssh.Error) as exc:
            raise self.error(f"the connection broke ({exc})") from None
        if "error" in message:
            raise self.error(str(message["error"]), str(message.get("path") or ""))
        return message

    async def ended(self) -> str:
        """Why the node's process stopped talking: its stderr's last lines, its status."""
        with contextlib.suppress(Exception):
            tail = (await asyncio.wait_for(self.proc.process.stderr.read(), 5)).decode(
                errors="replace"
            )
            status = await asyncio.wait_for(self.proc.exit_status(), 5)
            lines = "\n".join(tail.strip().splitlines()[-10:])
            return f"the node's process ended (exit status {status})" + (
                f":\n{lines}" if lines else ""
            )
        return "the node's process ended"

    async def close(self, abort: bool = False) -> None:
        """End the input (before b"E": the node drops its temp dir) and wait for the exit."""
        with contextlib.suppress(Exception):
            self.proc.process.stdin.write_eof()
        if self.final is not None:
            self.final.cancel()
            with contextlib.suppress(BaseException):
                await self.final  # its error was raised already, or is moot now
        try:
            await asyncio.wait_for(self.proc.exit_status(), 10 if abort else 30)
        except TimeoutError:
            await self.proc.host.kill_groups([self.proc.pid])
        self.proc.host.groups.discard(self.proc.pid)


async def _launch(node: RemoteNode, what: str, *args: str) -> StreamedProcess:
    """Start the treestore module on the node, in a process group the host adopts."""
    if node.python is None:
        raise DataError(
            f"{what} on {node.host}: the node was not prepared (no interpreter yet)",
            node=node.index,
        )
    # -S: the module needs only the stdlib, and a re-push is mostly this process's start-up,
    # which site lengthens by every .pth file (benchmarks/bench_data.py).
    command = module_command(node.python, MODULE, *args, site=False)
    try:
        return await node.start_process(command)
    except (OSError, asyncssh.Error, TypeError) as exc:
        raise DataError(f"{what} on {node.host} failed: {exc}", node=node.index) from None
