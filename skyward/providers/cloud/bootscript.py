"""What a cloud machine runs at first boot, shared by the cloud providers (EC2 user data, GCE
startup-script): install a host key made by the client, restart sshd, start the idle watchdog.

The host key pair is generated on the client, so the client knows the machine's public host key
before the machine exists and verifies its very first SSH connection; no key is ever accepted on
first use. All machines of one pool share the same script and so the same host key: it is fresh
per pool and only ever trusted for that pool's addresses.

``SKYWARD_ROOT`` (unset on a real machine) lets the tests run this same script against a scratch
directory inside a network-namespace host, without touching the machine's own /etc/ssh.
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

import asyncssh


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


def first_boot_script(pool_id: str, host_key: HostKey, idle_timeout: float, kind: str) -> str:
    """The bash script every machine of pool `pool_id` runs at first boot; `kind` names it
    (``user data``, ``startup-script``) in its header."""
    idle = max(1, int(idle_timeout))
    # The pool's name as one JSON string: a name with a newline in it would end the comment
    # and run the rest as a command (JSON escapes every control and non-ASCII character).
    name = json.dumps(pool_id)
    return f"""#!/bin/bash
# skyward {kind} for pool {name}: install the SSH host key the client generated (its first
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


def write_login_key(path: Path) -> str:
    """A fresh ed25519 login key for one pool at `path` (0600, in a 0700 folder); its public
    line."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"skyward-{path.parent.name}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    public = key.export_public_key().decode().strip()
    path.with_suffix(".pub").write_text(public + "\n")
    return public
