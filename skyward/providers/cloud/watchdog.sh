#!/bin/bash
# skyward watchdog: power this instance off when no SSH client has been connected, and no
# detached run has been running, for IDLE seconds (for at most AFTER_RUN seconds once a
# detached run has ended: its nodes go within a minute of its end, not IDLE later). Powering off ends the machine (EC2: InstanceInitiatedShutdownBehavior=terminate; GCE:
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

detached() {
    # A detached run's supervisor (python -m skyward.worker.supervisor) in this network
    # namespace: on a machine, any; in the tests' hosts, which share one PID space, their own.
    local me pid
    me=$(readlink /proc/$$/ns/net)
    for pid in $(grep -las 'skyward\.worker\.supervisor' /proc/[0-9]*/cmdline | cut -d/ -f3); do
        [ "$pid" != "$$" ] && [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$me" ] && return 0
    done
    return 1
}

after_run=30
limit=$idle
last=$(date +%s)
while true; do
    now=$(date +%s)
    if detached; then
        last=$now
        [ "$idle" -lt "$after_run" ] || limit=$after_run
    elif connected; then
        last=$now
    elif [ $((now - last)) -ge "$limit" ]; then
        echo "skyward-watchdog: no SSH client and no detached run for ${limit}s: powering off"
        poweroff
        exit 0
    fi
    sleep "$interval"
done
