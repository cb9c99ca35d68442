"""The GPU inventory (`skyward.worker.gpus`) and the host check that carries it.

There is no GPU on this machine nor in CI. The one place where a recorded answer stands in for
the hardware is here: nvidia-smi's outputs as real machines print them (``tests/data/gpus``,
see its README) are parsed directly, or printed by a fake ``nvidia-smi`` script put first on
PATH, which `find` then runs for real as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from skyward.hardware import Accelerator, ClusterSpec, Hardware
from skyward.worker import gpus, hostcheck
from skyward.worker.gpus import Gpu, Inventory
from tests.support.gpus import MACHINES, fake_nvidia_smi, recorded


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the real ``pynvml`` (on a GPU machine it would answer before the fake nvidia-smi)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


def parsed(machine: str) -> Inventory:
    return gpus.parse_smi(recorded(machine, "query.txt"), recorded(machine, "nvidia-smi.txt"))


def test_one_h100_with_driver_580_supports_cuda_13() -> None:
    """Recorded nvidia-smi output of a 1 x H100 machine stands in for the GPU."""
    inventory = parsed("h100-driver580")
    assert inventory == Inventory(
        gpus=(
            Gpu(
                index=0,
                name="H100",
                model="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                uuid="GPU-143e21f0-dc59-ac20-ed8e-c630f5df47cd",
            ),
        ),
        driver="580.159.04",
        cuda="13.0",
    )
    assert inventory.cuda_major == 13
    assert inventory.describe() == "1 x H100 (driver 580.159.04, CUDA 13.0)"


def test_eight_a100_80gb_with_driver_550_support_cuda_12_4() -> None:
    """Recorded nvidia-smi output of an 8 x A100-SXM4-80GB machine stands in for the GPUs."""
    inventory = parsed("a100x8-driver550")
    assert [g.index for g in inventory.gpus] == list(range(8))
    assert {g.name for g in inventory.gpus} == {"A100-80GB"}
    assert {g.memory_mib for g in inventory.gpus} == {81920}
    assert len({g.uuid for g in inventory.gpus}) == 8
    assert (inventory.driver, inventory.cuda, inventory.cuda_major) == ("550.54.15", "12.4", 12)
    assert inventory.usable == inventory.gpus
    assert len(inventory.matching("A100")) == 8, "A100 asks for either memory size"
    assert len(inventory.matching("a100-80gb")) == 8
    assert inventory.matching("A100-40GB") == ()
    assert inventory.matching("H100") == ()
    assert inventory.describe() == "8 x A100-80GB (driver 550.54.15, CUDA 12.4)"


def test_a_gpu_in_mig_mode_is_listed_but_not_usable() -> None:
    """Recorded nvidia-smi output of 2 x A100-40GB, GPU 0 in MIG mode, stands in for the GPUs."""
    inventory = parsed("a100-mig-driver535")
    assert [(g.index, g.name, g.mig) for g in inventory.gpus] == [
        (0, "A100", True),
        (1, "A100", False),
    ]
    assert [g.index for g in inventory.usable] == [1]
    assert [g.index for g in inventory.matching("GPU")] == [1]
    assert inventory.cuda == "12.2"
    assert inventory.describe() == "1 x A100 in MIG mode, 1 x A100 (driver 535.183.01, CUDA 12.2)"


def test_the_inventory_crosses_json_unchanged() -> None:
    for machine in ("a100-mig-driver535", "h100-driver580"):
        inventory = parsed(machine)
        assert Inventory.from_json(inventory.to_json()) == inventory
    broken = Inventory(problem="nvidia-smi failed (exit status 9): ...")
    assert Inventory.from_json(broken.to_json()) == broken
    old = json.loads(parsed("h100-driver580").to_json())
    del old["problem"]  # an inventory written before `problem` existed
    assert Inventory.from_json(json.dumps(old)).problem is None


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 NVL", "H100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("NVIDIA GeForce RTX 3080 Ti", "RTX3080TI"),
        ("NVIDIA RTX A6000", "A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX6000-ADA"),
        ("Quadro RTX 8000", "RTX8000"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_driver_model_names_become_the_names_pools_spell(model: str, name: str) -> None:
    assert gpus.gpu_name(model) == name


@pytest.mark.parametrize(
    ("requested", "name", "expected"),
    [
        ("H100", "H100", True),
        ("h100", "H100", True),
        ("GPU", "L4", True),
        ("gpu", "A100-80GB", True),
        ("A100", "A100-80GB", True),
        ("A100", "A100", True),
        ("A100-80GB", "A100", False),
        ("A100-80GB", "A100-80GB", True),
        ("V100", "V100-32GB", True),
        ("H100", "H200", False),
        ("L4", "L40S", False),
        ("RTX6000", "RTX6000-ADA", False),
    ],
)
def test_a_requested_name_matches(requested: str, name: str, expected: bool) -> None:
    assert gpus.matches(requested, Gpu(0, name, name, 0)) is expected


def test_nvml_cuda_numbers_read_as_nvidia_smi_prints_them() -> None:
    assert gpus.cuda_version(13000) == "13.0"
    assert gpus.cuda_version(12040) == "12.4"
    assert gpus.cuda_version(12020) == "12.2"
    assert gpus.cuda_version(11080) == "11.8"


def test_a_line_that_is_not_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="not a line"):
        gpus.parse_smi("No devices were found\n", "")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_this_machine_has_no_gpu() -> None:
    inventory = gpus.find()
    assert inventory.gpus == () and inventory.driver is None and inventory.cuda is None
    assert inventory.problem == "nvidia-smi was not found on PATH"
    assert inventory.describe() == "no NVIDIA GPU (nvidia-smi was not found on PATH)"


@pytest.mark.parametrize("machine", [m for m in MACHINES if m != "driver-failed"])
@pytest.mark.usefixtures("no_nvml")
def test_find_runs_nvidia_smi(
    machine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake nvidia-smi, first on PATH, prints a machine's recorded output in place of its
    GPUs: `find` runs it as a subprocess and parses both of its answers."""
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(machine, tmp_path)}:{os.environ['PATH']}")
    assert gpus.find() == parsed(machine)


@pytest.mark.usefixtures("no_nvml")
def test_a_driver_that_does_not_answer_is_no_gpu_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake nvidia-smi replays a machine whose driver is not loaded (exit status 9)."""
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi('driver-failed', tmp_path)}:/usr/bin:/bin")
    inventory = gpus.find()
    assert inventory.gpus == ()
    assert inventory.problem is not None
    assert inventory.problem.startswith("nvidia-smi failed (exit status 9): NVIDIA-SMI has failed")
    assert "couldn't communicate with the NVIDIA driver" in inventory.describe()


@pytest.mark.usefixtures("no_nvml")
def test_a_hung_nvidia_smi_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake nvidia-smi that never answers (a driver in trouble) is killed at the timeout."""
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi('hung', tmp_path)}:/usr/bin:/bin")
    started = time.monotonic()
    inventory = gpus.find(timeout=0.5)
    assert time.monotonic() - started < 30, "bounded by the timeout, not by the 600 s sleep"
    assert inventory == Inventory(problem="nvidia-smi did not answer within 0.5 s")


def test_nvml_is_asked_first(tmp_path: Path) -> None:
    """A stand-in ``pynvml`` (the names nvidia-ml-py 13 has, answering what NVML says on the
    recorded H100 machine) is preferred to nvidia-smi, which would say there is no GPU."""
    (tmp_path / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n"
        "NVML_DEVICE_MIG_ENABLE = 1\n"
        "class _Memory:\n    total = 81559 * 1024 * 1024\n"
        "def nvmlInit(): pass\n"
        "def nvmlShutdown(): pass\n"
        "def nvmlDeviceGetCount(): return 1\n"
        "def nvmlDeviceGetHandleByIndex(i): return i\n"
        "def nvmlDeviceGetName(h): return b'NVIDIA H100 80GB HBM3'\n"
        "def nvmlDeviceGetMemoryInfo(h): return _Memory()\n"
        "def nvmlDeviceGetUUID(h): return 'GPU-143e21f0-dc59-ac20-ed8e-c630f5df47cd'\n"
        "def nvmlDeviceGetMigMode(h): raise NVMLError('Not Supported')\n"
        "def nvmlSystemGetDriverVersion(): return '580.159.04'\n"
        "def nvmlSystemGetCudaDriverVersion_v2(): return 13000\n"
    )
    fake_nvidia_smi("driver-failed", tmp_path / "bin")
    found = _run_find(tmp_path, path=f"{tmp_path / 'bin'}:/usr/bin:/bin", pythonpath=tmp_path)
    assert found == parsed("h100-driver580")


def test_nvml_that_cannot_start_leaves_it_to_nvidia_smi(tmp_path: Path) -> None:
    """A ``pynvml`` whose library is missing (as the real binding without a driver) falls back
    to the fake nvidia-smi replaying the recorded 8 x A100 machine."""
    (tmp_path / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n"
        "def nvmlInit():\n    raise NVMLError('NVML Shared Library Not Found')\n"
    )
    fake_nvidia_smi("a100x8-driver550", tmp_path / "bin")
    found = _run_find(tmp_path, path=f"{tmp_path / 'bin'}:/usr/bin:/bin", pythonpath=tmp_path)
    assert found == parsed("a100x8-driver550")


def _run_find(cwd: Path, path: str, pythonpath: Path) -> Inventory:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", "from skyward.worker import gpus; print(gpus.find().to_json())"],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
        env={**os.environ, "PATH": path, "PYTHONPATH": f"{pythonpath}:{root}"},
    )
    return Inventory.from_json(done.stdout)


def test_the_host_check_reports_gpus_where_skyward_cannot_be_imported(tmp_path: Path) -> None:
    """A host's first contact: the check program runs with an interpreter that cannot import
    skyward (``-I -S``) and still lists the GPUs, here a fake nvidia-smi replaying the recorded
    H100 machine. A query that does not ask (Local's) lists none."""
    query = hostcheck.Query(cache=str(tmp_path), env="h", gpus=True)
    report = host_check(query, "h100-driver580", tmp_path)
    assert report.gpus == parsed("h100-driver580")
    # The probe travels in the program: no `packaging` there, so nothing counts as satisfied.
    assert report.satisfied is False
    assert hostcheck.check(replace(query, gpus=False)).gpus is None


def test_the_first_contact_says_whether_the_interpreter_has_the_requirements(
    tmp_path: Path,
) -> None:
    """The check program probes the requirements itself: on a host where skyward cannot be
    imported, an interpreter with `packaging` and the image's packages is found to satisfy it
    at once (no second check after skyward's source is copied)."""
    import importlib.util

    site = tmp_path / "site"
    site.mkdir()
    for name in ("packaging", "cloudpickle"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        package = Path(spec.origin).parent
        (site / name).symlink_to(package)
        for info in package.parent.glob(f"{name}-*.dist-info"):
            (site / info.name).symlink_to(info)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    for requirement, expected in (("cloudpickle", True), ("skyward-no-such-package", False)):
        query = hostcheck.Query(cache=str(tmp_path), env="h", requirements=(requirement,))
        done = subprocess.run(
            [sys.executable, "-S", "-c", hostcheck.program()],  # no site: no skyward
            input=query.to_json(),
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
            env=env,
        )
        assert hostcheck.HostReport.from_json(done.stdout).satisfied is expected, requirement


def host_check(
    query: hostcheck.Query, machine: str, tmp_path: Path, visible: str | None = None
) -> hostcheck.HostReport:
    """The check program's report on a host that cannot import skyward (``-I -S``), whose
    nvidia-smi replays `machine`, and whose CUDA_VISIBLE_DEVICES is `visible` (None: unset)."""
    fake = fake_nvidia_smi(machine, tmp_path / "bin")
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "CUDA_VISIBLE_DEVICES"}}
    env["PATH"] = f"{fake}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", hostcheck.program()],
        input=query.to_json(),  # on stdin, as the client sends it
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    )
    return hostcheck.HostReport.from_json(done.stdout)


def test_cuda_visible_devices_leaves_out_the_gpus_it_hides() -> None:
    """A process may use the GPUs its CUDA_VISIBLE_DEVICES names, by index, by UUID or by a
    UUID's prefix (as CUDA takes them), in the machine's order; the rest are counted and said."""
    eight = parsed("a100x8-driver550")
    uuids = [gpu.uuid for gpu in eight.gpus]
    assert gpus.visible(eight, None) == eight
    for devices in ("2,3", "3,2", f"{uuids[2]},3", f" {uuids[2][:12]} , {uuids[3]}"):
        seen = gpus.visible(eight, devices)
        assert [gpu.index for gpu in seen.gpus] == [2, 3], devices
        assert (seen.hidden, seen.driver, seen.cuda) == (6, eight.driver, eight.cuda)
    assert seen.describe() == (
        "2 x A100-80GB (driver 550.54.15, CUDA 12.4); 6 more hidden by CUDA_VISIBLE_DEVICES"
    )
    nothing = gpus.visible(eight, "")
    assert (nothing.gpus, nothing.hidden) == ((), 8)
    assert nothing.describe() == "no NVIDIA GPU (8 more hidden by CUDA_VISIBLE_DEVICES)"
    assert Inventory.from_json(seen.to_json()) == seen


def test_a_confined_step_lists_only_its_gpus_and_keeps_them_all() -> None:
    """Where a site confines a Slurm step to its GPUs (ConstrainDevices), the driver lists only
    those, numbered from 0 (here GPUs 2 and 3 of the recorded eight), and Slurm's
    CUDA_VISIBLE_DEVICES numbers them from 0 too: both are kept, none is hidden."""
    lines = recorded("a100x8-driver550", "query.txt").splitlines()[2:4]
    renumbered = "\n".join(f"{i}{line[1:]}" for i, line in enumerate(lines))
    confined = gpus.parse_smi(renumbered, recorded("a100x8-driver550", "nvidia-smi.txt"))
    seen = gpus.visible(confined, "0,1")
    assert [gpu.uuid for gpu in seen.gpus] == [line.split(", ")[3] for line in lines]
    assert seen.hidden == 0


def test_the_host_check_reports_only_the_gpus_its_step_was_given(tmp_path: Path) -> None:
    """On a Slurm node the host check is a job step, and Slurm names the step's GPUs in its
    CUDA_VISIBLE_DEVICES (here 2 and 3 of the recorded eight A100s): the check reports those
    alone, as every remote host's check does with what its CUDA_VISIBLE_DEVICES says."""
    query = hostcheck.Query(cache=str(tmp_path), env="h", gpus=True)
    report = host_check(query, "a100x8-driver550", tmp_path, visible="2,3")
    assert report.gpus == gpus.visible(parsed("a100x8-driver550"), "2,3")
    assert report.gpus is not None and [gpu.index for gpu in report.gpus.gpus] == [2, 3]


def hardware(*machines: str | None) -> Hardware:
    """What a pool of one node per machine has (None: a machine without a GPU)."""
    inventories = [parsed(m) if m else Inventory() for m in machines]
    return Hardware.of([i.usable for i in inventories], [i.cuda for i in inventories])


def test_a_pool_runs_the_cuda_of_its_oldest_driver() -> None:
    """The lowest CUDA wins; the GPUs' common name (or GPU) and the fewest any node owns."""
    assert hardware("h100-driver580") == Hardware("13.0", Accelerator("H100"))
    assert hardware("a100x8-driver550") == Hardware("12.4", Accelerator("A100-80GB", 8))
    assert hardware("h100-driver580", "a100x8-driver550") == Hardware("12.4", Accelerator("GPU"))
    # versions compare by number: 12.10 is newer than 12.4
    newer = Gpu(index=0, name="H100", model="NVIDIA H100", memory_mib=1)
    assert Hardware.of([(newer,), (newer,)], ["12.10", "12.4"]).cuda == "12.4"
    assert Hardware.of([(newer,), (newer,)], ["13.0", None]).cuda is None  # a driver did not say


def test_a_pool_with_a_node_without_gpus_has_none() -> None:
    assert hardware("h100-driver580", None) == Hardware()
    assert hardware("a100-mig-driver535", None, None) == Hardware()


def test_the_spec_takes_the_hardware_but_keeps_a_named_accelerator() -> None:
    spec = ClusterSpec(nodes=1, pool_id="p")
    seen = spec.seen(hardware("h100-driver580"))
    assert (seen.accelerator, seen.cuda) == (Accelerator("H100"), "13.0")
    named = ClusterSpec(nodes=1, pool_id="p", accelerator=Accelerator("GPU", 1))
    assert named.seen(hardware("h100-driver580")).accelerator == Accelerator("GPU")
    assert spec.seen(Hardware()) is spec  # nothing changed: the plugins are not asked again


@pytest.mark.gpu
def test_nvml_and_nvidia_smi_agree_on_this_machine() -> None:
    """On a real GPU: both ways of listing the GPUs give the same inventory."""
    pytest.importorskip("pynvml")
    assert gpus.find() == gpus._from_smi(gpus.SMI_TIMEOUT)
