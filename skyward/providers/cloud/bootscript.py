"""What a cloud machine runs at first boot, shared by the cloud providers (EC2 user data, GCE
startup-script): make the machine's own SSH host key, publish its public half, restart sshd,
start the idle watchdog.

The private host key is made on the machine and never leaves it: user data and metadata can be
read by whoever may describe the instance (and by any process on it), so they carry no secret.
The public half goes out through a channel only the machine writes and only the pool's owner
reads (`publish`: EC2's console output, GCE's guest attributes); the client waits for it there
and trusts that key, for that machine's address only, before its first connection. No key is
ever accepted on first use, and each machine has its own.

``SKYWARD_ROOT`` (unset on a real machine) lets the tests run this same script against a scratch
directory inside a network-namespace host, without touching the machine's own /etc/ssh.
"""

from __future__ import annotations

import importlib.resources
import json
import shlex
from pathlib import Path

import asyncssh

# The lines around the public host key where the boot script prints it (EC2's console output),
# in the manner of cloud-init's ``-----BEGIN SSH HOST KEY KEYS-----``.
KEY_BEGIN = "-----BEGIN SKYWARD SSH HOST KEY-----"
KEY_END = "-----END SKYWARD SSH HOST KEY-----"


def print_key() -> str:
    """The `publish` step that prints the key between `KEY_BEGIN` and `KEY_END` on the boot
    script's output, which cloud-init's final stage sends to the serial console."""
    return f"printf '%s\\n' {shlex.quote(KEY_BEGIN)} \"$PUB\" {shlex.quote(KEY_END)}"


def printed_key(text: str) -> str | None:
    """The last public host key printed between the markers in `text` (a console output), as
    ``ssh-ed25519 AAAA...``; None while there is none."""
    found: str | None = None
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if line.strip() == KEY_BEGIN and at + 2 < len(lines) and lines[at + 2].strip() == KEY_END:
            found = public_key(lines[at + 1])
    return found


def public_key(line: str) -> str | None:
    """``KEYTYPE BLOB`` of an OpenSSH public key line, or None when `line` is not one."""
    try:
        key = asyncssh.import_public_key(line.strip())
    except (asyncssh.KeyImportError, ValueError):
        return None
    return " ".join(key.export_public_key().decode().split()[:2])


def known_hosts_line(address: str, public: str) -> str:
    """The known_hosts line that trusts the public key `public` for `address` (port 22)."""
    return f"{address} {public}"


def watchdog_script() -> str:
    """The watchdog's bash source (shipped next to this module)."""
    return (importlib.resources.files(__package__) / "watchdog.sh").read_text()


def check_interval(idle_timeout: float) -> int:
    """How often the watchdog looks for a client: often enough to keep `idle_timeout` honest."""
    return max(1, min(30, int(idle_timeout // 10)))


def first_boot_script(pool_id: str, idle_timeout: float, kind: str, publish: str) -> str:
    """The bash script every machine of pool `pool_id` runs at first boot; `kind` names it
    (``user data``, ``startup-script``) in its header; `publish` is the bash step that sends the
    machine's public host key (in ``$PUB``) where the client reads it."""
    idle = max(1, int(idle_timeout))
    # The pool's name as one JSON string: a name with a newline in it would end the comment
    # and run the rest as a command (JSON escapes every control and non-ASCII character).
    name = json.dumps(pool_id)
    return f"""#!/bin/bash
# skyward {kind} for pool {name}: make this machine's own SSH host key and publish its
# public half (the client trusts only that key), restart sshd, and start the idle watchdog.
set -euo pipefail
R="${{SKYWARD_ROOT:-}}"
mkdir -p "$R/etc/ssh" "$R/usr/local/sbin" "$R/var/log"
# Only our key may be offered: drop the keys the image generated at first boot. The new one is
# made here and its private half never leaves this machine.
rm -f "$R"/etc/ssh/ssh_host_*_key "$R"/etc/ssh/ssh_host_*_key.pub
ssh-keygen -q -t ed25519 -N '' -C "skyward-host" -f "$R/etc/ssh/ssh_host_ed25519_key"
chmod 600 "$R/etc/ssh/ssh_host_ed25519_key"
chmod 644 "$R/etc/ssh/ssh_host_ed25519_key.pub"
PUB="$(cut -d' ' -f1,2 "$R/etc/ssh/ssh_host_ed25519_key.pub")"
{publish}
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
