#!/bin/bash
# skyward watchdog: power this instance off when no SSH client has been connected for IDLE
# seconds. Powering off ends the machine (EC2: InstanceInitiatedShutdownBehavior=terminate; GCE:
# the VM stops, and its pool's teardown or `skyward down` deletes it): a client that died (laptop
# closed, Ctrl-C twice, crash) costs minutes of instance time, not days. The clock starts at boot,
# so an instance whose client never connects goes too.
# Usage: skyward-watchdog IDLE_SECONDS [CHECK_INTERVAL_SECONDS]
set -u
idle=${1:?usage: skyward-watchdog IDLE_SECONDS [CHECK_INTERVAL_SECONDS]}
interval=${2:-10}

connected() {
    # An ESTABLISHED (st 01) TCP connection whose local port is 22 (hex 0016), IPv4 or IPv6.
    # /proc/net is per network namespace, which also lets the tests run this for real.
    local files=()
    for f in /proc/net/tcp /proc/net/tcp6; do [ -r "$f" ] && files+=("$f"); done
    [ ${#files[@]} -gt 0 ] || return 1
    awk 'FNR > 1 { n = split($2, a, ":"); if (a[n] == "0016" && $4 == "01") found = 1 }
         END { exit !found }' "${files[@]}"
}

last=$(date +%s)
while true; do
    now=$(date +%s)
    if connected; then
        last=$now
    elif [ $((now - last)) -ge "$idle" ]; then
        echo "skyward-watchdog: no SSH client for ${idle}s: powering off"
        poweroff
        exit 0
    fi
    sleep "$interval"
done
