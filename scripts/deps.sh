#!/usr/bin/env bash
# deps.sh - installs the Debian 12 packages idemgate needs to build, test and run; quick no-op when all are there.
#
#   scripts/deps.sh            build + test + run dependencies
#   scripts/deps.sh --bench    also what bench/ needs (nginx, wrk; perf and strace for bench/profile.sh)
#   scripts/deps.sh --citus    also what building Citus for the tests needs (scripts/citus-build.sh); the test
#                              command passes it, so that one apt-get update installs everything
#   scripts/deps.sh --check    only report what is missing (exit 1 if anything is)
set -euo pipefail

PKGS=(
    build-essential meson ninja-build pkg-config
    libmicrohttpd-dev libgnutls28-dev libcurl4-openssl-dev libhiredis-dev libpq-dev libssl-dev libyaml-dev libevent-dev
    libcriterion-dev libjansson-dev
    postgresql-15 postgresql-client-15 redis-server redis-tools
    curl ca-certificates universal-ctags clang clang-format libclang-rt-14-dev valgrind chromium
    iproute2 procps util-linux haproxy
    debhelper dpkg-dev fakeroot man-db systemd python3-yaml
)
# The package stage (tests/package/run.sh): debhelper, dpkg-dev and fakeroot build the .deb, man-db reads its man
# pages, systemd's systemd-analyze verifies its unit.
# python3-yaml: tests/docker/compose-diff.py compares docker/compose.yaml with its test override.
# pgbench (the shared bench's pg_limit) ships in postgresql-15 (the /usr/bin/pgbench wrapper in
# postgresql-client-common), already above.
BENCH_PKGS=(nginx-light wrk linux-perf strace)
# scripts/citus-build.sh's list: with them, it finds nothing missing and runs no apt-get of its own.
CITUS_PKGS=(postgresql-server-dev-15 libcurl4-openssl-dev liblz4-dev libzstd-dev libkrb5-dev libselinux1-dev
    libpam0g-dev libreadline-dev libxslt1-dev flex autoconf gcc make patch)

bench=0
citus=0
check=0
for a in "$@"; do
    case "$a" in
    --bench) bench=1 ;;
    --citus) citus=1 ;;
    --check) check=1 ;;
    -h | --help)
        sed -n '3,8p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "deps.sh: unknown option $a" >&2
        exit 2
        ;;
    esac
done
want=("${PKGS[@]}")
[ $bench = 1 ] && want+=("${BENCH_PKGS[@]}")
[ $citus = 1 ] && want+=("${CITUS_PKGS[@]}")

missing=()
for p in "${want[@]}"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ "${st:0:2}" = ii ] || missing+=("$p")
done

# The server must be the same minor release as the headers Citus is built against: when the headers come now,
# the server, its client and libpq are named too, so that apt moves them to that minor together.
if [ $citus = 1 ]; then
    hv=$(dpkg-query -W -f='${Version}' postgresql-server-dev-15 2>/dev/null || true)
    sv=$(dpkg-query -W -f='${Version}' postgresql-15 2>/dev/null || true)
    if [[ " ${missing[*]} " == *" postgresql-server-dev-15 "* ]] || [ "$hv" != "$sv" ]; then
        for p in postgresql-server-dev-15 postgresql-15 postgresql-client-15 libpq5 libpq-dev; do
            [[ " ${missing[*]} " == *" $p "* ]] || missing+=("$p")
        done
    fi
fi

if [ ${#missing[@]} = 0 ]; then
    echo "deps.sh: all ${#want[@]} packages present"
    exit 0
fi
echo "deps.sh: missing: ${missing[*]}"
[ $check = 1 ] && exit 1

if [ "$(id -u)" = 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "deps.sh: not root and no password-less sudo; install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Debian's postgresql postinst creates and may start a system cluster on 5432; nothing here relies on it
# (scripts/services.sh runs its own on a random port), so it is left as the package makes it.
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"

still=()
for p in "${missing[@]}"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ "${st:0:2}" = ii ] || still+=("$p")
done
if [ ${#still[@]} != 0 ]; then
    echo "deps.sh: still missing after install: ${still[*]}" >&2
    exit 1
fi
echo "deps.sh: installed ${missing[*]}"
