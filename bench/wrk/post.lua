-- wrk script: POST the file named by $BENCH_BODY as JSON; print one machine-readable line.
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,"err_connect":%.0f,' ..
    '"err_read":%.0f,"err_write":%.0f,"err_status":%.0f,"err_timeout":%.0f,' ..
    '"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f,"max_us":%.0f,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean))
end
