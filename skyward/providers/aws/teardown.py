"""Removing a pool from EC2: a reconciliation loop that ends with nothing left, or says what is.

Each round lists what the pool's tags still show, kind by kind, and removes it in dependency
order: instances first; the placement group and the security group once no instance of the pool
is left (EC2 refuses them with DependencyViolation / InUse until then); the key pair on its own.
Every step is idempotent ("not found" counts as removed) and a failing step never stops the
others. What the client knows it made (`Made`: instance ids, key pair and group names) is
removed too, so a listing that fails cannot hide it. Rounds repeat, `poll` apart while EC2 is
merely slow and with growing, jittered backoff while calls fail, until a successful listing of
every kind shows nothing, or `timeout` runs out: then ONE `ProvisionError` lists what remains
and ends with the command that retries. That loop is `cloud.reconcile`'s; this module
brings the EC2 round.

Retrying what is retryable (throttling, 5xx, dropped connections) is botocore's job (the
provider's clients use its adaptive retry mode); what still fails becomes a problem in one place,
`_call`, which names the EC2 call that failed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from skyward.providers.aws.resources import LIVE_STATES, POOL_TAG
from skyward.providers.cloud.reconcile import Log, Step, Words, reconcile

INSTANCE = "instance"
PLACEMENT_GROUP = "placement group"
SECURITY_GROUP = "security group"
KEY_PAIR = "key pair"
KINDS = (INSTANCE, PLACEMENT_GROUP, SECURITY_GROUP, KEY_PAIR)  # the order of removal
_AFTER_INSTANCES = (PLACEMENT_GROUP, SECURITY_GROUP)
_NOT_YET = ("DependencyViolation", "InvalidPlacementGroup.InUse")
# Kinds whose every resource the client names (`Made`) before it asks EC2 for it: for a pool's
# own teardown, a kind it never made needs no listing to be known gone. (Not the security
# group, whose id EC2 gives: a create whose answer was lost may have made one.)
_NAMED_FIRST = (PLACEMENT_GROUP, KEY_PAIR)
# Failed listings of a kind the pool never made before the teardown stops asking.
NEVER_MADE_TRIES = 2
_WORDS = Words("EC2", "removing", " --provider aws")


@dataclass
class Made:
    """What a launch made, or was about to make, by kind: known without asking EC2."""

    ids: dict[str, set[str]] = field(default_factory=lambda: {kind: set() for kind in KINDS})

    def add(self, kind: str, *ids: str) -> None:
        self.ids[kind].update(ids)


@dataclass(frozen=True)
class _Kind:
    list_api: str  # the EC2 API name of the listing, as a failure names it
    list_call: str  # the botocore method that lists the kind by tag
    list_key: str  # where its reply holds them
    id_key: str  # what names one
    delete_call: str
    delete_arg: str
    gone: tuple[str, ...]  # error codes that mean "already removed"


_KINDS = {
    PLACEMENT_GROUP: _Kind(
        "DescribePlacementGroups",
        "describe_placement_groups",
        "PlacementGroups",
        "GroupName",
        "delete_placement_group",
        "GroupName",
        ("InvalidPlacementGroup.Unknown",),
    ),
    SECURITY_GROUP: _Kind(
        "DescribeSecurityGroups",
        "describe_security_groups",
        "SecurityGroups",
        "GroupId",
        "delete_security_group",
        "GroupId",
        ("InvalidGroup.NotFound",),
    ),
    KEY_PAIR: _Kind(
        "DescribeKeyPairs",
        "describe_key_pairs",
        "KeyPairs",
        "KeyName",
        "delete_key_pair",
        "KeyName",
        ("InvalidKeyPair.NotFound",),
    ),
}
_INSTANCE_GONE = ("InvalidInstanceID.NotFound",)


def remove_pool(
    ec2: Any,
    pool_id: str,
    made: Made | None = None,
    *,
    timeout: float = 600.0,
    poll: float = 3.0,
    log: Log = lambda line: None,
) -> list[str]:
    """Remove everything of `pool_id` (and everything in `made`); what was found, by kind and id.

    Returns once a successful listing shows nothing of the pool. Raises `ProvisionError` naming
    what remains, and ``skyward down <pool_id>``, when `timeout` seconds were not enough.
    """
    suspects = {kind: set((made or Made()).ids[kind]) for kind in KINDS}
    seen: dict[str, set[str]] = {kind: set() for kind in KINDS}
    done: set[str] = set()  # kinds a successful listing showed none of: nothing brings them back
    # The pool's own teardown knows what it made: a kind it never made whose listing keeps
    # failing must not hold its user for the whole timeout (`skyward down` has no `made`).
    never_made = {k for k in _NAMED_FIRST if made is not None and not made.ids[k]}
    failed_listings = dict.fromkeys(never_made, 0)

    def one_round(problems: list[str]) -> Step:
        before = len(problems)
        waiting = _round(ec2, pool_id, suspects, seen, done, problems, log)
        for kind in sorted(never_made - done):
            failure = next(
                (p for p in problems[before:] if p.startswith(_KINDS[kind].list_api)), None
            )
            if failure is None:
                continue
            failed_listings[kind] += 1
            if failed_listings[kind] >= NEVER_MADE_TRIES and not seen[kind]:
                done.add(kind)
                problems.remove(failure)
                log(
                    f"teardown of {pool_id}: {failure}, {NEVER_MADE_TRIES} times; the pool "
                    f"made no {kind}, so none is left: not asking again"
                )
        if len(done) == len(KINDS):
            return Step.DONE
        return Step.WAIT if waiting else Step.AGAIN

    def remaining() -> list[str]:
        return [f"{kind} {name}" for kind in KINDS for name in sorted(suspects[kind])]

    reconcile(pool_id, one_round, remaining, _WORDS, timeout=timeout, poll=poll, log=log)
    return [f"{kind} {name}" for kind in KINDS for name in sorted(seen[kind])]


def _round(
    ec2: Any,
    pool_id: str,
    suspects: dict[str, set[str]],
    seen: dict[str, set[str]],
    done: set[str],
    problems: list[str],
    log: Log,
) -> bool:
    """One pass over every kind not yet `done`: list it, then remove what may still exist
    (`suspects`); `seen` gathers everything found. True when EC2 is still at work (instances
    not yet terminated, a group still held by them)."""
    tagged = [{"Name": f"tag:{POOL_TAG}", "Values": [pool_id]}]
    states: dict[str, str] | None = None
    waiting = False
    for kind in KINDS:
        if kind in done:
            continue
        if kind == INSTANCE:
            states = _list_instances(ec2, tagged, suspects[INSTANCE], problems)
            listed = None if states is None else set(states)
        else:
            listed = _list(ec2, _KINDS[kind], tagged, problems)
        if listed is not None:  # else the listing failed: remove what is known or was seen
            suspects[kind] = listed
            if not listed:
                done.add(kind)
        seen[kind] |= suspects[kind]
        if kind == INSTANCE:
            waiting = bool(suspects[INSTANCE])  # termination takes EC2 a while
            # Terminating is idempotent: when the listing failed, terminate every suspect.
            ids = sorted(i for i in suspects[INSTANCE] if (states or {}).get(i) != "shutting-down")
            if ids:
                reply = _call(ec2, problems, "terminate_instances", _INSTANCE_GONE, InstanceIds=ids)
                if reply is not None:
                    log(f"terminating {len(ids)} instance(s) of {pool_id}")
        elif kind in _AFTER_INSTANCES and states:
            waiting = True  # EC2 refuses these while instances still use them (if unsure, try)
        else:
            for name in sorted(suspects[kind]):
                waiting = _delete(ec2, kind, name, suspects, problems) or waiting
    return waiting


def _list(
    ec2: Any, kind: _Kind, tagged: list[dict[str, Any]], problems: list[str]
) -> set[str] | None:
    reply = _call(ec2, problems, kind.list_call, Filters=tagged)
    if reply is None:
        return None
    return {str(item[kind.id_key]) for item in reply.get(kind.list_key, [])}


def _list_instances(
    ec2: Any, tagged: list[dict[str, Any]], suspects: set[str], problems: list[str]
) -> dict[str, str] | None:
    """The pool's instances that are not terminated, with their states: by tag, and by id
    for the suspects the tag listing does not show."""
    live = [*tagged, {"Name": "instance-state-name", "Values": list(LIVE_STATES)}]
    reply = _call(ec2, problems, "describe_instances", Filters=live)
    if reply is None:
        return None
    found = _states(reply)
    # Known ids the tag listing does not show: terminated, or not yet visible (EC2 is
    # eventually consistent right after run_instances). Only a look by id can tell.
    unseen = sorted(suspects - found.keys())
    if unseen:
        by_id = _call(ec2, problems, "describe_instances", _INSTANCE_GONE, InstanceIds=unseen)
        if by_id is None:
            return None
        found |= _states(by_id)
    return {i: state for i, state in found.items() if state != "terminated"}


def _delete(
    ec2: Any, kind: str, name: str, suspects: dict[str, set[str]], problems: list[str]
) -> bool:
    """Delete one; True when EC2 answered "not yet" (DependencyViolation / InUse), which is
    no failure: the instances that hold it are still going."""
    spec = _KINDS[kind]
    failed: list[str] = []
    if _call(ec2, failed, spec.delete_call, spec.gone, **{spec.delete_arg: name}) is not None:
        suspects[kind].discard(name)
        return False
    if any(code in line for line in failed for code in _NOT_YET):
        return True
    problems += failed
    return False


def _call(
    ec2: Any, problems: list[str], method: str, gone: Iterable[str] = (), **kwargs: Any
) -> dict[str, Any] | None:
    """``ec2.<method>(**kwargs)`` (all pages), with botocore's retries; None when it failed,
    recorded in `problems` naming the call. An error code in `gone` is a success: ``{}``."""
    try:
        if ec2.can_paginate(method):
            result = ec2.get_paginator(method).paginate(**kwargs).build_full_result()
        else:
            result = getattr(ec2, method)(**kwargs)
        return dict(result)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        if error.get("Code") in gone:
            return {}
        reason: object = f"{error.get('Code', '?')}: {error.get('Message', exc)}"
    except (BotoCoreError, ResponseParserError) as exc:
        reason = exc
    problems.append(f"{ec2.meta.method_to_api_mapping[method]} failed: {reason}")
    return None


def _states(reply: dict[str, Any]) -> dict[str, str]:
    return {
        str(instance["InstanceId"]): str(instance["State"]["Name"])
        for reservation in reply.get("Reservations", [])
        for instance in reservation["Instances"]
    }
