#!/usr/bin/env bash
# lib.sh - sourced by bench.sh and soak.sh: the gateway start-up they share. Expects IDEMGATE (the binary),
# ADMIN_PORT, the PIDS array (processes stopped on exit) and die() from the sourcing script.

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
