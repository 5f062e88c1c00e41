#!/usr/bin/env bash
# run.sh - the chaos stage: 2 gateways, retrying clients and a fault schedule; ends with `N passed, N failed`.
#
#   tests/chaos/run.sh --short [CHAOS OPTIONS]            80 s of traffic, every fault kind (about 2 minutes)
#   tests/chaos/run.sh --long [MINUTES] [CHAOS OPTIONS]   MINUTES of traffic (default 10), every fault kind
#   tests/chaos/run.sh --citus --short|--long ...         the same on a Citus cluster of its own (a coordinator and
#                                                         two workers, scripts/services.sh citus-start): Citus
#                                                         worker restarts instead of the failover and SQL faults
#
# CHAOS OPTIONS go to the checker as they are (--seed S, --workers N, --instances 1|2, --keep,
# --faults LIST, ...). --faults takes comma-separated kinds (gateway_kill, postgres_restart, redis_restart,
# redis_flush, upstream_down, postgres_pause, commit_errors, serializable_default, failover, gateway_pause,
# redis_pause_purge) or
# all (the default). Instance 1 runs with its wall clock 2 minutes ahead (--clock-skew-ms, through the
# tests/tools/libclockshift.so shim).
# Environment: IDEMGATE_BUILD_DIR (default ./build; built when the checker is missing),
# IDEMGATE_TEST_SERVICES_DIR (running Postgres+Redis from scripts/services.sh; else throwaway ones are started
# here and stopped at exit), IDEMGATE_SERVICES_SH (default scripts/services.sh). When the faults include a
# failover, a Postgres pair (primary + synchronous standby) is always started here: a shared cluster is never
# failed over.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd -P)
BUILD=${IDEMGATE_BUILD_DIR:-$ROOT/build}
SERVICES_SH=${IDEMGATE_SERVICES_SH:-$ROOT/scripts/services.sh}
SVC=
OWN_SVC=0
KEEP=0
CHAOS_PID=

say() { echo "chaos/run.sh: $*" >&2; }
fail() {
    say "$*"
    echo "0 passed, 1 failed"
    exit 1
}

usage() {
    sed -n '4,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# shellcheck disable=SC2317 # called from the EXIT trap
cleanup() {
    trap '' INT TERM HUP
    if [ -n "$CHAOS_PID" ] && kill -0 "$CHAOS_PID" 2>/dev/null; then
        # the checker's own TERM handler kills the gateways and the upstream it started
        kill -TERM "$CHAOS_PID" 2>/dev/null
        for _ in $(seq 1 50); do
            kill -0 "$CHAOS_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$CHAOS_PID" 2>/dev/null
        wait "$CHAOS_PID" 2>/dev/null
    fi
    CHAOS_PID=
    if [ "$OWN_SVC" = 1 ] && [ -n "$SVC" ]; then
        bash "$SERVICES_SH" stop "$SVC" >/dev/null 2>&1 || bash "$SERVICES_SH" stop "$SVC"
        if [ "$KEEP" = 1 ]; then
            say "kept the services' logs (Postgres, standby, Redis) in $SVC"
        else
            rm -rf "$SVC"
        fi
    fi
    OWN_SVC=0
}
trap cleanup EXIT
trap 'say interrupted; exit 130' INT TERM HUP

[ $# -ge 1 ] || usage
CITUS=0
if [ "$1" = --citus ]; then
    CITUS=1
    shift
    [ $# -ge 1 ] || usage
fi
case "$1" in
--short)
    DURATION=80
    shift
    ;;
--long)
    shift
    MINUTES=10
    if [ $# -ge 1 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
        MINUTES=$1
        shift
    fi
    if [ "$MINUTES" -lt 1 ] || [ "$MINUTES" -gt 1440 ]; then fail "--long MINUTES: 1..1440"; fi
    DURATION=$((MINUTES * 60))
    ;;
-h | --help) usage ;;
*) usage ;;
esac

CHAOS=$BUILD/tests/chaos/chaos
if [ ! -x "$CHAOS" ] || [ ! -x "$BUILD/idemgate" ] || [ ! -x "$BUILD/tests/tools/testupstream" ] ||
    [ ! -f "$BUILD/tests/tools/libclockshift.so" ]; then
    say "building in $BUILD"
    if [ ! -f "$BUILD/build.ninja" ]; then
        meson setup "$BUILD" "$ROOT" >&2 || fail "meson setup failed"
    fi
    ninja -C "$BUILD" idemgate tests/tools/testupstream tests/tools/libclockshift.so tests/chaos/chaos >&2 || fail "build failed"
fi

# Does the fault list (default: all) include a failover? Is the run to be kept (--keep)?
FAULTS=all
prev=
for a in "$@"; do
    [ "$prev" = --faults ] && FAULTS=$a
    [ "$a" = --keep ] && KEEP=1
    prev=$a
done
FAILOVER=0
case ",$FAULTS," in *,all,* | *,failover,*) FAILOVER=1 ;; esac

if [ "$CITUS" = 1 ]; then
    # A cluster of its own (never a shared one: its workers are restarted); no standby, so no failover.
    SVC=$(mktemp -d /tmp/idemgate-chaos-citus.XXXXXX) || fail "mktemp failed"
    chmod 755 "$SVC"
    OWN_SVC=1
    bash "$SERVICES_SH" citus-start "$SVC" || fail "the Citus cluster did not start"
elif [ "$FAILOVER" = 0 ] && [ -n "${IDEMGATE_TEST_SERVICES_DIR:-}" ] &&
    bash "$SERVICES_SH" status "$IDEMGATE_TEST_SERVICES_DIR" >/dev/null 2>&1; then
    SVC=$IDEMGATE_TEST_SERVICES_DIR
    say "using the running services in $SVC"
else
    if [ "$FAILOVER" = 1 ]; then
        say "a failover is in the fault list: starting our own Postgres pair and Redis"
    elif [ -n "${IDEMGATE_TEST_SERVICES_DIR:-}" ]; then
        say "$IDEMGATE_TEST_SERVICES_DIR does not answer: starting our own"
    fi
    SVC=$(mktemp -d /tmp/idemgate-chaos-svc.XXXXXX) || fail "mktemp failed"
    chmod 755 "$SVC"
    OWN_SVC=1
    bash "$SERVICES_SH" start "$SVC" || fail "services did not start"
    if [ "$FAILOVER" = 1 ]; then
        bash "$SERVICES_SH" standby-start "$SVC" || fail "the standby did not start"
    fi
fi

# Bounded: traffic, the last requests' drain (a request and its retries can outlast the window by ~20 s), the
# checker's own wait for the fault thread (up to 120 s: a fault still running when the traffic ends), the quiet
# period (8 s), the checks (tens of seconds on a loaded 2-core machine), and a margin. DURATION + 150 was too tight
# for --long: a fault thread that used its 120 s left no time for the checks.
LIMIT=$((DURATION + 330))
timeout -k 10 "$LIMIT" "$CHAOS" --build "$BUILD" --services-dir "$SVC" --services-sh "$SERVICES_SH" \
    --duration "$DURATION" --workers 32 --instances 2 "$@" &
CHAOS_PID=$!
wait "$CHAOS_PID"
rc=$?
CHAOS_PID=
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "the checker did not finish within ${LIMIT}s"
    echo "0 passed, 1 failed"
fi
exit "$rc"
