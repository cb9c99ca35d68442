"""The VM's metadata: the pool's login key (``ssh-keys``) and its ``startup-script``, the shared
first-boot script (`cloud.bootscript`: the machine's own host key, published as a guest
attribute, sshd restart, idle watchdog). The guest agent of GCE images creates the login user
from ``ssh-keys`` and runs the startup script as root at boot."""

from __future__ import annotations

import shlex

from skyward.providers.cloud.bootscript import first_boot_script

METADATA_VALUE_LIMIT = 256 * 1024  # GCE's limit on one metadata value

# Where the machine publishes its public host key: a guest attribute, which only the machine
# writes (through its metadata server) and only those with ``getGuestAttributes`` read. Our own
# namespace, not the guest agent's ``hostkeys/``: the agent writes the image's keys there, which
# the startup script deletes, and the client must never read one of those.
KEY_NAMESPACE = "skyward"
KEY_NAME = "ssh-ed25519"
GUEST_ATTRIBUTES_URL = (
    "http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes"
)


def publish_key() -> str:
    """The startup script's step that PUTs the public host key (``$PUB``) to the guest attribute
    `KEY_NAMESPACE`/`KEY_NAME`, retried while the metadata server is not up."""
    url = shlex.quote(f"{GUEST_ATTRIBUTES_URL}/{KEY_NAMESPACE}/{KEY_NAME}")
    return (
        f"curl -fsS --retry 10 --retry-connrefused -X PUT -H 'Metadata-Flavor: Google' "
        f'--data "$PUB" {url}'
    )


def render(pool_id: str, idle_timeout: float) -> str:
    """The startup script of every VM of pool `pool_id`."""
    script = first_boot_script(pool_id, idle_timeout, "startup-script", publish_key())
    if len(script.encode()) > METADATA_VALUE_LIMIT:  # cannot happen: the script is fixed
        raise ValueError(f"startup-script is {len(script)} bytes, over GCE's limit")
    return script


def ssh_keys(user: str, public_key: str) -> str:
    """The ``ssh-keys`` metadata value: ``USER:KEYTYPE KEY COMMENT``, one a line."""
    return f"{user}:{public_key.strip()}"


def metadata(pool_id: str, idle_timeout: float, user: str, login: str) -> dict[str, str]:
    return {
        "ssh-keys": ssh_keys(user, login),
        "startup-script": render(pool_id, idle_timeout),
        # The machine may publish its host key as a guest attribute (off by default).
        "enable-guest-attributes": "TRUE",
        # Only the pool's key logs in: no project-wide key reaches these VMs.
        "block-project-ssh-keys": "true",
    }
