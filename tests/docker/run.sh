#!/usr/bin/env bash
# run.sh - the docker stage: builds and starts docker/compose.yaml, with the test override
# docker/compose.test.yaml over it, on a private, bridge-less Docker daemon, runs the README's curl demo against
# it, and takes it down; ends with `docker: N passed, N failed`. The override changes only images and network
# (tests/docker/compose-diff.py checks that): the official postgres and redis images and debian:bookworm-slim
# cannot be pulled here (no registry), so local images built from Debian's packages stand in for them, and every
# service runs in the host's network on 127.0.0.1 (this machine sends traffic to loopback only).
#
#   tests/docker/run.sh
#
# Installs docker.io, docker-compose and debootstrap with apt-get when missing. Skips (`docker: 0 passed,
# 0 failed` and `skipped: <reason>`) only where Docker cannot run here: not root, nothing installable, or a
# daemon that does not start. Every service listens on free random ports of 127.0.0.1 (host network). It stops
# everything it started, also on failure: the stack (`down -v`: containers and the volume) and dockerd when it
# was not running before. Images stay in the daemon's data root as the cache: IDEMGATE_DOCKER_DIR (default
# /var/cache/idemgate-docker).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd -P)
cd "$ROOT" || exit 1
export IDEMGATE_DOCKER_DIR=${IDEMGATE_DOCKER_DIR:-/var/cache/idemgate-docker}
# The builder Debian 12's docker.io uses by default (BuildKit only from Docker 23), whatever client is on PATH.
export DOCKER_BUILDKIT=0
DOCKERD_SH=$ROOT/docker/dockerd.sh
PROJECT=idemgatetest
OWN_DOCKERD=0
UP_PID=
STACK_UP=0
SD_NAME=idemgate-systemd-test
SD_UP=0
WORK=$(mktemp -d /tmp/idemgate-docker-test.XXXXXX)
# The stack as run: docker/compose.yaml with docker/compose.test.yaml over it, resolved by docker-compose (below).
COMPOSE_FILES=(-f "$WORK/compose.run.yaml")
T_START=$SECONDS
TIMINGS=()
STAGE=docker
# shellcheck source=tests/checks.sh
. "$ROOT/tests/checks.sh"

timing() { TIMINGS+=("$(printf '%-8s %4d s' "$1" "$2")"); }
compose() { timeout "${COMPOSE_TIMEOUT:-120}" docker-compose -p "$PROJECT" "${COMPOSE_FILES[@]}" "$@"; }

summary_extra() {
    if [ ${#TIMINGS[@]} -gt 0 ]; then
        say "timings:"
        printf '  %s\n' "${TIMINGS[@]}"
    fi
    say "total $((SECONDS - T_START)) s"
}
skip() {
    say "skipped: $*"
    echo "docker: 0 passed, 0 failed"
    echo "skipped: $*"
    exit 0
}

# shellcheck disable=SC2317 # called from the EXIT trap
cleanup() {
    trap '' INT TERM HUP PIPE
    if [ "$STACK_UP" = 1 ]; then
        say "cleanup: docker-compose down -v"
        COMPOSE_TIMEOUT=90 compose down -v --remove-orphans >"$WORK/down-cleanup.log" 2>&1 ||
            tail -n 20 "$WORK/down-cleanup.log"
        STACK_UP=0
    fi
    if [ -n "$UP_PID" ]; then
        kill -TERM "$UP_PID" 2>/dev/null
        timeout 10 tail --pid="$UP_PID" -f /dev/null
        kill -KILL "$UP_PID" 2>/dev/null
        wait "$UP_PID" 2>/dev/null
        UP_PID=
    fi
    if [ "$SD_UP" = 1 ]; then
        timeout 60 docker rm -f "$SD_NAME" >/dev/null 2>&1
        SD_UP=0
    fi
    if [ "$OWN_DOCKERD" = 1 ]; then
        say "cleanup: stopping the dockerd this stage started"
        bash "$DOCKERD_SH" stop
        OWN_DOCKERD=0
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'say interrupted; echo "docker: $PASS passed, $((FAIL + 1)) failed"; exit 130' INT TERM HUP

# ---- what the stage needs: root, the packages, a daemon
[ "$(id -u)" = 0 ] || skip "needs root to start its own dockerd"
t=$SECONDS
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    inst() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q \
        -o DPkg::Lock::Timeout=120 --no-install-recommends "${need[@]}"; }
    if ! inst >"$WORK/apt.log" 2>&1; then
        timeout 300 apt-get update -q -o DPkg::Lock::Timeout=120 >>"$WORK/apt.log" 2>&1
        inst >>"$WORK/apt.log" 2>&1 || {
            tail -n 10 "$WORK/apt.log"
            skip "apt-get could not install ${need[*]}"
        }
    fi
fi
command -v docker >/dev/null || skip "no docker client after installing docker.io"
timing install $((SECONDS - t))

t=$SECONDS
eval "$(bash "$DOCKERD_SH" env)"
if ! timeout 10 docker version >/dev/null 2>&1; then
    bash "$DOCKERD_SH" start >/dev/null || skip "dockerd does not start on this machine (see $IDEMGATE_DOCKER_DIR/dockerd.log)"
    OWN_DOCKERD=1
fi
timing dockerd $((SECONDS - t))
say "dockerd: $(docker version --format '{{.Server.Version}}' 2>/dev/null) at $DOCKER_HOST (started here: $OWN_DOCKERD)"

# ---- images
t=$SECONDS
bash docker/base-image.sh >"$WORK/base.log" 2>&1 ||
    fatal "base image idemgate-base:bookworm (docker/base-image.sh)" "$WORK/base.log"
cat "$WORK/base.log"
pass "base image idemgate-base:bookworm (docker/base-image.sh)"
timing base $((SECONDS - t))

# Free loopback ports for the five services (bound together, so they differ, then released).
read -r HTTP_PORT ADMIN_PORT UP_PORT PG_PORT REDIS_PORT < <(python3 -c '
import socket
ss = [socket.socket() for _ in range(5)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')
export IDEMGATE_HTTP_PORT=$HTTP_PORT IDEMGATE_ADMIN_PORT=$ADMIN_PORT IDEMGATE_UPSTREAM_PORT=$UP_PORT \
    IDEMGATE_PG_PORT=$PG_PORT IDEMGATE_REDIS_PORT=$REDIS_PORT IDEMGATE_BIND=127.0.0.1 \
    IDEMGATE_BASE_IMAGE=idemgate-base:bookworm
say "docker/compose.yaml with the test override docker/compose.test.yaml: local images in place of postgres:15,"
say "redis:7 and debian:bookworm-slim (no registry here), every service in the host network on 127.0.0.1"
say "ports on 127.0.0.1: gateway $HTTP_PORT, admin $ADMIN_PORT, upstream $UP_PORT, postgres $PG_PORT, redis $REDIS_PORT"

# docker-compose merges the override into compose.yaml (`config`); the published ports are then dropped: with the
# host network a service's ports are the host's already, and Docker refuses port bindings there ("host"
# network_mode is incompatible with port_bindings), while compose cannot remove a list entry by an override.
resolve() {
    timeout 60 docker-compose -p "$PROJECT" -f docker/compose.yaml -f docker/compose.test.yaml config \
        >"$WORK/compose.merged.yaml" 2>"$WORK/config.log" &&
        /usr/bin/python3 - "$WORK/compose.merged.yaml" "$WORK/compose.run.yaml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for svc in doc["services"].values():
    assert svc.get("network_mode") == "host", "a service outside the host network"
    svc.pop("ports", None)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
}
resolve || fatal "docker-compose config: compose.yaml + compose.test.yaml merged, ports dropped" "$WORK/config.log"
pass "docker-compose config: compose.yaml + compose.test.yaml merged, published ports dropped (host network)"

# What a run killed earlier may have left behind.
compose down -v --remove-orphans >/dev/null 2>&1

t=$SECONDS
COMPOSE_TIMEOUT=1200 compose build >"$WORK/build.log" 2>&1 ||
    fatal "docker-compose build (gateway, upstream, local postgres and redis images)" "$WORK/build.log"
pass "docker-compose build (gateway, upstream, local postgres and redis images)"
# Untagged images of the stack (the build stage of docker/Dockerfile, which is the layer cache, and images a
# new build took the tag from): keep what this build used, drop what older builds left.
for id in $(docker images -q --filter dangling=true --filter label=org.idemgate.stage | sort -u); do
    grep -q -e "---> $id" "$WORK/build.log" || docker rmi "$id" >/dev/null 2>&1
done
timing build $((SECONDS - t))

# What each image carries: the gateway's only the gateway (no test upstream, no compiler), the upstream's no gateway.
in_image() { # in_image IMAGE SHELL-TEST: runs the test in a throwaway container of IMAGE
    timeout 60 docker run --rm --network none --entrypoint /bin/sh "$1" -c "$2" >/dev/null 2>&1
}
check "gateway image: idemgate, no testupstream, no compiler, no -dev headers" in_image idemgate:local \
    'test -x /usr/local/bin/idemgate && ! command -v testupstream && ! command -v cc && ! test -d /usr/include/postgresql'
check "upstream image: testupstream, no idemgate" in_image idemgate-upstream:local \
    'test -x /usr/local/bin/testupstream && ! command -v idemgate'

# ---- the README's command with the test override, in the foreground as a user runs it (its output goes to a log)
t=$SECONDS
STACK_UP=1
timeout 900 docker-compose -p "$PROJECT" "${COMPOSE_FILES[@]}" up >"$WORK/up.log" 2>&1 &
UP_PID=$!
services=(postgres redis upstream idemgate)
# healthy_count: how many of the stack's containers report healthy (one docker call).
healthy_count() {
    docker ps --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Status}}' 2>/dev/null |
        grep -c '(healthy)'
}
healthy=0
for _ in $(seq 1 240); do
    healthy=$(healthy_count)
    [ "$healthy" = ${#services[@]} ] && break
    kill -0 "$UP_PID" 2>/dev/null || break
    sleep 0.5
done
[ "$healthy" = ${#services[@]} ] ||
    fatal "up: $healthy of ${#services[@]} services healthy after $((SECONDS - t)) s" "$WORK/up.log"
pass "up: postgres, redis, upstream and idemgate healthy in $((SECONDS - t)) s"
timing up $((SECONDS - t))
# With the host network the services' sockets are the host's: each must be on 127.0.0.1 alone (IDEMGATE_BIND).
only_loopback() {
    local p addrs
    for p in "$@"; do
        addrs=$(ss -Hltn "sport = :$p" | awk '{ print $4 }')
        if [ -z "$addrs" ] || grep -qv '^127\.0\.0\.1:' <<<"$addrs"; then
            echo "  port $p: ${addrs:-nothing listens}"
            return 1
        fi
    done
}
check "every service listens on 127.0.0.1 only" only_loopback "$HTTP_PORT" "$ADMIN_PORT" "$UP_PORT" "$PG_PORT" "$REDIS_PORT"

# ---- the README's curl demo
t=$SECONDS
GW=http://127.0.0.1:$HTTP_PORT
# post N BODY: the demo request; status in $WORK/status.N, headers in hdr.N, body in body.N.
post() {
    curl -sS --max-time 10 -X POST "$GW/v1/payments" -H 'Idempotency-Key: demo-1' \
        -H 'Authorization: Bearer tenant-a' -d "$2" -D "$WORK/hdr.$1" -o "$WORK/body.$1" -w '%{http_code}' \
        >"$WORK/status.$1" 2>"$WORK/curl.$1" || echo "curl: $(cat "$WORK/curl.$1")" >&2
}
status_is() { [ "$(cat "$WORK/status.$1" 2>/dev/null)" = "$2" ]; }
has_header() { grep -qi "^$2: $3"$'\r'"\?$" "$WORK/hdr.$1"; }
upstream_count() { curl -sS --max-time 5 "http://127.0.0.1:$UP_PORT/_test/count?key=demo-1" 2>/dev/null; }

post 1 '{"amount":42}'
check "first POST: 200" status_is 1 200
not_replayed() { ! grep -qi '^Idempotent-Replayed:' "$WORK/hdr.1"; }
check "first POST: not a replay" not_replayed
check "first POST: executed upstream once (testupstream count)" test "$(upstream_count)" = 1
post 2 '{"amount":42}'
check "same POST again: 200" status_is 2 200
check "same POST again: Idempotent-Replayed: true" has_header 2 Idempotent-Replayed true
check "same POST again: body byte-identical to the first" cmp -s "$WORK/body.1" "$WORK/body.2"
check "same POST again: not executed upstream again" test "$(upstream_count)" = 1
post 3 '{"amount":43}'
check "other body, same key: 422" status_is 3 422
check "other body, same key: idempotency-key-mismatch" grep -q 'idempotency-key-mismatch' "$WORK/body.3"
check "other body, same key: not executed upstream" test "$(upstream_count)" = 1

ready=$(curl -sS --max-time 5 -w ' %{http_code}' "http://127.0.0.1:$ADMIN_PORT/readyz" 2>&1)
ready_up() { [[ "$ready" == *'"postgres":"up"'*'"redis":"up"'*" 200" ]]; }
check "/readyz: 200 with Postgres and Redis up" ready_up
rows=$(compose exec -T -e PGPASSWORD=idemgate postgres psql -h 127.0.0.1 -U idemgate -d idemgate -tAc \
    "SELECT count(*) FROM idemgate_keys WHERE key = 'demo-1' AND state = 'completed'" 2>&1)
check "the record is in the stack's Postgres (completed rows: $rows)" test "$rows" = 1

# The record outlives the gateway container: a restarted gateway replays it from Postgres.
if COMPOSE_TIMEOUT=60 compose restart idemgate >"$WORK/restart.log" 2>&1; then
    for _ in $(seq 1 60); do
        curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$ADMIN_PORT/readyz" 2>/dev/null && break
        sleep 0.5
    done
fi
post 4 '{"amount":42}'
replayed_again() {
    status_is 4 200 && has_header 4 Idempotent-Replayed true && cmp -s "$WORK/body.1" "$WORK/body.4" &&
        test "$(upstream_count)" = 1
}
check "after a gateway restart: replayed, byte-identical, not executed again" replayed_again
compose logs --no-color idemgate >"$WORK/gw.log" 2>&1
log_clean() { [ -s "$WORK/gw.log" ] && ! grep -q -e tenant-a -e amount "$WORK/gw.log"; }
check "gateway log has no Authorization value and no body" log_clean
timing demo $((SECONDS - t))

# ---- down -v: everything the stack made goes
t=$SECONDS
if COMPOSE_TIMEOUT=90 compose down -v >"$WORK/down.log" 2>&1; then
    STACK_UP=0
    pass "docker-compose down -v"
else
    failed "docker-compose down -v"
    tail -n 20 "$WORK/down.log"
fi
up_rc=
if timeout 20 tail --pid="$UP_PID" -f /dev/null; then
    wait "$UP_PID"
    up_rc=$?
    UP_PID=
fi
check "the foreground up exits 0 after down (exit ${up_rc:-still running after 20 s})" test "$up_rc" = 0
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
check "no container of the stack left ($left)" test "$left" = 0
left=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
check "no volume of the stack left ($left)" test "$left" = 0
nets=$(docker network ls --format '{{.Name}}' | grep -v -x -e host -e none -e bridge | tr '\n' ' ')
check "no network made (host networking only): '${nets}'" test -z "$nets"
timing down $((SECONDS - t))

# ---- the Debian package's systemd unit, started by a booted systemd: the test machines have none of their own,
# so it runs as PID 1 of a container (no network: its own loopback; SYS_ADMIN and no seccomp profile, so that it
# can set up the unit's sandbox), with Debian's PostgreSQL and Redis started by their units beside it.
t=$SECONDS
mkdir -p "$WORK/sd"
deb=$(tests/package/build-deb.sh "$WORK/deb") || fatal "the Debian package for the unit (build-deb.sh)" "$WORK/deb/build.log"
cp "$deb" "$WORK/sd/idemgate.deb" && cp tests/package/systemd.Dockerfile "$WORK/sd/Dockerfile"
timeout 900 docker build --network host -t idemgate-systemd:test "$WORK/sd" >"$WORK/sd-build.log" 2>&1 ||
    fatal "image: Debian's systemd, PostgreSQL, Redis and the package (systemd.Dockerfile)" "$WORK/sd-build.log"
docker image prune -f --filter label=org.idemgate.stage=systemd >/dev/null 2>&1 # what older builds left untagged
docker rm -f "$SD_NAME" >/dev/null 2>&1
SD_UP=1
timeout 60 docker run -d --name "$SD_NAME" --network none --cap-add SYS_ADMIN --security-opt seccomp=unconfined \
    --security-opt apparmor=unconfined --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro \
    idemgate-systemd:test >/dev/null 2>"$WORK/sd-run.log" || fatal "systemd container starts" "$WORK/sd-run.log"
sd() { timeout 60 docker exec "$SD_NAME" sh -c "$1" 2>&1; }       # sd 'SHELL COMMANDS'
sd_script() { timeout 60 docker exec -i "$SD_NAME" sh -s 2>&1; } # the same, read from the standard input
booted=$(sd 'for i in $(seq 1 100); do systemctl is-system-running --wait 2>/dev/null && break; sleep 0.5; done')
check "systemd booted in the container ($booted)" test "$booted" = running -o "$booted" = degraded
# The gateway's role and database (Postgres's own unit started the package's cluster), its URL in the env file.
sd_script >"$WORK/sd-db.log" <<'SH' || fatal "a Postgres role and database for the unit" "$WORK/sd-db.log"
set -e
for i in $(seq 1 60); do pg_isready -q -h 127.0.0.1 && break; sleep 0.5; done
su postgres -c "psql -q -v ON_ERROR_STOP=1" <<'SQL'
CREATE ROLE idemgate LOGIN PASSWORD 'pw';
CREATE DATABASE idemgate OWNER idemgate;
SQL
umask 077
echo IDEMGATE_POSTGRES_URL=postgresql://idemgate:pw@127.0.0.1:5432/idemgate >/etc/idemgate/idemgate.env
SH
out=$(sd 'systemctl start idemgate 2>/dev/null; systemctl is-active idemgate')
check "systemctl start idemgate: $out" test "$out" = active
ready=$(sd 'for i in $(seq 1 40); do r=$(curl -s --max-time 2 -w " %{http_code}" http://127.0.0.1:9090/readyz) &&
    case "$r" in *" 200") break ;; esac; sleep 0.5; done; echo "$r"' | tr -d '\n')
ready_full() { [[ "$ready" == *'"postgres":"up"'*'"redis":"up"'*" 200" ]]; }
check "under its sandbox the gateway reaches Postgres and Redis: /readyz $ready" ready_full
st=$(sd 'p=$(systemctl show -P MainPID idemgate); grep -E "^(Uid|NoNewPrivs|Seccomp|CapEff):" /proc/$p/status | tr -s "\t " " " | tr "\n" ";"')
sandboxed() { [[ "$st" =~ Uid:\ ([0-9]+) ]] && [ "${BASH_REMATCH[1]}" -ge 61184 ] && [[ "$st" == *"NoNewPrivs: 1;"* ]] &&
    [[ "$st" == *"Seccomp: 2;"* ]] && [[ "$st" == *"CapEff: 0000000000000000;"* ]]; }
check "the gateway runs as a dynamic user, no new privileges, a seccomp filter, no capabilities ($st)" sandboxed
pid1=$(sd 'systemctl show -P MainPID idemgate')
out=$(sd 'sed -i "s/^shutdown_grace: .*/shutdown_grace: 7s/" /etc/idemgate/idemgate.yaml && systemctl reload idemgate 2>/dev/null &&
    for i in $(seq 1 20); do journalctl -u idemgate -o cat | grep -q "event=reloaded" && break; sleep 0.5; done
    journalctl -u idemgate -o cat | grep -c "event=reloaded"')
check "systemctl reload: SIGHUP, the file applied (event=reloaded logged $out times), same process" \
    test "$out" = 1 -a "$(sd 'systemctl show -P MainPID idemgate')" = "$pid1"
out=$(sd 'systemctl stop idemgate; systemctl is-active idemgate; systemctl show -P Result idemgate;
    journalctl -u idemgate -o cat | grep -c "event=stopped exit=0"')
check "systemctl stop: inactive, result success, the gateway logged exit=0 ($(tr '\n' ' ' <<<"$out"))" \
    test "$(tr '\n' ' ' <<<"$out")" = "inactive success 1 "
out=$(sd 'echo "listen: [" >>/etc/idemgate/idemgate.yaml; systemctl start idemgate 2>/dev/null; echo "start exit $?";
    journalctl -u idemgate -o cat | grep -q "event=config_invalid" && echo config_invalid logged;
    curl -s --max-time 2 http://127.0.0.1:9090/healthz || echo nothing on 9090')
check "a broken config: ExecStartPre (idemgate --check) keeps it from starting ($(tr '\n' ' ' <<<"$out"))" \
    test "$(tr '\n' ' ' <<<"$out")" = "start exit 1 config_invalid logged nothing on 9090 "
timeout 60 docker rm -f "$SD_NAME" >/dev/null 2>&1
SD_UP=0
timing systemd $((SECONDS - t))

summary
[ "$FAIL" = 0 ]
