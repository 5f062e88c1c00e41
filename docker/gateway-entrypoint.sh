#!/bin/sh
# gateway-entrypoint.sh - starts idemgate in the image with /etc/idemgate/idemgate.yaml, first setting the
# addresses compose chooses: IDEMGATE_LISTEN, IDEMGATE_ADMIN_LISTEN (host:port) and IDEMGATE_UPSTREAM_URL
# (the url of the upstream `api`), each only when set. Read by this script only; idemgate itself reads
# IDEMGATE_POSTGRES_URL, IDEMGATE_REDIS_URL and IDEMGATE_ADMIN_TOKEN. Exits 1 when a setting cannot be applied.
set -eu
src=${IDEMGATE_CONFIG:-/etc/idemgate/idemgate.yaml}
conf=/tmp/idemgate.yaml

# set_line PATTERN REPLACEMENT: the one line of $conf matching PATTERN (a basic regex) becomes REPLACEMENT.
set_line() {
    case "$2" in *'|'* | *'&'* | *\\*)
        echo "idemgate-entrypoint: '$2' has a character (| & \\) this script does not substitute" >&2
        exit 1
        ;;
    esac
    n=$(grep -c -- "$1" "$conf" || true)
    if [ "$n" != 1 ]; then
        echo "idemgate-entrypoint: expected one line matching '$1' in $src, found $n" >&2
        exit 1
    fi
    sed -i "s|$1.*|$2|" "$conf"
}

cp "$src" "$conf"
[ -n "${IDEMGATE_LISTEN:-}" ] && set_line '^listen: ' "listen: $IDEMGATE_LISTEN"
[ -n "${IDEMGATE_ADMIN_LISTEN:-}" ] && set_line '^  listen: ' "  listen: $IDEMGATE_ADMIN_LISTEN"
[ -n "${IDEMGATE_UPSTREAM_URL:-}" ] && set_line '^    url: ' "    url: $IDEMGATE_UPSTREAM_URL"
exec /usr/local/bin/idemgate -c "$conf" "$@"
