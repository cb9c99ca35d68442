"""Detached runs on Local: `sky.submit`, `sky.Run` from another process, restarts, refusals.

The SSH side (a client whose machine goes away) is tests/ssh/test_ssh_detached.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

import skyward as sky
from skyward.cli.main import main
from skyward.detached import record
from tests.support.motos3 import moto_s3, s3_env

# Rank 1 fails on the first attempt with status 4 after both ranks wrote a checkpoint; a
# restart resumes from it. Every rank says which attempt it is.
JOB = """\
import os, sys, pathlib
rank = int(os.environ["JAX_PROCESS_ID"])
attempt = int(os.environ["SKYWARD_RESTART"])
checkpoint = pathlib.Path(sys.argv[1]) / f"rank-{rank}"
start = int(checkpoint.read_text()) if checkpoint.exists() else 0
print(f"rank {rank} attempt {attempt} from step {start}", flush=True)
checkpoint.write_text(str(start + 5))
(pathlib.Path(os.environ["SKYWARD_OUTPUT_DIR"]) / "result.txt").write_text(f"{rank}:{attempt}")
if rank == 1 and attempt == 0 and sys.argv[2] == "fail":
    # fail once rank 0 has written its checkpoint too (it is stopped with this attempt)
    import time
    deadline = time.monotonic() + 10
    while not (checkpoint.parent / "rank-0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(4)
print(f"rank {rank} done", flush=True)
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    (tmp_path / "ckpt").mkdir()
    return path


def _lines(run: sky.Run) -> list[str]:
    lines: list[str] = []
    run.logs(out=lines.append)
    return lines


def test_submit_returns_a_run_another_process_can_wait_for(job: Path) -> None:
    run = sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=2, name="api")
    assert run.name == "api"
    assert run.status().state in ("running", "succeeded")
    waited = subprocess.run(
        [sys.executable, "-c", "import skyward as sky; print(sky.Run('api').wait(timeout=60))"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert waited.stdout.strip() == "0", waited.stderr
    status = run.status()
    assert (status.state, status.returncode, status.nodes, status.provider) == (
        "succeeded",
        0,
        2,
        "local",
    )
    assert sorted(_lines(run)) == [
        "(node 0) rank 0 attempt 0 from step 0",
        "(node 0) rank 0 done",
        "(node 1) rank 1 attempt 0 from step 0",
        "(node 1) rank 1 done",
    ]


def test_restarts_start_every_rank_again_from_what_it_wrote(job: Path) -> None:
    run = sky.submit(
        str(job), [str(job.parent / "ckpt"), "fail"], nodes=2, name="again", restarts=1
    )
    assert run.wait(timeout=60) == 0
    lines = _lines(run)
    assert "(node 1) rank 1 attempt 0 from step 0" in lines
    assert "(node 1) rank 1 attempt 1 from step 5" in lines
    assert "(node 0) rank 0 attempt 1 from step 5" in lines
    assert "(node 1) rank 1 done" in lines


def test_without_restarts_a_failing_rank_fails_the_run(job: Path) -> None:
    run = sky.submit(str(job), [str(job.parent / "ckpt"), "fail"], nodes=2, name="once")
    assert run.wait(timeout=60) == 4
    status = run.status()
    assert (status.state, status.rank, status.exit_status) == ("failed", 1, 4)
    assert status.reason == "rank 1 exited with status 4"


def test_the_record_is_owner_only(job: Path) -> None:
    sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=1, name="private").wait(60)
    runs = record.runs_dir()
    assert stat.S_IMODE(runs.stat().st_mode) == 0o700
    assert stat.S_IMODE((runs / "private.json").stat().st_mode) == 0o600
    for directory in record.load("private").directories:
        for path in [Path(directory), *Path(directory).iterdir()]:
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
        assert not (Path(directory) / "spec.json").exists()  # it held the run's environment


def test_logs_of_an_unknown_run_lists_the_runs_it_knows(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=1, name="known").wait(60)
    capsys.readouterr()
    assert main(["logs", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no detached run named 'nope'" in err and "known" in err
    assert main(["stop", "nope"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"name": "Bad Name"}, "run name 'Bad Name' is not valid"),
        ({"restarts": -1}, "restarts must be a whole number"),
        ({"restarts": 1.5}, "restarts must be a whole number"),
        ({"grace": float("nan")}, "grace must be a number of seconds"),
    ],
)
def test_bad_arguments_are_refused_before_a_pool_starts(
    job: Path, kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(sky.ConfigError, match=words):
        sky.submit(str(job), [], **kwargs)  # type: ignore[arg-type]


def test_a_name_in_use_is_refused(job: Path) -> None:
    sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=1, name="twice").wait(60)
    with pytest.raises(sky.ConfigError, match="'twice' exists already"):
        sky.submit(str(job), [], name="twice")


def test_run_flags_for_detached_runs_need_detach(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--name", "x", str(job)]) == 1
    assert "are for detached runs: add --detach" in capsys.readouterr().err


def test_a_made_up_name_is_short_and_readable() -> None:
    name = record.new_name()
    assert record.check_name(name) == name
    assert len(name.split("-")) == 3 and len(name) <= 24
    assert os.path.basename(name) == name


def test_outputs_come_back_with_the_end_and_with_fetch(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    run = sky.submit(
        str(job), [str(job.parent / "ckpt"), "ok"], nodes=2, name="outputs", output_dir=out
    )
    assert run.logs(follow=True, out=lambda line: None) == 0  # the end brings them
    assert [(out / f"node-{i}" / "result.txt").read_text() for i in (0, 1)] == ["0:0", "1:0"]
    assert main(["fetch", "outputs", "--to", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "node-1" / "result.txt").read_text() == "1:0"


def test_an_s3_output_dir_gets_every_nodes_outputs_from_the_nodes(
    job: Path, tmp_path: Path
) -> None:
    """The nodes upload their own once their rank ends: the client is not needed for it."""
    with moto_s3(tmp_path) as server:
        env = s3_env(server.url)
        boto3.client("s3", **_client_args(env)).create_bucket(Bucket="runs")
        run = sky.submit(
            str(job),
            [str(job.parent / "ckpt"), "ok"],
            nodes=2,
            name="to-s3",
            env=env,
            output_dir="s3://runs/exp",
        )
        assert run.wait(timeout=60) == 0
        s3 = boto3.client("s3", **_client_args(env))
        bodies = [
            s3.get_object(Bucket="runs", Key=f"exp/node-{i}/result.txt")["Body"].read()
            for i in (0, 1)
        ]
    assert bodies == [b"0:0", b"1:0"]


def _client_args(env: dict[str, str]) -> dict[str, str]:
    return {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "region_name": env["AWS_DEFAULT_REGION"],
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
    }


def test_an_output_dir_elsewhere_is_refused(job: Path) -> None:
    with pytest.raises(sky.ConfigError, match="or an s3:// prefix"):
        sky.submit(str(job), [], output_dir="gs://bucket/prefix")


def _leaders_of(name: str) -> list[int]:
    """This machine's processes leading run `name` (node 0's directory on their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"lead" in words and any(f"runs/{name}/node-0".encode() in w for w in words):
                found.append(int(entry.name))
    return found


def test_an_earlier_runs_leftovers_under_the_same_name_are_not_this_runs_plan(
    job: Path,
) -> None:
    # The record went (removed by hand), the node's directory stayed with the old plan: the
    # Local leader, started while the pool starts, must wait for this run's.
    from skyward.worker import supervisor

    old = supervisor.run_root("leftover") / "node-0"
    old.mkdir(parents=True)
    stale = {"launchers": [["false"]], "restarts": 0, "grace": 1}
    supervisor.write_private(old / supervisor.LEADER, json.dumps(stale))
    supervisor.write_private(old / supervisor.RUN_STATE, json.dumps({"state": "failed"}))
    run = sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=2, name="leftover")
    assert run.wait() == 0
    assert "rank 1 done" in "\n".join(_lines(run))


def test_a_pool_that_cannot_start_leaves_no_leader_waiting(job: Path) -> None:
    image = sky.Image(pip=["skyward-no-such-package-3f9a"])
    with pytest.raises(sky.SkywardError):
        sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=1, image=image, name="nope")
    assert _leaders_of("nope") == []
