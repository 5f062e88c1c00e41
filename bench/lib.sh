#!/usr/bin/env bash
# lib.sh - sourced by bench.sh and soak.sh: the start-up they share (services, test upstreams, the gateway) and
# the stop of what was started.
# Expects from the sourcing script: SVC (scripts/services.sh), T (the run's temp dir), IDEMGATE and UPSTREAM (the
# binaries), ADMIN_PORT, the PIDS array (processes stopped on exit) and die().

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

# stop_started: stops every process in PIDS (TERM, then KILL after 10 s each) and the services when they were
# started; for the sourcing script's exit trap.
stop_started() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "$SERVICES_UP" = 1 ]; then bash "$SVC" stop "$T/svc" >/dev/null 2>&1 || true; fi
}
