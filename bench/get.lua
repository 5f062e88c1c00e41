-- get.lua - wrk script: plain GETs (the passthrough path), optionally paced with BENCH_DELAY_MS (pause between two
-- requests of one connection), as bench/soak.sh uses it.
local delay_ms = tonumber(os.getenv("BENCH_DELAY_MS") or "")
if delay_ms then
    function delay()
        return delay_ms
    end
end
