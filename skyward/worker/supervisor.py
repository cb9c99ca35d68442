"""The supervisor of a detached run (``skyward run --detach``, `sky.submit`): it holds the run on
the nodes once the client is gone.

Its roles, each ``python -m skyward.worker.supervisor ROLE DIR ...``, standard library only:

- ``follow DIR``: one per node. It runs the node's rank (the ``argv`` of ``DIR/spec.json``, in
  its own process group), appends everything the rank prints to ``DIR/rank.log`` in order, and
  speaks to its leader over its own stdio: it prints ``started`` once the rank runs and
  ``exit N`` when it ends (``-N``: signal N). When its stdin ends (the leader stopped it, or the
  leader's node or channel is gone) it stops the rank: SIGTERM to its group, SIGKILL after the
  spec's ``grace`` seconds. Its state is ``DIR/node.json``.
- ``early DIR`` and ``attach DIR``: on an SSH node other than node 0, the follower starts
  with the pool, from the node's agent (``early``), before the leader exists: the rank runs at
  once, and what the follower says goes to ``DIR/said``. The leader's ``ssh`` (a key that runs
  ``attach DIR`` and nothing else) then claims that file and relays it, and the leader's
  stdin to the follower: its end (or 30 s of silence) stops the rank. An early follower that
  no leader attaches within `ATTACH_SECONDS`, or whose ``attach`` is gone, stops its rank.
  ``attach`` finding no early follower (a restart) is the follower itself. So the one ``ssh``
  login between nodes is not between the command and "every rank started".
- ``door DIR FD`` and ``dial HOST PORT KEY``: where the nodes have no sshd (pods), node i's
  agent also opens a **door**, a TCP listener on the nodes' own network that admits only who
  proves it holds the secret made for this run and node (node i's spec and node 0's keys hold
  it; an HMAC of fresh nonces, both ways, so the secret never crosses the network and a
  recorded exchange opens nothing). For each connection it admits it runs ``attach DIR`` with
  the connection as its stdin and stdout. The leader's launcher for that node is ``dial``,
  which connects, proves, and relays its stdio over the connection as ``ssh`` would.
- ``lead DIR``: one per run, on node 0 (or in the Slurm batch job). It starts one follower per
  rank through the launcher ``DIR/leader.json`` names for it: the follower itself for its own
  node, ``ssh`` to a key that only runs that node's ``attach`` (an SSH host, a cloud VM),
  ``dial`` to that node's door (a pod), or a ``srun`` step (Slurm). It enforces the gang rule:
  one rank that fails (or whose node is lost) stops the others; with restarts left and no node
  lost, every rank starts again. SIGTERM asks it to stop the run. The run's state is
  ``DIR/run.json``: ``starting``, ``running``, ``succeeded``, ``failed`` (with the rank and its
  status), ``stopped``.

Nothing here listens on a port facing the client: the leader reaches the followers over sshd,
Slurm or a door on the nodes' own network; the client reads the files over the same paths as
a live pool (SSH, Slurm, the provider's own commands: a pod's exec stream). Followers and the
leader also run in the node's agent (`prepare_node`, `start_leader`, the calls the client makes
while the pool is up). Files are written owner-only: a spec holds the run's environment
(``env=`` secrets too), and it is removed when the follower ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

# Nothing more of skyward here: a supervisor process starts between `skyward run --detach` and
# "every rank started" (an early follower, the leader), and skyward.info or .worker.script
# would double its imports. The functions that run in an agent or in the leader's launchers
# import what they need themselves.
from skyward.cachedir import keep_private, write_private

if TYPE_CHECKING:  # a door and its dial import it themselves (see above)
    import socket

SPEC = "spec.json"
LOG = "rank.log"
REPORTS = "reports.jsonl"  # what the rank gave sky.report, a JSON line each
REPORTS_FILE_ENV = "SKYWARD_REPORTS_FILE"  # = skyward.reports.REPORTS_FILE_ENV (see above)
NODE_STATE = "node.json"
RUN_STATE = "run.json"
LEADER = "leader.json"
LEADER_LOG = "leader.log"
KEYS = "keys"
KNOWN_HOSTS = "known_hosts"
KEY_TAG = "skyward-run"  # the comment that marks a run's line in authorized_keys
SAID = "said"  # what an early follower says, for its `attach` (renamed to CLAIMED by it)
CLAIMED = "said.attached"
ATTACH_LOCK = "attach.lock"  # held by a live `attach`
EARLY_LOG = "early.log"  # an early follower's own stderr
DOOR_LOG = "door.log"  # a door's own output: whom it refused, and why
OUTPUTS = "outputs"  # the rank's sky.output_dir(), in its node's directory
SCRIPT = "script"  # a lone script's copy (`prepare_node`'s `source`)

FINAL = ("succeeded", "failed", "stopped")
# A launcher that is this word and a node's directory: the leader follows that rank itself.
IN_PROCESS = "@here"
# This module by name: run as ``-m`` it is ``__main__``, and its commands must name it.
MODULE = "skyward.worker.supervisor"


class RunState(TypedDict, total=False):
    """What ``run.json`` holds (node 0's directory; every field but `state` optional)."""

    state: str  # starting, running, succeeded, failed, stopped
    rank: int  # failed: the first rank that failed
    status: int  # failed: its exit status (-N: signal N); lost: -1 with reason
    reason: str  # failed: in words ("exited with status 3", "node 1 was lost")
    attempt: int  # how many restarts so far
    started_at: float
    running_at: float
    ended_at: float
    leader_pid: int


# -- files ------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} while it is not there."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_root(name: str) -> Path:
    """Where a run's directories live on this node: ``<cache>/runs/<name>``."""
    from skyward.cachedir import cache_root

    return Path(cache_root()) / "runs" / name


def rank_path(node: int, rank: int, per_node: int) -> str:
    """A rank's directory under a run's (and its outputs' under a local output directory):
    ``node-<i>``, or ``node-<i>/rank-<r>`` (`rank` global) where a node holds several ranks,
    as a live pool's outputs are laid out."""
    return f"node-{node}" if per_node == 1 else f"node-{node}/rank-{rank}"


def rank_directory(name: str) -> Path:
    """In a rank's agent: that rank's directory of run `name` on this node."""
    from skyward.info import instance_info

    info = instance_info()
    return run_root(name) / rank_path(info.node, info.rank, info.processes_per_node)


# -- the follower -------------------------------------------------------------------------------


# The leader writes a newline to every follower this often; a follower that hears nothing for
# LEADER_SILENT seconds takes its leader (node 0, or the channel to it) as gone and stops its
# rank: a node that powers off closes no connection.
HEARTBEAT_SECONDS = 5.0
LEADER_SILENT = 30.0
# What the leader writes to a follower before it ends the follower's channel for a restart:
# the follower keeps the spec, which the next attempt starts from. Without it the run is over
# on that node, and its spec (the run's environment) and key go.
AGAIN = b"again\n"


def follow(directory: Path) -> int:
    """Run this node's rank as a process of its own (see the module's docstring)."""
    stop = threading.Event()
    # A leader whose channel closes leaves our stdout without a reader: EPIPE, not a death.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    leader = _watch_leader(stop)

    def say(word: str) -> None:
        with contextlib.suppress(OSError):
            print(word, flush=True)

    if run_node(directory, stop, say, finish=False) is None:
        return 2
    _finish_unless_again(directory, stop, leader)
    return 0


def _finish_unless_again(directory: Path, stop: threading.Event, leader: _Leader) -> None:
    """Once this node's rank has ended: wait for the leader's end of the channel (it closes
    it once it knows how the run goes on), and remove what the run left here unless the
    leader said ``again`` (a restart starts this node's rank from its spec once more). A
    leader that dies says nothing: no restart can come, and the spec (it holds the run's
    environment, ``env=`` secrets too) goes."""
    stop.wait()
    if not leader.again:
        finish_node(directory, read_json(directory / SPEC).get("key_tag"))


def run_node(directory: Path, stop: threading.Event, say: Any, finish: bool = True) -> int | None:
    """One attempt of this node's rank: `say` hears ``started`` and ``exit N``; `stop` set
    stops it. Returns its status, or None when the node has no spec. `finish`: the last
    attempt removes what the run left here (`finish_node`) once it has said how it ended."""
    spec = read_json(directory / SPEC)
    if not spec:
        say(f"no run spec in {directory}")
        return None
    grace = float(spec.get("grace", 10.0))
    # Each start of this node's follower is one attempt of the run; the spec stays while the
    # leader may still start it again (a restart), and goes with the last attempt.
    spec["starts"] = int(read_json(directory / NODE_STATE).get("starts", 0)) + 1
    status = _run_rank(directory, spec, grace, stop, say)
    if spec.get("upload"):
        _upload(directory, spec)
    if float(spec.get("keep_for", 0)) > 0:
        _hold(directory, float(spec["keep_for"]))
    say(f"exit {status}")
    if finish and last_attempt(spec):
        finish_node(directory, spec.get("key_tag"))
    return status


def last_attempt(spec: Mapping[str, Any]) -> bool:
    """Whether the attempt `spec` counts (its ``starts``) is the last the leader may make."""
    return int(spec["starts"]) > int(spec.get("restarts", 0))


def _run_rank(
    directory: Path, spec: Mapping[str, Any], grace: float, stop: threading.Event, say: Any
) -> int:
    # The spec's environment over the follower's own: what the node gives this process (a
    # Slurm step's SLURM_* and CUDA_VISIBLE_DEVICES) stays where the spec does not say.
    env = {**os.environ, **{str(k): str(v) for k, v in dict(spec.get("env", {})).items()}}
    env["SKYWARD_RESTART"] = str(spec["starts"] - 1)  # 0, then 1 after the first restart...
    env[REPORTS_FILE_ENV] = str(directory / REPORTS)  # the script's sky.report, kept by rank
    log_fd = os.open(directory / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        rank = subprocess.Popen(
            list(spec["argv"]),
            cwd=spec.get("cwd") or None,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,  # its own group: stopping it stops what it started
        )
    except OSError as exc:
        os.write(log_fd, f"skyward: the rank could not start: {exc}\n".encode())
        os.close(log_fd)
        _node_state(directory, {"state": "exited", "status": 127, "starts": spec["starts"]})
        return 127
    os.close(log_fd)
    running = {"pid": rank.pid, "follower": os.getpid(), "starts": spec["starts"]}
    _node_state(directory, {"state": "running", **running})
    say("started")
    while rank.poll() is None and not stop.wait(0.1):
        pass
    if rank.poll() is None:
        _stop_group(rank, grace)
    status = rank.wait()
    _node_state(directory, {"state": "exited", "status": status, "starts": spec["starts"]})
    return status


def _stop_group(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process's group, SIGKILL after `grace` seconds if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what the rank started, too


def _node_state(directory: Path, state: Mapping[str, Any]) -> None:
    write_private(directory / NODE_STATE, json.dumps({**state, "at": time.time()}))


def _upload(directory: Path, spec: Mapping[str, Any]) -> None:
    """Mirror the rank's outputs to the run's bucket (``<uri>/node-<i>``, or
    ``<uri>/node-<i>/rank-<r>`` where a node holds several ranks) with the rank's
    interpreter and environment (its credentials, the image's boto3), as a live pool's nodes
    do; what it says goes to the rank's log."""
    env = {**os.environ, **{str(k): str(v) for k, v in dict(spec.get("env", {})).items()}}
    where = spec.get("outputs_at", f"node-{spec['rank']}")
    target = f"{str(spec['upload']).rstrip('/')}/{where}"
    command = [spec["argv"][0], "-m", "skyward.worker.s3sync", "upload", output_dir(directory)]
    with open(directory / LOG, "ab") as log:
        log.write(f"[skyward] uploading the outputs to {target}\n".encode())
        log.flush()
        done = subprocess.run(
            [*command, target], env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
        if done.returncode != 0:
            log.write(f"[skyward] the upload to {target} failed ({done.returncode})\n".encode())


def _hold(directory: Path, seconds: float) -> None:
    """Keep this machine up `seconds` more for whoever fetches the outputs: a cloud machine's
    watchdog counts this process (``linger``) as a detached run. Its pid goes in the node's
    state, so that `skyward fetch` lets the machine go once it has what it came for."""
    holder = subprocess.Popen(
        [*interpreter(), "-m", MODULE, "linger", str(directory), str(seconds)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state = read_json(directory / NODE_STATE)
    write_private(directory / NODE_STATE, json.dumps({**state, "holder": holder.pid}))


def linger(directory: Path, seconds: str) -> int:
    """``linger DIR SECONDS``: nothing but being there (see `_hold`); SIGTERM ends it."""
    time.sleep(float(seconds))
    return 0


def finish_node(directory: Path, key_tag: str | None) -> None:
    """What the run left on this node goes, its log and state aside: the spec (it holds the
    run's environment) and the key that let the leader start this follower."""
    with contextlib.suppress(OSError):
        (directory / SPEC).unlink()
    if key_tag:
        remove_authorized(key_tag)


# -- the early follower and its attach -----------------------------------------------------------

# How long an early follower waits for its leader's `attach` before it stops its rank: as long
# as a follower bears a silent leader (a leader that dies before its ``ssh`` reaches this node
# leaves no channel to close).
ATTACH_SECONDS = LEADER_SILENT
# How long `prepare_node` waits for an early follower's rank to start (a process to spawn).
START_SECONDS = 60.0


def start_early(directory: Path, timeout: float) -> None:
    """In node i's agent: start its follower now, in a session of its own (it outlives the
    agent and the client), and wait until its rank runs; a `RuntimeError` if it does not."""
    write_private(directory / SAID, "")
    follower = _spawn_role([*interpreter(), "-m", MODULE, "early"], directory, EARLY_LOG)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = (directory / SAID).read_text(errors="replace").split()
        if "started" in said or "exit" in said:
            return
        if follower.poll() is not None:
            raise RuntimeError(
                f"the run's follower on this node ended at once ({follower.returncode}): "
                f"{_tail(directory / EARLY_LOG)}"
            )
        time.sleep(0.005)
    follower.kill()
    raise RuntimeError(f"the run's follower on this node did not start within {timeout:.0f} s")


def follow_early(directory: Path) -> int:
    """``early DIR``: run this node's rank now and say how it goes in ``DIR/said``, for the
    leader's `attach` to relay; stop it when no leader attaches in time or its attach is gone
    (see the module's docstring)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    said = open(directory / SAID, "a", encoding="utf-8")  # noqa: SIM115  (open for our life)
    said.write(f"pid {os.getpid()}\n")
    said.flush()

    def say(word: str) -> None:
        said.write(word + "\n")
        said.flush()

    within = float(read_json(directory / SPEC).get("attach_within", ATTACH_SECONDS))
    deadline = time.monotonic() + within
    threading.Thread(target=_watch_attach, args=(directory, stop, deadline), daemon=True).start()
    if run_node(directory, stop, say, finish=False) is None:
        return 2  # no spec: nothing ran (`start_early` says so)
    # The leader learns how the rank ended from `attach`: wait for one to claim what we said.
    while (directory / SAID).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if (directory / SAID).exists():  # no leader came (nor will): nothing can start it again
        finish_node(directory, read_json(directory / SPEC).get("key_tag"))
    # Claimed: by an `attach`, which removes what the run left once its leader says the run
    # is over, or by `stop_early`, whose caller does (`abandon`).
    return 0


def abandon(name: str) -> None:
    """In a node's agent, when run `name` could not start on every node: stop what this node
    started for it (`stop_early`), and leave no spec or key (each rank's agent, its own)."""
    stop_early(rank_directory(name))


def stop_early(directory: Path) -> None:
    """Stop the rank this node's early follower runs, if any, before any leader came: its
    ``said`` is claimed here (no leader will: it ends without waiting for one), then it gets
    SIGTERM and stops its rank as for a leader's end. The run never starts, whatever its
    restarts, so what it left here (its spec, its key) goes too."""
    with contextlib.suppress(OSError):
        os.rename(directory / SAID, directory / CLAIMED)
    follower = int(read_json(directory / NODE_STATE).get("follower", 0))
    if follower > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGTERM)
    finish_node(directory, read_json(directory / SPEC).get("key_tag"))


def _watch_attach(directory: Path, stop: threading.Event, deadline: float) -> None:
    """Set `stop` when no attach came by `deadline`, or when the one that came is gone (its
    lock on ``attach.lock`` free: the kernel lets it go with its process)."""
    while not stop.wait(0.2):
        if (directory / SAID).exists():  # not claimed yet
            if time.monotonic() > deadline:
                stop.set()
            continue
        fd = os.open(directory / ATTACH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # the attach holds it
        finally:
            os.close(fd)  # (and with it a lock we got)
        stop.set()


def attach(directory: Path) -> int:
    """``attach DIR``, what the leader's ``ssh`` runs: relay this node's early follower (what
    it said, and the leader's stdin: its end or silence stops the rank), or, when none waits
    to be claimed, be the follower (a restart's attempt)."""
    lock = os.open(directory / ATTACH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held for our life: the early follower's sign we live
    try:
        os.rename(directory / SAID, directory / CLAIMED)
    except FileNotFoundError:
        return follow(directory)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a leader gone: EPIPE, not a death
    stop = threading.Event()
    leader = _watch_leader(stop)
    told = _relay(directory, stop)
    _finish_unless_again(directory, stop, leader)
    return 0 if told else 1


def _relay(directory: Path, stop: threading.Event) -> bool:
    """`attach`'s part while the early follower runs: print what it says, SIGTERM it once
    `stop` is set; whether it said how its rank ended (False: it died without saying, and
    the leader calls the node lost)."""
    follower = 0
    asked = False
    with open(directory / CLAIMED, encoding="utf-8") as said:
        while True:
            line = said.readline()
            if line.endswith("\n"):
                word = line.strip()
                if word.startswith("pid "):
                    follower = int(word.split()[1])
                    continue
                with contextlib.suppress(OSError):
                    print(word, flush=True)
                if word.startswith("exit "):
                    return True
                continue
            if follower and not alive(follower):  # (it writes its pid first thing)
                return False
            if stop.is_set() and not asked:
                asked = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(follower, signal.SIGTERM)  # it stops its rank, then says so
            time.sleep(0.02)


class _Leader:
    """What a follower heard from its leader: when last, and whether it said ``again``."""

    def __init__(self) -> None:
        self.heard = time.monotonic()
        self.again = False


def _watch_leader(stop: threading.Event) -> _Leader:
    """Set `stop` when our stdin (the leader's channel) ends or is silent for LEADER_SILENT s;
    what the leader said (`AGAIN` before it ends the channel for a restart)."""
    leader = _Leader()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def watch_stdin() -> None:
        seen = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(0, 4096):
                leader.heard = time.monotonic()
                seen = seen[-len(AGAIN) :] + chunk  # a word split across two reads counts
                if AGAIN in seen:
                    leader.again = True
        stop.set()

    def watch_silence() -> None:
        while not stop.wait(1.0):
            if time.monotonic() - leader.heard > LEADER_SILENT:
                stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    threading.Thread(target=watch_silence, daemon=True).start()
    return leader


def alive(pid: int) -> bool:
    """Whether process `pid` of this machine runs (a zombie, ended but not yet reaped by its
    parent, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


# -- the door: the leader's way in over the nodes' own network ---------------------------------

# What a door says first, and the version of the exchange that follows.
DOOR_GREETING = b"skyward-door 1"
# Seconds a connection has to prove itself: one that does not (a port scan, a stalled peer)
# is dropped, and never keeps the leader out (each is handled on its own thread).
HANDSHAKE_SECONDS = 10.0
_HANDSHAKES = 8  # connections proving themselves at once; more are dropped
_NONCE_BYTES = 32
_LINE_LIMIT = 512
# How long `dial` tries to connect: a node's name may take seconds to resolve (a cluster's DNS
# learns of a pod's address a little after the pod has it).
DIAL_SECONDS = 20.0
# A connection whose other end went silent (its node powered off: no FIN comes) fails within
# about this long, as ssh's ServerAliveInterval makes it: keepalive probes while it is idle, and
# a bound on how long sent data may go unacknowledged (the leader's heartbeats are data).
_SILENT_LINK_SECONDS = 15


def open_door(directory: Path) -> int:
    """In node i's agent: start this node's door (``door DIR FD``, in a session of its own: it
    outlives the agent and the client) on a listening socket made here, so that its port is
    known before this returns; the port."""
    listener = _listener()
    try:
        argv = [*interpreter(), "-m", MODULE, "door"]
        _spawn_role(argv, directory, DOOR_LOG, passed=listener.fileno())
        return int(listener.getsockname()[1])
    finally:
        listener.close()  # the door holds its own copy


def _listener() -> socket.socket:
    """A TCP listener on a free port of every address of this node (IPv6 and IPv4 where the
    node has IPv6, IPv4 alone where it has not)."""
    import socket

    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
    else:
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
        except OSError:
            sock.close()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
    sock.listen(16)
    return sock


def door(directory: Path, fd: int) -> int:
    """``door DIR FD``: admit node 0's leader to this node's follower (see the module's
    docstring) on the listening socket `fd`, for as long as the run lasts here: it ends once
    the spec is gone (the run ended on this node, or never started), or when no ``attach``
    it started has run for as long as a follower bears a silent leader (nothing will come)."""
    import socket

    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    listener = socket.socket(fileno=fd)
    listener.settimeout(1.0)  # a look at the spec each second
    spec = read_json(directory / SPEC)
    secret = str(spec.get("door_secret") or "")
    if not secret:
        print(f"skyward door: no secret in {directory / SPEC}: nothing to admit", file=sys.stderr)
        return 2
    idle_limit = max(float(spec.get("attach_within", ATTACH_SECONDS)), LEADER_SILENT)
    attaches: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()
    handshakes = threading.BoundedSemaphore(_HANDSHAKES)
    idle_since = time.monotonic()
    while (directory / SPEC).exists():
        with lock:
            attaches[:] = [child for child in attaches if child.poll() is None]
            if attaches:
                idle_since = time.monotonic()
        if time.monotonic() - idle_since > idle_limit:
            print("skyward door: no leader came: closing", file=sys.stderr, flush=True)
            break
        try:
            conn, peer = listener.accept()
        except OSError:  # (the second's timeout too)
            continue
        if not handshakes.acquire(blocking=False):
            conn.close()
            continue
        admit = threading.Thread(
            target=_admit,
            args=(conn, peer, secret, directory, attaches, lock, handshakes),
            daemon=True,
        )
        admit.start()
    listener.close()
    return 0


def _admit(
    conn: socket.socket,
    peer: Any,
    secret: str,
    directory: Path,
    attaches: list[subprocess.Popen[bytes]],
    lock: threading.Lock,
    handshakes: threading.BoundedSemaphore,
) -> None:
    """One connection at the door: once it has proved it holds the secret, ``attach DIR`` with
    the connection as its stdin and stdout."""
    try:
        why = _door_handshake(conn, secret)
        if why is not None:
            print(f"skyward door: refused {peer}: {why}", file=sys.stderr, flush=True)
            return
        _tune(conn)
        conn.settimeout(None)  # the attach reads and writes it blocking
        with lock:
            if not (directory / SPEC).exists():
                return  # the run ended here meanwhile: nothing to attach to
            attaches.append(
                subprocess.Popen(
                    [*interpreter(), "-m", MODULE, "attach", str(directory)],
                    stdin=conn.fileno(),
                    stdout=conn.fileno(),
                    close_fds=True,
                )
            )
    except OSError as exc:
        print(f"skyward door: {peer}: {exc}", file=sys.stderr, flush=True)
    finally:
        conn.close()  # (the attach has its own copy)
        handshakes.release()


def _proof(secret: str, role: bytes, door_nonce: bytes, dial_nonce: bytes) -> bytes:
    """What `role` (``leader``, ``node``) sends to prove it holds `secret` for this exchange."""
    import hashlib
    import hmac

    message = b"skyward-door|" + role + b"|" + door_nonce + dial_nonce
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest().encode()


def _read_line(sock: socket.socket, got: bytes) -> tuple[bytes, bytes]:
    """The next line from `sock` (after `got`, read already) and what came after it."""
    while b"\n" not in got:
        if len(got) > _LINE_LIMIT:
            raise ConnectionError("a line longer than the exchange has")
        chunk = sock.recv(_LINE_LIMIT)
        if not chunk:
            raise ConnectionError("the connection closed during the exchange")
        got += chunk
    line, _, rest = got.partition(b"\n")
    return line, rest


def _door_handshake(conn: socket.socket, secret: str) -> str | None:
    """The door's side: a fresh nonce out, the dialer's nonce and proof in, the door's own
    proof out; None once admitted, else why not."""
    import hmac
    import secrets as tokens

    conn.settimeout(HANDSHAKE_SECONDS)
    mine = tokens.token_bytes(_NONCE_BYTES)
    try:
        conn.sendall(DOOR_GREETING + b" " + mine.hex().encode() + b"\n")
        line, rest = _read_line(conn, b"")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    words = line.split()
    try:
        theirs = bytes.fromhex(words[0].decode()) if len(words) == 2 else b""
    except ValueError:
        theirs = b""
    if rest or len(theirs) != _NONCE_BYTES:
        return "it does not speak the door's exchange"
    if not hmac.compare_digest(words[1], _proof(secret, b"leader", mine, theirs)):
        with contextlib.suppress(OSError):
            conn.sendall(b"refused\n")
        return "it did not prove it holds the run's secret for this node"
    conn.sendall(_proof(secret, b"node", mine, theirs) + b"\n")
    return None


def _dial_handshake(sock: socket.socket, secret: str) -> bytes:
    """The dialer's side: the door's nonce in, a fresh nonce and the proof out, the door's
    proof in (`ConnectionError` when it is wrong: not this run's node); what came after it
    (the follower's first words)."""
    import hmac
    import secrets as tokens

    sock.settimeout(HANDSHAKE_SECONDS)
    line, rest = _read_line(sock, b"")
    greeting, _, nonce = line.rpartition(b" ")
    try:
        theirs = bytes.fromhex(nonce.decode())
    except ValueError:
        theirs = b""
    if greeting != DOOR_GREETING or len(theirs) != _NONCE_BYTES or rest:
        raise ConnectionError("what answers there is not a skyward run's door")
    mine = tokens.token_bytes(_NONCE_BYTES)
    sock.sendall(mine.hex().encode() + b" " + _proof(secret, b"leader", theirs, mine) + b"\n")
    reply, rest = _read_line(sock, rest)
    if reply == b"refused":
        raise ConnectionError("the door refused the run's secret (another run's door?)")
    if not hmac.compare_digest(reply, _proof(secret, b"node", theirs, mine)):
        raise ConnectionError("the door did not prove it holds the run's secret: not this node")
    return rest


def _tune(sock: socket.socket) -> None:
    """A silent other end fails `sock` within `_SILENT_LINK_SECONDS` (where Linux lets us)."""
    import socket

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = (
        ("TCP_KEEPIDLE", 5),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", _SILENT_LINK_SECONDS * 1000),
    )
    for name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def dial(host: str, port: int, key: Path) -> int:
    """``dial HOST PORT KEY``, the leader's launcher for a node behind a door: connect, prove
    the secret in file `KEY`, then relay this process's stdin to the follower and the
    follower's words to its stdout, as ``ssh`` would; 255 (ssh's status for a connection that
    failed) with the reason on stderr when it cannot."""
    import socket

    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a leader gone: EPIPE, not a death
    where = f"{host}:{port}"
    try:
        secret = key.read_text().strip()
    except OSError as exc:
        print(f"cannot read the run's secret for {where}: {exc}", file=sys.stderr)
        return 255
    deadline = time.monotonic() + DIAL_SECONDS
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(
                    f"cannot connect to the run's door at {where} ({exc}) within "
                    f"{DIAL_SECONDS:.0f} s: the nodes must reach each other on their own "
                    "network (a NetworkPolicy or firewall between them refuses it)",
                    file=sys.stderr,
                )
                return 255
            time.sleep(0.5)
    try:
        early = _dial_handshake(sock, secret)
    except OSError as exc:
        print(f"the run's door at {where}: {exc}", file=sys.stderr)
        sock.close()
        return 255
    _tune(sock)
    sock.settimeout(None)

    def send() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(0, 1 << 16):
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)  # the leader's end: the follower stops its rank

    threading.Thread(target=send, daemon=True).start()
    try:
        if early:
            _write_all(1, early)
        while chunk := sock.recv(1 << 16):
            _write_all(1, chunk)
    except OSError as exc:
        print(f"the connection to {where} broke: {exc}", file=sys.stderr)
        return 255
    return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- authorized_keys: the leader's way in, one line per node and run --------------------------


def _authorized_keys() -> Path:
    return Path.home() / ".ssh" / "authorized_keys"


def authorize(public_key: str, command: str, tag: str) -> None:
    """Let `public_key` run `command` and nothing else here (no shell, no forwarding, no pty)."""
    path = _authorized_keys()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    quoted = command.replace("\\", "\\\\").replace('"', '\\"')
    line = f'restrict,command="{quoted}" {public_key.strip()} {tag}\n'
    with _locked(path) as handle:
        text = handle.read()
        if text and not text.endswith("\n"):
            text += "\n"
        _rewrite(handle, text + line)


def remove_authorized(tag: str) -> None:
    """Remove the authorized_keys lines that end with `tag` (a run's node)."""
    path = _authorized_keys()
    if not path.exists():
        return
    with _locked(path) as handle:
        lines = handle.read().splitlines(keepends=True)
        kept = [line for line in lines if not line.rstrip("\n").endswith(" " + tag)]
        if len(kept) != len(lines):
            _rewrite(handle, "".join(kept))


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle


def _rewrite(handle: Any, text: str) -> None:
    handle.seek(0)
    handle.write(text)
    handle.truncate()
    handle.flush()


# -- the leader ---------------------------------------------------------------------------------


class _Rank:
    """One rank's follower as the leader sees it: its launcher process and what it said."""

    def __init__(self, index: int, argv: Sequence[str], events: queue.Queue[tuple[int, str]]):
        self.index = index
        self.argv = list(argv)
        self.events = events
        self.process: subprocess.Popen[bytes] | None = None
        self.here: threading.Event | None = None  # an in-process follower's stop
        self.thread: threading.Thread | None = None
        self.started = False
        self.status: int | None = None  # its rank's exit status, once reported
        self.complaint: list[str] = []  # the last lines its launcher wrote on stderr
        self.said: list[str] = []  # the far follower's last words on stdout not for the leader

    @property
    def directory(self) -> Path | None:
        """The node's run directory of a rank this leader follows itself, else None."""
        return Path(self.argv[1]) if self.argv[0] == IN_PROCESS else None

    def start(self, log: int) -> None:
        self.started, self.status, self.complaint, self.said = False, None, [], []
        if self.directory is not None:
            self._start_here(self.directory)
            return
        from skyward.worker.script import die_with_parent  # (see the imports)

        try:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                # A leader that dies takes its launchers along: the followers' channels close
                # and they stop their ranks at once.
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            os.write(log, f"rank {self.index}: its launcher could not start: {exc}\n".encode())
            self.complaint = [f"its launcher could not start: {exc}"]
            self.events.put((self.index, "lost"))
            return
        complaints = threading.Thread(
            target=self._complaints, args=(self.process, log), daemon=True
        )
        complaints.start()
        threading.Thread(target=self._read, args=(self.process, complaints), daemon=True).start()

    def _complaints(self, process: subprocess.Popen[bytes], log: int) -> None:
        """The launcher's stderr (ssh's "Permission denied", srun's errors): to the leader's
        log, and its last lines kept for the reason a node that never started is given."""
        assert process.stderr is not None
        for raw in process.stderr:
            with contextlib.suppress(OSError):
                os.write(log, f"rank {self.index}: ".encode() + raw)
            self.complaint = [*self.complaint[-4:], raw.decode(errors="replace").strip()]

    def _start_here(self, directory: Path) -> None:
        """This node's rank, followed by a thread of the leader: no process more in between.
        The leader removes what the run left in `directory` when the run ends (`lead`)."""
        here = self.here = threading.Event()

        def follow_here() -> None:
            say = lambda word: self.events.put((self.index, word))  # noqa: E731
            run_node(directory, here, say, finish=False)
            self.events.put((self.index, "gone"))

        self.thread = threading.Thread(target=follow_here, daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen[bytes], complaints: threading.Thread) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "started" or line.startswith("exit "):
                self.events.put((self.index, line))
            elif line:  # the far follower's own words ("no run spec in DIR"): why, if it ends
                self.said = [*self.said[-4:], line]
        process.wait()
        # "gone" is when the leader reads `complaint` for the reason: the launcher's last words
        # on stderr (ssh's "Permission denied") must be in it, not still in the pipe. Bounded:
        # a grandchild that kept stderr open must not hold the run's end.
        complaints.join(timeout=5)
        self.events.put((self.index, "gone"))

    def beat(self) -> None:
        process = self.process
        if process is not None and process.stdin is not None and not process.stdin.closed:
            with contextlib.suppress(OSError, ValueError):
                process.stdin.write(b"\n")
                process.stdin.flush()

    def stop(self, again: bool = False) -> None:
        """Close the follower's stdin: it stops its rank (SIGTERM, then SIGKILL). `again`: a
        restart follows, and the follower keeps its spec for it (`AGAIN`)."""
        if self.here is not None:
            self.here.set()
        if self.process is not None and self.process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                if again:
                    self.process.stdin.write(AGAIN)
                    self.process.stdin.flush()
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def lead(directory: Path) -> int:
    """Hold the run (see the module's docstring) until it ends; returns 0. A leader started
    before its plan was written (Local: `skyward.detached.submit`) waits for it first."""
    plan = _wait_plan(directory)
    if not plan:
        return 0  # the run's start failed before it was planned: there is nothing to lead
    launchers: list[list[str]] = plan["launchers"]
    restarts = int(plan.get("restarts", 0))
    grace = float(plan.get("grace", 10.0))
    per_node = int(plan.get("per_node", 1))
    state: RunState = {"state": "starting", "attempt": 0, "started_at": time.time()}
    state["leader_pid"] = os.getpid()
    _run_state(directory, state)
    stop = threading.Event()
    events: queue.Queue[tuple[int, str]] = queue.Queue()

    def stopping(*_: object) -> None:
        stop.set()
        events.put((-1, "stop"))

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, stopping)
    log = os.open(directory / LEADER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    ranks = [_Rank(i, argv, events) for i, argv in enumerate(launchers)]
    here = [rank.directory for rank in ranks if rank.directory is not None]
    guard = _start_guard(directory)
    threading.Thread(target=_heartbeat, args=(ranks, stop), daemon=True).start()
    try:
        while True:
            for rank in ranks:
                rank.start(log)
            end = _watch(ranks, events, state, directory, per_node)
            if stop.is_set():
                end = {"state": "stopped", "reason": "stopped by skyward stop"}
            retry = end["state"] == "failed" and not end.get("lost")
            retry = retry and state["attempt"] < restarts
            _stop_all(ranks, events, grace, again=retry)
            if retry and not stop.is_set():
                state["attempt"] += 1
                with contextlib.suppress(OSError):
                    os.write(log, f"restart {state['attempt']} of {restarts}: {end}\n".encode())
                _run_state(directory, {**state, "state": "restarting", "reason": end["reason"]})
                continue
            if stop.is_set():
                end = {"state": "stopped", "reason": "stopped by skyward stop"}
            final: RunState = {**state, **end, "ended_at": time.time()}  # type: ignore[typeddict-item]
            final.pop("lost", None)  # type: ignore[typeddict-item]
            _run_state(directory, final)
            return 0
    finally:
        for rank in ranks:
            rank.kill()
        _finish_here(directory, here)
        if guard is not None and guard.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                guard.stdin.write(GUARD_END)  # the run ended in order: nothing to do
                guard.stdin.close()
        os.close(log)


def _finish_here(directory: Path, here: Sequence[Path]) -> None:
    """The run has ended: what it left on this node goes (the ranks this leader followed
    itself: their specs; the keys to the other nodes), logs, states and outputs aside."""
    import shutil

    for node in here:
        finish_node(node, None)
    shutil.rmtree(directory / KEYS, ignore_errors=True)


def _wait_plan(directory: Path) -> dict[str, Any]:
    """``leader.json`` once it is there (written whole: `write_private`). A leader started
    ahead of its plan (`leader_ahead`) has its client at the other end of its stdin: the
    client writes a line once the plan is there, however long its pool took to start, and
    its end (or death) without one leaves the plan empty. Any other leader has its plan
    already (its stdin is empty)."""
    with contextlib.suppress(OSError):
        os.read(0, 1)  # a line, or the end: both mean "look now"
    return read_json(directory / LEADER)


# What the leader writes to its guard when it ends in order (the guard has nothing to do).
GUARD_END = b"end\n"


def _start_guard(directory: Path) -> subprocess.Popen[bytes]:
    """The leader's guard (`guard`), in a session of its own, at the other end of a pipe from
    this process: its end without `GUARD_END` is the leader's death."""
    return _spawn_role([*interpreter(), "-m", MODULE, "guard"], directory, LEADER_LOG, piped=True)


def guard(directory: Path) -> int:
    """``guard DIR``: outlive the leader of the run whose node-0 directory is DIR. The ranks
    the leader follows itself (every rank on Local, node 0's elsewhere) are its children; when
    it dies (killed, out of memory) nothing else would stop them, while the other nodes' stop
    as their channels to it close. So once the leader's end of our stdin closes without
    `GUARD_END`, this stops those ranks as a follower does (SIGTERM to each group, SIGKILL
    after the run's grace), removes what the run left here, and ends the run's state:
    ``failed``, naming the supervisor's death."""
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    seen = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(0, 64):
            seen += chunk
    if GUARD_END in seen:
        return 0
    plan = read_json(directory / LEADER)
    grace = float(plan.get("grace", 10.0))
    here = [Path(a[1]) for a in plan.get("launchers", []) if a and a[0] == IN_PROCESS]
    groups = []
    for node in here:
        state = read_json(node / NODE_STATE)
        if state.get("state") == "running":
            groups.append((node, int(state["pid"]), state))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(state["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_alive(pid) for _, pid, _ in groups):
        time.sleep(0.1)
    for node, pid, state in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        _node_state(node, {**state, "state": "exited", "status": -int(signal.SIGTERM)})
    _finish_here(directory, here)
    run = read_json(directory / RUN_STATE)
    if run.get("state") not in FINAL:
        reason = "the run's supervisor on node 0 died; the ranks it held were stopped"
        ended = {"state": "failed", "status": -1, "reason": reason, "ended_at": time.time()}
        _run_state(directory, {**run, **ended})
    return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _heartbeat(ranks: list[_Rank], stop: threading.Event) -> None:
    """A newline to every follower process every few seconds: each knows its leader lives."""
    while not stop.wait(HEARTBEAT_SECONDS):
        for rank in ranks:
            rank.beat()


def _watch(
    ranks: list[_Rank],
    events: queue.Queue[tuple[int, str]],
    state: RunState,
    directory: Path,
    per_node: int = 1,
) -> dict[str, Any]:
    """Read the followers' words until the run (this attempt) ends; how it ended. The ranks
    are in rank order, `per_node` to a node: an end names the rank's node where a node holds
    several."""
    done: set[int] = set()
    while True:
        index, word = events.get()
        if index < 0:  # skyward stop
            return {"state": "stopped"}
        rank = ranks[index]
        if word == "started":
            rank.started = True
            if all(r.started for r in ranks) and state["state"] != "running":
                state["state"] = "running"
                state.setdefault("running_at", time.time())
                _run_state(directory, state)
            continue
        if word.startswith("exit "):
            rank.status = int(word.split()[1])
            if rank.status == 0:
                done.add(index)
                if len(done) == len(ranks):
                    return {"state": "succeeded"}
                continue
            return {
                "state": "failed",
                "rank": index,
                "status": rank.status,
                "reason": _status_words(_rank_words(index, per_node), rank.status),
            }
        if word in ("gone", "lost") and rank.status is None:
            # The launcher ended before its follower said how the rank ended: the node or
            # its channel is gone (ssh's status 255, a cancelled srun step).
            node = index // per_node
            reason = f"node {node} was lost (its supervisor could not be reached)"
            if not rank.started:
                reason = _unreached(node, [*rank.said, *rank.complaint])
            return {"state": "failed", "rank": index, "status": -1, "lost": True, "reason": reason}


def _unreached(node: int, complaint: Sequence[str]) -> str:
    """Why node `node`'s rank was never reached, from what its launcher (``ssh``) said."""
    said = " | ".join(line for line in complaint if line) or "it said nothing"
    reason = f"node 0 could not reach node {node}'s rank ({said})"
    if "Permission denied" in said:
        reason += (
            f"; node {node}'s sshd did not take the run's key, which skyward adds to "
            "~/.ssh/authorized_keys there: its sshd_config reads keys from elsewhere "
            "(AuthorizedKeysFile, AuthorizedKeysCommand). Add .ssh/authorized_keys to its "
            "AuthorizedKeysFile, or run the script attached (without --detach)"
        )
    return reason


def _rank_words(rank: int, per_node: int) -> str:
    """``rank R``, or ``node N rank R`` where a node holds several ranks."""
    return f"rank {rank}" if per_node == 1 else f"node {rank // per_node} rank {rank}"


def _status_words(rank: str, status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "unknown"
        return f"{rank} was killed by signal {-status} ({name})"
    return f"{rank} exited with status {status}"


def _stop_all(
    ranks: list[_Rank], events: queue.Queue[tuple[int, str]], grace: float, again: bool = False
) -> None:
    """Stop every follower still running and wait for them (their grace, then a kill);
    `again`: each is told that a restart follows (see `AGAIN`)."""
    for rank in ranks:
        rank.stop(again)
    deadline = time.monotonic() + grace + 5
    for rank in ranks:
        if rank.thread is not None:
            rank.thread.join(max(0.0, deadline - time.monotonic()))
        if rank.process is None:
            continue
        try:
            rank.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.process.wait()
    while not events.empty():  # what they said while stopping belongs to this attempt
        events.get_nowait()


def _run_state(directory: Path, state: Mapping[str, Any]) -> None:
    write_private(directory / RUN_STATE, json.dumps(dict(state)))


# -- what the client calls in the agents while the pool is up -----------------------------------


def prepare_node(
    name: str,
    script: str,
    args: Sequence[str],
    cwd: str | None,
    grace: float,
    restarts: int,
    leader_key: str | None,
    keep_for: float = 0.0,
    upload: str | None = None,
    source: bytes | None = None,
    door_secret: str | None = None,
) -> dict[str, Any]:
    """Write this node's spec for run `name` (in the agent, whose environment the rank gets) and,
    with `leader_key` (a node the leader reaches over SSH), start its rank now under an early
    follower and let that key run this node's ``attach`` and nothing else; with `door_secret`
    (a node the leader reaches over the nodes' network), the same behind a door that admits
    only who holds that secret (`open_door`). Returns the node's directory and login user
    (and its door's port), for the leader's launchers. With `source`, `script` is a file
    name: the script is `source`, written in the run's directory here."""
    import getpass

    from skyward.info import instance_info

    info = instance_info()
    where = rank_path(info.node, info.rank, info.processes_per_node)
    directory = _node_directory(name, where)
    if source is not None:
        script = _write_script(directory, script, source)
    tag = f"{KEY_TAG}:{name}:{where.replace('/', ':')}"
    spec = _node_spec(name, info.rank, where, directory, script, args, cwd)
    spec.update(grace=grace, restarts=restarts, keep_for=keep_for, upload=upload)
    spec["key_tag"] = tag if leader_key else None
    if door_secret:
        spec["door_secret"] = door_secret  # (the spec is owner-only, and goes with the run)
    write_private(directory / SPEC, json.dumps(spec))
    door = _start_rank(directory, leader_key, tag, door_secret)
    return {
        "directory": str(directory),
        "here": [IN_PROCESS, str(directory)],
        "user": getpass.getuser(),
        "key_tag": tag if leader_key else None,
        "attach_within": ATTACH_SECONDS,
        "door": door,
        "dial": [*interpreter(), "-m", MODULE, "dial"],
    }


def _node_directory(name: str, where: str) -> Path:
    """This rank's directory of run `name`, owner-only up to the runs' root, emptied of what an
    earlier run of the same name left there."""
    directory = run_root(name) / where
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for parent in directory.parents[: len(Path(where).parts) + 1]:
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
    _clear_earlier(directory)
    return directory


def _write_script(directory: Path, script: str, source: bytes) -> str:
    """The script the client sent, written in the run's directory; returns its path. It goes in
    a folder of its own: its name may be any of the run's files'."""
    (directory / SCRIPT).mkdir(mode=0o700, exist_ok=True)
    path = directory / SCRIPT / os.path.basename(script)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(source)
    return str(path)


def _node_spec(
    name: str,
    rank: int,
    where: str,
    directory: Path,
    script: str,
    args: Sequence[str],
    cwd: str | None,
) -> dict[str, Any]:
    """What the follower runs and how: the rank's command, its directory and the environment
    it inherits from the agent (whose environment the pool built)."""
    from skyward.info import OUTPUT_ENV_VAR as OUTPUT_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1", OUTPUT_ENV: output_dir(directory)}
    return {
        "name": name,
        "rank": rank,
        "outputs_at": where,
        "argv": [sys.executable, "-m", "skyward.worker.script", script, *args],
        "cwd": cwd or os.getcwd(),
        "env": env,
        "attach_within": ATTACH_SECONDS,
    }


def _start_rank(
    directory: Path, leader_key: str | None, tag: str, door_secret: str | None
) -> int | None:
    """Start the node's rank under an early follower, for a leader that comes over SSH (its key
    may run this node's ``attach`` and nothing else) or through a door; returns the door's
    port. A node the leader follows itself starts nothing here."""
    if leader_key:
        attach_argv = [*interpreter(), "-m", MODULE, "attach", str(directory)]
        authorize(leader_key, " ".join(_shell_word(w) for w in attach_argv), tag)
        start_early(directory, START_SECONDS)
        return None
    if not door_secret:
        return None
    # The door first: the rank runs from the early follower on, and the leader that comes for
    # it must find the door open.
    door = open_door(directory)
    try:
        start_early(directory, START_SECONDS)
    except BaseException:
        finish_node(directory, None)  # (the door ends with the spec)
        raise
    return door


def _clear_earlier(directory: Path) -> None:
    """Remove what an earlier run of the same name left in this node's `directory` (its
    states, log and outputs): a new run starts with empty logs and outputs. A leader started
    ahead here (`leader_ahead`) began from an empty directory, and its log is this run's."""
    import shutil

    stale_files = (NODE_STATE, RUN_STATE, SAID, CLAIMED, LOG, EARLY_LOG, DOOR_LOG, SPEC)
    for stale in (*stale_files, ATTACH_LOCK):
        (directory / stale).unlink(missing_ok=True)
    for folder in (OUTPUTS, SCRIPT, KEYS):
        shutil.rmtree(directory / folder, ignore_errors=True)


def output_dir(directory: Path) -> str:
    """The rank's `sky.output_dir()`: the run's own, beside its log (the pool's goes with the
    pool, while the run goes on)."""
    path = directory / OUTPUTS
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def interpreter() -> list[str]:
    """The command line prefix that runs this interpreter with this skyward and without the
    site packages: the supervisor needs the standard library only, and starts sooner."""
    source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return ["env", f"PYTHONPATH={source}", sys.executable, "-S"]


def follower_command(directory: Path) -> list[str]:
    """The command that runs this node's follower as a process of its own."""
    return [*interpreter(), "-m", MODULE, "follow", str(directory)]


def _shell_word(word: str) -> str:
    import shlex

    return shlex.quote(word)


def start_leader(
    name: str,
    launchers: Sequence[Sequence[str]],
    keys: Mapping[int, str],
    known_hosts: str,
    restarts: int,
    grace: float,
    timeout: float,
) -> RunState:
    """On node 0: start the run's leader outside the agent (its own session: it outlives the
    agent and the client) and wait until every rank has started or the run has ended. The
    other nodes' ranks may run already (early followers): they count as started once the
    leader has reached them, so a node whose sshd refuses the run's key fails the start.
    Its directory is rank 0's (this agent's)."""
    from skyward.info import instance_info

    directory = rank_directory(name)
    (directory / LEADER_LOG).unlink(missing_ok=True)  # an earlier run's of this name
    per_node = instance_info().processes_per_node
    write_plan(directory, launchers, keys, known_hosts, restarts, grace, per_node)
    leader = spawn_leader(directory, interpreter())
    return wait_started(directory, leader, timeout)


def write_plan(
    directory: Path,
    launchers: Sequence[Sequence[str]],
    keys: Mapping[int, str],
    known_hosts: str,
    restarts: int,
    grace: float,
    per_node: int = 1,
) -> None:
    """Node 0's part of the leader's plan: its keys to the other nodes, their host keys, and
    ``leader.json`` (the launchers, one a rank in rank order, and the ranks a node holds),
    last: a leader started ahead begins once it is there."""
    (directory / RUN_STATE).unlink(missing_ok=True)
    keydir = directory / KEYS
    keydir.mkdir(mode=0o700, exist_ok=True)
    argvs = [list(argv) for argv in launchers]
    for index, key in keys.items():
        path = keydir / f"node-{index}"
        write_private(path, key)
        argvs[index] = [w.replace("{key}", str(path)) for w in argvs[index]]
    write_private(keydir / KNOWN_HOSTS, known_hosts)
    argvs = [[w.replace("{known_hosts}", str(keydir / KNOWN_HOSTS)) for w in a] for a in argvs]
    plan = {"launchers": argvs, "restarts": restarts, "grace": grace, "per_node": per_node}
    write_private(directory / LEADER, json.dumps(plan))


def leader_ahead(name: str, per_node: int = 1) -> tuple[Path, subprocess.Popen[bytes]]:
    """Where nodes are this machine's processes (Local): start run `name`'s leader now, before
    the pool, so its interpreter starts while the pool does; it waits for `write_plan`. Its
    directory (node 0's) and process, whose stdin the caller holds: a line on it says the
    plan is there (`plan_written`), its end without one that there will be none. Its
    directory is rank 0's, for nodes of `per_node` ranks each."""
    import shutil

    # An earlier run of this name left its files here (every node's: they are this machine's):
    # this run starts with empty logs and outputs.
    shutil.rmtree(run_root(name), ignore_errors=True)
    directory = run_root(name) / rank_path(0, 0, per_node)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory, spawn_leader(directory, interpreter(), ahead=True)


def plan_written(leader: subprocess.Popen[bytes]) -> None:
    """Tell a leader started ahead (`leader_ahead`) that its plan is there."""
    assert leader.stdin is not None
    with contextlib.suppress(OSError):
        leader.stdin.write(b"plan\n")
        leader.stdin.close()


def spawn_leader(
    directory: Path, prefix: Sequence[str], ahead: bool = False
) -> subprocess.Popen[bytes]:
    """``lead DIR`` in a session of its own, its output on a file: nothing of the caller holds
    it. `ahead`: its stdin is a pipe from the caller, who writes the plan later."""
    return _spawn_role([*prefix, "-m", MODULE, "lead"], directory, LEADER_LOG, piped=ahead)


def _spawn_role(
    argv: Sequence[str],
    directory: Path,
    log: str,
    piped: bool = False,
    passed: int | None = None,
) -> subprocess.Popen[bytes]:
    """``argv DIR`` in a session of its own (it outlives its caller: the agent, the client),
    its output appended to ``DIR/log``; no stdin (`piped`: one the caller holds). `passed`: a
    file descriptor it inherits, named after DIR."""
    out = os.open(directory / log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    extra = [] if passed is None else [str(passed)]
    try:
        return subprocess.Popen(
            [*argv, str(directory), *extra],
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            close_fds=True,
            pass_fds=() if passed is None else (passed,),
        )
    finally:
        os.close(out)


def wait_started(
    directory: Path, leader: subprocess.Popen[bytes] | None, timeout: float
) -> RunState:
    """Wait until ``run.json`` says every rank started (or the run ended) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = read_json(directory / RUN_STATE)
        if state.get("state") in ("running", *FINAL):
            return state  # type: ignore[return-value]
        if leader is not None and leader.poll() is not None and not state:
            tail = _tail(directory / LEADER_LOG)
            return {"state": "failed", "reason": f"the supervisor did not start: {tail}"}
        time.sleep(0.01)
    return {"state": "starting", "reason": f"not every rank had started after {timeout:.0f} s"}


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return "(no output)"


# -- Slurm: the run is a batch job --------------------------------------------------------------

SLURM_PLAN = "slurm.json"
# What a rank's environment must not take from the pool's agent: its node's identity, and
# the pool job's Slurm world (the batch job has its own).
_NODE_OWN = ("SKYWARD_INSTANCE_INFO", "JAX_", "SLURM_", "CUDA_VISIBLE_DEVICES", "SKYWARD_AGENT")
_TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def node_environment(script: str, cwd: str | None) -> dict[str, Any]:
    """In node 0's agent: what every rank of a batch job starts from: the environment, the
    interpreter with this skyward (`prefix`), the script's path and the working directory."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(_NODE_OWN) and k not in _TORCHRUN
    }
    return {
        "env": {**env, "PYTHONUNBUFFERED": "1"},
        "python": sys.executable,
        "prefix": interpreter(),
        "script": script,
        "cwd": cwd or os.getcwd(),
    }


def lead_batch(root: Path) -> int:
    """The batch job of a detached Slurm run: learn the job's nodes, write each rank's spec
    (its JAX_* and torchrun variables for a coordinator on this node; ``per_node`` ranks a
    node, ``--nproc-per-node``), then lead the run with one ``srun`` step per rank as its
    launcher."""
    from skyward.info import OUTPUT_ENV_VAR as OUTPUT_ENV  # (see the imports)

    plan = read_json(root / SLURM_PLAN)
    hosts = _slurm_out(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).split()
    per_node = int(plan.get("per_node", 1))
    world = len(hosts) * per_node
    head = _node_address(hosts[0])
    port, torch_port = _free_ports(head, 2)
    launchers = []
    for rank in range(world):
        node, local = divmod(rank, per_node)
        directory = root / rank_path(node, rank, per_node)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {
            **plan["env"],
            OUTPUT_ENV: output_dir(directory),
            "JAX_COORDINATOR_ADDRESS": f"{head}:{port}",
            "JAX_COORDINATOR_BIND_ADDRESS": f"{head}:{port}",  # not [::] (jax_plugin)
            "JAX_NUM_PROCESSES": str(world),
            "JAX_PROCESS_ID": str(rank),
            # torchrun's, as `skyward run` sets them (NODE_RANK too, Lightning's name)
            "MASTER_ADDR": head,
            "MASTER_PORT": str(torch_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node),
            "NODE_RANK": str(node),
        }
        spec = {
            "name": plan["name"],
            "rank": rank,
            "argv": [plan["python"], "-m", "skyward.worker.script", *plan["argv"]],
            "cwd": plan["cwd"],
            "env": env,
            "grace": plan["grace"],
            "restarts": plan["restarts"],
            "upload": plan.get("upload"),
            "key_tag": None,
        }
        write_private(directory / SPEC, json.dumps(spec))
        # A step a rank: the job's node `node`, overlapping the batch script's own step.
        step = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={hosts[node]}"]
        here = [IN_PROCESS, str(directory)]  # the batch script runs on the job's first node
        launchers.append(here if rank == 0 else [*step, *follower_command(directory)])
    first = root / rank_path(0, 0, per_node)
    leader = {
        "launchers": launchers,
        "restarts": plan["restarts"],
        "grace": plan["grace"],
        "per_node": per_node,
    }
    write_private(first / LEADER, json.dumps(leader))
    return lead(first)


def _slurm_out(argv: Sequence[str]) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True).stdout


def _node_address(name: str) -> str:
    """The address Slurm reaches node `name` at (``NodeAddr``), as its peers should."""
    for word in _slurm_out(["scontrol", "show", "node", name]).split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    return name


def _free_ports(address: str, count: int) -> list[int]:
    """`count` distinct free ports at `address`: each socket stays bound until every port is
    chosen, as a port released at once may be the next one chosen (JAX and torch on one)."""
    import socket

    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind((address, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def main(argv: Sequence[str]) -> int:
    keep_private()
    roles = {
        "lead": lead,
        "follow": follow,
        "early": follow_early,
        "attach": attach,
        "batch": lead_batch,
        "guard": guard,
    }
    if len(argv) == 3 and argv[0] == "linger":
        return linger(Path(argv[1]), argv[2])
    if len(argv) == 3 and argv[0] == "door":
        return door(Path(argv[1]), int(argv[2]))
    if len(argv) == 4 and argv[0] == "dial":
        return dial(argv[1], int(argv[2]), Path(argv[3]))
    if len(argv) != 2 or argv[0] not in roles:
        usage = "lead|follow|early|attach|batch|guard DIR, door DIR FD, dial HOST PORT KEY"
        print(f"usage: python -m skyward.worker.supervisor {usage}", file=sys.stderr)
        return 2
    return roles[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
