#!/usr/bin/env bash
# Fails when a C file differs from the checked-in .clang-format style.
set -eu
cd "$(dirname "$0")/.."
git ls-files '*.c' '*.h' | xargs clang-format --dry-run -Werror
