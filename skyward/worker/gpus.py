"""What NVIDIA GPUs a machine has: the accelerator inventory.

Standard library only: it runs on the client (for Local) and on every host (inside the host
check), before any environment exists. `find` asks NVML (the ``pynvml`` module of nvidia-ml-py)
when it can be imported and answers, ``nvidia-smi`` otherwise; a machine with neither has no
GPU. It never raises: a machine whose GPUs cannot be listed (no nvidia-smi, a driver that does
not answer, a hung nvidia-smi) has an empty inventory whose `Inventory.problem` says why.

The parsing (`parse_smi`, `cuda_version`) and the naming (`gpu_name`, `matches`) are pure
functions over the tools' text, so tests feed them outputs recorded on real machines.

A process's ``CUDA_VISIBLE_DEVICES`` says which of the machine's GPUs it may use (`visible`):
the client's own for Local, a Slurm job step's as Slurm set it for the GPUs it granted. NVML
and nvidia-smi list every GPU of the machine whatever it says, so `find_visible` (what the host
check reports) leaves out the GPUs it hides.

Names: a GPU is named as a pool spells it (``accelerator="H100"``): the driver's model name
without the vendor words ("NVIDIA H100 80GB HBM3" -> "H100"), with the memory size only for the
models made in two sizes, on the larger one ("NVIDIA A100-SXM4-80GB" -> "A100-80GB", the 40 GB
one is "A100"; "V100-32GB" likewise), as the clouds and SkyPilot name them. A requested name
matches every memory size of its model ("A100" matches "A100-80GB"); a name with its memory
("A100-80GB") matches only that size; "GPU" matches any GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

ANY = "GPU"
"""The accelerator name that any GPU matches (``accelerator="GPU:2"``)."""

SMI_TIMEOUT = 5.0
"""Seconds `find` waits for nvidia-smi (a driver in trouble can hang it)."""

QUERY_FIELDS = ("index", "name", "memory.total", "uuid", "driver_version", "mig.mode.current")
QUERY_ARGS = (f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
"""nvidia-smi's arguments for one CSV line per GPU, as `parse_smi` reads them."""

_MIB = 1024 * 1024


@dataclass(frozen=True)
class Gpu:
    """One GPU as CUDA numbers it on its machine."""

    index: int  # the machine's device number (what CUDA_VISIBLE_DEVICES takes)
    name: str  # as a pool spells it: "H100", "A100-80GB", "L4"
    model: str  # as the driver reports it: "NVIDIA H100 80GB HBM3"
    memory_mib: int
    uuid: str = ""
    mig: bool = False  # in MIG mode: split into instances, not assignable whole


@dataclass(frozen=True)
class Inventory:
    """A machine's GPUs, its driver, and the highest CUDA that driver supports."""

    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None  # "580.159.04"
    cuda: str | None = None  # "13.0"
    # Why the GPUs could not be listed ("nvidia-smi was not found on PATH", the driver's own
    # complaint); None when they were (even none at all).
    problem: str | None = None
    # The machine's GPUs left out because the process's CUDA_VISIBLE_DEVICES hides them (a
    # Slurm step given 2 of 8: 6), said in errors so that the missing ones are explained.
    hidden: int = 0

    @property
    def cuda_major(self) -> int | None:
        """The CUDA major version the driver supports (13 for "13.0"), None without a driver."""
        return int(self.cuda.split(".")[0]) if self.cuda else None

    @property
    def usable(self) -> tuple[Gpu, ...]:
        """The GPUs a node can own whole: those not in MIG mode."""
        return tuple(gpu for gpu in self.gpus if not gpu.mig)

    def matching(self, requested: str) -> tuple[Gpu, ...]:
        """The usable GPUs that a pool's accelerator name asks for (see `matches`)."""
        return tuple(gpu for gpu in self.usable if matches(requested, gpu))

    def describe(self) -> str:
        """In words, for errors: "1 x L4 (driver 550.54.15, CUDA 12.4)", "no NVIDIA GPU (...)"."""
        hidden = f"{self.hidden} more hidden by CUDA_VISIBLE_DEVICES" if self.hidden else ""
        if not self.gpus:
            why = ", ".join(part for part in (self.problem or "", hidden) if part)
            return f"no NVIDIA GPU ({why})" if why else "no NVIDIA GPU"
        counts = Counter(gpu.name + (" in MIG mode" if gpu.mig else "") for gpu in self.gpus)
        driver = ", ".join(
            part
            for part in (f"driver {self.driver}" if self.driver else "", _cuda_words(self.cuda))
            if part
        )
        listed = ", ".join(f"{count} x {name}" for name, count in counts.items())
        described = f"{listed} ({driver})" if driver else listed
        return f"{described}; {hidden}" if hidden else described

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Inventory:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Inventory:
        """The inverse of `dataclasses.asdict` (as a `hostcheck.HostReport` carries it)."""
        return cls(
            gpus=tuple(Gpu(**gpu) for gpu in data["gpus"]),
            driver=data["driver"],
            cuda=data["cuda"],
            problem=data.get("problem"),
            hidden=data.get("hidden", 0),
        )


def find(timeout: float = SMI_TIMEOUT) -> Inventory:
    """This machine's GPUs: NVML when ``pynvml`` imports and answers, else nvidia-smi (each of
    its two commands bounded by `timeout` seconds), else none. Never raises."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        pass
    else:
        found = _from_nvml(nvml)
        if found is not None:
            return found
    return _from_smi(timeout)


def find_visible(timeout: float = SMI_TIMEOUT) -> Inventory:
    """The GPUs this process may use: `find`'s, less those its ``CUDA_VISIBLE_DEVICES``
    hides (`visible`). What a host check reports: on a Slurm node, the check is a job step
    given the allocation's GPUs, and Slurm names them there."""
    return visible(find(timeout), os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible(inventory: Inventory, devices: str | None) -> Inventory:
    """The part of `inventory` that a process whose ``CUDA_VISIBLE_DEVICES`` is `devices` may
    use: the GPUs it names by index or by UUID (or a UUID's prefix, as CUDA takes them), in the
    machine's order; all of them when it is unset (None), none when it is empty. The others
    are counted in `Inventory.hidden`.

    Where a site confines a Slurm step to its GPUs (``ConstrainDevices``), the driver lists
    only those, numbered from 0, and Slurm numbers ``CUDA_VISIBLE_DEVICES`` the same way: the
    two agree, and nothing is hidden."""
    if devices is None:
        return inventory
    wanted = [entry.strip() for entry in devices.split(",") if entry.strip()]
    kept = tuple(gpu for gpu in inventory.gpus if _named(gpu, wanted))
    return replace(inventory, gpus=kept, hidden=inventory.hidden + len(inventory.gpus) - len(kept))


def _named(gpu: Gpu, entries: list[str]) -> bool:
    return any(
        entry == str(gpu.index)
        or (bool(gpu.uuid) and entry.startswith("GPU-") and gpu.uuid.startswith(entry))
        for entry in entries
    )


def parse_smi(query: str, header: str) -> Inventory:
    """The inventory from nvidia-smi's output: `query` is what ``nvidia-smi`` + `QUERY_ARGS`
    prints (one CSV line per GPU), `header` what plain ``nvidia-smi`` prints (its banner names
    the highest CUDA the driver supports). Raises ValueError on a line it cannot read."""
    gpus = []
    driver = None
    for line in query.splitlines():
        if not line.strip():
            continue
        # "0, NVIDIA H100 80GB HBM3, 81559, GPU-..., 580.159.04, Disabled": the name is the one
        # field that could hold a comma, so the rest are counted from both ends.
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < len(QUERY_FIELDS) or not fields[0].isdigit():
            raise ValueError(f"not a line of nvidia-smi's GPU query: {line.strip()!r}")
        index, *name, memory, uuid, driver_version, mig = fields
        model = ", ".join(name)
        gpus.append(
            Gpu(
                index=int(index),
                name=gpu_name(model),
                model=model,
                memory_mib=int(memory) if memory.isdigit() else 0,
                uuid=uuid,
                mig=mig == "Enabled",
            )
        )
        driver = driver or driver_version
    banner = re.search(r"(?:Driver|KMD) Version:\s*([0-9.]+)", header)
    cuda = re.search(r"CUDA (?:UMD )?Version:\s*([0-9]+\.[0-9]+)", header)
    return Inventory(
        gpus=tuple(gpus),
        driver=driver or (banner[1] if banner else None),
        cuda=cuda[1] if cuda else None,
    )


def cuda_version(number: int) -> str:
    """NVML's CUDA driver version as nvidia-smi prints it: 13000 -> "13.0", 12040 -> "12.4"."""
    return f"{number // 1000}.{number % 1000 // 10}"


# "NVIDIA", then a brand some models carry: "Tesla T4", "NVIDIA GeForce RTX 4090".
_VENDOR = re.compile(r"^(?:NVIDIA\s+)?(?:Tesla\s+|Quadro\s+|GeForce\s+)?", re.IGNORECASE)
# Models made in two memory sizes: the larger one is named with it ("A100-80GB").
_LARGER = {"A100": "80GB", "V100": "32GB"}
# Series whose number belongs to the name: "RTX 4090" -> "RTX4090".
_SERIES = ("RTX", "GTX")
_SUFFIXES = {"TI": "TI", "SUPER": "SUPER", "ADA": "-ADA"}  # "RTX 6000 Ada Generation"
_MEMORY_SUFFIX = re.compile(r"-[0-9]+GB$")


def visible_env(owned: tuple[Gpu, ...]) -> dict[str, str]:
    """The environment that shows a process exactly `owned` (by UUID, which names the same GPUs
    whatever order CUDA would number them in)."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(gpu.uuid or str(gpu.index) for gpu in owned),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def gpu_name(model: str) -> str:
    """The name a pool spells for the driver's model name: "NVIDIA H100 80GB HBM3" -> "H100",
    "NVIDIA A100-SXM4-80GB" -> "A100-80GB", "Tesla T4" -> "T4", "NVIDIA RTX A6000" -> "A6000",
    "NVIDIA GeForce RTX 4090" -> "RTX4090"."""
    words = [word.upper() for word in _VENDOR.sub("", model.strip()).replace("-", " ").split()]
    if not words:
        return model.strip().upper()
    name = words[0]
    if name in _SERIES and len(words) > 1:
        if words[1][0].isalpha():  # "RTX A6000": the workstation A series goes by its number
            name = words[1]
        else:
            name += words[1] + "".join(_SUFFIXES.get(word, "") for word in words[2:])
    larger = _LARGER.get(name)
    if larger in words:
        name = f"{name}-{larger}"
    return name


def matches(requested: str, gpu: Gpu) -> bool:
    """Whether the accelerator name `requested` (any case) asks for `gpu`: "GPU" is any GPU,
    "A100" any A100 (40 or 80 GB), "A100-80GB" only the 80 GB one."""
    return name_matches(requested, gpu.name)


def name_matches(requested: str, name: str) -> bool:
    """`matches` for a GPU known by its name only (``gpu_name``'s, e.g. "A100-80GB")."""
    want = requested.upper()
    return want in (ANY, name) or _MEMORY_SUFFIX.sub("", name) == want


def _cuda_words(cuda: str | None) -> str:
    return f"CUDA {cuda}" if cuda else ""


def _text(value: str | bytes) -> str:
    """NVML's strings: str in current nvidia-ml-py, bytes in old releases."""
    return value.decode() if isinstance(value, bytes) else value


def _from_nvml(nvml: Any) -> Inventory | None:
    """The inventory from NVML, or None when NVML cannot answer (no library, no driver):
    nvidia-smi is asked then, and says why in its own words."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            model = _text(nvml.nvmlDeviceGetName(handle))
            try:
                mig = nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.NVML_DEVICE_MIG_ENABLE
            except nvml.NVMLError:  # a GPU without MIG
                mig = False
            gpus.append(
                Gpu(
                    index=index,
                    name=gpu_name(model),
                    model=model,
                    memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    mig=mig,
                )
            )
        return Inventory(
            gpus=tuple(gpus),
            driver=_text(nvml.nvmlSystemGetDriverVersion()),
            cuda=cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion_v2())),
        )
    except nvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _from_smi(timeout: float) -> Inventory:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Inventory(problem="nvidia-smi was not found on PATH")
    # Both at once: each can take a second or more on a machine without persistence mode.
    deadline = time.monotonic() + timeout
    query = _start([smi, *QUERY_ARGS])
    header = _start([smi])
    query_done = _finish(query, deadline)
    header_done = _finish(header, deadline)
    if query_done is None or header_done is None:
        return Inventory(problem=f"nvidia-smi did not answer within {timeout:g} s")
    status, out, err = query_done
    if status != 0:
        said = next((line.strip() for line in (out + err).splitlines() if line.strip()), "")
        return Inventory(problem=f"nvidia-smi failed (exit status {status}): {said}".strip())
    try:
        return parse_smi(out, header_done[1])
    except ValueError as exc:
        return Inventory(problem=str(exc))


def _start(args: list[str]) -> subprocess.Popen[str] | OSError:
    try:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
    except OSError as exc:  # not executable, vanished since `which`
        return exc


def _finish(
    process: subprocess.Popen[str] | OSError, deadline: float
) -> tuple[int, str, str] | None:
    """(exit status, stdout, stderr), or None past `deadline` (the process is killed, and not
    waited for: a driver hang can keep it in uninterruptible sleep)."""
    if isinstance(process, OSError):
        return 126, "", str(process)
    try:
        out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        return None
    return process.returncode, out, err
