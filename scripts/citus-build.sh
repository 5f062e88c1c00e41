#!/usr/bin/env bash
# citus-build.sh - builds and installs Citus 13.2.2 for the system's PostgreSQL 15 when it is missing; a quick no-op
# when the installed one matches (the stamp names the Citus and the server version).
#
#   scripts/citus-build.sh           install when missing (apt packages for the build too, only the missing ones)
#   scripts/citus-build.sh --check   exit 0 when installed and current, 1 when not (changes nothing)
#
# The source is shared/citus/citus-13.2.2.tar.gz beside the repository (IDEMGATE_CITUS_SRC overrides the
# directory). The build stays in IDEMGATE_CITUS_CACHE (default /var/cache/idemgate/citus-13.2.2), so a later
# run on the same machine only re-installs. Needs root (it installs into the server's lib and share dirs).
# Bounded: the build is given 30 minutes, a concurrent run waits up to 40 minutes for the lock.
set -euo pipefail

CITUS_VERSION=13.2.2
PG_MAJOR=15
PGCONFIG=/usr/lib/postgresql/$PG_MAJOR/bin/pg_config
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
CACHE=${IDEMGATE_CITUS_CACHE:-/var/cache/idemgate/citus-$CITUS_VERSION}
LIBDIR=/usr/lib/postgresql/$PG_MAJOR/lib
STAMP=$LIBDIR/citus.idemgate-stamp

say() { echo "citus-build.sh: $*" >&2; }
die() {
    say "$*"
    exit 1
}

find_src() {
    local d
    for d in "${IDEMGATE_CITUS_SRC:-}" "$ROOT/../shared/citus" "$ROOT/../../shared/citus" /work/shared/citus; do
        if [ -n "$d" ] && [ -f "$d/citus-$CITUS_VERSION.tar.gz" ]; then
            (cd "$d" && pwd -P)
            return 0
        fi
    done
    return 1
}

pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
pkg_installed() {
    local st
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null || true)
    [ "${st:0:2}" = ii ]
}

# What the stamp must say for the installed build to count: the Citus version and the server's exact version.
want_stamp() { echo "citus $CITUS_VERSION postgresql-$PG_MAJOR $(pkg_version postgresql-$PG_MAJOR)"; }

current() {
    [ -f "$LIBDIR/citus.so" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(want_stamp)" ]
}

if [ "${1:-}" = --check ]; then
    current
    exit $?
fi
[ $# = 0 ] || die "unknown option $1 (see the header of $0)"

if current; then
    say "citus $CITUS_VERSION already installed ($LIBDIR/citus.so)"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "citus is not installed and this is not root: run $0 as root once"
SRC=$(find_src) || die "citus-$CITUS_VERSION.tar.gz not found (shared/citus beside the repository, or IDEMGATE_CITUS_SRC)"

mkdir -p "$(dirname "$CACHE")"
exec 9>"$(dirname "$CACHE")/citus-$CITUS_VERSION.lock"
flock -w 2400 9 || die "another build holds the lock for over 40 minutes"
if current; then # built by the run we waited for
    say "citus $CITUS_VERSION installed by a concurrent run"
    exit 0
fi

# The build packages. postgresql-server-dev-15 comes at the archive's newest minor; the server must be the same
# minor as its headers, so postgresql-15 and libpq5 are named too (apt upgrades them to that minor).
BUILD_PKGS=(postgresql-server-dev-$PG_MAJOR libcurl4-openssl-dev liblz4-dev libzstd-dev libkrb5-dev
    libselinux1-dev libpam0g-dev libreadline-dev libxslt1-dev flex autoconf gcc make patch)
missing=()
for p in "${BUILD_PKGS[@]}"; do pkg_installed "$p" || missing+=("$p"); done
if pkg_installed postgresql-server-dev-$PG_MAJOR &&
    [ "$(pkg_version postgresql-server-dev-$PG_MAJOR)" != "$(pkg_version postgresql-$PG_MAJOR)" ]; then
    missing+=(postgresql-server-dev-$PG_MAJOR)
fi
if [ ${#missing[@]} != 0 ]; then
    say "installing: ${missing[*]} (and postgresql-$PG_MAJOR, libpq5 at the headers' minor)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 900 apt-get update -q
    timeout 1200 apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" postgresql-$PG_MAJOR libpq5 libpq-dev postgresql-client-$PG_MAJOR
fi
sv=$(pkg_version postgresql-$PG_MAJOR)
hv=$(pkg_version postgresql-server-dev-$PG_MAJOR)
[ "$sv" = "$hv" ] || die "postgresql-$PG_MAJOR is $sv but its headers are $hv: they must match"

BUILD=$CACHE/src
if [ ! -f "$BUILD/.idemgate-built" ] || [ "$(cat "$BUILD/.idemgate-built")" != "$(want_stamp)" ]; then
    say "building citus $CITUS_VERSION in $BUILD (several minutes on 2 cores)"
    rm -rf "$BUILD"
    mkdir -p "$BUILD"
    tar -xzf "$SRC/citus-$CITUS_VERSION.tar.gz" -C "$BUILD"
    # The patch is needed for the headers of 15.20 and later (have_createdb_privilege is exported there); it
    # applies to the source as shipped, so it is applied whenever it is present.
    if [ -f "$SRC/citus-$CITUS_VERSION-pg15.20.patch" ]; then
        (cd "$BUILD" && patch -s -p1 <"$SRC/citus-$CITUS_VERSION-pg15.20.patch")
    fi
    (cd "$BUILD" && timeout 600 ./configure -q PG_CONFIG=$PGCONFIG >"$CACHE/configure.log" 2>&1) || {
        tail -n 30 "$CACHE/configure.log" >&2
        die "configure failed (log: $CACHE/configure.log)"
    }
    (cd "$BUILD" && timeout 1800 make -j"$(nproc)" >"$CACHE/make.log" 2>&1) || {
        tail -n 30 "$CACHE/make.log" >&2
        die "make failed (log: $CACHE/make.log)"
    }
    want_stamp >"$BUILD/.idemgate-built"
fi
(cd "$BUILD" && timeout 300 make install >"$CACHE/install.log" 2>&1) || {
    tail -n 30 "$CACHE/install.log" >&2
    die "make install failed (log: $CACHE/install.log)"
}
want_stamp >"$STAMP"
say "citus $CITUS_VERSION installed ($LIBDIR/citus.so)"
