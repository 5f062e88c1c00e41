#!/usr/bin/env bash
# soak.sh - steady mixed load on idemgate for minutes, sampling its resident memory: the RSS must stay flat once
# warmed up (no leak, no unbounded cache or pool). Everything runs on 127.0.0.1 and is started and stopped here.
#
#   bench/soak.sh                 5 minutes
#   bench/soak.sh --minutes N     N minutes (1..240)
#   bench/soak.sh --quick         1 minute (smoke check)
#   bench/soak.sh --build DIR     use DIR/idemgate and DIR/tests/tools/testupstream (no build here)
#   bench/soak.sh --no-deps       do not run scripts/deps.sh --bench when wrk or curl is missing
#
# Load (three wrk processes at once, each paced with BENCH_DELAY_MS): passthrough GETs, POSTs with a new
# Idempotency-Key each (claim + forward + completion), and replays of already completed keys. VmRSS of the gateway
# is sampled every 10 s and printed as `soak_sample t_s=... rss_kb=...`. Verdict: the last sample may exceed the
# first sample after the warm-up (a fifth of the run, at least 20 s) by at most 10 % + 4 MiB; the gateway must
# still be alive and answer; at most 0.1 % of the requests may fail. Exit 0 on PASS, 1 on FAIL, 2 on usage errors.
# shellcheck disable=SC2317 # functions called from traps
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SVC=$ROOT/scripts/services.sh
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

MINUTES=5
BUILD=
deps=1
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) MINUTES=1 ;;
    --minutes)
        [ $# -ge 2 ] || {
            echo "soak.sh: --minutes needs a number" >&2
            exit 2
        }
        MINUTES=$2
        shift
        ;;
    --build)
        [ $# -ge 2 ] || {
            echo "soak.sh: --build needs a directory" >&2
            exit 2
        }
        BUILD=$2
        shift
        ;;
    --no-deps) deps=0 ;;
    -h | --help)
        sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "soak.sh: unknown option $1" >&2
        exit 2
        ;;
    esac
    shift
done
case "$MINUTES" in
'' | *[!0-9]*)
    echo "soak.sh: --minutes wants a whole number" >&2
    exit 2
    ;;
esac
if [ "$MINUTES" -lt 1 ] || [ "$MINUTES" -gt 240 ]; then
    echo "soak.sh: --minutes must be 1..240" >&2
    exit 2
fi

DUR=$((MINUTES * 60))
WARM=$((DUR / 5))
[ $WARM -ge 20 ] || WARM=20
SAMPLE_S=10
REPLAY_KEYS=100
# Paced load: connections and the pause between two requests of one connection (ms), per stream.
GET_CONNS=${SOAK_GET_CONNS:-16}
GET_DELAY_MS=${SOAK_GET_DELAY_MS:-4}
NEW_CONNS=${SOAK_NEW_CONNS:-8}
NEW_DELAY_MS=${SOAK_NEW_DELAY_MS:-10}
REPLAY_CONNS=${SOAK_REPLAY_CONNS:-8}
REPLAY_DELAY_MS=${SOAK_REPLAY_DELAY_MS:-5}
SLACK_PCT=${SOAK_SLACK_PCT:-10}
SLACK_KB=${SOAK_SLACK_KB:-4096}

trap cleanup EXIT
trap 'exit 130' INT TERM HUP

for c in wrk curl; do
    if ! command -v $c >/dev/null 2>&1; then
        [ $deps = 1 ] || die "$c missing: scripts/deps.sh --bench"
        bash scripts/deps.sh --bench
        break
    fi
done
ulimit -n 4096 2>/dev/null || true

# ---- build (optimised, in its own dir) unless given
if [ -z "$BUILD" ]; then
    BUILD=$ROOT/build-bench
    build_release "$BUILD" idemgate tests/tools/testupstream
fi
IDEMGATE=$BUILD/idemgate
UPSTREAM=$BUILD/tests/tools/testupstream
if [ ! -x "$IDEMGATE" ] || [ ! -x "$UPSTREAM" ]; then die "$IDEMGATE or $UPSTREAM missing"; fi

T=$(mktemp -d /tmp/idemgate-soak.XXXXXX)
chmod 755 "$T"
RUN_ID=$(date +%s)-$$

start_services

UP_PORT=$(bash "$SVC" free-port)
start_upstream upstream 0 "$UP_PORT"

GW_PORT=$(bash "$SVC" free-port)
ADMIN_PORT=$(bash "$SVC" free-port)
cat >"$T/idemgate.yaml" <<EOF
$(gateway_conf_head)
store:
  pool: 8
  redis_timeout: 50ms
upstreams:
  - name: up
    url: http://127.0.0.1:$UP_PORT
    connect_timeout: 2s
    timeout: 30s
    max_connections: 256
routes:
  - name: soak
    match:
      path_prefix: /soak
      methods: [POST]
    upstream: up
    idempotency:
      key: required
      retention: 1h
      lease: 60s
default_upstream: up
max_connections: 1024
client_timeout: 30s
EOF
export IDEMGATE_POSTGRES_URL=$IDEMGATE_TEST_PG_URL IDEMGATE_REDIS_URL=$IDEMGATE_TEST_REDIS_URL
start_gateway "$T/idemgate.yaml" "$T/idemgate.log"
GW=http://127.0.0.1:$GW_PORT

body='{"amount":4200,"currency":"EUR","note":"bench"}'
for i in $(seq 1 $REPLAY_KEYS); do
    curl -fsS -m 5 -o /dev/null -X POST "$GW/soak/replay" -H 'Content-Type: application/json' \
        -H "Idempotency-Key: rp-$RUN_ID-replay-$i" --data-binary "$body" || die "priming replay key $i failed"
done

rss_kb() { awk '$1 == "VmRSS:" {print $2}' "/proc/$GW_PID/status" 2>/dev/null || echo 0; }

echo "soak: ${MINUTES} min, warm-up ${WARM} s, sample every ${SAMPLE_S} s, $(nproc) CPUs, all on 127.0.0.1"
echo "soak: GET c=$GET_CONNS pause ${GET_DELAY_MS}ms | new keys c=$NEW_CONNS pause ${NEW_DELAY_MS}ms |" \
    "replays c=$REPLAY_CONNS pause ${REPLAY_DELAY_MS}ms"

wrk_run() { # name conns delay lua url keys (run in the background: exec, so that its pid is the timeout's)
    BENCH_DELAY_MS=$3 BENCH_RUN=$6 BENCH_KEYS=$REPLAY_KEYS exec timeout $((DUR + 60)) \
        wrk -t1 -c"$2" -d"${DUR}s" --timeout 5s -s "$ROOT/bench/$4" "$5" >"$T/wrk-$1.txt" 2>&1
}
wrk_run get "$GET_CONNS" "$GET_DELAY_MS" get.lua "$GW/" "$RUN_ID-get" &
PIDS+=($!)
wrk_run newkey "$NEW_CONNS" "$NEW_DELAY_MS" newkey.lua "$GW/soak/new" "$RUN_ID-new" &
PIDS+=($!)
wrk_run replay "$REPLAY_CONNS" "$REPLAY_DELAY_MS" replay.lua "$GW/soak/replay" "$RUN_ID-replay" &
PIDS+=($!)
WRK_PIDS=("${PIDS[@]: -3}")

# ---- the RSS curve
echo "t_s rss_kb"
start=$SECONDS
first_warm=
last=
alive=1
t=0
while [ $t -le $DUR ]; do
    while ((SECONDS - start < t)); do sleep 0.2; done
    if ! kill -0 "$GW_PID" 2>/dev/null; then
        alive=0
        echo "soak_sample t_s=$t gateway=dead"
        break
    fi
    last=$(rss_kb)
    echo "soak_sample t_s=$t rss_kb=$last"
    if [ -z "$first_warm" ] && [ $t -ge $WARM ]; then first_warm=$last; fi
    t=$((t + SAMPLE_S))
done
for pid in "${WRK_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
hwm=$(awk '$1 == "VmHWM:" {print $2}' "/proc/$GW_PID/status" 2>/dev/null || echo 0)
answers=1
curl -fsS -m 5 -o /dev/null "$GW/after-soak" || answers=0

# ---- totals and verdict
total=0
failed=0
for s in get newkey replay; do
    f=$T/wrk-$s.txt
    n=$(awk '/requests in/ {print $1}' "$f")
    rps=$(awk '/^Requests\/sec:/ {printf "%.0f", $2}' "$f")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$f")
    sock=$(awk -F'[ ,]+' '/Socket errors:/ {print $4 + $6 + $8 + $10}' "$f")
    echo "soak_stream name=$s requests=${n:-0} rps=${rps:-0} non2xx=${non2xx:-0} socket_errors=${sock:-0}"
    total=$((total + ${n:-0}))
    failed=$((failed + ${non2xx:-0} + ${sock:-0}))
done
limit=
verdict=PASS
why=
if [ $alive = 0 ] || [ $answers = 0 ]; then
    verdict=FAIL
    why="gateway died or stopped answering"
elif [ -z "$first_warm" ] || [ -z "$last" ]; then
    verdict=FAIL
    why="no sample after the warm-up"
else
    limit=$((first_warm + first_warm * SLACK_PCT / 100 + SLACK_KB))
    if [ "$last" -gt "$limit" ]; then
        verdict=FAIL
        why="RSS grew after the warm-up"
    fi
fi
if [ $verdict = PASS ] && { [ $total = 0 ] || [ $((failed * 1000)) -gt "$total" ]; }; then
    verdict=FAIL
    why="$failed of $total requests failed"
fi
echo "soak verdict=$verdict minutes=$MINUTES warm_s=$WARM first_after_warmup_kb=${first_warm:-0} last_kb=${last:-0}" \
    "limit_kb=${limit:-0} vmhwm_kb=${hwm:-0} requests=$total failed=$failed${why:+ reason=\"$why\"}"
if [ $verdict != PASS ]; then
    KEEP=1
    tail -n 20 "$T/idemgate.log" >&2 || true
    exit 1
fi
exit 0
