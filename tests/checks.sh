# checks.sh - the counted assertions of the stage scripts (tests/docker/run.sh, tests/package/run.sh): source it
# after setting STAGE (the name of the `STAGE: N passed, N failed` line). summary_extra, when a script defines
# it, prints what goes before that line.
# shellcheck shell=bash
PASS=0
FAIL=0

say() { echo "$STAGE/run.sh: $*"; }
pass() {
    PASS=$((PASS + 1))
    echo "  ok   $*"
}
failed() {
    FAIL=$((FAIL + 1))
    echo "  FAIL $*"
}
# check NAME COMMAND...: one assertion, counted.
check() {
    local name=$1
    shift
    if "$@"; then pass "$name"; else failed "$name"; fi
}
summary() {
    if declare -F summary_extra >/dev/null; then summary_extra; fi
    echo "$STAGE: $PASS passed, $FAIL failed"
}
# fatal NAME [LOG]: a failed step the rest cannot run without: count it, show the end of LOG, stop here.
fatal() {
    failed "$1"
    if [ -n "${2:-}" ]; then tail -n 40 "$2"; fi
    summary
    exit 1
}
