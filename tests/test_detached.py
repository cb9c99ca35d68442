"""Detached runs on Local: `sky.submit`, `sky.Run` from another process, restarts, refusals.

The SSH side (a client whose machine goes away) is tests/ssh/test_ssh_detached.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

import skyward as sky
from skyward.cachedir import write_private
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
    write_private(old / supervisor.LEADER, json.dumps(stale))
    write_private(old / supervisor.RUN_STATE, json.dumps({"state": "failed"}))
    run = sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=2, name="leftover")
    assert run.wait() == 0
    assert "rank 1 done" in "\n".join(_lines(run))


def test_a_pool_that_cannot_start_leaves_no_leader_waiting(job: Path) -> None:
    image = sky.Image(pip=["skyward-no-such-package-3f9a"])
    with pytest.raises(sky.SkywardError):
        sky.submit(str(job), [str(job.parent / "ckpt"), "ok"], nodes=1, image=image, name="nope")
    assert _leaders_of("nope") == []


# A rank that says it runs, then waits to be stopped (its token names its processes).
WAITER = """\
import os, sys, time
print(f"rank {os.environ['JAX_PROCESS_ID']} up {os.getpid()}", flush=True)
time.sleep(600)
"""


def _rank_pids(name: str, nodes: int) -> list[int]:
    from skyward.worker import supervisor

    pids = []
    for node in range(nodes):
        state = supervisor.read_json(supervisor.run_root(name) / f"node-{node}" / "node.json")
        pids.append(int(state["pid"]))
    return pids


def test_a_killed_leader_takes_its_ranks_down_and_the_run_says_why(tmp_path: Path) -> None:
    """The leader holds every Local rank itself: SIGKILLed, it cannot stop them, and its guard
    does (as another node's follower does when the leader's channel closes)."""
    from tests.conftest import alive, wait_gone

    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    run = sky.submit(str(script), [], nodes=2, name="headless", grace=2)
    ranks = _rank_pids("headless", 2)
    assert all(alive(pid) for pid in ranks)
    state = json.loads((Path(run.record.directories[0]) / "run.json").read_text())
    leader = int(state["leader_pid"])
    os.kill(leader, signal.SIGKILL)
    assert wait_gone(ranks, timeout=20) == [], "a rank outlived its leader"
    deadline = time.monotonic() + 10  # the guard says how the run ended once they are gone
    while (status := run.status()).state == "lost" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (status.state, status.returncode) == ("failed", 1)
    assert "supervisor on node 0 died" in status.reason
    for directory in run.record.directories:
        assert not (Path(directory) / "spec.json").exists()  # it held the run's environment


@pytest.mark.slow
def test_a_pool_that_takes_longer_than_a_minute_to_start_still_starts_its_run(
    tmp_path: Path,
) -> None:
    """The leader starts with the pool and waits for its plan as long as the pool takes."""
    script = tmp_path / "hello.py"
    script.write_text("print('hello from', __import__('os').environ['JAX_PROCESS_ID'])\n")

    def slow_start(info: sky.InstanceInfo) -> None:  # nested: it travels by value
        import time

        time.sleep(75)

    plugin = sky.Plugin("slow-start", around_app=slow_start)
    run = sky.submit(str(script), [], nodes=1, name="patient", plugins=[plugin])
    assert run.wait(timeout=60) == 0
    assert _lines(run) == ["(node 0) hello from 0"]


# Two clients that start a run of one name at once: each says how its submit went.
RACER = """\
import sys
import skyward as sky
try:
    sky.submit(sys.argv[1], [sys.argv[2]], nodes=2, name="contested")
except sky.ConfigError as exc:
    print("refused:", exc)
else:
    print("started")
"""

COUNTER = """\
import os, sys, time
with open(os.path.join(sys.argv[1], f"rank-{os.getpid()}"), "w") as mark:
    mark.write(os.environ["JAX_PROCESS_ID"])
time.sleep(2)
"""


def test_two_clients_starting_one_name_at_once_make_one_run(tmp_path: Path) -> None:
    script, marks = tmp_path / "counter.py", tmp_path / "marks"
    script.write_text(COUNTER)
    marks.mkdir()
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(script), str(marks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    said = sorted(racer.communicate(timeout=120)[0].strip() for racer in racers)
    assert said[1] == "started", said
    assert said[0].startswith("refused:") and "contested" in said[0], said
    assert sky.Run("contested").wait(timeout=60) == 0
    assert sorted(path.read_text() for path in marks.iterdir()) == ["0", "1"]  # no stray rank


def test_a_run_that_succeeds_after_a_restart_leaves_no_secret_behind(tmp_path: Path) -> None:
    """The spec holds the run's environment: it goes when the run ends on its nodes (before any
    client looks), whatever the restarts left unused."""
    import secrets

    from skyward.cachedir import cache_root
    from skyward.worker import supervisor

    canary = f"canary-{secrets.token_hex(8)}"
    script = tmp_path / "quiet.py"
    script.write_text("print('done')\n")
    sky.submit(str(script), [], nodes=2, name="secretive", env={"K": canary}, restarts=1)
    node0 = supervisor.run_root("secretive") / "node-0"
    deadline = time.monotonic() + 60
    state: dict[str, object] = {}
    while time.monotonic() < deadline:
        state = supervisor.read_json(node0 / "run.json")
        if state.get("state") in supervisor.FINAL and not supervisor.alive(
            int(state.get("leader_pid", 0))  # type: ignore[call-overload]
        ):
            break
        time.sleep(0.05)
    assert state.get("state") == "succeeded", state
    holders = [
        str(path)
        for path in Path(cache_root()).rglob("*")
        if path.is_file()
        and path.stat().st_size < 1 << 22  # (not an environment's libraries)
        and canary.encode() in path.read_bytes()
    ]
    assert holders == []


def test_submit_takes_a_string_of_arguments_as_a_shell_would(tmp_path: Path) -> None:
    script = tmp_path / "echo.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n")
    run = sky.submit(str(script), "--lr 0.1 'a b'", nodes=1, name="quoted")
    assert run.wait(timeout=60) == 0
    assert _lines(run) == ["(node 0) ['--lr', '0.1', 'a b']"]
    with pytest.raises(sky.ConfigError, match="list of strings"):
        sky.submit(str(script), [1, 2], nodes=1, name="numbers")  # type: ignore[list-item]


def test_a_reused_name_starts_with_empty_logs_and_outputs(tmp_path: Path) -> None:
    script = tmp_path / "once.py"
    script.write_text(
        "import os, sys\nprint('attempt', sys.argv[1])\n"
        "open(os.path.join(os.environ['SKYWARD_OUTPUT_DIR'], sys.argv[1]), 'w').close()\n"
    )
    assert sky.submit(str(script), ["first"], nodes=1, name="reused").wait(timeout=60) == 0
    with pytest.raises(sky.ConfigError, match="exists already"):
        sky.submit(str(script), ["second"], nodes=1, name="reused")
    assert main(["status", "--forget", "reused"]) == 0
    run = sky.submit(str(script), ["second"], nodes=1, name="reused")
    assert run.wait(timeout=60) == 0
    assert _lines(run) == ["(node 0) attempt second"]
    fetched = run.fetch(tmp_path / "out")
    assert sorted(p.name for p in fetched[0].iterdir()) == ["second"]


def test_status_forgets_only_runs_that_have_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache of its own: --forget-ended would forget the other tests' runs too.
    monkeypatch.setenv("SKYWARD_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    run = sky.submit(str(script), [], nodes=1, name="going", grace=1)
    assert main(["status", "--forget", "going"]) == 1
    assert "run going is running" in capsys.readouterr().err
    assert record.exists("going")
    run.stop()
    assert main(["status", "--forget-ended"]) == 0
    assert capsys.readouterr().out.startswith("forgot run going (stopped")
    assert not record.exists("going")
    assert record.all_records() == []


def test_a_runs_cost_counts_the_time_keep_for_holds_its_machines() -> None:
    """A cloud run's machines wait --keep-for seconds after its end for its outputs, and are
    paid for: its cost runs to the end of that wait, or to the fetch that lets them go."""
    now = time.time()
    ended = {"state": "succeeded", "running_at": now - 3600 * 3, "ended_at": now - 3600}
    kept = record.RunRecord(
        name="held",
        provider="aws",
        kind="ssh",
        nodes=2,
        script="train.py",
        args=[],
        created_at=now - 3600 * 3,
        directories=["/a", "/b"],
        price_per_hour=1.5,
        keep_for=1800.0,
        last=ended,
    )
    record.save(kept)
    # two hours of the run and half an hour held, on two nodes at $1.50 an hour each
    assert sky.Run("held").status().cost == pytest.approx(1.5 * 2 * 2.5)
    kept.last = {**ended, "released_at": now - 3600 + 600}  # a fetch let them go 10 min in
    record.save(kept)
    assert sky.Run("held").status().cost == pytest.approx(1.5 * 2 * (2 + 1 / 6))
    record.forget("held")
