"""How a node's failures read on the client: exit statuses in words, a node's exception rebuilt
as itself, and reports of where the other nodes were when one failed or the pool got stuck.

Plain functions over values and sessions (`NodeState`: what they read of a `NodeSession`);
nothing here changes a session.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable, Sequence
from typing import Protocol

from skyward.client import sources
from skyward.errors import RemoteError, WorkerError
from skyward.transport import frames, messages


class NodeState(Protocol):
    """What the reports read of a node's session (`skyward.client.session.NodeSession` is one)."""

    @property
    def node(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    @property
    def plugin(self) -> str | None: ...
    @property
    def where(self) -> str: ...
    @property
    def lines(self) -> Iterable[str]: ...


TAIL_LINES = 20
REPORT_LINES = 10


def describe_status(status: int | None) -> str:
    """Human words for an exit status (negative: the signal that killed it)."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    return f"exit status {status}"


def worker_error(
    what: str,
    node: int,
    status: int | None,
    where: str,
    lines: Sequence[str],
    name: str,
) -> WorkerError:
    """A `WorkerError` for node `node`, whose rank `name` (``node 1``, or ``node 1 rank 3``
    when it holds several) was `where` when `what` happened; its last output."""
    tail = tuple(list(lines)[-TAIL_LINES:])
    shown = "\n".join(f"    {line}" for line in tail) or "    (it printed nothing)"
    return WorkerError(
        f"{what} ({describe_status(status)}) while {where}.\nLast output of {name}:\n{shown}",
        node=node,
        exit_status=status,
        output_tail=tail,
    )


class RemoteTraceback(Exception):
    """Carries a node's traceback text as the `__cause__` of a re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def rebuild_exception(
    report: messages.ErrorReport, segments: list[frames.Buffer], node: int, name: str
) -> BaseException:
    """The exception of node `node`'s rank `name` (``node 1``, or ``node 1 rank 3``) as
    itself, with the remote traceback as its cause."""
    exc: BaseException
    text = sources.with_sources(report.traceback.rstrip())
    try:
        if not segments:
            raise ValueError("no pickled exception")
        exc = frames.loads(segments)
        if not isinstance(exc, Exception):
            # SystemExit or KeyboardInterrupt from a node must not end the client's program
            raise TypeError("not an ordinary exception")
    except Exception:
        exc = RemoteError(report.type_name, report.message, text, node=node)
    exc.__cause__ = RemoteTraceback(f'\n"""\nTraceback on {name}:\n{text}\n"""')
    with contextlib.suppress(Exception):
        exc.add_note(f"(raised on {name})")
    return exc


def laggards(failed: NodeState, sessions: Sequence[NodeState], plugin: str | None) -> list[str]:
    """Where the other nodes were when `failed` failed in `plugin`: often the real culprit."""
    lines = []
    for other in sessions:
        if other is failed or other.ready:
            continue
        if plugin is not None and other.plugin != plugin:
            lines.append(
                f"{other.name} never reached plugin {plugin!r}: it was "
                f"{other.where}; its last output:"
            )
        else:
            lines.append(f"{other.name} was {other.where}; its last output:")
        lines += _tail(other)
    return lines


def stuck_report(headline: str, sessions: Sequence[NodeState]) -> str:
    """Why the pool is not ready: every node that is not, where it is, its last output."""
    lines = [headline + ":"]
    for session in sessions:
        if not session.ready:
            lines.append(f"{session.name} is {session.where}; its last output:")
            lines += _tail(session)
    lines.append("Raise startup_timeout if the nodes only need more time.")
    return "\n".join(lines)


def _tail(session: NodeState) -> list[str]:
    return [f"    {line}" for line in list(session.lines)[-REPORT_LINES:]] or ["    (nothing)"]
