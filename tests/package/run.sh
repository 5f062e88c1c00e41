#!/usr/bin/env bash
# run.sh - the package stage: meson's defaults (werror off) and version, the Debian package built with
# dpkg-buildpackage from debian/, installed with dpkg -i, its binary, man pages and systemd unit checked, then
# purged; ends with `package: N passed, N failed`.
#
#   tests/package/run.sh
#
# Needs root (dpkg -i on this machine: the test machine is a throwaway one) and scripts/deps.sh's packages
# (debhelper, fakeroot, man-db, systemd). The package is built in a temporary copy of the work tree, so no
# build output lands in or beside the repository. A trap purges the package and removes the copy on any exit.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd -P)
cd "$ROOT" || exit 1
INSTALLED=0
WORK=$(mktemp -d /tmp/idemgate-package.XXXXXX)
UNIT=/lib/systemd/system/idemgate.service
STAGE=package
# shellcheck source=tests/checks.sh
. "$ROOT/tests/checks.sh"

# dpkg ARGS...: dpkg, waiting (bounded) while another apt/dpkg holds the lock.
dpkg_locked() {
    local i
    for i in $(seq 1 60); do
        if dpkg "$@" >"$WORK/dpkg.log" 2>&1; then return 0; fi
        grep -q 'lock' "$WORK/dpkg.log" || break
        sleep 2
    done
    cat "$WORK/dpkg.log"
    return 1
}
# shellcheck disable=SC2317 # called from the EXIT trap
cleanup() {
    trap '' INT TERM HUP PIPE
    if [ "$INSTALLED" = 1 ]; then
        say "cleanup: dpkg --purge idemgate"
        dpkg_locked --purge idemgate || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'say interrupted; echo "package: $PASS passed, $((FAIL + 1)) failed"; exit 130' INT TERM HUP

[ "$(id -u)" = 0 ] || fatal "needs root (dpkg -i)"
for c in dpkg-buildpackage dh fakeroot man systemd-analyze meson; do
    command -v "$c" >/dev/null || fatal "$c not found (scripts/deps.sh installs it)"
done

# ---- meson's defaults: what a user's plain `meson setup` gets
if timeout 120 meson setup "$WORK/defaults" -Dtests=false >"$WORK/setup.log" 2>&1; then
    VERSION=$(meson introspect --projectinfo "$WORK/defaults" | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')
    werror=$(meson introspect --buildoptions "$WORK/defaults" |
        python3 -c 'import json,sys; print([o["value"] for o in json.load(sys.stdin) if o["name"] == "werror"][0])')
    check "meson.build: werror is off by default (werror=$werror)" test "$werror" = False
else
    fatal "meson setup with the defaults" "$WORK/setup.log"
fi
say "meson project version: $VERSION"
clog=$(dpkg-parsechangelog -l debian/changelog -S Version 2>/dev/null)
check "debian/changelog's version ($clog) is meson's project version ($VERSION)" test "${clog%-*}" = "$VERSION"
lic=$(awk '/^Files: \*/ { f = 1 } f && /^License:/ { print $2; exit }' debian/copyright)
check "debian/copyright: the files are under Apache-2.0 ($lic)" test "$lic" = Apache-2.0

# ---- dpkg-buildpackage, in a copy of the work tree (tests/package/build-deb.sh)
t=$SECONDS
DEB=$(tests/package/build-deb.sh "$WORK/pkg") || fatal "dpkg-buildpackage -b -us -uc" "$WORK/pkg/build.log"
pass "dpkg-buildpackage -b -us -uc ($((SECONDS - t)) s)"
check "the package's name carries the version ($(basename "$DEB"))" test "$(basename "$DEB")" = "idemgate_${VERSION}_$(dpkg --print-architecture).deb"
# The unit's ExecReload runs /bin/kill, which procps ships (a minimal Debian, such as a container's, lacks it).
deps=$(dpkg-deb -f "$DEB" Depends)
check "the package depends on procps (/bin/kill for ExecReload)" grep -qw procps <<<"$deps"
say "dpkg -c $(basename "$DEB"):"
dpkg -c "$DEB" | tee "$WORK/contents" | sed 's/^/    /'
in_package() { grep -q " \./${1#/}\$" "$WORK/contents"; }
want=(/usr/bin/idemgate /usr/share/man/man8/idemgate.8.gz /usr/share/man/man5/idemgate.yaml.5.gz "$UNIT"
    /etc/idemgate/idemgate.yaml /usr/share/doc/idemgate/copyright /usr/share/doc/idemgate/examples/idemgate.example.yaml)
[ -f docs/configuration.md ] && want+=(/usr/share/doc/idemgate/configuration.md)
[ -f CHANGELOG.md ] && want+=(/usr/share/doc/idemgate/CHANGELOG.md.gz)
for f in conf/examples/*.yaml; do [ -f "$f" ] && want+=("/usr/share/doc/idemgate/examples/${f#conf/examples/}"); done
missing=()
for f in "${want[@]}"; do in_package "$f" || missing+=("$f"); done
check "the package holds the ${#want[@]} files meson and debian/rules install (missing: ${missing[*]:-none})" \
    test ${#missing[@]} = 0

# ---- dpkg -i on this machine
if dpkg-query -W -f='${db:Status-Abbrev}' idemgate 2>/dev/null | grep -q '^.[^n]'; then
    say "an idemgate package was left installed; purging it first"
    dpkg_locked --purge idemgate || fatal "dpkg --purge of a left-over idemgate"
fi
INSTALLED=1
dpkg_locked -i "$DEB" || fatal "dpkg -i $(basename "$DEB")"
pass "dpkg -i $(basename "$DEB")"
check "dpkg knows idemgate $VERSION as installed" \
    test "$(dpkg-query -W -f='${db:Status-Abbrev} ${Version}' idemgate)" = "ii  $VERSION"

first=$(zcat /usr/share/doc/idemgate/changelog.gz 2>&1 | head -n 1)
check "/usr/share/doc/idemgate/changelog.gz is debian/changelog ($first)" test "${first%%;*}" = "idemgate ($clog) unstable"
v=$(/usr/bin/idemgate --version 2>&1)
check "/usr/bin/idemgate --version: '$v' is 'idemgate $VERSION'" test "$v" = "idemgate $VERSION"

for page in /usr/share/man/man8/idemgate.8.gz /usr/share/man/man5/idemgate.yaml.5.gz; do
    n=$(MANWIDTH=80 man -l "$page" 2>/dev/null | wc -l)
    check "man -l $page: $n lines" test "$n" -gt 40
    w=$(MANWIDTH=80 man --warnings -l "$page" 2>&1 >/dev/null)
    check "man --warnings -l $page: no warnings${w:+ ($w)}" test -z "$w"
done
found=$(man -w idemgate.yaml 2>&1)
check "man finds idemgate.yaml(5) in its path ($found)" test "$found" = /usr/share/man/man5/idemgate.yaml.5.gz
found=$(man -w 8 idemgate 2>&1)
check "man finds idemgate(8) in its path ($found)" test "$found" = /usr/share/man/man8/idemgate.8.gz

# ---- the systemd unit
out=$(timeout 60 systemd-analyze verify "$UNIT" 2>&1)
rc=$?
check "systemd-analyze verify $UNIT: exit 0, nothing printed${out:+ ($out)}" test "$rc" = 0 -a -z "$out"
timeout 60 systemd-analyze security --offline=true --threshold=20 "$UNIT" >"$WORK/security.log" 2>&1
score=$(sed -nE 's/.*Overall exposure level for idemgate.service: ([0-9.]+).*/\1/p' "$WORK/security.log")
low() { [ -n "$score" ] && awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }'; }
check "systemd-analyze security --offline: exposure ${score:-?} (at most 2.0)" low
unit_has() { grep -qx -- "$1" "$UNIT"; }
for d in 'ExecReload=/bin/kill -HUP $MAINPID' DynamicUser=yes ProtectSystem=strict NoNewPrivileges=yes \
    'ExecStart=/usr/bin/idemgate -c /etc/idemgate/idemgate.yaml' 'CapabilityBoundingSet='; do
    check "unit: $d" unit_has "$d"
done
check "/etc/idemgate/idemgate.yaml is a conffile" \
    grep -q ' /etc/idemgate/idemgate.yaml ' <<<"$(dpkg-query -W -f='${Conffiles}\n' idemgate) "
# The service's user is a dynamic one: the config must be readable by a user with no rights (nobody here).
out=$(setpriv --reuid=nobody --regid=nogroup --clear-groups /usr/bin/idemgate --check -c /etc/idemgate/idemgate.yaml 2>&1)
check "the unit's ExecStartPre (idemgate --check) passes as an unprivileged user" test $? = 0
# A booted systemd is what would start it; say whether this machine has one (a container usually does not).
state=$(systemctl is-system-running 2>&1)
say "systemd on this machine: '$state' (PID 1 is $(cat /proc/1/comm)): the unit is verified offline here and started under a booted systemd in the docker stage"

# ---- purge: nothing left
if dpkg_locked --purge idemgate; then
    INSTALLED=0
    pass "dpkg --purge idemgate"
else
    failed "dpkg --purge idemgate"
fi
left=()
for f in /usr/bin/idemgate /etc/idemgate "$UNIT" /usr/share/doc/idemgate /usr/share/man/man8/idemgate.8.gz; do
    [ -e "$f" ] && left+=("$f")
done
check "nothing of the package left after the purge (${left[*]:-none})" test ${#left[@]} = 0
check "dpkg no longer knows idemgate" test -z "$(dpkg-query -W -f='${db:Status-Abbrev}' idemgate 2>/dev/null | tr -d ' n')"

summary
[ "$FAIL" = 0 ]
