-- newkey.lua - wrk script: every request is a POST with a new, unique Idempotency-Key (the claim + forward +
-- completion path of the gateway). Keys are unique per run (BENCH_RUN), per thread and per request.
local threads = 0
function setup(thread)
    threads = threads + 1
    thread:set("tid", threads)
end

local n = 0
local prefix
local headers = { ["Content-Type"] = "application/json" }
local body = '{"amount":4200,"currency":"EUR","note":"bench"}'

function init(args)
    prefix = string.format("nk-%s-%d-", os.getenv("BENCH_RUN") or tostring(os.time()), tid or 0)
end

function request()
    n = n + 1
    headers["Idempotency-Key"] = prefix .. n
    return wrk.format("POST", wrk.path, headers, body)
end

-- BENCH_DELAY_MS (optional): pause between two requests of one connection, for a paced load (bench/soak.sh).
local delay_ms = tonumber(os.getenv("BENCH_DELAY_MS") or "")
if delay_ms then
    function delay()
        return delay_ms
    end
end
