#!/usr/bin/env bash
# build-deb.sh - builds the Debian package in a copy of the work tree (the files git knows or would add), so no
# build output lands in or beside the repository: `dpkg-buildpackage -b -us -uc` in OUTDIR/src, the .debs in OUTDIR.
#
#   tests/package/build-deb.sh OUTDIR      prints the path of idemgate_VERSION_ARCH.deb; the log is OUTDIR/build.log
#
# Exits 1 when the build fails (within 900 s).
set -uo pipefail
out=${1:?usage: build-deb.sh OUTDIR}
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$out/src" || exit 1
git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C "$out/src" || exit 1
(cd "$out/src" && timeout 900 dpkg-buildpackage -b -us -uc) >"$out/build.log" 2>&1 || exit 1
deb=$(ls "$out"/idemgate_*.deb 2>/dev/null | head -n 1)
[ -n "$deb" ] || exit 1
echo "$deb"
