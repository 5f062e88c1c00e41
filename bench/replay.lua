-- replay.lua - wrk script: POSTs cycling over a fixed set of keys already completed (bench/soak.sh primes them
-- with the same body first), so every request through the gateway is a replay. BENCH_RUN and BENCH_KEYS must match
-- the priming: keys are rp-$BENCH_RUN-1 .. rp-$BENCH_RUN-$BENCH_KEYS.
local threads = 0
function setup(thread)
    threads = threads + 1
    thread:set("tid", threads)
end

local i
local nkeys
local run
local headers = { ["Content-Type"] = "application/json" }
local body = '{"amount":4200,"currency":"EUR","note":"bench"}'

function init(args)
    run = os.getenv("BENCH_RUN") or "0"
    nkeys = tonumber(os.getenv("BENCH_KEYS") or "100")
    i = ((tid or 1) * 7919) % nkeys -- threads start at different keys
end

function request()
    i = i % nkeys + 1
    headers["Idempotency-Key"] = "rp-" .. run .. "-" .. i
    return wrk.format("POST", wrk.path, headers, body)
end

-- BENCH_DELAY_MS (optional): pause between two requests of one connection, for a paced load (bench/soak.sh).
local delay_ms = tonumber(os.getenv("BENCH_DELAY_MS") or "")
if delay_ms then
    function delay()
        return delay_ms
    end
end
