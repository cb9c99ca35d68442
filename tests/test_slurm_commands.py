"""The Slurm command lines and the reading of their output, without a cluster (the cluster
tests are in tests/slurm/)."""

from __future__ import annotations

import shlex
import subprocess
import time

import pytest

from skyward.errors import ConfigError
from skyward.hardware import Accelerator
from skyward.providers.slurm import commands


def test_gres_comes_from_the_accelerator() -> None:
    assert commands.gres_for(Accelerator("A100", 4)) == "gpu:a100:4"
    assert commands.gres_for(Accelerator("H100", 8), typed=False) == "gpu:8"
    assert commands.gres_for(Accelerator("GPU", 2)) == "gpu:2"  # any GPU: no type
    assert commands.gres_for(None) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu:a100:4", ["gpu:a100:4"]),
        ("gpu:4", ["gpu:4"]),
        ("gpu:a100:4(S:0-1)", ["gpu:a100:4"]),
        ("gpu:a100:2,gpu:v100:2", ["gpu:a100:2", "gpu:v100:2"]),
        ("gpu:a100:2(S:0,2),gpu:v100:2(S:1)", ["gpu:a100:2", "gpu:v100:2"]),
        ("gpu:nvidia_a100-sxm4-80gb:8", ["gpu:nvidia_a100-sxm4-80gb:8"]),
        ("gpu:a100:no_consume:4", ["gpu:a100:4"]),
        ("gpu:h100:8,bandwidth:lustre:4G", ["gpu:h100:8", f"bandwidth:lustre:{4 * 1024**3}"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_sinfo_gres_lists_are_read(text: str, expected: list[str]) -> None:
    assert [str(gres) for gres in commands.parse_gres(text)] == expected


def test_the_gres_of_the_partition_a_job_goes_to() -> None:
    """Asked with -p, every line is the partition's; without, the default partition's (the one
    sinfo marks with *), or every line on a cluster without a default."""
    out = "debug* gpu:4\ndebug* (null)\nbig gpu:h100:8(S:0-1)\n"
    assert [str(g) for g in commands.partition_gres(out, None)] == ["gpu:4"]
    assert [str(g) for g in commands.partition_gres("big gpu:h100:8\n", "big")] == ["gpu:h100:8"]
    no_default = "a gpu:a100:2\nb gpu:v100:2\n"
    assert [str(g) for g in commands.partition_gres(no_default, None)] == [
        "gpu:a100:2",
        "gpu:v100:2",
    ]


def request(accelerator: str, site: str) -> str:
    return commands.gres_request(
        Accelerator.parse(accelerator), commands.parse_gres(site), "partition 'gpu'"
    )


def test_gres_asks_for_the_sites_type_or_for_gpus_without_one() -> None:
    assert request("A100:4", "gpu:a100:4") == "gpu:a100:4"
    assert request("A100:2", "gpu:A100:8") == "gpu:A100:2"  # the site's spelling
    assert request("A100:2", "gpu:a100:2,gpu:v100:2") == "gpu:a100:2"
    # A type named as the driver names the model: the pool's name for it is A100-80GB.
    assert request("A100:2", "gpu:nvidia_a100-sxm4-80gb:8") == "gpu:nvidia_a100-sxm4-80gb:2"
    assert request("A100-80GB:2", "gpu:a100_80gb:8") == "gpu:a100_80gb:2"
    assert request("A100:2", "gpu:4") == "gpu:2"  # no types at this site
    assert request("H100", "gpu:a100:4,gpu:2") == "gpu:1"  # untyped GPUs beside: maybe H100s
    assert request("GPU:2", "gpu:a100:4") == "gpu:2"  # any GPU


def test_a_type_the_partition_lacks_is_a_config_error_naming_what_it_has() -> None:
    with pytest.raises(ConfigError, match=r"'A100:4'.*partition 'gpu' has gpu:h100:8: no A100"):
        request("A100:4", "gpu:h100:8(S:0-1)")
    with pytest.raises(ConfigError, match=r"partition 'gpu' has none that Slurm allocates"):
        request("A100:4", "(null)")
    with pytest.raises(ConfigError, match=r"several GPU types.*gres='gpu:a100_40gb:4'"):
        request("A100:4", "gpu:a100_40gb:4,gpu:a100_80gb:4")


def test_a_time_limit_in_seconds_is_rounded_up_to_slurms_minutes() -> None:
    assert commands.duration(None) is None
    assert commands.duration(30) == "0-00:01:00"
    assert commands.duration(3601) == "0-01:01:00"
    assert commands.duration(2 * 86400) == "2-00:00:00"


def test_the_holders_line_and_slurms_count_lists() -> None:
    granted = commands.Granted.parse("SKYWARD-ALLOCATION 42 n[1-3] 4(x2),2\n")
    assert granted == commands.Granted("42", "n[1-3]", "4(x2),2")
    assert granted.cpus_per_node(3) == [4, 4, 2]
    assert commands.Granted.parse("salloc: Granted job allocation 42") is None
    with pytest.raises(ValueError, match="for 3 nodes, not 2"):
        granted.cpus_per_node(2)


def test_salloc_names_the_job_and_keeps_the_users_options_last() -> None:
    request = commands.Request(
        "skyward-p1",
        "skyward pool p1",
        2,
        partition="gpu",
        account="lab",
        time_limit="1:00:00",
        gres="gpu:a100:4",
        options=("--exclusive",),
    )
    args = request.salloc()
    assert args[:4] == ["salloc", "--nodes=2", "--ntasks-per-node=1", "--no-kill"]
    assert "--job-name=skyward-p1" in args and "--partition=gpu" in args
    assert "--account=lab" in args and "--gres=gpu:a100:4" in args and "--time=1:00:00" in args
    assert "--qos" not in " ".join(args)  # not asked: not passed
    assert args[-4:] == ["--exclusive", "/bin/sh", "-c", commands.holder()]


def test_salloc_output_is_read_for_the_job_and_the_refusal() -> None:
    assert commands.job_id_in("salloc: Pending job allocation 17") == "17"
    assert commands.job_id_in("salloc: job 17 queued and waiting for resources") == "17"
    assert commands.job_id_in("salloc: Nodes n1 are ready for job") is None
    refused = commands.refusal(
        ["salloc: error: Job submit/allocate failed: Invalid partition name specified"]
    )
    assert refused == ("Job submit/allocate failed: Invalid partition name specified", True)
    assert commands.refusal(["salloc: error: Unable to contact slurm controller"]) == (
        "Unable to contact slurm controller",
        False,
    )
    assert commands.refusal(["salloc: Granted job allocation 3"]) is None


def test_a_step_overlaps_the_allocation_and_passes_binary_output_at_once() -> None:
    line = commands.step("42", "n1", "echo 'hi there'", cpus=8, gres="gpu:4")
    words = shlex.split(line)
    assert words[:2] == ["exec", "srun"]
    for flag in (
        "--jobid=42",
        "--overlap",
        "--nodelist=n1",
        "--cpus-per-task=8",
        "--unbuffered",
        "--gres=gpu:4",
    ):
        assert flag in words
    assert words[-3:] == ["/bin/sh", "-c", "echo 'hi there'"]


def test_scontrol_output_gives_addresses_and_states() -> None:
    out = (
        "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.11 NodeHostName=n1\n"
        "NodeName=n2 Arch=x86_64 NodeAddr= NodeHostName=n2\n"
    )
    assert commands.node_addresses(out) == {"n1": "10.0.0.11", "n2": "n2"}
    state = "NodeName=n1 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=Not responding [root@x]"
    assert commands.node_state(state) == ("DOWN+NOT_RESPONDING", "Not responding [root@x]")
    assert commands.node_state("NodeName=n1 State=IDLE ThreadsPerCore=1") == ("IDLE", "")


def test_the_holder_holds_while_lines_come_and_ends_when_they_stop() -> None:
    """`holder(idle)` run by the shell as salloc would: it prints the grant, stays while a line
    comes within `idle` seconds, and returns once none has for that long, its stdin still open."""
    holder = subprocess.Popen(
        ["/bin/sh", "-c", commands.holder(1)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_CPUS_PER_NODE": "2"},
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().decode().split() == [commands.GRANTED, "7", "n[0-1]", "2"]
        for _ in range(8):  # 2.4 s of lines, each within the second
            holder.stdin.write(b"\n")
            holder.stdin.flush()
            silent = time.monotonic()
            time.sleep(0.3)
            assert holder.poll() is None
        holder.wait(timeout=10)  # stdin left open
        assert 0.9 <= time.monotonic() - silent < 5
    finally:
        holder.kill()
        holder.wait()


def test_without_an_idle_limit_the_holder_ends_only_with_its_stdin() -> None:
    holder = subprocess.Popen(
        ["/bin/sh", "-c", commands.holder()], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        holder.stdout.readline()
        time.sleep(1.5)
        assert holder.poll() is None
        holder.stdin.close()
        assert holder.wait(timeout=10) == 0
    finally:
        holder.kill()
        holder.wait()
