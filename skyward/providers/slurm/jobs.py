"""The pools' jobs in the queue: what `skyward ls/down --provider slurm` and `skyward status`
list and cancel. A pool's job is named ``skyward-<pool id>`` (and commented ``skyward pool <pool
id>``), so what a crashed client left is found by name, among this user's jobs only."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from datetime import UTC, datetime

from skyward.errors import ProvisionError
from skyward.providers.slurm.login import Login

JOB_PREFIX = "skyward-"
_FIELDS = "%i|%j|%T|%V|%u|%N"  # id, name, state, submit time, user, nodes


@dataclass(frozen=True)
class Job:
    """One of a pool's allocations as `squeue` shows it."""

    job_id: str
    state: str
    nodes: str


@dataclass(frozen=True)
class PoolJob:
    """A pool's jobs (its allocation, and one more per replaced node)."""

    pool_id: str
    jobs: tuple[Job, ...]
    created_at: datetime | None
    created_by: str | None

    def describe(self) -> list[str]:
        return [
            f"job {job.job_id} {job.state.lower()} on {job.nodes or '(no nodes yet)'}"
            for job in self.jobs
        ]


def parse_queue(text: str) -> dict[str, PoolJob]:
    """The pools' jobs among ``squeue -o '%i|%j|%T|%V|%u|%N'`` lines, by pool id."""
    found: dict[str, PoolJob] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6 or not fields[1].startswith(JOB_PREFIX):
            continue
        job_id, name, state, submitted, user, nodes = fields
        try:
            created: datetime | None = datetime.fromisoformat(submitted).replace(tzinfo=UTC)
        except ValueError:
            created = None
        pool = name[len(JOB_PREFIX) :]
        job = Job(job_id, state, nodes)
        if pool in found:
            first = found[pool]
            found[pool] = PoolJob(pool, (*first.jobs, job), first.created_at, first.created_by)
        else:
            found[pool] = PoolJob(pool, (job,), created, user)
    return found


async def find(login: Login) -> dict[str, PoolJob]:
    """This user's pools' jobs, by pool id."""
    command = f'squeue -h -u "$(id -un)" -o {shlex.quote(_FIELDS)}'
    done = await login.run(command)
    if done.status != 0:
        raise ProvisionError(f"squeue failed on {login} (exit status {done.status}): {done.tail}")
    return parse_queue(done.stdout.decode(errors="replace"))


async def cancel(login: Login, pool: str | None) -> list[str]:
    """Cancel the job of `pool` (every pool's with None); what was cancelled, in words."""
    jobs = await find(login)
    chosen = [job for job in jobs.values() if pool is None or job.pool_id == pool]
    if not chosen:
        return []
    ids = " ".join(shlex.quote(job.job_id) for pool_job in chosen for job in pool_job.jobs)
    done = await login.run(f"scancel {ids}")
    if done.status != 0:
        raise ProvisionError(f"scancel {ids} failed (exit status {done.status}): {done.tail}")
    return [f"job {job.job_id} of pool {p.pool_id}" for p in chosen for job in p.jobs]
