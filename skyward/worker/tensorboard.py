"""`sky.report` metrics as TensorBoard event files, for ``tensorboard --logdir``.

Where there is a TensorBoard writer (tensorboardX's ``SummaryWriter``, else PyTorch's
``torch.utils.tensorboard``, which needs the ``tensorboard`` package), reports go to
``<directory>/tensorboard/<rank>/`` (``node-1``, or ``node-1-rank-3`` where nodes hold several
ranks): one TensorBoard run a rank, so its charts draw a line per rank as the dashboard's do.
Two places write them: a pool, on the client, under its local ``output_dir`` (its reports
arrive there); and a detached run's script, on its node, under its rank's ``sky.output_dir()``,
which comes back with the run's outputs (`install_for_script`). A metric's step is the report's
``step`` where it has a whole one, else the count of that rank's reports of it; its wall time
is the node's. Each writer writes out every `FLUSH_SECONDS`, and at the end.

The writer is imported at the first report: a pool or a script that reports nothing pays
nothing. Without a writer nothing is written. Runs on nodes: the standard library, `reports`,
and the writer where it is installed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from skyward.reports import Report

Writer = Any  # a SummaryWriter: add_scalar(tag, value, step, walltime), flush(), close()
FLUSH_SECONDS = 5


def writer_class() -> Callable[..., Writer] | None:
    """A TensorBoard SummaryWriter class, or None where none is installed."""
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter  # type: ignore[no-any-return]
    except ImportError:
        pass
    try:
        from torch.utils.tensorboard import SummaryWriter as TorchWriter

        return TorchWriter
    except ImportError:  # no torch, or torch without tensorboard
        return None


class TensorBoard:
    """The pool's TensorBoard writers, a rank each, made as reports come; thread-safe."""

    def __init__(self, outputs: str | None) -> None:
        local = outputs is not None and "://" not in outputs
        self.directory = os.path.join(outputs, "tensorboard") if local and outputs else None
        self._make: Callable[..., Writer] | None = None
        self._looked = False
        self._writers: dict[str, Writer] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def report(self, report: Report, ranks_per_node: int) -> None:
        if self.directory is None:
            return
        rank = report.global_rank
        name = f"node-{report.node}" if ranks_per_node == 1 else f"node-{report.node}-rank-{rank}"
        with self._lock:
            writer = self._writer(name)
            if writer is None:
                return
            given = report.metrics.get("step")
            for key, value in report.metrics.items():
                if key == "step" or type(value) not in (int, float):
                    continue  # a bool or a string is no scalar to chart
                count = self._counts.get((name, key), 0)
                self._counts[name, key] = count + 1
                step = given if type(given) is int else count
                writer.add_scalar(key, value, step, walltime=report.time)

    def _writer(self, name: str) -> Writer | None:
        if not self._looked:
            self._looked = True
            self._make = writer_class()
        if self._make is None or self.directory is None:
            return None
        if name not in self._writers:
            try:
                path = os.path.join(self.directory, name)
                self._writers[name] = self._make(path, flush_secs=FLUSH_SECONDS)
            except Exception as exc:  # a directory it cannot write: the pool goes on
                logging.getLogger("skyward").warning("no TensorBoard files for %s: %s", name, exc)
                self.directory = None
                return None
        return self._writers[name]

    def close(self) -> None:
        """Write out what every writer holds (at the pool's end)."""
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            try:
                writer.close()
            except Exception as exc:
                logging.getLogger("skyward").warning("a TensorBoard writer failed: %s", exc)


def install_for_script(rank: int, per_node: int) -> None:
    """In a detached run's script (`skyward.worker.script`): its reports, which go to its
    rank's ``reports.jsonl``, also go to TensorBoard files under its ``sky.output_dir()``
    (``SKYWARD_OUTPUT_DIR``), written out at the script's end too. Nothing where the script
    has no output directory or reports go elsewhere."""
    import atexit

    from skyward import reports

    output = os.environ.get("SKYWARD_OUTPUT_DIR")
    if not output or not os.environ.get(reports.REPORTS_FILE_ENV):
        return
    to_file = reports.script_sink()
    if to_file is None:
        return
    board = TensorBoard(output)
    node = rank // per_node

    def both(entry: reports.Entry) -> None:
        to_file(entry)
        at, metrics, checkpoint = entry
        report = Report(node, at, metrics, checkpoint, None if per_node == 1 else rank)
        board.report(report, per_node)

    reports.install(both)
    atexit.register(board.close)
