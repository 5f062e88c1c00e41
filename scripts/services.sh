#!/usr/bin/env bash
# services.sh - throwaway Postgres 15 and Redis on random free loopback ports, for the tests, the demo and the bench.
#
#   services.sh start DIR          start both in DIR, write DIR/env (sourceable), wait until both answer
#   services.sh stop DIR           stop both (bounded, then kill), delete their data; logs stay in DIR
#   services.sh status DIR         exit 0 when both answer
#   services.sh pg-stop DIR [fast|immediate]   fault injection: stop Postgres, keep its data and port
#   services.sh pg-start DIR       start it again on the same port
#   services.sh redis-stop DIR     stop Redis (its data is lost: it never saves)
#   services.sh redis-start DIR    start it again on the same port
#   services.sh redis-flush DIR    FLUSHALL
#   services.sh standby-start DIR  add a streaming standby (pg_basebackup -R) on another port, synchronous
#                                  (the primary's synchronous_standby_names); DIR/env gains the multi-host URLs
#   services.sh promote DIR        failover: stop the primary hard if it still runs, promote the standby; the
#                                  env's primary (PG_PORT, PG_DATA, the single-host URLs) is the promoted one after
#   services.sh standby-stop DIR   stop the standby, delete its data, make the primary's commits local again
#   services.sh standby-down DIR   fault injection: stop the standby (immediate), keep its data; the primary's
#                                  commits wait for it (synchronous) until standby-up DIR starts it again
#   services.sh free-port [PORT]   print PORT when nothing listens on it, else a random free loopback port
#   services.sh citus-start DIR    like start, but Postgres is a Citus 13.2.2 cluster: the coordinator (PG_PORT, the
#                                  URLs) and two workers on their own random ports (CITUS_WORKER_PORTS); builds and
#                                  installs Citus first when it is missing (scripts/citus-build.sh, cached)
#   services.sh citus-stop DIR     stop the cluster (workers too) and Redis, like stop
#   services.sh citus-worker-stop DIR N [fast|immediate]   fault injection: stop worker N (1 or 2), keep its data
#   services.sh citus-worker-start DIR N                   start it again on the same port
#
# Never touches the system cluster (5432) or the system Redis (6379). As root, Postgres runs as the
# `postgres` user (runuser); Redis runs as the caller. Every wait is bounded (WAIT_S, default 30 s).
# shellcheck disable=SC2030,SC2031 # with_standby runs the Postgres helpers on the standby in a subshell, on purpose
set -euo pipefail

WAIT_S=${SERVICES_WAIT_S:-30}
PORT_MIN=20000
PORT_MAX=32000 # below Linux's ephemeral range (32768-60999)

die() {
    echo "services.sh: $*" >&2
    exit 1
}
say() { echo "services.sh: $*" >&2; }

usage() {
    sed -n '4,24p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

is_root() { [ "$(id -u)" = 0 ]; }

# kill -0 is not enough: an orphan's zombie lingers until init reaps it, and some inits here reap late.
alive() {
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

find_pgbin() {
    local d cands=()
    cands+=("$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/15/bin)
    for d in /usr/lib/postgresql/*/bin; do cands+=("$d"); done
    for d in "${cands[@]}"; do
        if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then
            echo "$d"
            return 0
        fi
    done
    return 1
}

# Runs a command as the user that owns the Postgres cluster, from / (the caller's cwd may be unreadable to it).
as_pg() {
    if is_root; then
        (cd / && runuser -u postgres -- "$@")
    else
        (cd / && "$@")
    fi
}

port_free() {
    local p=$1
    if command -v ss >/dev/null 2>&1; then
        [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ] || return 1
    fi
    # Also catches listeners in other network views ss may not show; a refused connect means free.
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then return 1; fi
    return 0
}

pick_port() {
    local i p
    for i in $(seq 1 200); do
        if command -v shuf >/dev/null 2>&1; then
            p=$(shuf -i "$PORT_MIN-$PORT_MAX" -n 1)
        else
            p=$((PORT_MIN + RANDOM % (PORT_MAX - PORT_MIN)))
        fi
        if port_free "$p"; then
            echo "$p"
            return 0
        fi
    done
    die "no free port found in $PORT_MIN-$PORT_MAX"
}

abs_dir() {
    mkdir -p "$1"
    (cd "$1" && pwd -P)
}

load_env() {
    [ -f "$DIR/env" ] || die "$DIR/env not found: run 'services.sh start $DIR' first"
    # shellcheck disable=SC1091
    . "$DIR/env"
}

# ---------------------------------------------------------------- Postgres

pg_ready() {
    "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -t 2 >/dev/null 2>&1
}

pg_pid() {
    local pid
    [ -f "$PG_DATA/postmaster.pid" ] || return 1
    pid=$(head -n 1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    alive "$pid" || return 1
    echo "$pid"
}

wait_pg_ready() {
    local deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        pg_ready && return 0
        sleep 0.2
    done
    return 1
}

# write_pg_conf [DATA PORT EXTRA]: DATA/idemgate.conf for the cluster in DATA on PORT (default: the primary's),
# with EXTRA lines (standby name, synchronous standby) after the common ones.
write_pg_conf() {
    local tmp data=${1:-$PG_DATA} port=${2:-$PG_PORT} extra=${3:-}
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# written by scripts/services.sh: throwaway cluster. fsync is off (the machine does not crash in tests), but
# commits stay synchronous: fault tests crash Postgres (immediate shutdown), and a committed claim must survive that.
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PG_HOME'
max_connections = 200
fsync = off
synchronous_commit = on
full_page_writes = off
log_min_messages = warning
log_line_prefix = '%m [%p] '
${PG_CONF_EXTRA:-}
$extra
EOF
    chmod 644 "$tmp"
    if is_root; then chown postgres: "$tmp"; fi
    mv -f "$tmp" "$data/idemgate.conf"
}

pg_start() {
    if pg_pid >/dev/null; then
        wait_pg_ready && return 0
        die "postgres (pid $(pg_pid)) runs but does not answer on port $PG_PORT"
    fi
    rm -f "$PG_DATA/postmaster.pid"
    as_pg timeout $((WAIT_S + 10)) "$PGBIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$WAIT_S" -s start \
        >/dev/null 2>&1 || return 1
    wait_pg_ready
}

pg_stop() {
    local mode=${1:-fast} pid i
    pid=$(pg_pid) || return 0
    # A cluster left stopped (SIGSTOP) by a chaos pause whose checker was killed would never stop: continue it.
    kill -CONT "$pid" 2>/dev/null || true
    pkill -CONT -P "$pid" 2>/dev/null || true
    as_pg timeout $((WAIT_S + 5)) "$PGBIN/pg_ctl" -D "$PG_DATA" -m "$mode" -w -t "$WAIT_S" -s stop \
        >/dev/null 2>&1 || true
    if alive "$pid"; then
        say "postgres $pid did not stop ($mode): immediate"
        as_pg timeout 15 "$PGBIN/pg_ctl" -D "$PG_DATA" -m immediate -w -t 10 -s stop >/dev/null 2>&1 || true
    fi
    if alive "$pid"; then
        say "postgres $pid still there: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    # The backends exit by themselves once the postmaster is gone; wait for the port to be released.
    for i in $(seq 1 100); do
        alive "$pid" || break
        sleep 0.1
    done
    for i in $(seq 1 50); do
        port_free "$PG_PORT" && break
        sleep 0.1
    done
    if alive "$pid"; then
        die "postgres $pid would not stop"
    fi
}

# ---------------------------------------------------------------- Redis

redis_cli() { timeout 5 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }

redis_ready() { [ "$(redis_cli ping 2>/dev/null)" = PONG ]; }

redis_pid() {
    local pid
    [ -f "$REDIS_PIDFILE" ] || return 1
    pid=$(head -n 1 "$REDIS_PIDFILE" 2>/dev/null || true)
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    alive "$pid" || return 1
    echo "$pid"
}

# Returns 0 when Redis answers, 1 on failure, 2 when the port was taken (the caller may retry elsewhere).
redis_start() {
    local deadline logstart
    if redis_pid >/dev/null && redis_ready; then return 0; fi
    rm -f "$REDIS_PIDFILE"
    touch "$REDIS_LOG"
    logstart=$(wc -l <"$REDIS_LOG")
    (cd "$DIR" && redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --pidfile "$REDIS_PIDFILE" --logfile "$REDIS_LOG" --dir "$DIR" \
        --protected-mode yes --databases 16 </dev/null >/dev/null 2>&1) || return 1
    deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        redis_ready && return 0
        if tail -n +"$((logstart + 1))" "$REDIS_LOG" 2>/dev/null | grep -qiE 'address already in use|could not create server tcp'; then
            return 2
        fi
        sleep 0.1
    done
    return 1
}

redis_stop() {
    local pid i
    pid=$(redis_pid) || return 0
    redis_cli shutdown nosave >/dev/null 2>&1 || true
    for i in $(seq 1 $((WAIT_S * 10))); do
        alive "$pid" || break
        ((i == 50)) && kill -TERM "$pid" 2>/dev/null
        sleep 0.1
    done
    if alive "$pid"; then
        say "redis $pid did not stop: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do
            alive "$pid" || break
            sleep 0.1
        done
    fi
    rm -f "$REDIS_PIDFILE"
}

# ---------------------------------------------------------------- commands

write_env() {
    local tmp
    tmp=$(mktemp "$DIR/.env.XXXXXX")
    cat >"$tmp" <<EOF
# written by scripts/services.sh start: source it
export IDEMGATE_TEST_PG_URL=postgresql://idemgate@127.0.0.1:$PG_PORT/idemgate
export IDEMGATE_TEST_PG_ADMIN_URL=postgresql://postgres@127.0.0.1:$PG_PORT/idemgate
export IDEMGATE_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
export IDEMGATE_TEST_SERVICES_DIR=$DIR
export IDEMGATE_SERVICES_SH=$SELF
export PG_PORT=$PG_PORT
export REDIS_PORT=$REDIS_PORT
export PG_DATA=$PG_DATA
export PG_HOME=$PG_HOME
export PG_LOG=$PG_LOG
export PGBIN=$PGBIN
export REDIS_PIDFILE=$REDIS_PIDFILE
export REDIS_LOG=$REDIS_LOG
export PG_STANDBY_PORT=${PG_STANDBY_PORT:-}
export PG_STANDBY_DATA=${PG_STANDBY_DATA:-}
export PG_STANDBY_LOG=${PG_STANDBY_LOG:-}
export PG_MULTI_HOSTS=${PG_MULTI_HOSTS:-}
export PG_CONF_EXTRA="${PG_CONF_EXTRA:-}"
export CITUS_WORKER_PORTS=${CITUS_WORKER_PORTS:-}
EOF
    if [ -n "${CITUS_WORKER_PORTS:-}" ]; then
        # The same cluster under the names the e2e engine matrix reads (IDEMGATE_TEST_ENGINE=citus).
        cat >>"$tmp" <<EOF
export IDEMGATE_TEST_CITUS_PG_URL=postgresql://idemgate@127.0.0.1:$PG_PORT/idemgate
export IDEMGATE_TEST_CITUS_PG_ADMIN_URL=postgresql://postgres@127.0.0.1:$PG_PORT/idemgate
export IDEMGATE_TEST_CITUS_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
export IDEMGATE_TEST_CITUS_SERVICES_DIR=$DIR
EOF
    fi
    if [ -n "${PG_MULTI_HOSTS:-}" ]; then
        cat >>"$tmp" <<EOF
export IDEMGATE_TEST_PG_MULTI_URL='postgresql://idemgate@$PG_MULTI_HOSTS/idemgate?target_session_attrs=read-write'
export IDEMGATE_TEST_PG_MULTI_ADMIN_URL='postgresql://postgres@$PG_MULTI_HOSTS/idemgate?target_session_attrs=read-write'
EOF
    fi
    chmod 644 "$tmp"
    mv -f "$tmp" "$DIR/env"
}

# ---------------------------------------------------------------- standby (streaming, synchronous)

STANDBY_NAME=idemgate_standby

# Runs a Postgres helper (pg_ready, pg_start, pg_stop) on the standby instead of the primary.
with_standby() {
    (
        PG_DATA=$PG_STANDBY_DATA
        PG_PORT=$PG_STANDBY_PORT
        PG_LOG=$PG_STANDBY_LOG
        "$@"
    )
}

psql_at() { # PORT SQL: one value, as the superuser, bounded
    PGCONNECT_TIMEOUT=3 timeout 10 "$PGBIN/psql" -X -A -t -q -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2" \
        2>/dev/null
}

# The primary's commits wait for the standby (on) or are local again (off); reloads a running primary.
primary_sync() {
    if [ "$1" = on ]; then
        write_pg_conf "$PG_DATA" "$PG_PORT" "synchronous_standby_names = '$STANDBY_NAME'"
    else
        write_pg_conf "$PG_DATA" "$PG_PORT"
    fi
    if pg_pid >/dev/null; then
        as_pg "$PGBIN/pg_ctl" -D "$PG_DATA" -s reload >/dev/null 2>&1 || true
    fi
}

cmd_standby_start() {
    local try deadline
    load_env
    pg_ready || die "the primary does not answer on port $PG_PORT"
    if [ -n "${PG_STANDBY_PORT:-}" ] && with_standby pg_ready; then
        say "standby already running on port $PG_STANDBY_PORT"
        return 0
    fi
    PG_STANDBY_DATA=$PG_HOME/standby
    PG_STANDBY_LOG=$PG_HOME/standby.log
    PG_STANDBY_PORT=
    rm -rf "$PG_STANDBY_DATA"
    # From here on, a failure removes the standby again and leaves the primary's commits local.
    trap 'rc=$?; if [ $rc -ne 0 ]; then say "standby-start failed: cleaning up"; cmd_standby_stop || true; fi' EXIT
    if ! as_pg timeout $((WAIT_S * 2)) "$PGBIN/pg_basebackup" -h 127.0.0.1 -p "$PG_PORT" -U postgres \
        -D "$PG_STANDBY_DATA" -R -X stream -c fast >"$DIR/basebackup.log" 2>&1; then
        cat "$DIR/basebackup.log" >&2
        die "pg_basebackup failed"
    fi
    for try in 1 2 3 4 5; do
        PG_STANDBY_PORT=$(pick_port)
        write_pg_conf "$PG_STANDBY_DATA" "$PG_STANDBY_PORT" "cluster_name = '$STANDBY_NAME'"
        if with_standby pg_start; then break; fi
        if grep -qi 'already in use' "$PG_STANDBY_LOG" 2>/dev/null && ((try < 5)); then
            say "standby port $PG_STANDBY_PORT taken: retrying"
            with_standby pg_stop immediate || true
            continue
        fi
        tail -n 30 "$PG_STANDBY_LOG" >&2 2>/dev/null || true
        die "the standby did not start on port $PG_STANDBY_PORT within ${WAIT_S}s"
    done
    PG_MULTI_HOSTS=127.0.0.1:$PG_PORT,127.0.0.1:$PG_STANDBY_PORT
    write_env
    primary_sync on
    deadline=$((SECONDS + WAIT_S))
    until [ "$(psql_at "$PG_PORT" "SELECT sync_state FROM pg_stat_replication WHERE application_name = '$STANDBY_NAME'")" = sync ]; do
        ((SECONDS < deadline)) || die "the standby did not become synchronous within ${WAIT_S}s"
        sleep 0.2
    done
    trap - EXIT
    say "standby 127.0.0.1:$PG_STANDBY_PORT (synchronous) of the primary 127.0.0.1:$PG_PORT"
}

cmd_promote() {
    local deadline
    load_env
    [ -n "${PG_STANDBY_PORT:-}" ] || die "no standby in $DIR: run 'services.sh standby-start $DIR' first"
    if pg_pid >/dev/null; then
        say "the primary still runs: stopping it (immediate) before the promotion"
        pg_stop immediate
    fi
    as_pg timeout $((WAIT_S + 10)) "$PGBIN/pg_ctl" -D "$PG_STANDBY_DATA" -w -t "$WAIT_S" -s promote >/dev/null 2>&1 ||
        die "pg_ctl promote failed (log: $PG_STANDBY_LOG)"
    deadline=$((SECONDS + WAIT_S))
    until [ "$(psql_at "$PG_STANDBY_PORT" "SELECT pg_is_in_recovery()")" = f ]; do
        ((SECONDS < deadline)) || die "the standby was not writable within ${WAIT_S}s of its promotion"
        sleep 0.1
    done
    # The promoted standby is the primary now (its commits are local: it has no standby of its own).
    PG_DATA=$PG_STANDBY_DATA
    PG_PORT=$PG_STANDBY_PORT
    PG_LOG=$PG_STANDBY_LOG
    PG_STANDBY_DATA=
    PG_STANDBY_PORT=
    PG_STANDBY_LOG=
    write_env
    say "promoted: the primary is 127.0.0.1:$PG_PORT"
}

cmd_standby_stop() {
    load_env
    if [ -z "${PG_STANDBY_DATA:-}" ]; then
        say "no standby in $DIR"
        return 0
    fi
    primary_sync off
    if [ -n "${PG_STANDBY_PORT:-}" ]; then with_standby pg_stop fast || true; fi
    case "$PG_STANDBY_DATA" in
    "$PG_HOME"/standby) rm -rf "$PG_STANDBY_DATA" ;;
    esac
    PG_STANDBY_DATA=
    PG_STANDBY_PORT=
    PG_STANDBY_LOG=
    PG_MULTI_HOSTS=
    write_env
}

# Postgres must be able to reach its home: as root, DIR/pg when the postgres user can traverse to it and the
# socket path stays short, else a private directory under /tmp (recorded in DIR/env, removed by stop).
choose_pg_home() {
    local h="$DIR/pg"
    mkdir -p "$h"
    if is_root; then
        chown postgres: "$h"
        chmod 700 "$h"
        if ((${#h} > 80)) || ! runuser -u postgres -- test -w "$h" 2>/dev/null; then
            rmdir "$h"
            h=$(mktemp -d /tmp/idemgate-pg.XXXXXX)
            chown postgres: "$h"
        fi
    elif ((${#h} > 80)); then
        rmdir "$h"
        h=$(mktemp -d /tmp/idemgate-pg.XXXXXX)
    fi
    echo "$h"
}

cmd_start() {
    local try rc
    if [ -f "$DIR/env" ]; then
        load_env
        if pg_ready && redis_ready; then
            say "already running in $DIR (postgres $PG_PORT, redis $REDIS_PORT)"
            return 0
        fi
        say "stale $DIR/env: stopping what is left and starting afresh"
        cmd_stop
    fi
    PGBIN=$(find_pgbin) || die "Postgres server binaries not found (initdb, pg_ctl): run scripts/deps.sh"
    command -v redis-server >/dev/null 2>&1 || die "redis-server not found: run scripts/deps.sh"
    command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found: run scripts/deps.sh"
    if is_root; then
        id postgres >/dev/null 2>&1 || die "user postgres missing: run scripts/deps.sh (package postgresql)"
        command -v runuser >/dev/null 2>&1 || die "runuser missing (util-linux)"
    fi

    PG_HOME=$(choose_pg_home)
    PG_DATA=$PG_HOME/data
    PG_LOG=$PG_HOME/postgres.log
    REDIS_PIDFILE=$DIR/redis.pid
    REDIS_LOG=$DIR/redis.log
    PG_PORT=0
    REDIS_PORT=0
    # From here on, a failure stops whatever started.
    trap 'rc=$?; if [ $rc -ne 0 ]; then say "start failed: cleaning up"; write_env; cmd_stop || true; fi' EXIT

    if ! as_pg "$PGBIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --locale=C -N \
        >"$DIR/initdb.log" 2>&1; then
        cat "$DIR/initdb.log" >&2
        die "initdb failed"
    fi
    echo "include_if_exists = 'idemgate.conf'" | as_pg tee -a "$PG_DATA/postgresql.conf" >/dev/null

    for try in 1 2 3 4 5; do
        PG_PORT=$(pick_port)
        write_pg_conf
        if pg_start; then break; fi
        if grep -qi 'already in use' "$PG_LOG" 2>/dev/null && ((try < 5)); then
            say "postgres port $PG_PORT taken: retrying"
            pg_stop immediate || true
            continue
        fi
        tail -n 30 "$PG_LOG" >&2 2>/dev/null || true
        die "postgres did not start on port $PG_PORT within ${WAIT_S}s"
    done
    if ! PGCONNECT_TIMEOUT=5 timeout 30 "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" \
        -U postgres -d postgres \
        -c "CREATE ROLE idemgate LOGIN" -c "CREATE DATABASE idemgate OWNER idemgate" >/dev/null; then
        die "could not create role and database idemgate"
    fi

    for try in 1 2 3 4 5; do
        REDIS_PORT=$(pick_port)
        rc=0
        redis_start || rc=$?
        [ $rc = 0 ] && break
        if [ $rc = 2 ] && ((try < 5)); then
            say "redis port $REDIS_PORT taken: retrying"
            redis_stop || true
            continue
        fi
        tail -n 30 "$REDIS_LOG" >&2 2>/dev/null || true
        die "redis did not start on port $REDIS_PORT within ${WAIT_S}s"
    done

    write_env
    trap - EXIT
    echo "services.sh: postgres 127.0.0.1:$PG_PORT redis 127.0.0.1:$REDIS_PORT env $DIR/env" >&2
}

cmd_stop() {
    if [ ! -f "$DIR/env" ]; then
        say "nothing to stop in $DIR"
        return 0
    fi
    load_env
    redis_stop
    if [ -n "${PG_STANDBY_PORT:-}" ]; then with_standby pg_stop fast || true; fi
    if [ -n "${CITUS_WORKER_PORTS:-}" ]; then
        with_worker 1 pg_stop fast || true
        if [ -n "$(worker_port 2)" ]; then with_worker 2 pg_stop fast || true; fi
    fi
    pg_stop fast
    # The logs stay in DIR (the home goes): the primary's, the standby's, and after a promotion the old primary's.
    local f
    for f in "$PG_HOME"/*.log; do
        [ -f "$f" ] && cp -f "$f" "$DIR/" 2>/dev/null || true
    done
    # Only what start created: the cluster's home (DIR/pg or /tmp/idemgate-pg.*), the env file.
    case "$PG_HOME" in
    "$DIR/pg" | /tmp/idemgate-pg.*) rm -rf "$PG_HOME" ;;
    esac
    rm -f "$DIR/env"
}

cmd_status() {
    local ok=0
    load_env
    if pg_ready; then echo "postgres: up (127.0.0.1:$PG_PORT)"; else
        echo "postgres: down (127.0.0.1:$PG_PORT)"
        ok=1
    fi
    if redis_ready; then echo "redis: up (127.0.0.1:$REDIS_PORT)"; else
        echo "redis: down (127.0.0.1:$REDIS_PORT)"
        ok=1
    fi
    return $ok
}

# ---------------------------------------------------------------- Citus (a coordinator and two workers)

CITUS_PRELOAD="shared_preload_libraries = 'citus'"

worker_port() { echo "$CITUS_WORKER_PORTS" | cut -d, -f"$1"; }

# Runs a Postgres helper on worker N (1-based) instead of the coordinator.
with_worker() {
    local n=$1
    shift
    (
        PG_DATA=$PG_HOME/w$n
        PG_LOG=$PG_HOME/w$n.log
        PG_PORT=$(worker_port "$n")
        "$@"
    )
}

psql_db() { # PORT DB SQL...: as the superuser, stop at the first error, bounded
    local port=$1 db=$2
    shift 2
    local args=()
    for c in "$@"; do args+=(-c "$c"); done
    PGCONNECT_TIMEOUT=5 timeout 60 "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres \
        -d "$db" "${args[@]}" >/dev/null
}

# Starts worker n on a fresh random port (retried when taken); CITUS_WORKER_PORTS gains it.
worker_init() {
    local n=$1 try port
    if ! as_pg "$PGBIN/initdb" -D "$PG_HOME/w$n" -U postgres --auth=trust -E UTF8 --locale=C -N \
        >"$DIR/initdb-w$n.log" 2>&1; then
        cat "$DIR/initdb-w$n.log" >&2
        die "initdb of worker $n failed"
    fi
    echo "include_if_exists = 'idemgate.conf'" | as_pg tee -a "$PG_HOME/w$n/postgresql.conf" >/dev/null
    for try in 1 2 3 4 5; do
        port=$(pick_port)
        write_pg_conf "$PG_HOME/w$n" "$port"
        if (PG_DATA=$PG_HOME/w$n PG_LOG=$PG_HOME/w$n.log PG_PORT=$port pg_start); then break; fi
        if grep -qi 'already in use' "$PG_HOME/w$n.log" 2>/dev/null && ((try < 5)); then
            say "worker $n port $port taken: retrying"
            (PG_DATA=$PG_HOME/w$n PG_PORT=$port pg_stop immediate) || true
            continue
        fi
        tail -n 30 "$PG_HOME/w$n.log" >&2 2>/dev/null || true
        die "worker $n did not start on port $port within ${WAIT_S}s"
    done
    CITUS_WORKER_PORTS=${CITUS_WORKER_PORTS:+$CITUS_WORKER_PORTS,}$port
}

cmd_citus_start() {
    local n port
    if [ -f "$DIR/env" ]; then
        load_env
        if [ -n "${CITUS_WORKER_PORTS:-}" ] && pg_ready && redis_ready && with_worker 1 pg_ready &&
            with_worker 2 pg_ready; then
            say "citus already running in $DIR (coordinator $PG_PORT, workers $CITUS_WORKER_PORTS)"
            return 0
        fi
        say "stale $DIR/env: stopping what is left and starting afresh"
        cmd_stop
    fi
    bash "$(dirname "$SELF")/citus-build.sh" || die "citus is not installed (scripts/citus-build.sh failed)"
    PG_CONF_EXTRA=$CITUS_PRELOAD
    CITUS_WORKER_PORTS=
    cmd_start # the coordinator (with the role and database idemgate) and Redis; its trap stops them on failure
    trap 'rc=$?; if [ $rc -ne 0 ]; then say "citus-start failed: cleaning up"; write_env; cmd_stop || true; fi' EXIT
    for n in 1 2; do
        worker_init $n
        write_env
        port=$(worker_port $n)
        psql_db "$port" postgres "CREATE ROLE idemgate LOGIN" "CREATE DATABASE idemgate OWNER idemgate" ||
            die "worker $n: could not create role and database idemgate"
        psql_db "$port" idemgate "CREATE EXTENSION citus" || die "worker $n: CREATE EXTENSION citus failed"
    done
    psql_db "$PG_PORT" idemgate "CREATE EXTENSION citus" \
        "SELECT citus_set_coordinator_host('127.0.0.1', $PG_PORT)" \
        "SELECT citus_add_node('127.0.0.1', $(worker_port 1))" \
        "SELECT citus_add_node('127.0.0.1', $(worker_port 2))" ||
        die "could not make the coordinator on $PG_PORT know its workers"
    trap - EXIT
    say "citus: coordinator 127.0.0.1:$PG_PORT workers $CITUS_WORKER_PORTS redis 127.0.0.1:$REDIS_PORT env $DIR/env"
}

worker_arg() {
    load_env
    [ -n "${CITUS_WORKER_PORTS:-}" ] || die "no citus cluster in $DIR"
    case "${1:-}" in 1 | 2) ;; *) die "worker number: 1 or 2" ;; esac
}

if [ "${1:-}" = free-port ]; then
    if [ -n "${2:-}" ] && port_free "$2"; then echo "$2"; else pick_port; fi
    exit 0
fi
[ $# -ge 2 ] || usage
CMD=$1
DIR=$(abs_dir "$2")
SELF=$(cd "$(dirname "$0")" && pwd -P)/$(basename "$0")
shift 2

case "$CMD" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
pg-stop)
    load_env
    mode=${1:-fast}
    case "$mode" in fast | immediate | smart) ;; *) die "pg-stop mode: fast|immediate" ;; esac
    pg_stop "$mode"
    ;;
pg-start)
    load_env
    pg_start || {
        tail -n 20 "$PG_LOG" >&2 2>/dev/null || true
        die "postgres did not start again on port $PG_PORT"
    }
    ;;
redis-stop)
    load_env
    redis_stop
    ;;
redis-start)
    load_env
    redis_start || {
        tail -n 20 "$REDIS_LOG" >&2 2>/dev/null || true
        die "redis did not start again on port $REDIS_PORT"
    }
    ;;
standby-start) cmd_standby_start ;;
citus-start) cmd_citus_start ;;
citus-stop) cmd_stop ;;
citus-worker-stop)
    worker_arg "${1:-}"
    mode=${2:-fast}
    case "$mode" in fast | immediate) ;; *) die "citus-worker-stop mode: fast|immediate" ;; esac
    with_worker "$1" pg_stop "$mode"
    ;;
citus-worker-start)
    worker_arg "${1:-}"
    with_worker "$1" pg_start || die "worker $1 did not start again"
    ;;
promote) cmd_promote ;;
standby-stop) cmd_standby_stop ;;
standby-down | standby-up)
    load_env
    [ -n "${PG_STANDBY_PORT:-}" ] || die "no standby in $DIR: run 'services.sh standby-start $DIR' first"
    if [ "$CMD" = standby-down ]; then with_standby pg_stop immediate; else with_standby pg_start; fi
    ;;
redis-flush)
    load_env
    [ "$(redis_cli flushall 2>/dev/null)" = OK ] || die "redis FLUSHALL failed"
    ;;
*) usage ;;
esac
