"""A detached run on Slurm is a batch job: the pool builds the environment and stages the
script as for ``skyward run``, then ends; ``sbatch`` queues a job with the same request (the
command the provider makes: `Provider.batch_command`) whose batch script is the run's leader
(`skyward.worker.supervisor.lead_batch`). The job survives the login session, ``squeue``
shows it and ``scancel`` ends it.

The run's directory is in the cache this machine shares with the nodes (a shared home, with
the client on the login node), where the leader and the followers write and the client reads.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyward.cachedir import write_private
from skyward.calls import compute
from skyward.errors import ProvisionError
from skyward.pool import ComputePool
from skyward.worker import supervisor

BATCH_SCRIPT = "batch.sh"
BATCH_OUTPUT = "batch.out"


@dataclass(frozen=True)
class BatchJob:
    """What `submit` queues: the sbatch command line and the run's directory."""

    command: list[str]
    root: Path
    nodes: int
    per_node: int = 1  # ranks a node: a step each


def prepare(
    pool: ComputePool,
    name: str,
    target: Any,
    args: list[str],
    cwd: Any,
    restarts: int,
    grace: float,
    upload: str | None = None,
    per_node: int = 1,
) -> BatchJob:
    """While `pool` is up: write the run's plan and batch script into its directory. The
    provider makes the batch job's command first: it refuses a run it cannot hold before
    anything is written."""
    assert pool.cluster is not None, "the pool has started"
    root = supervisor.run_root(name)
    script = root / BATCH_SCRIPT
    command = pool.provider.batch_command(
        pool.cluster, pool.spec, name, str(script), str(root / BATCH_OUTPUT)
    )
    node = pool.run(compute(supervisor.node_environment)(target, cwd), node=0)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    plan = {
        "name": name,
        "env": node["env"],
        "python": node["python"],
        "argv": [node["script"], *args],
        "cwd": node["cwd"],
        "restarts": restarts,
        "grace": grace,
        "upload": upload,
        "per_node": per_node,
    }
    write_private(root / supervisor.SLURM_PLAN, json.dumps(plan))
    words = " ".join(_quote(w) for w in [*node["prefix"], "-m", supervisor.MODULE, "batch"])
    write_private(script, f"#!/bin/sh\nexec {words} {_quote(str(root))}\n")
    script.chmod(0o700)
    return BatchJob(command, root, pool.spec.nodes, per_node)


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


def submit(job: BatchJob) -> str:
    """Queue the job; its id."""
    done = subprocess.run(job.command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ProvisionError(f"sbatch refused the run: {done.stderr.strip() or done.stdout}")
    return done.stdout.strip().split(";")[0]


def directories(job: BatchJob) -> list[str]:
    """Each rank's directory, node-major (``node-<i>``, or ``node-<i>/rank-<r>``)."""
    per_node = job.per_node
    return [
        str(job.root / supervisor.rank_path(rank // per_node, rank, per_node))
        for rank in range(job.nodes * per_node)
    ]


def wait_started(job: BatchJob, job_id: str, say: Any) -> supervisor.RunState:
    """Wait until every rank of the job has started (the job may pend first: its reason is
    said once per change) or the run has ended; the run's state then."""
    head = Path(directories(job)[0])
    told = ""
    while True:
        state = supervisor.read_json(head / supervisor.RUN_STATE)
        if state.get("state") in ("running", *supervisor.FINAL):
            return state  # type: ignore[return-value]
        queued = job_state(job_id)
        if queued is None:
            state = supervisor.read_json(head / supervisor.RUN_STATE)
            if state.get("state") in ("running", *supervisor.FINAL):
                return state  # type: ignore[return-value]
            output = job.root / BATCH_OUTPUT
            tail = output.read_text(errors="replace").strip()[-500:] if output.exists() else ""
            return {"state": "failed", "reason": f"job {job_id} ended before its ranks: {tail}"}
        if queued != told:
            say(f"job {job_id}: {queued}")
            told = queued
        time.sleep(0.2)


def job_state(job_id: str) -> str | None:
    """``PENDING (Resources)``, ``RUNNING``...: the job as squeue shows it, or None once it is
    no longer queued."""
    done = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True, timeout=30
    )
    line = done.stdout.strip()
    if done.returncode != 0 or not line:
        return None
    state, _, reason = line.partition(" ")
    return f"{state} ({reason})" if state == "PENDING" and reason else state
