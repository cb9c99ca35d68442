"""The instance's user data: the shared first-boot script (`skyward.providers.cloud.bootscript`:
the client-made host key, sshd restart, idle watchdog), within EC2's size limit."""

from __future__ import annotations

from skyward.providers.cloud.bootscript import (
    HostKey,
    check_interval,
    first_boot_script,
    watchdog_script,
)

__all__ = ["USER_DATA_LIMIT", "HostKey", "check_interval", "render", "watchdog_script"]

USER_DATA_LIMIT = 16 * 1024  # EC2's limit on user data, before base64


def render(pool_id: str, host_key: HostKey, idle_timeout: float) -> str:
    """The user data script for every instance of pool `pool_id`."""
    script = first_boot_script(pool_id, host_key, idle_timeout, "user data")
    if len(script.encode()) > USER_DATA_LIMIT:  # cannot happen with one ed25519 key; be loud
        raise ValueError(f"user data is {len(script)} bytes, over EC2's {USER_DATA_LIMIT}")
    return script
