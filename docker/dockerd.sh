#!/usr/bin/env bash
# dockerd.sh - a private Docker daemon for the compose stack: no bridge, no iptables, its own data, exec root and
# socket under one cache directory, so it never touches a system daemon and containers can only use the host's
# network (the stack listens on 127.0.0.1).
#
#   docker/dockerd.sh start [DIR]   start it (no-op when it already answers); prints the DOCKER_HOST line
#   docker/dockerd.sh stop [DIR]    stop it (TERM, up to 30 s, then KILL) and remove its runtime state
#   docker/dockerd.sh env [DIR]     print `export DOCKER_HOST=...` for this daemon
#
# DIR defaults to $IDEMGATE_DOCKER_DIR or /var/cache/idemgate-docker. Images stay in DIR/data (the cache).
# Needs root. Exits 0 on success, 1 when the daemon does not start within 60 s (its log is DIR/dockerd.log).
set -euo pipefail

cmd=${1:-}
DIR=${2:-${IDEMGATE_DOCKER_DIR:-/var/cache/idemgate-docker}}
SOCK=$DIR/run/docker.sock
PIDF=$DIR/run/dockerd.pid
LOG=$DIR/dockerd.log
export DOCKER_HOST=unix://$SOCK

die() {
    echo "dockerd.sh: $*" >&2
    exit 1
}
answers() { timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
# What a stopped daemon leaves mounted (its network namespace file, overlays of a killed one), deepest first.
unmount_all() {
    local m
    awk -v d="$DIR/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || echo "dockerd.sh: cannot unmount $m" >&2
    done
}
alive() { [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; }

case "$cmd" in
start)
    if answers; then
        echo "export DOCKER_HOST=$DOCKER_HOST"
        exit 0
    fi
    [ "$(id -u)" = 0 ] || die "starting dockerd needs root"
    command -v dockerd >/dev/null || die "dockerd not found (apt-get install docker.io)"
    if alive; then die "dockerd (pid $(cat "$PIDF")) runs but does not answer on $SOCK; see $LOG"; fi
    mkdir -p "$DIR/data" "$DIR/exec" "$DIR/run"
    rm -f "$SOCK" "$PIDF"
    # setsid: the daemon outlives this script and is not hit by the caller's Ctrl-C; stop is explicit.
    setsid dockerd --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
        --data-root "$DIR/data" --exec-root "$DIR/exec" --pidfile "$PIDF" \
        -H "unix://$SOCK" >"$LOG" 2>&1 </dev/null &
    pid=$!
    for _ in $(seq 1 120); do
        if answers; then
            echo "export DOCKER_HOST=$DOCKER_HOST"
            exit 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        echo "dockerd.sh: dockerd did not answer within 60 s; the end of $LOG:" >&2
    else
        echo "dockerd.sh: dockerd exited at start; the end of $LOG:" >&2
    fi
    tail -n 15 "$LOG" >&2 || true
    exit 1
    ;;
stop)
    if ! alive; then
        unmount_all
        rm -rf "$DIR/exec" "$DIR/run"
        exit 0
    fi
    pid=$(cat "$PIDF")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "dockerd.sh: dockerd (pid $pid) still runs after 30 s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
        sleep 1
    fi
    # The containerd that dockerd started (its pid file is under the exec root) goes with it; make sure.
    cpid=$(cat "$DIR/exec/containerd/containerd.pid" 2>/dev/null || true)
    if [ -n "$cpid" ] && kill -0 "$cpid" 2>/dev/null; then
        kill -TERM "$cpid" 2>/dev/null || true
        sleep 2
        kill -KILL "$cpid" 2>/dev/null || true
    fi
    unmount_all
    rm -rf "$DIR/exec" "$DIR/run"
    ;;
env)
    echo "export DOCKER_HOST=$DOCKER_HOST"
    ;;
*)
    sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
