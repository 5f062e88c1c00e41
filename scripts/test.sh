#!/usr/bin/env bash
# test.sh - the whole test run: deps, build, throwaway Postgres+Redis, the unit suite, then the unit and e2e suites
# under ASan+UBSan (with --quick: both in the plain build instead), the engine tests again on a Citus cluster (suite
# citus), the fuzz, chaos, demo, package and docker stages. Ends with one line `N passed, N failed` (meson tests,
# plus each extra stage's own count or 1 per stage) and exits non-zero on a failure.
#
#   scripts/test.sh                  everything
#   scripts/test.sh --quick          skip the ASan+UBSan stage
#   scripts/test.sh --suite unit     only that meson suite (unit|e2e), no extra stages
#   scripts/test.sh --no-deps        do not run scripts/deps.sh first
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd -P)

quick=0
suite=
deps=1
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1 ;;
    --suite)
        suite=${2:-}
        shift
        case "$suite" in unit | e2e) ;; *)
            echo "test.sh: --suite unit|e2e" >&2
            exit 2
            ;;
        esac
        ;;
    --suite=*)
        suite=${1#--suite=}
        case "$suite" in unit | e2e) ;; *)
            echo "test.sh: --suite unit|e2e" >&2
            exit 2
            ;;
        esac
        ;;
    --no-deps) deps=0 ;;
    -h | --help)
        sed -n '7,10p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "test.sh: unknown option $1 (see --help)" >&2
        exit 2
        ;;
    esac
    shift
done

TOTAL_PASS=0
TOTAL_FAIL=0
# The failed tests of a meson testlog.json: each one's name, then its assertion messages, [FAIL] lines and sanitizer
# reports (the CI log keeps only its tail, so these are repeated after the results). At most 60 lines.
failed_lines() {
    python3 - "$1" <<'PY' | head -n 60
import json, re, sys
keep = re.compile(r"Assertion Failed|\[FAIL\]|\[ERR \]|ERROR: (Address|Leak|Undefined)Sanitizer|runtime error|SUMMARY:|CRASH|Timeout")
for raw in open(sys.argv[1], errors="replace"):
    try:
        t = json.loads(raw)
    except ValueError:
        continue
    if t.get("result") not in ("FAIL", "TIMEOUT", "ERROR", "UNEXPECTEDPASS"):
        continue
    print('"name": "%s" (%s)' % (t.get("name"), t.get("result")))
    lines = (t.get("stdout") or "").splitlines() + (t.get("stderr") or "").splitlines()
    for i, l in enumerate(lines):
        if keep.search(l):
            print("  " + l[:300])
            if "Assertion Failed" in l:
                for m in lines[i + 1:i + 4]:
                    m = m.replace("[----]", "").strip()
                    if m:
                        print("    " + m[:300])
PY
}
STAGES=()
FAILS=()
TMP=
SVC=
CITUS_SVC=
NSVC=0
EXTRA_PID=

log() { printf '\n==== %s\n' "$*"; }
LAST_RECORD_S=$SECONDS
record() { # name passed failed note; each line also says the seconds since the previous record (its build included)
    STAGES+=("$(printf '%-22s %4s passed %4s failed %5ss  %s' "$1" "$2" "$3" $((SECONDS - LAST_RECORD_S)) "${4:-}")")
    LAST_RECORD_S=$SECONDS
    TOTAL_PASS=$((TOTAL_PASS + $2))
    TOTAL_FAIL=$((TOTAL_FAIL + $3))
}
record_note() {
    STAGES+=("$(printf '%-22s %s' "$1" "$2")")
    LAST_RECORD_S=$SECONDS
}

services_stop() {
    if [ -n "$SVC" ]; then
        bash scripts/services.sh stop "$SVC" >/dev/null 2>&1 || bash scripts/services.sh stop "$SVC"
        SVC=
    fi
}
cleanup() {
    trap '' PIPE
    if [ -n "$EXTRA_PID" ]; then kill -TERM "$EXTRA_PID" 2>/dev/null && wait "$EXTRA_PID" 2>/dev/null; fi
    EXTRA_PID=
    services_stop
    citus_stop
    if [ -n "$TMP" ] && [ -d "$TMP" ]; then rm -rf "$TMP"; fi
    TMP=
}
trap cleanup EXIT
trap 'echo "test.sh: interrupted" >&2; exit 130' INT TERM HUP

citus_stop() {
    if [ -n "$CITUS_SVC" ]; then
        bash scripts/services.sh citus-stop "$CITUS_SVC" >/dev/null 2>&1 || bash scripts/services.sh citus-stop "$CITUS_SVC"
        CITUS_SVC=
    fi
}

# A fresh Postgres+Redis for each stage, so no stage sees another's records. Returns 1 on failure.
services_fresh() {
    services_stop
    NSVC=$((NSVC + 1))
    SVC=$TMP/svc$NSVC
    if ! bash scripts/services.sh start "$SVC"; then
        services_stop # tidies whatever start left behind
        return 1
    fi
    # shellcheck disable=SC1091
    . "$SVC/env"
}

# meson setup (when needed) + ninja. $1 = build dir, rest = meson options.
build() {
    local dir=$1
    shift
    if [ ! -f "$dir/build.ninja" ]; then
        rm -rf "$dir"
        meson setup "$dir" "$@" || return 1
    elif [ $# -gt 0 ]; then
        meson configure "$dir" "$@" >/dev/null || return 1 # an older dir gets today's options
    fi
    ninja -C "$dir"
}

# meson test in $1 (stage name $2, then meson options: which suites); counts results from testlog.json.
meson_stage() {
    local dir=$1 name=$2 rc=0 pass fail skip args=()
    shift 2
    args=(test -C "$dir" --print-errorlogs --num-processes 2)
    if [ -n "$suite" ]; then args+=(--suite "$suite"); else args+=("$@"); fi
    [ "$dir" = build-asan ] && args+=(--timeout-multiplier 3)
    rm -f "$dir/meson-logs/testlog.json"
    log "$name: meson ${args[*]}"
    meson "${args[@]}" || rc=$?
    pass=0
    fail=0
    skip=0
    if [ -f "$dir/meson-logs/testlog.json" ]; then
        pass=$(grep -oE '"result": *"(OK|EXPECTEDFAIL)"' "$dir/meson-logs/testlog.json" | wc -l)
        fail=$(grep -oE '"result": *"(FAIL|TIMEOUT|ERROR|UNEXPECTEDPASS)"' "$dir/meson-logs/testlog.json" | wc -l)
        skip=$(grep -oE '"result": *"SKIP"' "$dir/meson-logs/testlog.json" | wc -l)
    fi
    if [ "$fail" != 0 ]; then
        FAILS+=("---- $name: failed tests:")
        while IFS= read -r line; do FAILS+=("$line"); done < <(failed_lines "$dir/meson-logs/testlog.json")
    fi
    if [ "$rc" != 0 ] && [ "$fail" = 0 ]; then
        record "$name" "$pass" 1 "(meson test exited $rc)"
    elif [ $((pass + fail)) = 0 ]; then
        record "$name" 0 1 "(no test ran)"
    elif [ "$skip" != 0 ]; then
        record "$name" "$pass" "$fail" "($skip skipped)"
    else
        record "$name" "$pass" "$fail"
    fi
}

# An extra stage script: its own `N passed, N failed` line when it prints one, else 1 test by exit code.
# extra_stage NAME services|no-services SCRIPT ARGS...   (bounded by STAGE_TIMEOUT seconds, default 900)
extra_stage() {
    local name=$1 svc=$2 script=$3 rc=0 out line p f
    shift 3
    if [ ! -e "$script" ]; then
        record_note "$name" "not present"
        return
    fi
    if [ ! -x "$script" ]; then
        record_note "$name" "skipped: $script is not executable"
        return
    fi
    if [ "$svc" = services ]; then
        if ! services_fresh; then
            record "$name" 0 1 "(services did not start)"
            return
        fi
    else
        services_stop
    fi
    log "$name: $script $*"
    out=$TMP/$name.out
    # timeout puts the stage in its own process group and, on expiry or on our TERM, signals all of it.
    : >"$out"
    timeout -k 10 "${STAGE_TIMEOUT:-900}" "$script" "$@" >>"$out" 2>&1 </dev/null &
    EXTRA_PID=$!
    tail -n +1 --pid="$EXTRA_PID" -f "$out"
    wait "$EXTRA_PID"
    rc=$?
    EXTRA_PID=
    # A failed stage's telling lines are printed again after the results, so a log cut to its tail still shows them.
    if [ "$rc" != 0 ]; then
        FAILS+=("---- $name (exit $rc):")
        while IFS= read -r line; do FAILS+=("$line"); done < <(grep -E 'FAIL|CRASH|ERROR|SUMMARY|panic|Assertion|==[0-9]+==' "$out" | tail -n 25)
    fi
    line=$(grep -E '^([A-Za-z]+: )?[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
    if [ -n "$line" ]; then
        p=$(sed -E 's/^([A-Za-z]+: )?([0-9]+) passed.*/\2/' <<<"$line")
        f=$(sed -E 's/^([A-Za-z]+: )?[0-9]+ passed, ([0-9]+) failed.*/\2/' <<<"$line")
        if [ "$rc" != 0 ] && [ "$f" = 0 ]; then f=1; fi
        record "$name" "$p" "$f" "$([ "$rc" != 0 ] && echo "(exit $rc)")"
    elif [ "$rc" = 0 ]; then
        record "$name" 1 0
    else
        record "$name" 0 1 "(exit $rc)"
    fi
}

start_s=$SECONDS

if [ $deps = 1 ]; then
    log "deps"
    if ! bash scripts/deps.sh --citus; then
        record "deps" 0 1
        cleanup
        printf '\n%s\n' "${STAGES[@]}"
        echo "$TOTAL_PASS passed, $TOTAL_FAIL failed"
        exit 1
    fi
fi

TMP=$(mktemp -d /tmp/idemgate-test.XXXXXX)
chmod 755 "$TMP"

# ---- stage 1: the normal build
log "build (build/)"
if build build -Dwerror=true; then
    export IDEMGATE_BUILD_DIR=$ROOT/build
    if services_fresh; then
        # The end-to-end tests wait far more than they compute (faults, leases, timeouts), so running them in both
        # builds doubled the suite's time for little: with the ASan stage to come, they run there only (every
        # one under ASan, UBSan and LeakSanitizer), and this stage runs the unit tests. The plain build's
        # gateway still runs end to end in the Citus, chaos, demo, package and docker stages below.
        if [ $quick = 0 ] && [ -z "$suite" ]; then
            meson_stage build "tests" --no-suite citus --no-suite e2e
        else
            meson_stage build "tests" --no-suite citus
        fi
    else
        record "services" 0 1 "(Postgres/Redis did not start)"
    fi
else
    record "build" 0 1 "(build failed)"
fi

# ---- stage 2: ASan + UBSan
if [ $quick = 0 ]; then
    log "build (build-asan/: address,undefined)"
    # Same -Werror as the normal build. LeakSanitizer is on; tests/lsan.supp only hides Criterion's own
    # runner allocation, nothing of idemgate.
    if build build-asan -Dwerror=true -Db_sanitize=address,undefined -Db_lundef=false; then
        if services_fresh; then
            ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 LSAN_OPTIONS=suppressions=$ROOT/tests/lsan.supp:print_suppressions=0 \
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
                IDEMGATE_BUILD_DIR=$ROOT/build-asan \
                meson_stage build-asan "tests (asan+ubsan)" --no-suite citus
        else
            record "services" 0 1 "(Postgres/Redis did not start)"
        fi
    else
        record "build-asan" 0 1 "(build failed)"
    fi
else
    record_note "tests (asan+ubsan)" "skipped (--quick)"
fi

# ---- stage 3: the engine tests on Citus (a coordinator and two workers; Citus is built once and cached)
if [ -z "$suite" ] && [ -f build/build.ninja ]; then
    services_stop
    CITUS_SVC=$TMP/citus
    log "citus: services.sh citus-start"
    if bash scripts/services.sh citus-start "$CITUS_SVC"; then
        # Only the IDEMGATE_TEST_CITUS_* names: the plain services' variables stay as they are.
        eval "$(grep '^export IDEMGATE_TEST_CITUS_' "$CITUS_SVC/env")"
        IDEMGATE_BUILD_DIR=$ROOT/build meson_stage build "tests (citus)" --suite citus
    else
        record "citus" 0 1 "(the Citus cluster did not start)"
    fi
    citus_stop
fi

# ---- extra stages (each owned by its room; they find the build in IDEMGATE_BUILD_DIR)
if [ -z "$suite" ]; then
    export IDEMGATE_BUILD_DIR=$ROOT/build
    # 12 s per target: the corpus and the regression inputs replayed, then a short search (longer: run.sh SECS).
    extra_stage fuzz services tests/fuzz/run.sh 12
    extra_stage chaos services tests/chaos/run.sh --short
    # The same on a Citus cluster of its own, with worker restarts among the faults.
    extra_stage chaos-citus no-services tests/chaos/run.sh --citus --short
    # The README's run command, end to end (its own Postgres/Redis in .run/, the replay demo, then stop).
    extra_stage demo no-services scripts/run.sh --no-wait --no-deps
    # The Debian package: dpkg-buildpackage, dpkg -i, --version, man pages, systemd unit, purge (needs root).
    extra_stage package no-services tests/package/run.sh
    # docker/compose.test.yaml changes only images and network of docker/compose.yaml (python3-yaml, no Docker).
    extra_stage compose-files no-services tests/docker/compose-diff.py
    # docker/compose.yaml under its test override (local images, host network) on a private bridge-less dockerd,
    # the README's curl demo through the stack, then the package's unit under a booted systemd in a container
    # (skips where Docker cannot run). Cold (no image cache) it took 451 s here, so it gets 1500 s.
    STAGE_TIMEOUT=1500 extra_stage docker no-services tests/docker/run.sh
fi

cleanup
printf '\n==== results (%ss)\n' $((SECONDS - start_s))
printf '%s\n' "${STAGES[@]}"
if [ ${#FAILS[@]} -gt 0 ]; then
    printf '\n==== what the failed stages said\n'
    printf '%s\n' "${FAILS[@]}"
fi
echo "$TOTAL_PASS passed, $TOTAL_FAIL failed"
[ "$TOTAL_FAIL" = 0 ]
