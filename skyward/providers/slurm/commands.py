"""The Slurm command lines a pool uses, and how their output is read.

Plain functions over strings, tested without a cluster. The commands and the output fields used
exist in Slurm 20.11 and later (``srun --overlap`` came in 20.11); the test cluster runs
Debian's 22.05.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.worker.gpus import ANY, gpu_name, name_matches

# The holding command's line, once the allocation is granted: the job id, the node list and the
# CPUs per node, as salloc hands them to the command it runs.
GRANTED = "SKYWARD-ALLOCATION"
_ANNOUNCE = f'echo "{GRANTED} $SLURM_JOB_ID $SLURM_JOB_NODELIST $SLURM_JOB_CPUS_PER_NODE"'


def holder(idle_seconds: int | None = None) -> str:
    """The command salloc runs on the login node for the pool's life: it prints the grant, then
    holds while its stdin stays open (the client's pipe, or its SSH channel). When the client
    ends, however it ends, that closes, the holder returns and salloc gives the nodes back.

    With `idle_seconds`, it also returns once no line has come for that long: the client writes
    one every few seconds, so a client that went silent without its connection closing (a
    laptop asleep, a network gone: sshd on the login node may not notice for hours) still ends
    the allocation. Only ``sleep`` and ``kill`` besides the shell: login nodes vary."""
    if idle_seconds is None:
        return f"{_ANNOUNCE}; exec cat >/dev/null"
    # Each line disarms the last timer and arms a new one, which ends the holder ($$) if it
    # fires first. A disarmed timer's `sleep` outlives it harmlessly, by at most idle_seconds:
    # its stdio is /dev/null, as an SSH channel stays open while any process holds its pipes
    # (the pool's end would wait for the sleep).
    return (
        f"{_ANNOUNCE}; while :; do (sleep {idle_seconds}; kill $$) </dev/null >/dev/null 2>&1 & "
        "timer=$!; IFS= read -r _ || { kill $timer 2>/dev/null; exit 0; }; "
        "kill $timer 2>/dev/null; done"
    )


# Every SLURM_* and SLURMD_* variable of the step but SLURM_CONF, unset before the agent
# starts: JAX (and other libraries) read them to guess the world size, and a step's world is
# one task. SLURM_CONF only says where the cluster's configuration is: user code that runs
# squeue or srun on a site that sets it needs it.
UNSET_STEP_VARIABLES = (
    "unset $(env | sed -n '/^SLURM_CONF=/d; s/^\\(SLURMD\\{0,1\\}_[A-Za-z0-9_]*\\)=.*/\\1/p')"
)

# Refusals that are the request's fault: the user fixes the settings, not the cluster.
_CONFIG_ERRORS = (
    "invalid partition",
    "invalid account",
    "invalid qos",
    "requested node configuration is not available",
    "requested time limit is invalid",
    "invalid generic resource",
    "invalid gres",
    "node count specification invalid",
)


@dataclass(frozen=True)
class Request:
    """What a pool asks Slurm for, in Slurm's words."""

    job_name: str
    comment: str
    nodes: int
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None
    gres: str | None = None
    options: tuple[str, ...] = ()
    idle_seconds: int | None = None  # the holder's (`holder`): with a client that writes lines

    def salloc(self) -> list[str]:
        """The ``salloc`` command line that holds the allocation for the pool's life."""
        # --no-kill: a node that fails leaves the job (by default Slurm ends the whole job,
        # and with it every survivor's step), so the pool can replace just that node.
        size, rest = self._settings()[:2], self._settings()[2:]
        args = ["salloc", *size, "--no-kill", *rest]
        return [*args, "/bin/sh", "-c", holder(self.idle_seconds)]

    def sbatch(self, script: str, output: str) -> list[str]:
        """The ``sbatch`` command line of a detached run: the same request as a batch job whose
        script is `script`, its own output to `output`. A lost node ends the job (Slurm's
        default): a detached run has no client to replace it."""
        return ["sbatch", "--parsable", *self._settings(), f"--output={output}", script]

    def _settings(self) -> list[str]:
        args = [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        args += [f"--job-name={self.job_name}", f"--comment={self.comment}"]
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--time", self.time_limit),
            ("--gres", self.gres),
        ):
            if value:
                args.append(f"{flag}={value}")
        return args + list(self.options)


def gres_for(accelerator: Accelerator | None, typed: bool = True) -> str | None:
    """``gpu:a100:4`` for ``A100:4`` (``gpu:4`` with `typed` False: a site without GPU types,
    and for ``GPU:4``, which any GPU serves)."""
    if accelerator is None or accelerator.name.lower() in {"cpu", "none"}:
        return None
    count = max(accelerator.count, 1)
    if not typed or accelerator.name.upper() == ANY:
        return f"gpu:{count}"
    return f"gpu:{accelerator.name.lower()}:{count}"


@dataclass(frozen=True)
class SiteGres:
    """A generic resource that nodes have, as ``sinfo -o %G`` lists it: ``gpu:a100:4``."""

    name: str
    type: str | None
    count: int

    def __str__(self) -> str:
        return ":".join([self.name, *([self.type] if self.type else []), str(self.count)])


# One entry of a GRES list: ``gpu:a100:4`` and what may follow it in parentheses, the sockets
# its devices sit on (``(S:0-1)``, ``(S:0,2)``: a comma there does not end the entry).
_GRES_ENTRY = re.compile(r"[^,(]+(?:\([^)]*\))?")
_GRES_COUNT = re.compile(r"(\d+)([KMGTP]?)")


def parse_gres(text: str) -> list[SiteGres]:
    """The generic resources of a GRES list as sinfo prints it: ``gpu:a100:4(S:0-1)``,
    ``gpu:4`` (a GPU without a type), ``gpu:a100:2,gpu:v100:2``; none for ``(null)``."""
    found: list[SiteGres] = []
    if text.strip() in {"", "(null)"}:
        return found
    for entry in _GRES_ENTRY.findall(text.strip()):
        words = [w for w in re.sub(r"\(.*\)$", "", entry.strip()).split(":") if w]
        words = [w for w in words if w != "no_consume"]  # a flag, not a type
        if not words or not re.fullmatch(r"[A-Za-z][\w.-]*", words[0]):
            continue
        count = _GRES_COUNT.fullmatch(words[-1]) if len(words) > 1 else None
        number = 1  # a GRES listed without a count (none of Slurm's do) is one
        if count is not None:
            words.pop()
            suffix = count.group(2)  # large counts (a bandwidth GRES): 4K, 2G
            number = int(count.group(1)) * (1024 ** ("KMGTP".index(suffix) + 1) if suffix else 1)
        found.append(SiteGres(words[0], words[1] if len(words) > 1 else None, number))
    return found


def partition_gres(sinfo_output: str, partition: str | None) -> list[SiteGres]:
    """The generic resources of a partition's nodes from ``sinfo -h -o '%P %G'`` (one line per
    partition and group of alike nodes): every line when sinfo was asked for `partition`
    (``-p``); else the default partition's (sinfo marks it ``debug*``), or every line on a
    cluster without one."""
    lines = [line.split(None, 1) for line in sinfo_output.splitlines() if line.strip()]
    if partition is None and any(words[0].endswith("*") for words in lines):
        lines = [words for words in lines if words[0].endswith("*")]
    return [gres for words in lines if len(words) == 2 for gres in parse_gres(words[1])]


def gres_request(accelerator: Accelerator, listed: Sequence[SiteGres], where: str) -> str:
    """The ``--gres`` that asks for `accelerator` on nodes with `listed`: ``gpu:<type>:<n>``
    where a GPU type of the site is the accelerator (``a100`` or ``nvidia_a100-sxm4-80gb`` for
    ``A100``), ``gpu:<n>`` where the site's GPUs have no type (or for ``GPU:<n>``). A
    `ConfigError` naming what `where` (``partition 'gpu'``) has when it has no such GPU, so
    that nothing is queued that Slurm would refuse or never run."""
    count = max(accelerator.count, 1)
    gpus = [gres for gres in listed if gres.name == "gpu"]
    if not gpus:
        raise ConfigError(
            f"accelerator={str(accelerator)!r} asks for GPUs, and {where} has none that Slurm "
            "allocates (no gpu GRES in `sinfo -o %G`). Leave accelerator out, pick a "
            "partition with GPUs (partition=...), or pass gres= as your site documents it"
        )
    if accelerator.name.upper() == ANY:
        return f"gpu:{count}"
    types = sorted({gres.type for gres in gpus if gres.type})
    exact = [t for t in types if t.lower() == accelerator.name.lower()]
    fitting = exact or [t for t in types if name_matches(accelerator.name, _type_name(t))]
    if len(fitting) == 1:
        return f"gpu:{fitting[0]}:{count}"
    has = ", ".join(sorted({str(gres) for gres in gpus}))
    if fitting:
        raise ConfigError(
            f"accelerator={str(accelerator)!r} fits several GPU types of {where} ({has}): "
            f"name one with gres=, e.g. gres='gpu:{fitting[0]}:{count}'"
        )
    if any(gres.type is None for gres in gpus):
        return f"gpu:{count}"  # GPUs without a type: the host check then sees which they are
    raise ConfigError(
        f"accelerator={str(accelerator)!r} asks for {accelerator.name} GPUs, and {where} has "
        f"{has}: no {accelerator.name}. Ask for what it has, pick another partition "
        "(partition=...), or pass gres= as your site documents it"
    )


def _type_name(gres_type: str) -> str:
    """A GRES type as a pool names GPUs: ``nvidia_a100-sxm4-80gb`` -> ``A100-80GB``."""
    return gpu_name(gres_type.replace("_", " "))


def duration(seconds: float | None) -> str | None:
    """A time limit in Slurm's ``D-HH:MM:SS`` (rounded up to the minute Slurm counts in)."""
    if seconds is None:
        return None
    minutes = max(1, int(-(-seconds // 60)))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


@dataclass(frozen=True)
class Granted:
    """The holding command's line: the allocation's job, nodes (as Slurm writes the list) and
    CPUs per node (``4(x2),2``)."""

    job_id: str
    nodelist: str
    cpus: str

    @classmethod
    def parse(cls, line: str) -> Granted | None:
        words = line.split()
        if len(words) != 4 or words[0] != GRANTED:
            return None
        return cls(words[1], words[2], words[3])

    def cpus_per_node(self, count: int) -> list[int]:
        """The CPUs of each of the allocation's `count` nodes, in node order."""
        return expand_counts(self.cpus, count)


def expand_counts(text: str, count: int) -> list[int]:
    """``4(x2),2`` -> ``[4, 4, 2]``: Slurm's run-length list of per-node counts."""
    out: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"unexpected Slurm count list {text!r}")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    if len(out) != count:
        raise ValueError(f"Slurm count list {text!r} is for {len(out)} nodes, not {count}")
    return out


def job_id_in(line: str) -> str | None:
    """The job id salloc names on stderr (``Pending job allocation 42``, ``Granted ... 42``)."""
    match = re.search(r"job allocation (\d+)", line) or re.search(r"\bjob (\d+) queued", line)
    return match.group(1) if match else None


def refusal(lines: Sequence[str]) -> tuple[str, bool] | None:
    """The error salloc printed, and whether it is the request's fault (a `ConfigError`)."""
    errors = [line for line in lines if "error:" in line.lower()]
    if not errors:
        return None
    text = errors[-1].split("error:", 1)[1].strip()
    return text, any(marker in text.lower() for marker in _CONFIG_ERRORS)


def step(job_id: str, node: str, command: str, cpus: int = 1, gres: str | None = None) -> str:
    """`command` (a shell command line) as a step of the job on one node, sharing the
    allocation's resources with the other steps (``--overlap``); its stdio is srun's."""
    args = [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--cpus-per-task={cpus}",
        "--quiet",
        "--kill-on-bad-exit=1",
        # Without it slurmstepd passes a task's output on only at line ends, and a frame of
        # the wire is binary: the agent's first answer would wait for a newline forever.
        "--unbuffered",
    ]
    if gres:
        args.append(f"--gres={gres}")
    # `exec` so that killing srun's process group on the client's side ends the step too.
    return "exec " + shlex.join([*args, "/bin/sh", "-c", command])


def node_addresses(scontrol_output: str) -> dict[str, str]:
    """``NodeName -> NodeAddr`` from ``scontrol -o show node`` (one line per node)."""
    out: dict[str, str] = {}
    for line in scontrol_output.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            out[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return out


def node_state(scontrol_output: str) -> tuple[str, str]:
    """A node's state and reason from ``scontrol -o show node NAME``."""
    state = re.search(r"\bState=(\S+)", scontrol_output)
    reason = re.search(r"\bReason=(.*?)(?: \w+=|$)", scontrol_output)
    return (state.group(1) if state else "UNKNOWN", reason.group(1).strip() if reason else "")
