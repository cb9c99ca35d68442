"""A Slurm compute node as the remote machinery sees it: a `Host` whose commands are job steps.

Each command (the host check, the environment build, the agent) runs as
``srun --jobid=J --overlap --nodelist=NODE ...`` started through the login, so the compute nodes
need no sshd and the site's rules (cgroups, accounting) apply to all of it. A step's stdio is
srun's, so the agent's stream is the same pipe or SSH channel a Local or SSH node has.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex

from skyward.providers.remote.bootstrap import RemoteNode
from skyward.providers.remote.host import StreamedProcess
from skyward.providers.slurm import commands
from skyward.providers.slurm.login import Log, Login
from skyward.transport.base import AgentStream
from skyward.transport.sshhost import Completed


class StepHost:
    """One node of a job's allocation; its commands run as steps of the job."""

    def __init__(self, login: Login, job_id: str, name: str, address: str, cpus: int = 1) -> None:
        self.login = login
        self.job_id = job_id
        self.name = name
        self.address = address
        self.cpus = cpus  # the allocation's CPUs on this node: what the agent's step may use
        self.gres: str | None = None  # the GPUs the agent's step asks for

    def __str__(self) -> str:
        return f"{self.name} (job {self.job_id})"

    @property
    def closed(self) -> bool:
        return self.login.closed

    async def run(self, command: str, input: bytes = b"", log: Log | None = None) -> Completed:
        # With the node's GRES too: where the site confines devices (cgroups), a step that did
        # not ask for the GPUs would not see them, and the host check would find none.
        step = commands.step(self.job_id, self.name, command, gres=self.gres)
        return await self.login.run(step, input, log)

    async def close(self, last: str = "") -> None:
        # The login, shared by every node of the job, is the provider's to close.
        if last and not self.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.run(last), 30)

    def agent_step(self, command: str) -> str:
        """The agent's step: every CPU (and GPU) of the allocation on the node, and an
        environment without the step's SLURM_* world (the pool is the world)."""
        job, node = shlex.quote(self.job_id), shlex.quote(self.name)
        inner = (
            f"{commands.UNSET_STEP_VARIABLES}; export SKYWARD_SLURM_JOB_ID={job} "
            f"SKYWARD_SLURM_NODE={node}; {command}"
        )
        return commands.step(self.job_id, self.name, inner, self.cpus, self.gres)


class SlurmNode(RemoteNode):
    """A node of the pool: one node of the job's allocation."""

    def __init__(self, index: int, host: StepHost) -> None:
        super().__init__(index, host)
        self.step_host = host

    async def open_agent(self, command: str) -> AgentStream:
        return await self.step_host.login.open_agent(self.step_host.agent_step(command))

    async def start_process(self, command: str) -> StreamedProcess:
        """A step whose stdio the client streams over (a data tree's push or pull), started
        through the login: srun's pipes here, or an SSH channel to the login node."""
        return await self.step_host.login.start(
            commands.step(self.step_host.job_id, self.step_host.name, command)
        )
