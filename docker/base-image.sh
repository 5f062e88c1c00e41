#!/usr/bin/env bash
# base-image.sh - makes idemgate-base:bookworm, the Debian 12 image every image of the compose stack starts
# from, out of Debian's own packages (debootstrap + docker import), so no image registry is needed.
#
#   docker/base-image.sh            build it unless the image exists (then it says so and exits 0)
#   docker/base-image.sh --rebuild  build it again even when it exists
#
# The mirror is the one apt uses on this machine (/etc/apt/sources.list*), or $IDEMGATE_DEBIAN_MIRROR.
# Needs root, debootstrap and a reachable Docker daemon (DOCKER_HOST). Exits 1 on failure.
set -euo pipefail

IMAGE=${IDEMGATE_BASE_IMAGE:-idemgate-base:bookworm}
SUITE=bookworm
rebuild=0
case "${1:-}" in
--rebuild) rebuild=1 ;;
"") ;;
*)
    sed -n '4,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac

die() {
    echo "base-image.sh: $*" >&2
    exit 1
}

if [ $rebuild = 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base-image.sh: $IMAGE exists ($(docker image inspect -f '{{.Created}}' "$IMAGE")), not rebuilt"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"

# The Debian archive (not the security one) apt is configured with: deb822 URIs: lines or one-line deb lines.
mirror_of_host() {
    local f u
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        u=$(sed -nE 's#^URIs:[[:space:]]*(https?://[^[:space:]]*/debian)/?[[:space:]]*$#\1#p;
                     s#^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?(https?://[^[:space:]]*/debian)/?[[:space:]]+'"$SUITE"'[[:space:]].*#\2#p' "$f" |
            head -n 1)
        if [ -n "$u" ]; then
            echo "$u"
            return
        fi
    done
    echo http://deb.debian.org/debian
}
MIRROR=${IDEMGATE_DEBIAN_MIRROR:-$(mirror_of_host)}
SECURITY=${MIRROR%/debian}/debian-security

ROOTFS=$(mktemp -d /var/tmp/idemgate-base.XXXXXX)
cleanup() { rm -rf "$ROOTFS"; }
trap cleanup EXIT

t0=$SECONDS
echo "base-image.sh: debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes)"
if ! timeout 1200 debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1; then
    tail -n 20 "$ROOTFS.log" >&2
    rm -f "$ROOTFS.log"
    die "debootstrap failed"
fi
rm -f "$ROOTFS.log"

# What an image needs that a bootstrapped system does not: the updates and security suites, no recommends,
# no apt caches kept in layers, no daemons started by package scripts during `docker build`.
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
cat >"$ROOTFS/etc/apt/apt.conf.d/90idemgate-image" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
Acquire::Languages "none";
EOF
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
chmod 0755 "$ROOTFS/usr/sbin/policy-rc.d"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/tmp/* "$ROOTFS"/var/log/*.log
: >"$ROOTFS/etc/hostname"

echo "base-image.sh: docker import -> $IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . |
    docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null ||
    die "docker import failed"
echo "base-image.sh: $IMAGE built in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes)"
