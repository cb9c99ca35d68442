"""A detached run's early follower and its attach, as real processes on this machine.

On an SSH node other than node 0 the rank starts with the pool, under an early follower its
agent starts (`supervisor.start_early`); the leader's ``ssh`` later runs ``attach`` there. What
runs over ssh is these same processes with the channel as ``attach``'s stdio: here the test
holds that stdio itself (tests/ssh/test_ssh_detached.py runs them over real sshd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skyward.cachedir import write_private
from skyward.worker import supervisor


def _spec(directory: Path, code: str, attach_within: float = 60.0) -> Path:
    directory.mkdir(mode=0o700, parents=True)
    spec = {
        "name": "t",
        "rank": 1,
        "argv": [sys.executable, "-c", code],
        "cwd": str(directory),
        "env": {},
        "grace": 2.0,
        "restarts": 0,
        "keep_for": 0,
        "upload": None,
        "key_tag": None,
        "attach_within": attach_within,
    }
    write_private(directory / supervisor.SPEC, json.dumps(spec))
    return directory


def _attach(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*supervisor.interpreter(), "-m", supervisor.MODULE, "attach", str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _node(directory: Path) -> dict[str, object]:
    return supervisor.read_json(directory / supervisor.NODE_STATE)


def _wait_exited(directory: Path, seconds: float) -> dict[str, object]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (node := _node(directory)).get("state") == "exited":
            return node
        time.sleep(0.05)
    raise AssertionError(f"the rank did not end within {seconds} s: {_node(directory)}")


def _gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as stat:  # a zombie of this test's child counts
            if stat.read().split(") ")[-1].startswith("Z"):
                return True
        time.sleep(0.05)
    return False


SLEEPER = "import time; print('up', flush=True); time.sleep(60)"


def test_an_early_rank_is_relayed_by_its_attach_and_stops_when_the_leader_goes(
    tmp_path: Path,
) -> None:
    directory = _spec(tmp_path / "node-1", SLEEPER)
    supervisor.start_early(directory, 20)
    rank = int(_node(directory)["pid"])  # type: ignore[call-overload]
    attach = _attach(directory)
    assert attach.stdout is not None and attach.stdin is not None
    assert attach.stdout.readline().strip() == "started"
    attach.stdin.close()  # the leader's channel ends
    assert attach.stdout.readline().strip() == f"exit -{signal.SIGTERM}"
    assert attach.wait(10) == 0
    assert _gone(rank), "the rank outlived its leader"
    assert "up" in (directory / supervisor.LOG).read_text()


def test_a_rank_that_ends_before_its_leader_attaches_is_still_told(tmp_path: Path) -> None:
    directory = _spec(tmp_path / "node-1", "raise SystemExit(3)")
    supervisor.start_early(directory, 20)
    _wait_exited(directory, 10)
    attach = _attach(directory)
    out, _ = attach.communicate(timeout=10)
    assert out.split() == ["started", "exit", "3"]
    deadline = time.monotonic() + 5  # the follower finishes once it sees the claim
    while (directory / supervisor.SPEC).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (directory / supervisor.SPEC).exists(), "the last attempt leaves no spec"


def test_an_early_rank_no_leader_attaches_to_is_stopped(tmp_path: Path) -> None:
    directory = _spec(tmp_path / "node-1", SLEEPER, attach_within=1.0)
    supervisor.start_early(directory, 20)
    rank = int(_node(directory)["pid"])  # type: ignore[call-overload]
    assert _wait_exited(directory, 10)["status"] == -signal.SIGTERM
    assert _gone(rank)


def test_an_early_rank_stops_when_its_attach_is_killed(tmp_path: Path) -> None:
    # A leader's node that powers off, or an sshd that kills its session, leaves no EOF: the
    # early follower sees its attach's lock go with the process.
    directory = _spec(tmp_path / "node-1", SLEEPER)
    supervisor.start_early(directory, 20)
    rank = int(_node(directory)["pid"])  # type: ignore[call-overload]
    attach = _attach(directory)
    assert attach.stdout is not None
    assert attach.stdout.readline().strip() == "started"
    attach.kill()
    attach.wait()
    assert _wait_exited(directory, 10)["status"] == -signal.SIGTERM
    assert _gone(rank)


def test_attach_with_no_early_follower_is_the_follower(tmp_path: Path) -> None:
    # A restart: the leader starts every rank again through the same launcher.
    directory = _spec(tmp_path / "node-1", "print('again', flush=True)")
    attach = _attach(directory)
    assert attach.stdout is not None and attach.stdin is not None
    said = [attach.stdout.readline().strip() for _ in range(2)]  # its stdin still open
    assert said == ["started", "exit 0"]
    attach.stdin.close()
    assert attach.wait(10) == 0
    assert "again" in (directory / supervisor.LOG).read_text()


def test_an_early_follower_that_cannot_start_says_why(tmp_path: Path) -> None:
    directory = tmp_path / "node-1"
    directory.mkdir()  # no spec: the follower has nothing to run
    with pytest.raises(RuntimeError, match="ended at once"):
        supervisor.start_early(directory, 20)


def test_an_early_rank_of_a_run_that_could_not_start_everywhere_is_stopped(
    tmp_path: Path,
) -> None:
    # Another node's preparation failed: the client stops what this one started, at once
    # rather than after the wait for a leader.
    directory = _spec(tmp_path / "node-1", SLEEPER)
    supervisor.start_early(directory, 20)
    rank = int(_node(directory)["pid"])  # type: ignore[call-overload]
    supervisor.stop_early(directory)
    assert _wait_exited(directory, 10)["status"] == -signal.SIGTERM
    assert _gone(rank)
    deadline = time.monotonic() + 5  # the follower ends without waiting for a leader
    while (directory / supervisor.SPEC).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (directory / supervisor.SPEC).exists()


def test_a_batch_jobs_ports_are_distinct() -> None:
    """A Slurm batch job's JAX and torch ports are chosen together: each chosen port stays
    bound until all are, so the kernel cannot hand one out twice. Choosing 500 releasing each
    at once repeats one on nearly every try (the ephemeral range holds ~14,000 of a parity)."""
    ports = supervisor._free_ports("127.0.0.1", 500)
    assert len(ports) == 500 and len(set(ports)) == 500
    assert all(0 < port < 65536 for port in ports)


def test_key_lines_are_edited_in_place_under_the_lock_a_symlink_stays_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ~/.ssh/authorized_keys is a link (to a file a configuration tool manages), the
    supervisor's edits and the client's clean-up both write through it, leaving it a link and
    every other line as it was."""
    from skyward.detached.reach import _UNAUTHORIZE

    home, managed = tmp_path / "home", tmp_path / "managed_keys"
    (home / ".ssh").mkdir(parents=True)
    managed.write_text("ssh-ed25519 AAAAother someone@else\n")
    (home / ".ssh" / "authorized_keys").symlink_to(managed)
    monkeypatch.setenv("HOME", str(home))
    for node in (1, 2):
        supervisor.authorize(f"ssh-ed25519 AAAAkey{node}", "true", f"skyward-run:x:node-{node}")
    supervisor.remove_authorized("skyward-run:x:node-1")
    subprocess.run(
        ["sh", "-c", _UNAUTHORIZE.format(tag="skyward-run:x:node-2")],
        env={**os.environ, "HOME": str(home)},
        check=True,
    )
    assert (home / ".ssh" / "authorized_keys").is_symlink()
    assert managed.read_text() == "ssh-ed25519 AAAAother someone@else\n"
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


def test_a_rank_whose_launcher_ends_before_it_starts_is_named_with_what_it_said(
    tmp_path: Path,
) -> None:
    """The leader's reason for a rank never reached holds the far side's own words (a
    follower that found no spec says so on stdout) beside the launcher's stderr."""
    directory = tmp_path / "node-0"
    directory.mkdir()
    launchers = [
        ["sh", "-c", "echo started; sleep 5; echo 'exit 0'"],
        ["sh", "-c", "echo 'no run spec in /somewhere'; echo 'ssh: a complaint' >&2"],
    ]
    supervisor.write_plan(directory, launchers, {}, "", restarts=0, grace=1.0)
    led = subprocess.run(
        [sys.executable, "-m", "skyward.worker.supervisor", "lead", str(directory)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    assert led.returncode == 0, led.stderr
    state = json.loads((directory / supervisor.RUN_STATE).read_text())
    assert state["state"] == "failed"
    assert state["reason"] == (
        "node 0 could not reach node 1's rank (no run spec in /somewhere | ssh: a complaint)"
    )


def test_the_supervisor_names_the_reports_file_as_the_scripts_read_it() -> None:
    """The supervisor spells the variable out (it imports nothing more of skyward): the same
    name `sky.report` reads in a detached rank."""
    from skyward import reports

    assert supervisor.REPORTS_FILE_ENV == reports.REPORTS_FILE_ENV
