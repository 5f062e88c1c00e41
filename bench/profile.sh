#!/usr/bin/env bash
# profile.sh - where the gateway's CPU goes on its hot paths: perf and strace on a release build under the
# shared bench's load (same routes, upstreams, Lua scripts, Postgres with fsync on). Not a benchmark: speed is
# measured by the shared bench (../shared/bench/run.sh); perf costs the gateway CPU while it samples.
#
#   bench/profile.sh                 every scenario: pass replay new slow slow_new, 10 s of perf each
#   bench/profile.sh --only LIST     only these scenarios (comma-separated, e.g. --only pass,new)
#   bench/profile.sh --duration S    seconds of perf per scenario (default 10)
#   bench/profile.sh --keep          keep the temp dir (perf.data files, wrk and strace output, logs)
#   bench/profile.sh --no-deps       do not run scripts/deps.sh --bench when perf, strace, wrk or nginx is missing
#   bench/profile.sh --bin PATH      profile that gateway binary (e.g. an older release build) instead of building
#
# Scenarios: pass (GET /pass/ping, key off), replay (POST /v1/payments, 1000 keys executed once first),
# new (POST /v1/payments, a new key per request) at wrk -t2 -c64 against nginx `return 200`; slow (GET
# /slow/pass/ping) and slow_new (POST /slow/payments, new keys) at wrk -t1 -c1000 against slow_upstream (100 ms).
# Per scenario: warm-up, then wrk with `perf record -F 999 -e cpu-clock --call-graph dwarf` on the gateway for S
# seconds; printed: wrk's req/s, p50, p99; CPU of each process group over the perf window (/proc/PID/stat); the
# top 25 symbols by self time; the top 40 gateway functions by children; syscalls per request (strace -c -f for
# 2 s in a second, shorter wrk run). Machine lines: `profile name=...`. Environment: IDEMGATE_SHARED_BENCH (the
# shared bench's directory, default ../shared/bench), PG_CONF_EXTRA (default: fsync and full_page_writes on, as
# the shared bench's Postgres). Everything listens on 127.0.0.1 and is stopped on exit.
# shellcheck disable=SC2317 # functions called from traps
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SVC=$ROOT/scripts/services.sh
# shellcheck source=bench/lib.sh
. "$ROOT/bench/lib.sh"

ALL_SCENARIOS=(pass replay new slow slow_new)
DUR=10
ONLY=
deps=1
BIN=
while [ $# -gt 0 ]; do
    case "$1" in
    --only)
        [ $# -ge 2 ] || usage_err "--only needs a list"
        ONLY=$2
        shift
        ;;
    --duration)
        [ $# -ge 2 ] || usage_err "--duration needs seconds"
        DUR=$2
        shift
        ;;
    --keep) KEEP=1 ;;
    --no-deps) deps=0 ;;
    --bin)
        [ $# -ge 2 ] || usage_err "--bin needs a path"
        BIN=$(realpath "$2")
        [ -x "$BIN" ] || usage_err "--bin: $2 is not an executable"
        shift
        ;;
    -h | --help)
        sed -n '6,11p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) usage_err "unknown option $1" ;;
    esac
    shift
done
case "$DUR" in
'' | *[!0-9]*) usage_err "--duration wants whole seconds" ;;
esac
if [ "$DUR" -lt 1 ] || [ "$DUR" -gt 600 ]; then usage_err "--duration must be 1..600"; fi
SCENARIOS=()
for s in "${ALL_SCENARIOS[@]}"; do
    if [ -z "$ONLY" ] || [[ ",$ONLY," == *",$s,"* ]]; then SCENARIOS+=("$s"); fi
done
for s in ${ONLY//,/ }; do
    [[ " ${ALL_SCENARIOS[*]} " == *" $s "* ]] || usage_err "unknown scenario $s (${ALL_SCENARIOS[*]})"
done
[ ${#SCENARIOS[@]} -gt 0 ] || usage_err "no scenario selected"

WARM=2
[ "$DUR" -ge 5 ] || WARM=1
WIN=$(awk -v d="$DUR" 'BEGIN {print (d >= 2) ? d - 1 : d / 2}') # the CPU window inside perf's
STRACE_S=2
REPLAY_KEYS=1000
AUTH="Bearer bench-tenant-1"
HZ=$(getconf CLK_TCK)
NCPU=$(nproc)

SHARED=${IDEMGATE_SHARED_BENCH:-$ROOT/../shared/bench}
PG_EXTRA=${PG_CONF_EXTRA-$'fsync = on\nfull_page_writes = on'}
# Nothing from the caller's environment may redirect the gateway or libpq (the shared bench does the same).
for v in $(compgen -e); do
    case $v in PG* | IDEMGATE_*) unset "$v" ;; esac
done
export PG_CONF_EXTRA=$PG_EXTRA LC_ALL=C

trap cleanup EXIT
trap 'exit 130' INT TERM HUP

if [ ! -f "$SHARED/slow_upstream.c" ] || [ ! -f "$SHARED/warm_keys.py" ] || [ ! -d "$SHARED/lua" ]; then
    die "no shared bench at $SHARED (set IDEMGATE_SHARED_BENCH)"
fi
SHARED=$(cd "$SHARED" && pwd -P)
need=(wrk nginx perf strace curl gcc python3 timeout)
for c in "${need[@]}"; do
    if ! command -v "$c" >/dev/null 2>&1; then
        [ $deps = 1 ] || die "$c missing: scripts/deps.sh --bench"
        bash scripts/deps.sh --bench
        break
    fi
done
for c in "${need[@]}"; do command -v "$c" >/dev/null 2>&1 || die "$c missing"; done
# 1000 connections each for wrk and the gateway, plus the gateway's upstream sockets.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

# ---- release build (the one the shared bench is run with)
if [ -n "$BIN" ]; then
    IDEMGATE=$BIN
else
    IDEMGATE=$ROOT/build-release/idemgate
    build_release "$ROOT/build-release" idemgate
fi

T=$(mktemp -d /tmp/idemgate-profile.XXXXXX)
chmod 755 "$T"
mkdir -p "$T/lua" "$T/out"
RUN_ID=$(date +%s)-$$
# The shared bench's scripts with its report.lua appended: one WRKSTAT line per run.
for s in get new_keys replay; do cat "$SHARED/lua/$s.lua" "$SHARED/lua/report.lua" >"$T/lua/$s.lua"; done
gcc -O2 -pthread -o "$T/slow_upstream" "$SHARED/slow_upstream.c" 2>"$T/slow_upstream.build.log" ||
    die "slow_upstream did not build: $(head -5 "$T/slow_upstream.build.log")"

# ---- Postgres + Redis
start_services
PG_MASTER=$(head -n 1 "$PG_DATA/postmaster.pid")
REDIS_SRV=$(head -n 1 "$REDIS_PIDFILE")
PORTS+=("$PG_PORT" "$REDIS_PORT")

# ---- the fast upstream (nginx, as the shared bench's) and slow_upstream
UP_PORT=$(bash "$SVC" free-port)
mkdir -p "$T/nginx"
cat >"$T/nginx/nginx.conf" <<EOF
worker_processes 1;
pid $T/nginx/nginx.pid;
error_log $T/nginx/error.log warn;
worker_rlimit_nofile 16384;
events { worker_connections 8192; }
http {
    access_log off;
    client_body_temp_path $T/nginx/body;
    proxy_temp_path $T/nginx/proxy;
    fastcgi_temp_path $T/nginx/fastcgi;
    uwsgi_temp_path $T/nginx/uwsgi;
    scgi_temp_path $T/nginx/scgi;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:$UP_PORT;
        default_type application/json;
        location / { return 200 '{"ok":true}'; }
    }
}
EOF
nginx -t -q -p "$T/nginx/" -c "$T/nginx/nginx.conf" -e "$T/nginx/error.log" || die "nginx config rejected"
nginx -p "$T/nginx/" -c "$T/nginx/nginx.conf" -e "$T/nginx/error.log" -g 'daemon off;' >"$T/nginx/stdout.log" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
PORTS+=("$UP_PORT")
wait_port "$UP_PORT" 10 || die "nginx does not listen (see $T/nginx/error.log)"

SLOW_PORT=$(bash "$SVC" free-port)
"$T/slow_upstream" -p "$SLOW_PORT" -a 127.0.0.1 -d 100 -t 1 >"$T/slow_upstream.log" 2>&1 </dev/null &
SLOW_PID=$!
PIDS+=("$SLOW_PID")
PORTS+=("$SLOW_PORT")
wait_port "$SLOW_PORT" 10 || die "slow_upstream did not start (see $T/slow_upstream.log)"

# ---- the gateway, configured as the shared bench configures it
GW_PORT=$(bash "$SVC" free-port)
ADMIN_PORT=$(bash "$SVC" free-port)
PORTS+=("$GW_PORT" "$ADMIN_PORT")
idem_block() { # the shared bench's key: required block
    cat <<EOF
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
}
cat >"$T/idemgate.yaml" <<EOF
$(gateway_conf_head)
store:
  postgres: $IDEMGATE_TEST_PG_URL
  pool: 16
  redis: $IDEMGATE_TEST_REDIS_URL
  redis_timeout: 50ms
upstreams:
  - name: fast
    url: http://127.0.0.1:$UP_PORT
    connect_timeout: 2s
    timeout: 30s
  - name: slow
    url: http://127.0.0.1:$SLOW_PORT
    connect_timeout: 2s
    timeout: 30s
routes:
  - name: pass
    match:
      path_prefix: /pass
    upstream: fast
    idempotency:
      key: off
  - name: payments
    match:
      path_prefix: /v1/payments
      methods: [POST]
    upstream: fast
$(idem_block)
  - name: slow-pass
    match:
      path_prefix: /slow/pass
    upstream: slow
    idempotency:
      key: off
  - name: slow-payments
    match:
      path_prefix: /slow/payments
      methods: [POST]
    upstream: slow
$(idem_block)
EOF
timeout 20 "$IDEMGATE" --check -c "$T/idemgate.yaml" >"$T/idemgate.check.log" 2>&1 || {
    cat "$T/idemgate.check.log" >&2
    die "idemgate rejected the config"
}
start_gateway "$T/idemgate.yaml" "$T/idemgate.log"
GW=http://127.0.0.1:$GW_PORT

# ---- measuring helpers
# requests answered so far: the sum of idemgate_requests_total
gw_requests() {
    curl -fsS -m 5 "http://127.0.0.1:$ADMIN_PORT/metrics" 2>/dev/null |
        awk '/^idemgate_requests_total\{/ {s += $NF} END {printf "%.0f\n", s}'
}
# machine_ticks: "busy total" clock ticks of all CPUs so far (/proc/stat)
machine_ticks() {
    local _cpu u n sy id io irq sirq steal
    read -r _cpu u n sy id io irq sirq steal _ </proc/stat
    echo "$((u + n + sy + irq + sirq + steal)) $((u + n + sy + id + io + irq + sirq + steal))"
}
# cpu_snap FILE [LOAD_PID PERF_PID]: "group pid ticks" (utime + stime) for every process we measure, then
# "machine busy total". LOAD_PID and PERF_PID are the `timeout` wrappers of wrk and perf. No fork per process
# (bash reads /proc), so that the snapshot is quick on a saturated machine.
cpu_snap() {
    local out=$1 load=${2:-} perfp=${3:-} g pid st f t pids kids
    {
        for g in gateway:"$GW_PID" postgres:"$PG_MASTER" redis:"$REDIS_SRV" nginx:"$NGINX_PID" \
            slow_upstream:"$SLOW_PID" wrk:"$load" perf:"$perfp"; do
            pid=${g#*:}
            [ -n "$pid" ] || continue
            g=${g%%:*}
            kids=()
            for t in /proc/"$pid"/task/*/children; do
                [ -r "$t" ] || continue
                f=()
                read -ra f <"$t" || true # one line, no newline
                kids+=("${f[@]}")
            done
            case $g in
            postgres | nginx) pids=("$pid" "${kids[@]}") ;;
            wrk | perf) pids=("${kids[@]}") ;; # the wrapped process, not `timeout`
            *) pids=("$pid") ;;
            esac
            for pid in "${pids[@]}"; do
                { read -r st <"/proc/$pid/stat"; } 2>/dev/null || continue
                read -ra f <<<"${st##*) }"
                echo "$g $pid $((f[11] + f[12]))"
            done
        done
        echo "machine $(machine_ticks)"
    } >"$out"
}
now_ns() { date +%s%N; }
# cpu_report BEFORE AFTER SECONDS REQUESTS NAME: % of one CPU per group over the window, the rest of the
# machine (everything else busy: the kernel's softirqs, this shell, other load), and gateway CPU per request.
cpu_report() {
    awk -v s="$3" -v hz="$HZ" -v n="$4" -v ncpu="$NCPU" -v name="$5" '
        FNR == NR { if ($1 == "machine") { b0 = $2; t0 = $3 } else before[$1 " " $2] = $3; next }
        $1 == "machine" { busy = $2 - b0; tot = $3 - t0; next }
        { k = $1 " " $2; d = $3 - ((k in before) ? before[k] : 0); if (d < 0) d = 0; ticks[$1] += d; sum += d }
        END {
            split("gateway postgres redis nginx slow_upstream wrk perf", order, " ")
            line = ""; m = "profile_cpu name=" name
            for (i = 1; i <= 7; i++) {
                g = order[i]; pct = 100 * ticks[g] / hz / s
                line = line sprintf("  %s %.1f", g, pct); m = m sprintf(" %s_pct=%.1f", g, pct)
            }
            mach = (tot > 0) ? 100 * ncpu * busy / tot : 0
            rest = mach - 100 * sum / hz / s; if (rest < 0) rest = 0
            us = (n > 0) ? 1e6 * ticks["gateway"] / hz / n : 0
            printf "cpu over %.1f s, %% of one CPU (%d CPUs = %d %%):\n%s  rest %.1f  (machine busy %.1f)\n", s, ncpu, 100 * ncpu, line, rest, mach
            printf "gateway CPU per request: %.1f us (%d requests in the window)\n", us, n
            printf "%s rest_pct=%.1f machine_pct=%.1f gw_us_per_req=%.1f\n", m, rest, mach, us > "/dev/stderr"
        }' "$1" "$2" 2>>"$T/machine-lines"
}

# wrk_start CONNS THREADS SECONDS OUT [VAR=value...]: wrk in the background on the scenario's URL and Lua
# script (SC_URL, SC_LUA), bounded by timeout; its wrapper's pid in LOAD_PID (and PIDS).
wrk_start() {
    local c=$1 th=$2 d=$3 out=$4
    shift 4
    env "$@" timeout -k 5 $((d + 30)) wrk -t"$th" -c"$c" -d"${d}s" --timeout 10s -s "$T/lua/$SC_LUA.lua" "$SC_URL" \
        >"$out" 2>&1 </dev/null &
    LOAD_PID=$!
    PIDS+=("$LOAD_PID")
}
wrk_wait() {
    wait "$LOAD_PID" 2>/dev/null || note "wrk exited non-zero: $(tail -n 2 "$1" | tr '\n' ' ')"
    forget_pid "$LOAD_PID"
    LOAD_PID=
}
# wrk_stat OUT: "rps p50_ms p99_ms requests errors" from the WRKSTAT line
wrk_stat() {
    grep '^WRKSTAT ' "$1" | tail -n 1 | awk '{
        for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        err = v["err_connect"] + v["err_read"] + v["err_write"] + v["err_status"] + v["err_timeout"]
        d = v["duration_us"] / 1e6
        printf "%.0f %.2f %.2f %d %d\n", (d > 0) ? v["requests"] / d : 0, v["p50_us"] / 1000, v["p99_us"] / 1000, v["requests"], err
    }'
}
checkpoint() {
    timeout 60 "$PGBIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c CHECKPOINT >/dev/null 2>&1 ||
        note "CHECKPOINT failed"
}
# (awk reads to the end rather than head: perf must not die of SIGPIPE under pipefail)
perf_top() { # DATA: top 25 symbols by self time, in every object the gateway's threads ran (kernel included)
    timeout 600 perf report -i "$1" --stdio --no-children --sort dso,sym -g none 2>/dev/null |
        awk '!/^#/ && !/^[[:space:]]*$/ && !/^\(/ && n++ < 25' || true
}
perf_own() { # DATA: the gateway's own functions by children (self + what they call)
    timeout 600 perf report -i "$1" --stdio --children --sort dso,sym -g none 2>/dev/null |
        awk -v dso="$(basename "$IDEMGATE")" '$3 == dso && n++ < 40' || true
}

REPLAY_WARM=0
warm_replay_keys() { # the shared bench's warm phase: each of the 1000 keys executed once
    [ $REPLAY_WARM = 0 ] || return 0
    timeout 180 python3 "$SHARED/warm_keys.py" --port "$GW_PORT" --nonce "$RUN_ID" --keys $REPLAY_KEYS \
        --path /v1/payments --auth "$AUTH" --deadline 150 >"$T/out/warm_keys.txt" 2>&1 || {
        cat "$T/out/warm_keys.txt" >&2
        die "replay warm phase failed"
    }
    REPLAY_WARM=1
}

SUMMARY=()
profile_scenario() {
    local s=$1 conns=64 threads=2 env=() st rps p50 p99 nreq errs
    SC_LUA="get"
    case $s in
    pass) SC_URL=$GW/pass/ping ;;
    replay)
        SC_URL=$GW/v1/payments SC_LUA=replay
        env=(BENCH_REPLAY_NONCE="$RUN_ID" BENCH_REPLAY_KEYS="$REPLAY_KEYS" BENCH_PATH=/v1/payments BENCH_AUTH="$AUTH")
        warm_replay_keys
        ;;
    new) SC_URL=$GW/v1/payments SC_LUA=new_keys env=(BENCH_PATH=/v1/payments BENCH_AUTH="$AUTH") ;;
    slow) SC_URL=$GW/slow/pass/ping ;;
    slow_new) SC_URL=$GW/slow/payments SC_LUA=new_keys env=(BENCH_PATH=/slow/payments BENCH_AUTH="$AUTH") ;;
    esac
    case $s in slow*) conns=1000 threads=1 ;; esac
    echo
    echo "== $s: $SC_URL, wrk -t$threads -c$conns ($SC_LUA.lua), perf ${DUR} s"
    kill -0 "$GW_PID" 2>/dev/null || die "the gateway is gone (see $T/idemgate.log)"

    # warm-up (new keys: their own nonce), then a checkpoint so that the window does not pay for the last run
    wrk_start "$conns" "$threads" "$WARM" "$T/out/$s.warm.txt" "${env[@]}" BENCH_NONCE="w-$s-$RUN_ID"
    wrk_wait "$T/out/$s.warm.txt"
    checkpoint
    sleep 1

    # the measured run: wrk for DUR + 4 s, perf and the CPU window in its middle
    local t0 t1 r0 r1 perf_pid data=$T/$s.perf.data
    wrk_start "$conns" "$threads" $((DUR + 4)) "$T/out/$s.txt" "${env[@]}" BENCH_NONCE="m-$s-$RUN_ID"
    sleep 1
    timeout -k 5 $((DUR + 60)) perf record -F 999 -e cpu-clock --call-graph dwarf,16384 --no-buildid-cache \
        -o "$data" -p "$GW_PID" -- sleep "$DUR" >"$T/out/$s.perf.log" 2>&1 &
    perf_pid=$!
    PIDS+=("$perf_pid")
    # the CPU window: from perf's start-up done to just before its end, so that perf's own CPU is counted
    sleep 0.5
    r0=$(gw_requests)
    t0=$(now_ns)
    cpu_snap "$T/out/$s.cpu0" "$LOAD_PID" "$perf_pid"
    sleep "$WIN"
    cpu_snap "$T/out/$s.cpu1" "$LOAD_PID" "$perf_pid"
    t1=$(now_ns)
    r1=$(gw_requests)
    wait "$perf_pid" 2>/dev/null || note "perf record exited non-zero: $(tail -n 3 "$T/out/$s.perf.log" | tr '\n' ' ')"
    forget_pid "$perf_pid"
    wrk_wait "$T/out/$s.txt"

    st=$(wrk_stat "$T/out/$s.txt")
    read -r rps p50 p99 nreq errs <<<"${st:-0 0 0 0 0}"
    echo "wrk: $rps req/s  p50 $p50 ms  p99 $p99 ms  ($nreq requests, $errs errors, $((DUR + 4)) s)"
    cpu_report "$T/out/$s.cpu0" "$T/out/$s.cpu1" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", (b - a) / 1e9}')" \
        $((${r1:-0} - ${r0:-0})) "$s"

    # syscalls per request: strace on every gateway thread for STRACE_S s of a second, short run
    local q0 q1 n calls per
    wrk_start "$conns" "$threads" $((STRACE_S + 2)) "$T/out/$s.strace-wrk.txt" "${env[@]}" BENCH_NONCE="s-$s-$RUN_ID"
    sleep 1
    q0=$(gw_requests)
    timeout -s INT -k 5 "$STRACE_S" strace -c -f -p "$GW_PID" -o "$T/out/$s.strace.txt" >/dev/null 2>&1 || true
    q1=$(gw_requests)
    wrk_wait "$T/out/$s.strace-wrk.txt"
    n=$((${q1:-0} - ${q0:-0}))
    # strace -c: "% time, seconds, usecs/call, calls, [errors,] syscall" per line
    calls=$(awk '$1 ~ /^[0-9.]+$/ && $NF != "total" {c += $4} END {print c + 0}' "$T/out/$s.strace.txt" 2>/dev/null)
    per=$(awk -v c="${calls:-0}" -v n="$n" 'BEGIN {printf "%.2f", (n > 0) ? c / n : 0}')
    echo "syscalls per request: $per (${calls:-0} calls, $n requests under strace, ${STRACE_S} s); most called, per request:"
    awk -v n="$n" '$1 ~ /^[0-9.]+$/ && $NF != "total" { printf "  %-18s %7.2f\n", $NF, (n > 0) ? $4 / n : 0 }' \
        "$T/out/$s.strace.txt" 2>/dev/null | sort -k2,2nr | awk 'NR <= 8' || true

    echo "perf: $(grep -m1 '^\[ perf record: Captured' "$T/out/$s.perf.log" | sed 's/^\[ perf record: //; s/ \]$//')"
    echo "-- top 25 symbols (self; perf report --no-children --sort dso,sym):"
    perf_top "$data"
    echo "-- top 40 gateway functions (children: self + callees; perf report --children, dso idemgate):"
    perf_own "$data"
    [ "$KEEP" = 1 ] || rm -f "$data"
    SUMMARY+=("profile name=$s rps=$rps p50_ms=$p50 p99_ms=$p99 errors=$errs syscalls_per_req=$per")
}

echo "profile: ${SCENARIOS[*]}; ${DUR} s of perf each after ${WARM} s warm-up; $NCPU CPUs; all on 127.0.0.1"
echo "profile: gateway $IDEMGATE (pid $GW_PID) :$GW_PORT, nginx upstream :$UP_PORT, slow_upstream :$SLOW_PORT (100 ms)"
echo "profile: Postgres :$PG_PORT ($(tr '\n' ' ' <<<"$PG_CONF_EXTRA" | sed 's/ *$//')), Redis :$REDIS_PORT, store.pool 16"
# Other load on the machine shows as `rest` in every window; here once before ours starts.
read -r b0 t0 <<<"$(machine_ticks)"
sleep 1
read -r b1 t1 <<<"$(machine_ticks)"
echo "profile: machine busy before the load: $(awk -v b=$((b1 - b0)) -v t=$((t1 - t0)) -v n="$NCPU" \
    'BEGIN {printf "%.0f", (t > 0) ? 100 * n * b / t : 0}') % of $((NCPU * 100)) % (others' load shows as rest)"
for s in "${SCENARIOS[@]}"; do profile_scenario "$s"; done
echo
printf '%s\n' "${SUMMARY[@]}"
if [ -f "$T/machine-lines" ]; then cat "$T/machine-lines"; fi
