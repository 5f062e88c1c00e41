#!/usr/bin/env bash
# run.sh - the demo: builds idemgate, starts Postgres+Redis (in .run/), the test upstream and the gateway,
# shows a replay, then keeps the gateway in the foreground until Ctrl-C, which stops everything.
#
#   scripts/run.sh             run, demo, stay in the foreground
#   scripts/run.sh --no-wait   run, demo, stop everything (exit 0 when the demo behaved)
#   scripts/run.sh --no-deps   skip scripts/deps.sh
# shellcheck disable=SC2317 # functions run from traps and check() look unreachable to shellcheck
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
RUN=$ROOT/.run
CONF_SRC=$ROOT/conf/idemgate.example.yaml
SVC=$ROOT/scripts/services.sh

wait_fg=1
deps=1
for a in "$@"; do
    case "$a" in
    --no-wait) wait_fg=0 ;;
    --no-deps) deps=0 ;;
    -h | --help)
        sed -n '5,7p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "run.sh: unknown option $a" >&2
        exit 2
        ;;
    esac
done

say() { printf '%s\n' "$*"; }
if [ -t 1 ]; then
    hdr() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
    hdr() { printf '\n== %s\n' "$*"; }
fi
die() {
    echo "run.sh: $*" >&2
    exit 1
}

GW_PID=
UP_PID=
TAIL_PID=
SERVICES_UP=0
# Stops a child: TERM, up to $2 seconds, then KILL.
stop_pid() {
    local pid=$1 grace=$2
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 $((grace * 10))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    # Runs to the end whatever happens: Ctrl-C may also have closed the pipe our output went to.
    trap - EXIT INT TERM HUP
    trap '' PIPE
    set +e
    echo
    say "run.sh: stopping"
    stop_pid "$GW_PID" 15
    stop_pid "$TAIL_PID" 1
    stop_pid "$UP_PID" 5
    GW_PID='' TAIL_PID='' UP_PID=''
    if [ "$SERVICES_UP" = 1 ]; then bash "$SVC" stop "$RUN" >/dev/null || true; fi
    say "run.sh: stopped (logs in .run/)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

[ $deps = 1 ] && bash scripts/deps.sh

mkdir -p "$RUN"
hdr "build"
if [ ! -f build/build.ninja ]; then
    rm -rf build
    meson setup build >"$RUN/meson-setup.log" 2>&1 || {
        cat "$RUN/meson-setup.log" >&2
        die "meson setup failed"
    }
fi
ninja -C build
IDEMGATE=$ROOT/build/idemgate
UPSTREAM=$ROOT/build/tests/tools/testupstream
[ -x "$IDEMGATE" ] || die "build/idemgate missing after the build"
[ -x "$UPSTREAM" ] || die "build/tests/tools/testupstream missing after the build"
[ -f "$CONF_SRC" ] || die "$CONF_SRC missing"

hdr "Postgres + Redis (throwaway, .run/)"
mkdir -p "$RUN"
bash "$SVC" start "$RUN"
SERVICES_UP=1
# shellcheck disable=SC1091
. "$RUN/env"

hdr "demo upstream (build/tests/tools/testupstream)"
UP_PORT=$(bash "$SVC" free-port 9000)
rm -f "$RUN/upstream.port"
"$UPSTREAM" --host 127.0.0.1 --port "$UP_PORT" --port-file "$RUN/upstream.port" --quiet \
    >"$RUN/upstream.log" 2>&1 </dev/null &
UP_PID=$!
for _ in $(seq 1 100); do
    [ -s "$RUN/upstream.port" ] && break
    kill -0 "$UP_PID" 2>/dev/null || break
    sleep 0.1
done
[ -s "$RUN/upstream.port" ] || {
    cat "$RUN/upstream.log" >&2
    die "testupstream did not start"
}
say "upstream: http://127.0.0.1:$UP_PORT (pid $UP_PID, log .run/upstream.log)"

hdr "gateway"
GW_PORT=$(bash "$SVC" free-port 8080)
ADMIN_PORT=$(bash "$SVC" free-port 9090)
[ "$ADMIN_PORT" != "$GW_PORT" ] || ADMIN_PORT=$(bash "$SVC" free-port)
CONF=$RUN/idemgate.yaml
# The example, with the ports actually free here (the Postgres/Redis URLs come from the environment).
sed -e "s#^listen: 127\.0\.0\.1:8080#listen: 127.0.0.1:$GW_PORT#" \
    -e "s#^\(  listen: \)127\.0\.0\.1:9090#\1127.0.0.1:$ADMIN_PORT#" \
    -e "s#url: http://127\.0\.0\.1:9000#url: http://127.0.0.1:$UP_PORT#" \
    "$CONF_SRC" >"$CONF"
if ! grep -q "^listen: 127.0.0.1:$GW_PORT" "$CONF" || ! grep -q "listen: 127.0.0.1:$ADMIN_PORT" "$CONF" ||
    ! grep -q "url: http://127.0.0.1:$UP_PORT" "$CONF"; then
    die "conf/idemgate.example.yaml no longer has listen 127.0.0.1:8080, admin 127.0.0.1:9090, upstream :9000"
fi
TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export IDEMGATE_POSTGRES_URL=$IDEMGATE_TEST_PG_URL
export IDEMGATE_REDIS_URL=$IDEMGATE_TEST_REDIS_URL
export IDEMGATE_ADMIN_TOKEN=$TOKEN
"$IDEMGATE" --check -c "$CONF" || die "idemgate --check rejected $CONF"
"$IDEMGATE" -c "$CONF" >>"$RUN/idemgate.log" 2>&1 </dev/null &
GW_PID=$!
GW=http://127.0.0.1:$GW_PORT
ADMIN=http://127.0.0.1:$ADMIN_PORT
ready=0
for _ in $(seq 1 300); do
    if ! kill -0 "$GW_PID" 2>/dev/null; then break; fi
    if curl -fsS -m 1 -o /dev/null "$ADMIN/readyz" 2>/dev/null; then
        ready=1
        break
    fi
    sleep 0.1
done
if [ $ready = 0 ]; then
    tail -n 30 "$RUN/idemgate.log" >&2
    die "the gateway did not become ready within 30 s"
fi
say "gateway: $GW  admin: $ADMIN  (pid $GW_PID, log .run/idemgate.log)"
say "readyz:  $(curl -sS -m 2 "$ADMIN/readyz")"

hdr "try it"
cat <<EOF
  # a payment: the first call reaches the upstream, retries with the same key are replayed
  curl -i -X POST $GW/v1/payments -H 'Idempotency-Key: k1' -H 'Content-Type: application/json' \\
       -d '{"amount":4200,"currency":"EUR"}'
  # same key, other body: 422 idempotency-key-mismatch
  curl -i -X POST $GW/v1/payments -H 'Idempotency-Key: k1' -d '{"amount":1}'
  # no key on a key: required route: 400 idempotency-key-missing
  curl -i -X POST $GW/v1/payments -d '{}'
  # admin
  curl $ADMIN/readyz
  curl -s $ADMIN/metrics | grep ^idemgate_
  curl -H 'Authorization: Bearer $TOKEN' '$ADMIN/admin/keys?route=payments&key=k1'
  # how many times the upstream executed key k1
  curl 'http://127.0.0.1:$UP_PORT/_test/count?key=k1'
EOF
say "  admin token (IDEMGATE_ADMIN_TOKEN): $TOKEN"

hdr "demo: one payment, retried"
KEY=demo-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
BODY='{"amount":4200,"currency":"EUR"}'
D=$RUN/demo
rm -rf "$D"
mkdir -p "$D"
post() { # n body -> prints the status code (000 when curl failed)
    local code
    code=$(curl -sS -m 15 -D "$D/h$1" -o "$D/b$1" -w '%{http_code}' -X POST "$GW/v1/payments" \
        -H 'Content-Type: application/json' -H "Idempotency-Key: $KEY" --data-binary "$2") || true
    touch "$D/h$1" "$D/b$1"
    echo "${code:-000}"
}
show() { # n title
    say "--- $2"
    tr -d '\r' <"$D/h$1" | grep -iE '^(HTTP/|idempotent-replayed|x-upstream-exec|content-type)' | sed 's/^/  /' || true
    printf '  body: %s\n' "$(head -c 400 "$D/b$1")"
}
ok=1
check() { # message command...
    local msg=$1
    shift
    if "$@"; then say "  ok: $msg"; else
        say "  FAILED: $msg"
        ok=0
    fi
}
is_2xx() { [[ "$1" =~ ^2[0-9][0-9]$ ]]; }
is_replay() { [ "$s2" = "$s1" ] && tr -d '\r' <"$D/h2" | grep -qi '^idempotent-replayed: *true'; }

say "POST $GW/v1/payments  Idempotency-Key: $KEY  body: $BODY"
s1=$(post 1 "$BODY")
show 1 "1st attempt"
s2=$(post 2 "$BODY")
show 2 "2nd attempt, same key, same body"
s3=$(post 3 '{"amount":9900,"currency":"EUR"}')
show 3 "3rd attempt, same key, another body"
execs=$(curl -sS -m 5 "http://127.0.0.1:$UP_PORT/_test/count?key=$KEY" 2>/dev/null) || execs='?'
say "--- upstream executions of this key: $execs"
say "--- checks"
check "1st answer is the upstream's ($s1)" is_2xx "$s1"
check "2nd answer is a replay ($s2, Idempotent-Replayed: true)" is_replay
check "2nd body is byte-identical to the 1st" cmp -s "$D/b1" "$D/b2"
check "another body with the same key is refused ($s3, want 422)" test "$s3" = 422
check "the upstream executed the payment once ($execs)" test "$execs" = 1

if [ $wait_fg = 0 ]; then
    [ $ok = 1 ] || die "the demo did not behave as expected (see above, and .run/idemgate.log)"
    say
    say "run.sh: demo ok (--no-wait: stopping)"
    exit 0
fi
[ $ok = 1 ] || say "run.sh: WARNING: the demo did not behave as expected (see above)"
hdr "gateway log (Ctrl-C stops the gateway, the upstream, Postgres and Redis)"
tail -n 5 -f --pid="$GW_PID" "$RUN/idemgate.log" &
TAIL_PID=$!
rc=0
wait "$GW_PID" || rc=$?
GW_PID=
say "run.sh: the gateway exited ($rc)"
exit "$rc"
