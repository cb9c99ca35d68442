"""The instance's user data: a bash script that installs the client-made host key and the watchdog.

The host key pair is generated on the client, so the client knows the instance's public host key
before the instance exists and verifies its very first SSH connection; no key is ever accepted on
first use. All N instances of one `run_instances` share the same user data and so the same host key:
it is fresh per pool and only ever trusted for that pool's addresses.

``SKYWARD_ROOT`` (unset on an instance) lets the tests run this same script against a scratch
directory inside a network-namespace host, without touching the machine's own /etc/ssh.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import asyncssh

USER_DATA_LIMIT = 16 * 1024  # EC2's limit on user data, before base64


@dataclass(frozen=True)
class HostKey:
    """An ed25519 SSH host key: OpenSSH private key text and the ``ssh-ed25519 AAAA...`` line."""

    private: str
    public: str

    @classmethod
    def generate(cls, comment: str) -> HostKey:
        key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
        return cls(
            key.export_private_key().decode(),
            key.export_public_key().decode().strip(),
        )

    def known_hosts_line(self, address: str) -> str:
        """The known_hosts line that trusts this key for `address` (port 22)."""
        keytype, blob = self.public.split()[:2]
        return f"{address} {keytype} {blob}"


def watchdog_script() -> str:
    """The watchdog's bash source (shipped next to this module)."""
    return (importlib.resources.files(__package__) / "watchdog.sh").read_text()


def check_interval(idle_timeout: float) -> int:
    """How often the watchdog looks for a client: often enough to keep `idle_timeout` honest."""
    return max(1, min(30, int(idle_timeout // 10)))


def render(pool_id: str, host_key: HostKey, idle_timeout: float) -> str:
    """The user data script for every instance of pool `pool_id`."""
    idle = max(1, int(idle_timeout))
    script = f"""#!/bin/bash
# skyward user data for pool {pool_id}: install the SSH host key the client generated (its first
# connection is then verified), restart sshd, and start the idle watchdog.
set -euo pipefail
R="${{SKYWARD_ROOT:-}}"
mkdir -p "$R/etc/ssh" "$R/usr/local/sbin" "$R/var/log"
# Only our key may be offered: drop the keys the image generated at first boot.
rm -f "$R"/etc/ssh/ssh_host_*_key "$R"/etc/ssh/ssh_host_*_key.pub
(umask 077; cat > "$R/etc/ssh/ssh_host_ed25519_key" <<'SKYWARD_HOST_KEY'
{host_key.private.strip()}
SKYWARD_HOST_KEY
)
cat > "$R/etc/ssh/ssh_host_ed25519_key.pub" <<'SKYWARD_HOST_PUB'
{host_key.public}
SKYWARD_HOST_PUB
chmod 600 "$R/etc/ssh/ssh_host_ed25519_key"
chmod 644 "$R/etc/ssh/ssh_host_ed25519_key.pub"
if [ -z "$R" ]; then
    systemctl restart ssh.service 2>/dev/null || systemctl restart sshd.service 2>/dev/null \\
        || service ssh restart 2>/dev/null || service sshd restart
fi
cat > "$R/usr/local/sbin/skyward-watchdog" <<'SKYWARD_WATCHDOG'
{watchdog_script().strip()}
SKYWARD_WATCHDOG
chmod 755 "$R/usr/local/sbin/skyward-watchdog"
if [ -z "$R" ] && command -v systemd-run >/dev/null 2>&1; then
    systemd-run --unit=skyward-watchdog --collect \\
        /usr/local/sbin/skyward-watchdog {idle} {check_interval(idle)}
else
    setsid nohup "$R/usr/local/sbin/skyward-watchdog" {idle} {check_interval(idle)} \\
        >>"$R/var/log/skyward-watchdog.log" 2>&1 </dev/null &
    echo $! > "$R/var/log/skyward-watchdog.pid"
fi
"""
    if len(script.encode()) > USER_DATA_LIMIT:  # cannot happen with one ed25519 key; be loud
        raise ValueError(f"user data is {len(script)} bytes, over EC2's {USER_DATA_LIMIT}")
    return script
