"""Preemption notices a node watches for itself, beside the signal one (`preemption`).

- AWS: the two-minute spot interruption notice, ``spot/instance-action`` in the instance
  metadata service (IMDSv2: a session token first), polled every few seconds; 404 means no
  action is scheduled. ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` moves the service, as it does for
  the AWS SDKs.
- GCP: ``instance/preempted`` in the metadata server (``Metadata-Flavor: Google``), ``TRUE``
  once Compute Engine preempts the VM, which then has about 30 s before it is stopped.
  ``GCE_METADATA_HOST`` moves the server, as it does for Google's client libraries.

Runs on the node: standard library only. `urllib.request` is imported by the watches that use
it: every agent imports this module, and urllib (http.client, email, ssl) was about a third of
an agent's own imports (`python -X importtime -c "import skyward.worker.agent"`).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from datetime import datetime

# Which watch the provider asked its nodes' agents to run, as "module:function" (a provider
# outside skyward can name its own), if any: see `watcher`.
NOTICES_ENV = "SKYWARD_NOTICES"
POLL_ENV = "SKYWARD_NOTICE_POLL"  # seconds between two looks (default 5)
_IMDS = "http://169.254.169.254"


Watch = Callable[[Callable[[str, float | None], None]], None]
"""A notice watch: runs for the agent's life, calling ``on_notice(source, seconds_left)``."""


def watcher(spec: str) -> Watch:
    """The watch ``spec`` ("package.module:function", from `NOTICES_ENV`) names: the agent
    runs what its provider asked for without knowing any provider."""
    module, _, name = spec.partition(":")
    found: Watch = getattr(importlib.import_module(module), name)
    return found


def watch_aws(on_notice: Callable[[str, float | None], None]) -> None:
    """Poll the spot interruption notice until one is scheduled; then `on_notice(source,
    seconds_left)` and return. A metadata service that cannot be reached is asked again."""
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", _IMDS).rstrip("/")
    poll = float(os.environ.get(POLL_ENV, "5"))
    while True:
        action = _instance_action(base)
        if action is not None:
            left = _seconds_until(action.get("time"))
            on_notice(f"AWS spot interruption: {action.get('action', '?')}", left)
            return
        time.sleep(poll)


# What Compute Engine gives a preempted VM between the notice and its stop.
GCP_NOTICE_SECONDS = 30.0


def watch_gcp(on_notice: Callable[[str, float | None], None]) -> None:
    """Poll ``instance/preempted`` until it says TRUE; then `on_notice(source, seconds_left)`
    and return. A metadata server that cannot be reached is asked again."""
    host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
    url = f"http://{host}/computeMetadata/v1/instance/preempted"
    poll = float(os.environ.get(POLL_ENV, "5"))
    import urllib.request

    while True:
        try:
            request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=2) as reply:
                preempted = reply.read().decode().strip().upper() == "TRUE"
        except OSError:
            preempted = False
        if preempted:
            on_notice("GCP preemption", GCP_NOTICE_SECONDS)
            return
        time.sleep(poll)


def _instance_action(base: str) -> dict[str, str] | None:
    import urllib.request

    try:
        token_request = urllib.request.Request(
            f"{base}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
        )
        with urllib.request.urlopen(token_request, timeout=2) as reply:
            token = reply.read().decode()
        request = urllib.request.Request(
            f"{base}/latest/meta-data/spot/instance-action",
            headers={"X-aws-ec2-metadata-token": token},
        )
        with urllib.request.urlopen(request, timeout=2) as reply:
            found = json.loads(reply.read())
    except (OSError, ValueError):  # 404 (nothing scheduled), no service, a broken answer
        return None
    return found if isinstance(found, dict) else None


def _seconds_until(stamp: object) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0.0, when.timestamp() - time.time())
