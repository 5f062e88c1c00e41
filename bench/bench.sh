#!/usr/bin/env bash
# bench.sh - loopback benchmark: idemgate against the bare upstream and nginx as a proxy, then the idempotency
# engine (new keys against pgbench running the same SQL, replays against nginx, added latency).
#
#   bench/bench.sh            10 s per figure (about 3 minutes in all)
#   bench/bench.sh --quick    3 s per figure (smoke check)
#   bench/bench.sh --no-deps  do not run scripts/deps.sh --bench first
#
# Not a test: numbers depend on the machine; wrk, the servers and Postgres share its cores. Every figure is
# printed in a table and as one line `bench name=... rps=... p50_ms=... p99_ms=...`. Traffic goes to 127.0.0.1 only.
# shellcheck disable=SC2317 # functions called from traps
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SVC=$ROOT/scripts/services.sh
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

DUR=10
WARM=2
deps=1
for a in "$@"; do
    case "$a" in
    --quick)
        DUR=3
        WARM=1
        ;;
    --no-deps) deps=0 ;;
    -h | --help)
        sed -n '5,7p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "bench.sh: unknown option $a" >&2
        exit 2
        ;;
    esac
done
CONNS=64
CONNS_SLOW=1000
DELAY_MS=100
THREADS=2
REPLAY_KEYS=100

die() {
    echo "bench.sh: $*" >&2
    exit 1
}
note() { echo "bench.sh: $*" >&2; }

# ---- processes we start, stopped by id on exit
T=
PIDS=()
NGINX_PID=
SERVICES_UP=0
cleanup() {
    trap - EXIT INT TERM HUP
    trap '' PIPE
    set +e
    if [ -n "$NGINX_PID" ]; then
        kill -TERM "$NGINX_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$NGINX_PID" 2>/dev/null || break
            sleep 0.1
        done
        # nginx (daemon) leads its own process group: master and workers.
        kill -KILL -- "-$NGINX_PID" 2>/dev/null || true
    fi
    stop_started
    if [ -n "$T" ] && [ -d "$T" ]; then rm -rf "$T"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# 1000 connections each for wrk, nginx and idemgate (plus their upstream sockets).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
[ "$(ulimit -n)" = unlimited ] || [ "$(ulimit -n)" -ge $((CONNS_SLOW * 3)) ] ||
    die "ulimit -n is $(ulimit -n): too low for $CONNS_SLOW connections"

[ $deps = 1 ] && bash scripts/deps.sh --bench
for c in wrk nginx pgbench curl; do command -v $c >/dev/null 2>&1 || die "$c missing: scripts/deps.sh --bench"; done

# ---- build (optimised, in its own dir)
if [ ! -f build-bench/build.ninja ]; then
    rm -rf build-bench
    meson setup build-bench -Dbuildtype=release >/tmp/idemgate-bench-setup.log 2>&1 || {
        cat /tmp/idemgate-bench-setup.log >&2
        die "meson setup build-bench failed"
    }
else
    meson configure build-bench -Dbuildtype=release >/dev/null
fi
ninja -C build-bench idemgate tests/tools/testupstream >/tmp/idemgate-bench-build.log 2>&1 || {
    tail -n 40 /tmp/idemgate-bench-build.log >&2
    die "build failed"
}
rm -f /tmp/idemgate-bench-setup.log /tmp/idemgate-bench-build.log
IDEMGATE=$ROOT/build-bench/idemgate
UPSTREAM=$ROOT/build-bench/tests/tools/testupstream
if [ ! -x "$IDEMGATE" ] || [ ! -x "$UPSTREAM" ]; then die "build-bench/idemgate or testupstream missing"; fi

T=$(mktemp -d /tmp/idemgate-bench.XXXXXX)
chmod 755 "$T"
RUN_ID=$(date +%s)-$$
export BENCH_RUN=$RUN_ID BENCH_KEYS=$REPLAY_KEYS

# ---- Postgres + Redis
start_services

# ---- upstreams: one fast, one answering after DELAY_MS
UP_FAST=$(bash "$SVC" free-port)
start_upstream up-fast 0 "$UP_FAST"
UP_SLOW=$(bash "$SVC" free-port)
start_upstream up-slow $DELAY_MS "$UP_SLOW"

# ---- nginx: the reference proxy, tuned as one would in production
NGX_PORT=$(bash "$SVC" free-port)
mkdir -p "$T/nginx"
cat >"$T/nginx/nginx.conf" <<EOF
worker_processes 2;
worker_rlimit_nofile 65536;
pid $T/nginx/nginx.pid;
error_log $T/nginx/error.log warn;
events { worker_connections 8192; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $T/nginx/body;
    proxy_temp_path $T/nginx/proxy;
    fastcgi_temp_path $T/nginx/fastcgi;
    uwsgi_temp_path $T/nginx/uwsgi;
    scgi_temp_path $T/nginx/scgi;
    upstream fast { server 127.0.0.1:$UP_FAST; keepalive 64; keepalive_requests 1000000; }
    upstream slow { server 127.0.0.1:$UP_SLOW; keepalive 64; keepalive_requests 1000000; }
    server {
        listen 127.0.0.1:$NGX_PORT reuseport backlog=4096;
        location / {
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location /slow/ {
            proxy_pass http://slow;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
nginx -e "$T/nginx/error.log" -p "$T/nginx/" -c "$T/nginx/nginx.conf" -t -q || die "nginx config rejected"
nginx -e "$T/nginx/error.log" -p "$T/nginx/" -c "$T/nginx/nginx.conf"
for _ in $(seq 1 50); do
    [ -s "$T/nginx/nginx.pid" ] && break
    sleep 0.1
done
NGINX_PID=$(cat "$T/nginx/nginx.pid" 2>/dev/null) || die "nginx did not start"
wait_port "$NGX_PORT" 10 || die "nginx does not listen (see $T/nginx/error.log)"

# ---- idemgate
GW_PORT=$(bash "$SVC" free-port)
ADMIN_PORT=$(bash "$SVC" free-port)
cat >"$T/idemgate.yaml" <<EOF
listen: 127.0.0.1:$GW_PORT
admin:
  listen: 127.0.0.1:$ADMIN_PORT
shutdown_grace: 5s
store:
  # One connection per loop: Postgres shares these 2 CPUs, and the pool's batches (many claims or completions
  # in one statement and one commit) do better than more backends (README, Benchmark).
  pool: 2
  redis_timeout: 50ms
upstreams:
  - name: fast
    url: http://127.0.0.1:$UP_FAST
    connect_timeout: 2s
    timeout: 30s
    max_connections: 2048
  - name: slow
    url: http://127.0.0.1:$UP_SLOW
    connect_timeout: 2s
    timeout: 30s
    max_connections: 2048
routes:
  - name: bench
    match:
      path_prefix: /bench
      methods: [POST]
    upstream: fast
    idempotency:
      key: required
      retention: 1h
      lease: 60s
  - name: slow
    match:
      path_prefix: /slow
    upstream: slow
    idempotency:
      key: "off"
default_upstream: fast
max_connections: 8192
client_timeout: 30s
EOF
export IDEMGATE_POSTGRES_URL=$IDEMGATE_TEST_PG_URL IDEMGATE_REDIS_URL=$IDEMGATE_TEST_REDIS_URL
"$IDEMGATE" --check -c "$T/idemgate.yaml" >/dev/null || {
    "$IDEMGATE" --check -c "$T/idemgate.yaml" || true
    die "idemgate rejected the bench config"
}
start_gateway "$T/idemgate.yaml" "$T/idemgate.log"

UP=http://127.0.0.1:$UP_FAST
UPS=http://127.0.0.1:$UP_SLOW
NGX=http://127.0.0.1:$NGX_PORT
GW=http://127.0.0.1:$GW_PORT

# ---- measuring
ROWS=()    # table rows
SUMMARY=() # machine-readable lines
declare -A RPS P50 P99

to_ms() { # 520.00us | 1.23ms | 2.01s | 1.00m -> ms
    awk -v v="$1" 'BEGIN {
        n = v + 0; u = v; sub(/^[0-9.]+/, "", u)
        if (u == "us") n /= 1000; else if (u == "s") n *= 1000; else if (u == "m") n *= 60000; else if (u == "h") n *= 3600000
        printf "%.3f", n }'
}

add_row() { # name rps p50 p99 errors note
    RPS[$1]=$2
    P50[$1]=$3
    P99[$1]=$4
    ROWS+=("$(printf '%-34s %10s %9s %9s  %s' "$1" "$2" "$3" "$4" "${5:-0}${6:+  $6}")")
    SUMMARY+=("bench name=$1 rps=$2 p50_ms=$3 p99_ms=$4 errors=${5:-0}")
    printf '  %-34s rps=%s p50_ms=%s p99_ms=%s errors=%s\n' "$1" "$2" "$3" "$4" "${5:-0}"
}

# wrk_fig NAME URL CONNS [LUA [KEYS]]: warm-up, then the measured run with --latency. The Lua scripts name their
# keys after BENCH_RUN: by default distinct for the warm-up and the run (new keys), or KEYS for both (replays).
wrk_fig() {
    local name=$1 url=$2 c=$3 lua=${4:-} keys=${5:-} out=$T/wrk-$1.txt args rps p50 p99 errs non2xx sock
    args=(-t "$THREADS" -c "$c" --latency --timeout 5s)
    [ -n "$lua" ] && args+=(-s "$ROOT/bench/$lua")
    curl -fsS -m 5 -o /dev/null -X POST "$UP/_test/reset" || true
    curl -fsS -m 5 -o /dev/null -X POST "$UPS/_test/reset" || true
    BENCH_RUN=${keys:-$RUN_ID-$name-warm} timeout $((WARM + 30)) wrk "${args[@]}" -d "${WARM}s" "$url" >/dev/null 2>&1 || true
    # The warm-up's connections close with requests still in flight (their answers are still awaited from the
    # upstream): let them drain, then restart the gateway's peak-RSS count so that VmHWM is the measured run's
    # (back to back, the two runs briefly overlap to ~2x the connections).
    sleep 1
    [ -n "${GW_PID:-}" ] && [ -w "/proc/$GW_PID/clear_refs" ] && echo 5 >"/proc/$GW_PID/clear_refs" 2>/dev/null
    BENCH_RUN=${keys:-$RUN_ID-$name} timeout $((DUR + 30)) wrk "${args[@]}" -d "${DUR}s" "$url" >"$out" 2>&1 ||
        note "wrk $name exited non-zero"
    rps=$(awk '/^Requests\/sec:/ {printf "%.0f", $2}' "$out")
    p50=$(to_ms "$(awk '$1 == "50%" {print $2}' "$out")")
    p99=$(to_ms "$(awk '$1 == "99%" {print $2}' "$out")")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$out")
    sock=$(awk -F'[ ,]+' '/Socket errors:/ {print $4 + $6 + $8 + $10}' "$out")
    errs=$((${non2xx:-0} + ${sock:-0}))
    add_row "$name" "${rps:-0}" "$p50" "$p99" "$errs" "$([ "$errs" != 0 ] && echo "(non2xx=${non2xx:-0} socket=${sock:-0})")"
}

vm() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
GW_IDLE_KB=$(vm "$GW_PID" VmRSS) # before any load: shared libraries and start-up allocations

echo "bench: ${DUR}s per figure after ${WARM}s warm-up, wrk -t$THREADS, $(nproc) CPUs, all on 127.0.0.1"
echo "bench: upstream fast :$UP_FAST, slow :$UP_SLOW (+${DELAY_MS}ms), nginx :$NGX_PORT, idemgate :$GW_PORT"
echo "bench: Postgres :$PG_PORT (fsync=off: test cluster), Redis :$REDIS_PORT"

echo "== proxy: GET, $CONNS connections, fast upstream"
wrk_fig "get-c$CONNS-upstream" "$UP/" $CONNS
wrk_fig "get-c$CONNS-nginx" "$NGX/" $CONNS
wrk_fig "get-c$CONNS-idemgate" "$GW/" $CONNS

echo "== proxy: GET, $CONNS_SLOW connections, upstream answering after ${DELAY_MS}ms"
wrk_fig "get-c$CONNS_SLOW-slow-upstream" "$UPS/slow/" $CONNS_SLOW
wrk_fig "get-c$CONNS_SLOW-slow-nginx" "$NGX/slow/" $CONNS_SLOW
wrk_fig "get-c$CONNS_SLOW-slow-idemgate" "$GW/slow/" $CONNS_SLOW
GW_HWM_KB=$(vm "$GW_PID" VmHWM)
GW_THREADS=$(vm "$GW_PID" Threads)

echo "== idempotency: new keys (claim + forward + completion), $CONNS connections"
wrk_fig "newkey-c$CONNS-upstream" "$UP/bench/new" $CONNS newkey.lua
wrk_fig "newkey-c$CONNS-idemgate" "$GW/bench/new" $CONNS newkey.lua

echo "== idempotency: the same SQL in pgbench ($CONNS clients, -j $THREADS, prepared)"
PGB=$PGBIN/pgbench
[ -x "$PGB" ] || PGB=pgbench
psql_q() { "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 "$IDEMGATE_TEST_PG_URL" "$@"; }
psql_q -c "DROP TABLE IF EXISTS bench_keys" -c "CREATE TABLE bench_keys (LIKE idemgate_keys INCLUDING ALL)"
pgb_common=(-h 127.0.0.1 -p "$PG_PORT" -U idemgate -n -M prepared -c "$CONNS" -j "$THREADS" -f "$ROOT/bench/claim.sql")
timeout $((WARM + 30)) "$PGB" "${pgb_common[@]}" -T "$WARM" idemgate >/dev/null 2>&1 || true
mkdir -p "$T/pgb"
timeout $((DUR + 60)) "$PGB" "${pgb_common[@]}" -T "$DUR" -l --log-prefix="$T/pgb/tx" idemgate >"$T/pgbench.txt" 2>&1 ||
    note "pgbench exited non-zero: $(tail -n 3 "$T/pgbench.txt")"
tps=$(awk '/^tps = / {printf "%.0f", $3; exit}' "$T/pgbench.txt")
# per-transaction log: client tx latency_us script epoch us
cat "$T"/pgb/tx* 2>/dev/null | awk '{print $3}' | sort -n >"$T/pgb-lat.txt"
nlat=$(wc -l <"$T/pgb-lat.txt")
pct() { # file count pct -> ms
    awk -v n="$2" -v p="$3" 'BEGIN { i = int(n * p / 100); if (i < 1) i = 1 } NR == i { printf "%.3f", $1 / 1000; exit }' "$1"
}
pgerr=$(awk '/number of failed transactions:/ {print $5}' "$T/pgbench.txt")
add_row "claim-c$CONNS-pgbench" "${tps:-0}" "$(pct "$T/pgb-lat.txt" "$nlat" 50)" "$(pct "$T/pgb-lat.txt" "$nlat" 99)" "${pgerr:-0}"

echo "== idempotency: replays of $REPLAY_KEYS completed keys, $CONNS connections"
body='{"amount":4200,"currency":"EUR","note":"bench"}'
for i in $(seq 1 $REPLAY_KEYS); do
    curl -fsS -m 5 -o /dev/null -X POST "$GW/bench/replay" -H 'Content-Type: application/json' \
        -H "Idempotency-Key: rp-$RUN_ID-replay-$i" --data-binary "$body" || die "priming replay key $i failed"
done
wrk_fig "replay-c$CONNS-upstream" "$UP/bench/replay" $CONNS replay.lua "$RUN_ID-replay"
wrk_fig "replay-c$CONNS-nginx" "$NGX/bench/replay" $CONNS replay.lua "$RUN_ID-replay"
wrk_fig "replay-c$CONNS-idemgate" "$GW/bench/replay" $CONNS replay.lua "$RUN_ID-replay"
replayed=$(curl -fsS -m 5 "http://127.0.0.1:$ADMIN_PORT/metrics" 2>/dev/null |
    awk '/^idemgate_dedup_hits_total/ {s += $NF} END {printf "%.0f", s}')

# ---- report
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 == 0) print "n/a"; else printf "%.2f", a / b }'; }
diff_ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%+.3f", a - b }'; }
echo
printf '%-34s %10s %9s %9s  %s\n' figure req/s p50_ms p99_ms errors
printf '%s\n' "${ROWS[@]}"
echo
c64=get-c$CONNS
c1k=get-c$CONNS_SLOW-slow
for pair in "$c64" "$c1k" "replay-c$CONNS"; do
    rr=$(ratio "${RPS[$pair-idemgate]}" "${RPS[$pair-nginx]}")
    pr=$(ratio "${P99[$pair-idemgate]}" "${P99[$pair-nginx]}")
    printf 'idemgate/nginx %-26s throughput x%s  p99 x%s\n' "$pair" "$rr" "$pr"
    SUMMARY+=("bench name=ratio-$pair-idemgate-nginx rps_ratio=$rr p99_ratio=$pr")
done
rr=$(ratio "${RPS[newkey-c$CONNS-idemgate]}" "${RPS[claim-c$CONNS-pgbench]}")
printf 'idemgate new keys / pgbench claim+complete      x%s of the SQL ceiling\n' "$rr"
SUMMARY+=("bench name=ratio-newkey-idemgate-pgbench rps_ratio=$rr")
for k in "$c64" "newkey-c$CONNS" "replay-c$CONNS"; do
    a50=$(diff_ms "${P50[$k-idemgate]}" "${P50[$k-upstream]}")
    a99=$(diff_ms "${P99[$k-idemgate]}" "${P99[$k-upstream]}")
    printf 'added latency over the upstream %-16s p50 %s ms  p99 %s ms\n' "$k" "$a50" "$a99"
    SUMMARY+=("bench name=added-latency-$k p50_ms=$a50 p99_ms=$a99")
done
GW_PER_CONN_KB=$(awk -v h="$GW_HWM_KB" -v i="$GW_IDLE_KB" -v n=$CONNS_SLOW 'BEGIN { printf "%.1f", (h - i) / n }')
printf 'idemgate peak RSS (VmHWM) after the %d-connection run: %s kB (idle %s kB: %s kB per connection), %s threads\n' \
    $CONNS_SLOW "$GW_HWM_KB" "$GW_IDLE_KB" "$GW_PER_CONN_KB" "$GW_THREADS"
SUMMARY+=("bench name=idemgate-peak-rss-c$CONNS_SLOW vmhwm_kb=$GW_HWM_KB idle_kb=$GW_IDLE_KB per_conn_kb=$GW_PER_CONN_KB threads=$GW_THREADS")
printf 'replays counted by idemgate_dedup_hits_total: %s\n' "${replayed:-n/a}"
echo
printf '%s\n' "${SUMMARY[@]}"
