#!/usr/bin/env bash
# ab.sh - A/B of two gateway binaries on one load: the two alternate (A B A B ...) behind the same Postgres, Redis
# and upstream, each run on a fresh gateway process, so a machine whose speed drifts (a shared VM) moves both alike.
# Not a benchmark of record (that is ../shared/bench/run.sh): it tells whether a change moves a path, with the CPU
# each process spent per request, which varies less than req/s here.
#
#   bench/ab.sh A_BIN B_BIN                    8 s runs of the fast new-key load, 5 pairs
#   bench/ab.sh --load slow_new A_BIN B_BIN    the load: new (64 conns, 0 ms upstream) | slow_new (1000 conns,
#                                              100 ms) | pass (64 conns, GET, key off, 0 ms) | slow (1000 conns,
#                                              GET, key off, 100 ms: the shared bench's gw_slow) | replay (64 conns,
#                                              1000 keys executed once before the first run: the shared bench's
#                                              gw_replay; each gateway's warm-up fills its replay cache)
#   bench/ab.sh --pairs N --duration S ...     pairs of runs, seconds per run
#   bench/ab.sh --pause S ...                  seconds between the warm-up and the measured run (default 0): with
#                                              --load slow --pause 65, a first wave after keepalive_timeout (60 s)
#   bench/ab.sh --warmup S ...                 seconds of warm-up (default 1; 2 for slow); 0: the measured run is
#                                              the fresh gateway's first load (with --load slow, a cold first wave)
#
# Per run one line: `ab NAME rps= p50_ms= p99_ms= gw_us= pg_us= redis_us= commits_per_req=` (CPU of the gateway, of every
# Postgres process and of Redis over the run, per request; Postgres commits per request), then a `mean NAME` line
# per binary. Postgres has fsync and full_page_writes on (as the shared bench's). Everything listens on 127.0.0.1
# and is stopped on exit; every wait is bounded.
# shellcheck disable=SC2317 # functions called from traps
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SVC=$ROOT/scripts/services.sh
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

LOAD=new
PAIRS=5
DUR=8
PAUSE=0
WARMUP=
while [ $# -gt 0 ]; do
    case "$1" in
    --load)
        [ $# -ge 2 ] || usage_err "--load needs new, slow_new, pass, slow or replay"
        LOAD=$2
        shift
        ;;
    --pairs)
        [ $# -ge 2 ] || usage_err "--pairs needs a number"
        PAIRS=$2
        shift
        ;;
    --duration)
        [ $# -ge 2 ] || usage_err "--duration needs seconds"
        DUR=$2
        shift
        ;;
    --pause)
        [ $# -ge 2 ] || usage_err "--pause needs seconds"
        PAUSE=$2
        shift
        ;;
    --warmup)
        [ $# -ge 2 ] || usage_err "--warmup needs seconds"
        WARMUP=$2
        shift
        ;;
    --keep) KEEP=1 ;;
    -h | --help)
        sed -n '6,17p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    -*) usage_err "unknown option $1" ;;
    *) break ;;
    esac
    shift
done
[ $# = 2 ] || usage_err "two binaries, A and B"
BINS=("$(realpath "$1")" "$(realpath "$2")")
for b in "${BINS[@]}"; do [ -x "$b" ] || usage_err "$b is not an executable"; done
case "$LOAD" in new | slow_new | pass | slow | replay) ;; *) usage_err "--load: new, slow_new, pass, slow or replay" ;; esac
case "$PAIRS$DUR$PAUSE$WARMUP" in *[!0-9]*) usage_err "--pairs, --duration, --pause and --warmup want whole numbers" ;; esac
((PAUSE <= 600)) || usage_err "--pause 0..600"
((${WARMUP:-0} <= 60)) || usage_err "--warmup 0..60"
((PAIRS >= 1 && PAIRS <= 50 && DUR >= 1 && DUR <= 120)) || usage_err "--pairs 1..50, --duration 1..120"

SHARED=${IDEMGATE_SHARED_BENCH:-$ROOT/../shared/bench}
if [ ! -f "$SHARED/slow_upstream.c" ] || [ ! -d "$SHARED/lua" ]; then
    die "no shared bench at $SHARED (set IDEMGATE_SHARED_BENCH)"
fi
for c in wrk curl gcc timeout psql; do command -v "$c" >/dev/null 2>&1 || die "$c missing: scripts/deps.sh --bench"; done
for v in $(compgen -e); do
    case $v in PG* | IDEMGATE_*) unset "$v" ;; esac
done
export PG_CONF_EXTRA=$'fsync = on\nfull_page_writes = on' LC_ALL=C
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

T=$(mktemp -d /tmp/idemgate-ab.XXXXXX)
chmod 755 "$T"
for s in get new_keys replay; do cat "$SHARED/lua/$s.lua" "$SHARED/lua/report.lua" >"$T/$s.lua"; done
gcc -O2 -pthread -o "$T/slow_upstream" "$SHARED/slow_upstream.c" 2>"$T/slow_upstream.build.log" ||
    die "slow_upstream did not build: $(head -5 "$T/slow_upstream.build.log")"
start_services
PORTS+=("$PG_PORT" "$REDIS_PORT")
UP_PORT=$(bash "$SVC" free-port)
delay=0 conns=64 threads=2 path=/v1/payments lua=new_keys warm=1
case "$LOAD" in
slow_new) delay=100 conns=1000 threads=1 ;;
pass) path=/pass/ping lua=get ;;
slow) delay=100 conns=1000 path=/pass/ping lua=get warm=2 ;;
replay) lua=replay ;;
esac
AUTH="Bearer bench-tenant-1"
RUN_ID=ab$$-$SECONDS
export BENCH_REPLAY_NONCE=$RUN_ID BENCH_REPLAY_KEYS=1000 BENCH_AUTH=$AUTH
warm=${WARMUP:-$warm}
"$T/slow_upstream" -p "$UP_PORT" -a 127.0.0.1 -d "$delay" -t 1 >"$T/upstream.log" 2>&1 </dev/null &
PIDS+=($!)
PORTS+=("$UP_PORT")
wait_port "$UP_PORT" 10 || die "slow_upstream did not start (see $T/upstream.log)"
GW_PORT=$(bash "$SVC" free-port)
ADMIN_PORT=$(bash "$SVC" free-port)
PORTS+=("$GW_PORT" "$ADMIN_PORT")
cat >"$T/idemgate.yaml" <<EOF
$(gateway_conf_head)
store:
  postgres: $IDEMGATE_TEST_PG_URL
  pool: 16
  redis: $IDEMGATE_TEST_REDIS_URL
  redis_timeout: 50ms
upstreams:
  - name: up
    url: http://127.0.0.1:$UP_PORT
    connect_timeout: 2s
    timeout: 30s
routes:
  - name: pass
    match:
      path_prefix: /pass
    upstream: up
    idempotency:
      key: off
  - name: payments
    match:
      path_prefix: /v1/payments
      methods: [POST]
    upstream: up
    idempotency:
      key: required
      header: Idempotency-Key
      scope: [header:Authorization]
      fingerprint: [method, path, query, body]
      retention: 24h
      lease: 60s
      on_in_flight: conflict
      max_body: 1MiB
EOF

ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
pg_ticks() {
    local t=0 p
    for p in $(pgrep -u postgres -x postgres); do t=$((t + $(ticks "$p"))); done
    echo "$t"
}
commits() {
    PGCONNECT_TIMEOUT=3 timeout 10 psql -X -A -t -d "$IDEMGATE_TEST_PG_ADMIN_URL" \
        -c "SELECT sum(xact_commit) FROM pg_stat_database" 2>/dev/null || echo 0
}
HZ=$(getconf CLK_TCK)
REDIS_SRV=$(head -n 1 "$REDIS_PIDFILE")
RESULTS=$T/results
: >"$RESULTS"

# run NAME BIN: a fresh gateway from BIN, a warm-up of $warm s (none at 0), then DUR s measured; one `ab` line.
run() {
    local name=$1 IDEMGATE=$2 out=$T/wrk.out g0 g1 p0 p1 r0 r1 c0 c1
    timeout 20 "$IDEMGATE" --check -c "$T/idemgate.yaml" >"$T/check.log" 2>&1 || die "$name rejected the config"
    start_gateway "$T/idemgate.yaml" "$T/idemgate-$name.log"
    if [ "$LOAD" = replay ] && [ ! -e "$T/warm_keys.txt" ]; then # the keys' records, once: Postgres keeps them
        timeout 180 python3 "$SHARED/warm_keys.py" --port "$GW_PORT" --nonce "$RUN_ID" --keys 1000 \
            --path /v1/payments --auth "$AUTH" --deadline 150 >"$T/warm_keys.txt" 2>&1 ||
            die "replay warm phase failed: $(tail -n 3 "$T/warm_keys.txt" | tr '\n' ' ')"
    fi
    if ((warm > 0)); then
        BENCH_PATH=$path BENCH_NONCE=w$RANDOM$SECONDS timeout -k 5 30 wrk -t"$threads" -c"$conns" -d"${warm}s" \
            -s "$T/$lua.lua" "http://127.0.0.1:$GW_PORT$path" >/dev/null 2>&1 </dev/null || true
    fi
    sleep "$PAUSE"
    g0=$(ticks "$GW_PID") p0=$(pg_ticks) r0=$(ticks "$REDIS_SRV") c0=$(commits)
    BENCH_PATH=$path BENCH_NONCE=m$RANDOM$SECONDS timeout -k 5 $((DUR + 30)) wrk -t"$threads" -c"$conns" \
        -d"${DUR}s" --timeout 10s -s "$T/$lua.lua" "http://127.0.0.1:$GW_PORT$path" >"$out" 2>&1 </dev/null ||
        note "wrk exited non-zero: $(tail -n 2 "$out" | tr '\n' ' ')"
    g1=$(ticks "$GW_PID") p1=$(pg_ticks) r1=$(ticks "$REDIS_SRV") c1=$(commits)
    kill -TERM "$GW_PID" 2>/dev/null || true
    reap "$GW_PID"
    forget_pid "$GW_PID"
    grep '^WRKSTAT ' "$out" | tail -n 1 | awk -v name="$name" -v hz="$HZ" -v g="$((g1 - g0))" -v p="$((p1 - p0))" \
        -v r="$((r1 - r0))" -v c="$((c1 - c0))" '{
        for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        n = v["requests"]; d = v["duration_us"] / 1e6
        err = v["err_connect"] + v["err_read"] + v["err_write"] + v["err_status"] + v["err_timeout"]
        if (n == 0 || d == 0) { printf "ab %s no requests\n", name; exit }
        printf "ab %s rps=%.0f p50_ms=%.2f p99_ms=%.2f errors=%d gw_us=%.1f pg_us=%.1f redis_us=%.1f commits_per_req=%.3f\n",
            name, n / d, v["p50_us"] / 1000, v["p99_us"] / 1000, err, 1e6 * g / hz / n, 1e6 * p / hz / n, 1e6 * r / hz / n, c / n
    }' | tee -a "$RESULTS"
}

echo "ab: load $LOAD (wrk -t$threads -c$conns, ${warm} s warm-up, ${PAUSE} s pause, ${DUR} s, upstream ${delay} ms), $PAIRS pairs; A=${BINS[0]} B=${BINS[1]}"
for i in $(seq 1 "$PAIRS"); do
    if ((i % 2)); then order=(0 1); else order=(1 0); fi
    for j in "${order[@]}"; do run "$([ "$j" = 0 ] && echo A || echo B)" "${BINS[$j]}"; done
done
awk '$1 == "ab" && NF > 4 {
    k = $2; n[k]++
    for (i = 3; i <= NF; i++) { split($i, kv, "="); s[k, kv[1]] += kv[2]; if (!(kv[1] in seen)) { seen[kv[1]] = 1; order[++m] = kv[1] } }
} END {
    for (k in n) { line = "mean " k; for (i = 1; i <= m; i++) line = line sprintf(" %s=%.3f", order[i], s[k, order[i]] / n[k]); print line }
}' "$RESULTS" | sort
