#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan), replays tests/fuzz/regress/<target>/, then fuzzes each
# target for SECONDS (default 20) from tests/fuzz/corpus/<target>/. Exits non-zero when any target crashes.
# FUZZ_TARGETS="conf jcs" fuzzes only those targets. FUZZ_KEEP=1 keeps the built targets (their directory is printed) to fuzz one longer by hand.
# Usage: tests/fuzz/run.sh [SECONDS]   (crash inputs are kept in $FUZZ_ARTIFACTS, default /tmp/idemgate-fuzz-artifacts)
set -u

SECS=${1:-20}
case "$SECS" in
'' | *[!0-9]*)
    echo "usage: $0 [SECONDS]" >&2
    exit 2
    ;;
esac
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FUZZ="$ROOT/tests/fuzz"
ARTIFACTS=${FUZZ_ARTIFACTS:-/tmp/idemgate-fuzz-artifacts}
CC=${CC_FUZZ:-clang}
WORK=$(mktemp -d /tmp/idemgate-fuzz.XXXXXX)
[ -n "${FUZZ_KEEP:-}" ] && echo "fuzz: targets built in $WORK (kept)"
trap '[ -n "${FUZZ_KEEP:-}" ] || rm -rf "$WORK"' EXIT

CFLAGS=(-std=gnu11 -g -O1 -D_GNU_SOURCE -fno-omit-frame-pointer
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I"$ROOT"
    -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION)
# shellcheck disable=SC2207
LIBS=($(pkg-config --libs libcrypto yaml-0.1)) || {
    echo "pkg-config: libcrypto or yaml-0.1 missing" >&2
    exit 2
}
# shellcheck disable=SC2207
INCS=($(pkg-config --cflags libcrypto yaml-0.1))

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# conf_load_string applies these: keep the conf target independent of the caller's environment.
unset IDEMGATE_POSTGRES_URL IDEMGATE_REDIS_URL IDEMGATE_ADMIN_TOKEN

sources() {
    case "$1" in
    key | fp | jcs) echo "common/common.c gateway/idem.c gateway/parts.c gateway/json.c gateway/jwt.c" ;;
    resp | hdrs) echo "common/common.c" ;;
    conf) echo "common/common.c common/uri.c common/addr.c conf/conf.c conf/fields.c conf/process.c conf/upstreams.c conf/routes.c conf/idempotency.c conf/check.c conf/restart.c" ;;
    path) echo "common/common.c common/uri.c" ;;
    verify) echo "common/common.c gateway/verify.c" ;;
    prefer) echo "common/common.c gateway/hints.c" ;;
    parts) echo "common/common.c gateway/parts.c gateway/json.c gateway/jwt.c" ;;
    h1) echo "common/common.c upstream/upstream.c upstream/h1.c upstream/curl.c upstream/head.c upstream/transfer.c" ;;
    esac
}

# Libraries a target needs beyond LIBS (the upstream room links libcurl and libevent).
extra_libs() {
    case "$1" in
    h1) pkg-config --libs libcurl libevent ;;
    key | fp | parts | jcs) pkg-config --libs jansson ;;
    esac
}

# shellcheck disable=SC2206 # a list of words
TARGETS=(${FUZZ_TARGETS:-key resp hdrs fp conf path h1 parts prefer verify jcs})
passed=0
failed=0
for t in "${TARGETS[@]}"; do
    echo "== fuzz_$t"
    bin="$WORK/fuzz_$t"
    srcs=()
    for s in $(sources "$t"); do srcs+=("$ROOT/$s"); done
    # shellcheck disable=SC2207
    xlibs=($(extra_libs "$t"))
    if ! "$CC" "${CFLAGS[@]}" "${INCS[@]}" -o "$bin" "$FUZZ/fuzz_$t.c" "${srcs[@]}" "${LIBS[@]}" "${xlibs[@]}" \
        2>"$WORK/build_$t.log"; then
        cat "$WORK/build_$t.log" >&2
        echo "fuzz_$t: BUILD FAILED"
        failed=$((failed + 1))
        continue
    fi

    ok=1
    regress=()
    if [ -d "$FUZZ/regress/$t" ]; then
        while IFS= read -r -d '' f; do regress+=("$f"); done < <(find "$FUZZ/regress/$t" -type f -print0 | sort -z)
    fi
    if [ ${#regress[@]} -gt 0 ]; then
        if "$bin" -timeout=5 -rss_limit_mb=2048 "${regress[@]}" >"$WORK/regress_$t.log" 2>&1; then
            echo "fuzz_$t: ${#regress[@]} regression inputs ok"
        else
            tail -n 40 "$WORK/regress_$t.log" >&2
            echo "fuzz_$t: REGRESSION INPUT CRASHED"
            ok=0
        fi
    fi

    if [ $ok = 1 ]; then
        corpus="$WORK/corpus_$t"
        mkdir -p "$corpus" "$ARTIFACTS/$t"
        [ -d "$FUZZ/corpus/$t" ] && cp "$FUZZ/corpus/$t"/* "$corpus"/ 2>/dev/null
        dict=()
        [ -f "$FUZZ/$t.dict" ] && dict=(-dict="$FUZZ/$t.dict")
        if "$bin" "${dict[@]}" -max_total_time="$SECS" -timeout=5 -rss_limit_mb=2048 -print_final_stats=1 \
            -artifact_prefix="$ARTIFACTS/$t/" "$corpus" >"$WORK/fuzz_$t.log" 2>&1; then
            grep -E '^stat::number_of_executed_units|^stat::new_units_added' "$WORK/fuzz_$t.log" | tr '\n' ' '
            echo
        else
            tail -n 60 "$WORK/fuzz_$t.log" >&2
            echo "fuzz_$t: CRASH (inputs in $ARTIFACTS/$t/; fix the code, then keep them in tests/fuzz/regress/$t/)"
            ok=0
        fi
    fi
    if [ $ok = 1 ]; then
        echo "fuzz_$t: ok"
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
    fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
