"""The VM's metadata: the pool's login key (``ssh-keys``) and its ``startup-script``, the shared
first-boot script (`cloud.bootscript`: the client-made host key, sshd restart, idle
watchdog). The guest agent of GCE images creates the login user from ``ssh-keys`` and runs the
startup script as root at boot."""

from __future__ import annotations

from skyward.providers.cloud.bootscript import HostKey, first_boot_script

METADATA_VALUE_LIMIT = 256 * 1024  # GCE's limit on one metadata value


def render(pool_id: str, host_key: HostKey, idle_timeout: float) -> str:
    """The startup script of every VM of pool `pool_id`."""
    script = first_boot_script(pool_id, host_key, idle_timeout, "startup-script")
    if len(script.encode()) > METADATA_VALUE_LIMIT:  # cannot happen with one ed25519 key
        raise ValueError(f"startup-script is {len(script)} bytes, over GCE's limit")
    return script


def ssh_keys(user: str, public_key: str) -> str:
    """The ``ssh-keys`` metadata value: ``USER:KEYTYPE KEY COMMENT``, one a line."""
    return f"{user}:{public_key.strip()}"


def metadata(
    pool_id: str, host_key: HostKey, idle_timeout: float, user: str, login: str
) -> dict[str, str]:
    return {
        "ssh-keys": ssh_keys(user, login),
        "startup-script": render(pool_id, host_key, idle_timeout),
        # Only the pool's key logs in: no project-wide key reaches these VMs.
        "block-project-ssh-keys": "true",
    }
