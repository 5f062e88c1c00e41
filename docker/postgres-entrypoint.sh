#!/bin/sh
# postgres-entrypoint.sh - the local Postgres 15 image's entrypoint (the test stage's stand-in for the official
# postgres image, with the same interface): on the first start (no $PGDATA/PG_VERSION) makes the cluster with the
# role and database $POSTGRES_USER / $POSTGRES_DB (password $POSTGRES_PASSWORD, scram over TCP), then runs the
# command, `postgres [ARGS]` (port $PGPORT, default 5432; ARGS such as -c listen_addresses=...; it listens on
# 127.0.0.1 unless told otherwise). Exits 1 when the set-up fails (a half-made cluster is removed, so the next
# start tries again).
set -eu
: "${POSTGRES_USER:=idemgate}" "${POSTGRES_DB:=idemgate}" "${POSTGRES_PASSWORD:=idemgate}"
sock=/tmp/postgres-init

case "$POSTGRES_USER$POSTGRES_DB" in *[!A-Za-z0-9_]*)
    echo "postgres-entrypoint: POSTGRES_USER and POSTGRES_DB must be letters, digits and _" >&2
    exit 1
    ;;
esac

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    echo "postgres-entrypoint: first start, making the cluster in $PGDATA"
    rm -rf "$PGDATA"
    pw=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pw"
    if ! initdb -D "$PGDATA" -U postgres --pwfile="$pw" -E UTF8 --locale=C.UTF-8 \
        --auth-local=peer --auth-host=scram-sha-256 >/tmp/initdb.log 2>&1; then
        cat /tmp/initdb.log >&2
        rm -rf "$PGDATA" "$pw"
        exit 1
    fi
    mkdir -p "$sock"
    # Socket only while the role and database are made: no client can reach a half-made cluster.
    pg_ctl -D "$PGDATA" -w -t 60 -o "-c listen_addresses='' -c unix_socket_directories=$sock" start >/dev/null
    # The password goes through a psql variable (quoted by psql), never through the SQL text.
    if ! psql -v ON_ERROR_STOP=1 -q -h "$sock" -U postgres -d postgres -v pw="$POSTGRES_PASSWORD" <<SQL; then
CREATE ROLE $POSTGRES_USER LOGIN PASSWORD :'pw';
CREATE DATABASE $POSTGRES_DB OWNER $POSTGRES_USER;
SQL
        pg_ctl -D "$PGDATA" -m fast -w -t 60 stop >/dev/null || true
        rm -rf "$PGDATA" "$pw"
        exit 1
    fi
    pg_ctl -D "$PGDATA" -m fast -w -t 60 stop >/dev/null
    rm -f "$pw"
fi
if [ "${1:-}" = postgres ]; then shift; fi
exec postgres -D "$PGDATA" -c listen_addresses=127.0.0.1 -c unix_socket_directories=/tmp "$@"
