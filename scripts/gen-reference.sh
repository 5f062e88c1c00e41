#!/usr/bin/env bash
# gen-reference.sh - writes docs/configuration.md from the key tables in conf/*.c (idemgate --print-reference).
# Run it after adding or changing a configuration key; conf_test fails while the file and the tables differ.
# Usage: scripts/gen-reference.sh [BUILD_DIR]   (default: build; it is built first)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
[ -d "$BUILD" ] || meson setup "$BUILD" "$ROOT" >/dev/null
ninja -C "$BUILD" idemgate >/dev/null
"$BUILD/idemgate" --print-reference >"$ROOT/docs/configuration.md.tmp"
mv "$ROOT/docs/configuration.md.tmp" "$ROOT/docs/configuration.md"
echo "docs/configuration.md: $(wc -l <"$ROOT/docs/configuration.md") lines"
