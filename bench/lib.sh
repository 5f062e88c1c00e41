#!/usr/bin/env bash
# lib.sh - sourced by soak.sh and profile.sh: the start-up they share (release build, services, test upstreams,
# the gateway) and the stop of what was started.
# Expects from the sourcing script: SVC (scripts/services.sh), IDEMGATE and UPSTREAM (the binaries) and
# ADMIN_PORT; sets T (the run's temp dir, once made), PIDS (processes stopped on exit), PORTS (127.0.0.1 ports
# checked after the stop), KEEP (1: keep T) for it to fill, and installs nothing: the script traps cleanup.
# shellcheck disable=SC2034 # state the sourcing script fills

PROG=$(basename "$0")
T=
PIDS=()
PORTS=()
SERVICES_UP=0
KEEP=0

# die MSG, note MSG: to stderr, prefixed with the script's name; die exits 1.
die() {
    echo "$PROG: $*" >&2
    exit 1
}
note() { echo "$PROG: $*" >&2; }
# usage_err MSG: a wrong command line; exits 2.
usage_err() {
    echo "$PROG: $*" >&2
    exit 2
}

# build_release DIR TARGET...: an optimised build in DIR (meson setup --buildtype=release when DIR has no
# build.ninja), then ninja TARGET...; dies with the log when either fails.
build_release() {
    local dir=$1 log
    shift
    log=$(mktemp /tmp/idemgate-build.XXXXXX)
    if [ ! -f "$dir/build.ninja" ]; then
        rm -rf "$dir"
        meson setup "$dir" --buildtype=release >"$log" 2>&1 || {
            cat "$log" >&2
            rm -f "$log"
            die "meson setup $dir failed"
        }
    fi
    ninja -C "$dir" "$@" >"$log" 2>&1 || {
        tail -n 40 "$log" >&2
        rm -f "$log"
        die "build in $dir failed"
    }
    rm -f "$log"
}

# start_gateway CONF LOG: runs "$IDEMGATE -c CONF" in the background (output to LOG), records its pid in GW_PID and
# PIDS, and waits at most 30 s for /readyz on 127.0.0.1:$ADMIN_PORT; dies with the log's tail otherwise.
start_gateway() {
    "$IDEMGATE" -c "$1" >"$2" 2>&1 </dev/null &
    GW_PID=$!
    PIDS+=("$GW_PID")
    local ready=0
    for _ in $(seq 1 300); do
        kill -0 "$GW_PID" 2>/dev/null || break
        if curl -fsS -m 1 -o /dev/null "http://127.0.0.1:$ADMIN_PORT/readyz" 2>/dev/null; then
            ready=1
            break
        fi
        sleep 0.1
    done
    [ $ready = 1 ] || {
        tail -n 20 "$2" >&2
        die "idemgate did not become ready"
    }
}

# gateway_conf_head: the first lines of a gateway config: listeners on 127.0.0.1:$GW_PORT (requests) and
# :$ADMIN_PORT (admin), 5 s shutdown grace.
gateway_conf_head() {
    cat <<EOF
listen: 127.0.0.1:$GW_PORT
admin:
  listen: 127.0.0.1:$ADMIN_PORT
shutdown_grace: 5s
EOF
}

# start_services: Postgres and Redis for this run in $T/svc (scripts/services.sh), their env sourced.
start_services() {
    bash "$SVC" start "$T/svc" >/dev/null
    # shellcheck disable=SC2034 # read by the sourcing script's cleanup
    SERVICES_UP=1
    # shellcheck disable=SC1091
    . "$T/svc/env"
}

# wait_port PORT SECONDS: true once something accepts on 127.0.0.1:PORT.
wait_port() {
    local deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# start_upstream NAME DELAY_MS PORT: a testupstream ($UPSTREAM) on 127.0.0.1:PORT, log in $T/NAME.log, pid in PIDS.
# Not in $(...): PIDS must be recorded in the calling shell.
start_upstream() {
    "$UPSTREAM" --host 127.0.0.1 --port "$3" --delay-ms "$2" --quiet >"$T/$1.log" 2>&1 </dev/null &
    PIDS+=($!)
    wait_port "$3" 10 || die "testupstream $1 did not start (see $T/$1.log)"
}

# forget_pid PID: drops PID from PIDS once it has been waited for (its number may be reused).
forget_pid() {
    local p keep=()
    for p in "${PIDS[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# reap PID: waits up to 10 s for PID (already sent TERM) to end, then KILLs it; reaps it.
reap() {
    for _ in $(seq 1 100); do
        kill -0 "$1" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}

# stop_started: stops every process in PIDS (TERM, then KILL after 10 s each) and the services when they were
# started; for the sourcing script's exit trap.
stop_started() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do reap "$pid"; done
    if [ "$SERVICES_UP" = 1 ]; then bash "$SVC" stop "$T/svc" >/dev/null 2>&1 || true; fi
}

# cleanup: for the sourcing script's exit trap. Stops what was started (stop_started), says whether any of
# PORTS still listens, then removes T, or keeps it when KEEP is 1.
cleanup() {
    trap - EXIT INT TERM HUP
    trap '' PIPE
    set +e
    stop_started
    local p left=()
    for p in "${PORTS[@]}"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then left+=("$p"); fi
    done
    if [ ${#left[@]} != 0 ]; then
        note "WARNING: still listening on 127.0.0.1 port(s) ${left[*]}"
    elif [ ${#PORTS[@]} != 0 ]; then
        note "cleanup: everything started here stopped, none of its ports listening"
    fi
    if [ -n "$T" ] && [ -d "$T" ]; then
        if [ "$KEEP" = 1 ]; then note "kept $T"; else rm -rf "$T"; fi
    fi
}
