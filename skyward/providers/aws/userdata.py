"""The instance's user data: the shared first-boot script (`skyward.providers.cloud.bootscript`:
the machine's own host key, printed for the console output, sshd restart, idle watchdog), within
EC2's size limit."""

from __future__ import annotations

from skyward.providers.cloud.bootscript import (
    check_interval,
    first_boot_script,
    print_key,
    watchdog_script,
)

__all__ = ["USER_DATA_LIMIT", "check_interval", "render", "watchdog_script"]

USER_DATA_LIMIT = 16 * 1024  # EC2's limit on user data, before base64


def render(pool_id: str, idle_timeout: float) -> str:
    """The user data script for every instance of pool `pool_id`. Its output reaches the
    instance's console output (cloud-init's final stage writes to the console), where the client
    reads the host key the instance made (`GetConsoleOutput`)."""
    script = first_boot_script(pool_id, idle_timeout, "user data", print_key())
    if len(script.encode()) > USER_DATA_LIMIT:  # cannot happen: the script is fixed; be loud
        raise ValueError(f"user data is {len(script)} bytes, over EC2's {USER_DATA_LIMIT}")
    return script
