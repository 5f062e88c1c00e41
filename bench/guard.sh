#!/usr/bin/env bash
# guard.sh - the ordering guard's cost on new keys, measured with the shared bench (../shared/bench/run.sh).
#
#   bench/guard.sh [--quick] [--rounds N]
#
# Two runs of the shared bench's `gw_new_keys` and `pg_limit` scenarios: the first as the bench ships, the
# second with an ordering guard on the bench's `payments` route (resource /v1/payments/{id}, sequence from
# X-Sequence, on_gap: accept). For the second run the bench is copied to a temp dir and two things change: its
# new-key Lua script sends each request to /v1/payments/<key> with `X-Sequence: <counter>` (a fresh resource
# per request, so the guard's statement runs every time and no request waits for another), and --bin is a
# wrapper that adds the ordering block to the config the harness writes. Everything else (Postgres, Redis,
# pgbench, the checks) is the shared bench unchanged. Each ratio is within one run; compare
# gw_new_keys/pg_limit and the p50s across the two runs.
#
# Environment: IDEMGATE_BIN (default build/idemgate), IDEMGATE_SHARED_BENCH (default ../shared/bench).
# Needs root and what the shared bench needs (its README). Traffic goes to 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
BIN=$(realpath "${IDEMGATE_BIN:-$ROOT/build/idemgate}")
SHARED=$(realpath "${IDEMGATE_SHARED_BENCH:-$ROOT/../shared/bench}")
[ -x "$BIN" ] || {
    echo "guard.sh: no gateway binary at $BIN (ninja -C build)" >&2
    exit 2
}
[ -x "$SHARED/run.sh" ] || {
    echo "guard.sh: no shared bench at $SHARED" >&2
    exit 2
}
opts=()
while [ $# -gt 0 ]; do
    case $1 in
    --quick) opts+=(--quick) ;;
    --rounds)
        opts+=(--rounds "$2")
        shift
        ;;
    *)
        echo "guard.sh: unknown option $1" >&2
        exit 2
        ;;
    esac
    shift
done

TMP=$(mktemp -d /tmp/idemgate-guard-bench.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
cp -r "$SHARED" "$TMP/bench"
# a later definition of request() replaces the bench's: same key and body, the key also names the resource
cat >>"$TMP/bench/lua/new_keys.lua" <<'EOF'

request = function()
  counter = counter + 1
  local key = string.format("%s-%d-%d-%08x", nonce, tid, counter, math.random(0, 0x7fffffff))
  return wrk.format("POST", path .. "/" .. key, {
    ["Idempotency-Key"] = key,
    ["Content-Type"] = "application/json",
    ["Authorization"] = auth,
    ["X-Sequence"] = tostring(counter),
  }, body)
end
EOF
cat >"$TMP/idemgate-guard" <<EOF
#!/usr/bin/env bash
# adds the ordering guard to the bench's payments route, then runs the gateway in this process
args=()
while [ \$# -gt 0 ]; do
    if [ "\$1" = -c ]; then
        awk '{ print } /^  - name: payments\$/ { print "    ordering:"; print "      resource: /v1/payments/{id}";
              print "      sequence: header:X-Sequence"; print "      on_gap: accept" }' "\$2" >"\$2.guard"
        args+=(-c "\$2.guard")
        shift 2
    else
        args+=("\$1")
        shift
    fi
done
exec "$BIN" "\${args[@]}"
EOF
chmod +x "$TMP/idemgate-guard"

echo "== run 1: gw_new_keys as the shared bench ships it"
"$SHARED/run.sh" --bin "$BIN" --only pg_limit,gw_new_keys "${opts[@]}" 2>&1 | grep -E '^(ratio|result|check|info|SKIP)' || true
echo "== run 2: the same with the ordering guard on (a fresh resource per request)"
"$TMP/bench/run.sh" --bin "$TMP/idemgate-guard" --only pg_limit,gw_new_keys "${opts[@]}" 2>&1 |
    grep -E '^(ratio|result|check|info|SKIP)' || true
