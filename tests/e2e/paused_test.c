/* paused_test.c - end-to-end: exactly once when a gateway itself pauses or its clock disagrees (SPEC 8: "A paused
 * owner never acts", "The probe waits for the original to be over", "One clock"). Faults: a gateway SIGSTOPped
 * for longer than its lease, a gateway SIGKILLed while its request runs, a wall clock moved by the clockshift
 * shim (tests/tools/clockshift.c, LD_PRELOAD), Postgres stopped, a server process paused, and an upstream that
 * applies its writes when they finish (testupstream's X-Test-Commit: end). */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "harness.h"

static pid_t stopped_pid; /* a gateway or a server process this test paused: resumed whatever happens */

static void paused_setup(void)
{
    e2e_setup();
    cr_assert_eq(e2e_services("pg-start"), 0, "Postgres could not be (re)started before the test");
}

static void paused_teardown(void)
{
    if (stopped_pid > 0)
        (void)kill(stopped_pid, SIGCONT);
    stopped_pid = 0;
    if (e2e_services("pg-start") != 0)
        fprintf(stderr, "paused_test: pg-start failed in .fini\n");
    e2e_teardown();
}

TestSuite(paused, .init = paused_setup, .fini = paused_teardown, .timeout = 120);

static void pause_proc(pid_t pid)
{
    stopped_pid = pid;
    cr_assert_eq(kill(pid, SIGSTOP), 0);
}

static void resume_proc(pid_t pid)
{
    cr_assert_eq(kill(pid, SIGCONT), 0);
    stopped_pid = 0;
}

/* A gateway (one loop, pool 2) in front of up, whose upstream "api" has one connection at most (timeout), with the
 * route "pay" (/v1/pay; idem: its idempotency lines, each indented by six) and the guarded route "acct"
 * (/v1/acct/{id}, X-Sequence, lease 1s, hold 500ms). Waits until /readyz answers 200. */
static struct e2e_gw *gw_start(const struct e2e_upstream *up, const char *timeout, const char *idem, long shift_ms)
{
    char *conf = NULL;
    cr_assert(asprintf(&conf,
                       E2E_CONF_PORTS
                       "threads: 1\n"
                       "store:\n"
                       "  postgres: \"{{PG_URL}}\"\n"
                       "  redis: \"{{REDIS_URL}}\"\n"
                       "  pool: 2\n"
                       "upstreams:\n"
                       "  - name: api\n"
                       "    url: {{UPSTREAM_URL}}\n"
                       "    connect_timeout: 1s\n"
                       "    timeout: %s\n"
                       "    max_connections: 1\n"
                       "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "%s"
                                                                           "  - name: acct\n"
                                                                           "    match:\n"
                                                                           "      path_prefix: /v1/acct\n"
                                                                           "    upstream: api\n"
                                                                           "    idempotency:\n"
                                                                           "      key: required\n"
                                                                           "      lease: 1s\n"
                                                                           "    ordering:\n"
                                                                           "      resource: /v1/acct/{id}\n"
                                                                           "      sequence: header:X-Sequence\n"
                                                                           "      hold: 500ms\n",
                       timeout, idem) > 0);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true, .env = e2e_clock_env(shift_ms)};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    free(conf);
    return gw;
}

/* A POST of key on path in a thread, with extra header lines (NULL-terminated, may be NULL). */
static struct e2e_async *post_async(uint16_t port, const char *path, const char *key, const char *const *extra)
{
    static char kh[8][160];
    static const char *h[8][8];
    static int slot;
    int s = slot++ % 8;
    snprintf(kh[s], sizeof kh[s], "Idempotency-Key: %s", key);
    size_t n = 0;
    h[s][n++] = kh[s];
    for (size_t i = 0; extra && extra[i] && n < 7; i++)
        h[s][n++] = extra[i];
    h[s][n] = NULL;
    struct e2e_req rq = {
        .method = "POST", .path = path, .headers = h[s], .body = "{\"a\":1}", .body_len = 7, .timeout_ms = 30000};
    return e2e_http_async(port, &rq);
}

static void post(uint16_t port, const char *path, const char *key, const char *const *extra, struct e2e_resp *r)
{
    e2e_http_key(port, "POST", path, key, extra, "{\"a\":1}", 20000, r);
}

static long upstream_violations(const struct e2e_upstream *up)
{
    struct e2e_resp r;
    e2e_get(up->port, "/_test/order-violations", &r);
    cr_assert_eq(r.status, 200, "/_test/order-violations: %ld", r.status);
    long v = atol((const char *)r.body);
    e2e_resp_free(&r);
    return v;
}

/* ---- 1. a paused owner never sends */

/* Gateway A claims k; its request waits for A's only upstream connection (held 4 s by another request); A is
 * SIGSTOPped for 3 s (lease 1 s). B takes the lapsed claim over (on_unknown: retry) and executes k. When A resumes,
 * its lease is long gone by its own monotonic clock: k is never sent again, and A's client gets 503 with
 * Retry-After. */
Test(paused, a_paused_owner_never_sends_what_it_no_longer_owns)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n      lease: 1s\n      on_unknown: retry\n";
    struct e2e_gw *a = gw_start(up, "10s", idem, 0);
    struct e2e_gw *b = gw_start(up, "10s", idem, 0);
    char busy[96], k[96];
    e2e_mkkey(busy, sizeof busy, "busy");
    e2e_mkkey(k, sizeof k, "paused");
    const char *slow[] = {"X-Test-Delay-Ms: 4000", NULL};
    struct e2e_async *hold = post_async(a->port, "/v1/pay/busy", busy, slow);
    cr_assert_eq(e2e_upstream_wait_count(up, busy, 1, 3000), 1, "the busy request did not reach the upstream");
    struct e2e_async *queued = post_async(a->port, "/v1/pay/k", k, NULL);
    e2e_sleep_ms(300); /* claimed, waiting for the connection */
    uint64_t t0 = e2e_now_ms();
    pause_proc(a->proc.pid);
    e2e_sleep_ms(1800); /* A's lease (1 s) lapsed: nobody renewed it */
    struct e2e_resp r;
    post(b->port, "/v1/pay/k", k, NULL, &r);
    cr_expect_eq(r.status, 200, "B takes the lapsed claim over and executes: %ld %.200s", r.status,
                 (const char *)r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k), 1);
    while (e2e_now_ms() < t0 + 3000)
        e2e_sleep_ms(20);
    resume_proc(a->proc.pid);
    e2e_http_join(queued, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "A's client, after A lost its lease");
    cr_expect(e2e_resp_header(&r, "Retry-After") != NULL, "503 with Retry-After");
    e2e_resp_free(&r);
    e2e_http_join(hold, &r);
    e2e_resp_free(&r);
    e2e_sleep_ms(500);
    cr_expect_eq(e2e_upstream_count(up, k), 1, "k executed once (A must not send after losing its lease)");
    cr_expect(e2e_gw_log_contains(a, "result=lease_lost"), "A logs that it did not send for its lost lease");
    post(b->port, "/v1/pay/k", k, NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "k replays B's answer: %ld", r.status);
    e2e_resp_free(&r);
}

/* The lease runs out only because Postgres, stopped, never confirmed a renewal: nobody took the claim over. The
 * request is not sent (503), and the claim, still this request's, is released (fenced by its token) once Postgres
 * answers: the retry executes once, never "outcome unknown" for a request that never left. */
Test(paused, a_lease_lost_to_a_stopped_postgres_releases_the_unsent_claim)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *a = gw_start(up, "10s", "      key: required\n      lease: 1s\n      on_unknown: reject\n", 0);
    char busy[96], k[96];
    e2e_mkkey(busy, sizeof busy, "pbusy");
    e2e_mkkey(k, sizeof k, "pgstop");
    const char *slow[] = {"X-Test-Delay-Ms: 4000", NULL};
    struct e2e_async *hold = post_async(a->port, "/v1/pay/busy", busy, slow);
    cr_assert_eq(e2e_upstream_wait_count(up, busy, 1, 3000), 1, "the busy request did not reach the upstream");
    struct e2e_async *queued = post_async(a->port, "/v1/pay/k", k, NULL);
    e2e_sleep_ms(300);
    cr_assert_eq(e2e_services("pg-stop"), 0);
    e2e_sleep_ms(2500);
    cr_assert_eq(e2e_services("pg-start"), 0);
    struct e2e_resp r;
    e2e_http_join(queued, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "the request whose lease ran out while Postgres was away");
    e2e_resp_free(&r);
    e2e_http_join(hold, &r);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k), 0, "nothing was sent");
    uint64_t deadline = e2e_now_ms() + 15000;
    long st = 0;
    bool replay = false;
    while (e2e_now_ms() < deadline) {
        post(a->port, "/v1/pay/k", k, NULL, &r);
        st = r.status;
        replay = e2e_resp_is_replay(&r);
        bool busy_answer = st == 503 || (st == 409 && e2e_resp_is_problem(&r, "idempotency-key-in-use"));
        if (!busy_answer)
            cr_log_info("last answer %ld %.200s", st, (const char *)r.body);
        e2e_resp_free(&r);
        if (!busy_answer)
            break;
        e2e_sleep_ms(200);
    }
    cr_expect(st == 200 && !replay, "the retry executes (never outcome-unknown for a request never sent): %ld", st);
    cr_expect_eq(e2e_upstream_count(up, k), 1, "exactly one execution");
}

/* ---- 2. the ordering guard: a higher sequence never overtakes a lower one in flight */

/* A takes the marker for seq 2, its request waits for the connection, A is paused 2.5 s (lease 1 s); B's seq 3
 * goes through the lapsed marker. A must not send seq 2 after it: the upstream would apply [1, 3, 2]. */
Test(paused, a_paused_marker_owner_never_sends_a_lower_sequence)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n      lease: 1s\n";
    struct e2e_gw *a = gw_start(up, "10s", idem, 0);
    struct e2e_gw *b = gw_start(up, "10s", idem, 0);
    char busy[96], k1[96], k2[96], k3[96], res[128];
    e2e_mkkey(busy, sizeof busy, "obusy");
    e2e_mkkey(k1, sizeof k1, "o1");
    e2e_mkkey(k2, sizeof k2, "o2");
    e2e_mkkey(k3, sizeof k3, "o3");
    snprintf(res, sizeof res, "/v1/acct/%s", k1);
    const char *s1[] = {"X-Sequence: 1", NULL}, *s2[] = {"X-Sequence: 2", NULL}, *s3[] = {"X-Sequence: 3", NULL};
    struct e2e_resp r;
    post(a->port, res, k1, s1, &r);
    cr_assert_eq(r.status, 200, "seq 1: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    const char *slow[] = {"X-Test-Delay-Ms: 4000", NULL};
    struct e2e_async *hold = post_async(a->port, "/v1/pay/busy", busy, slow);
    cr_assert_eq(e2e_upstream_wait_count(up, busy, 1, 3000), 1, "the busy request did not reach the upstream");
    struct e2e_async *queued = post_async(a->port, res, k2, s2);
    e2e_sleep_ms(300);
    uint64_t t0 = e2e_now_ms();
    pause_proc(a->proc.pid);
    e2e_sleep_ms(1500);
    post(b->port, res, k3, s3, &r);
    cr_expect_eq(r.status, 200, "seq 3 through the lapsed marker: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    while (e2e_now_ms() < t0 + 2500)
        e2e_sleep_ms(20);
    resume_proc(a->proc.pid);
    e2e_http_join(queued, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "seq 2's client, after A lost its marker");
    e2e_resp_free(&r);
    e2e_http_join(hold, &r);
    e2e_resp_free(&r);
    e2e_sleep_ms(300);
    cr_expect_eq(e2e_upstream_count(up, k2), 0, "seq 2 must never be sent after seq 3");
    cr_expect_eq(upstream_violations(up), 0, "sequences applied in order");
}

/* Keys k[0..2] for sequences 1..3 of one new resource (its path in res); seq 1 applied through gw. */
struct seq3 {
    char k[3][96];
    char res[128];
};
static void seq1_applied(const struct e2e_gw *gw, const char *tag, struct seq3 *q)
{
    for (int i = 0; i < 3; i++) {
        char t[32];
        snprintf(t, sizeof t, "%s%d", tag, i + 1);
        e2e_mkkey(q->k[i], sizeof q->k[i], t);
    }
    snprintf(q->res, sizeof q->res, "/v1/acct/%s", q->k[0]);
    const char *s1[] = {"X-Sequence: 1", NULL};
    struct e2e_resp r;
    post(gw->port, q->res, q->k[0], s1, &r);
    cr_assert_eq(r.status, 200, "seq 1: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
}

/* No pause: B's wall clock is 3 s ahead. A's seq 2 runs 2.5 s at an upstream that applies it when it finishes; B's
 * seq 3 must not be let through A's marker (it would be applied first: [1, 3, 2]). */
Test(paused, a_clock_ahead_never_lets_a_higher_sequence_overtake)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n      lease: 1s\n";
    struct e2e_gw *a = gw_start(up, "10s", idem, 0);
    struct e2e_gw *b = gw_start(up, "10s", idem, 3000);
    struct seq3 q;
    seq1_applied(a, "c", &q);
    const char *s2[] = {"X-Sequence: 2", "X-Test-Delay-Ms: 2500", "X-Test-Commit: end", NULL};
    const char *s3[] = {"X-Sequence: 3", NULL};
    struct e2e_resp r;
    struct e2e_async *two = post_async(a->port, q.res, q.k[1], s2);
    e2e_sleep_ms(700);
    post(b->port, q.res, q.k[2], s3, &r);
    long st3 = r.status;
    cr_expect(st3 == 409 && e2e_resp_is_problem(&r, "sequence-in-use"),
              "seq 3 while seq 2 is in flight: want 409 sequence-in-use, got %ld %.200s", st3, (const char *)r.body);
    e2e_resp_free(&r);
    e2e_http_join(two, &r);
    cr_expect_eq(r.status, 200, "seq 2: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(upstream_violations(up), 0, "sequences applied in order");
}

/* Postgres is stopped for 2.5 s (lease 1 s) while A's seq 2 runs at the upstream; the first request after it, seq 3
 * on the same gateway, must not win against A's next renewal: A holds the marker in this process. */
Test(paused, a_marker_held_in_this_process_survives_a_postgres_outage)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n      lease: 1s\n";
    struct e2e_gw *a = gw_start(up, "20s", idem, 0);
    struct seq3 q;
    seq1_applied(a, "p", &q);
    const char *s2[] = {"X-Sequence: 2", "X-Test-Delay-Ms: 6000", "X-Test-Commit: end", NULL};
    const char *s3[] = {"X-Sequence: 3", NULL};
    struct e2e_resp r;
    struct e2e_async *two = post_async(a->port, q.res, q.k[1], s2);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 2, 3000), 2, "seq 2 did not reach the upstream");
    cr_assert_eq(e2e_services("pg-stop"), 0);
    e2e_sleep_ms(2500);
    cr_assert_eq(e2e_services("pg-start"), 0);
    long st3 = 0;
    uint64_t deadline = e2e_now_ms() + 3000;
    do { /* the first request that Postgres answers after the outage */
        post(a->port, q.res, q.k[2], s3, &r);
        st3 = r.status;
        e2e_resp_free(&r);
    } while (st3 == 503 && e2e_now_ms() < deadline);
    cr_expect(st3 == 409, "seq 3 while seq 2 is in flight in this process: want 409, got %ld", st3);
    e2e_http_join(two, &r);
    e2e_resp_free(&r);
    cr_expect_eq(upstream_violations(up), 0, "sequences applied in order");
}

/* ---- 3. the probe waits for the original to be over */

/* The owner sends k to an upstream that takes 4 s and shows only committed work in its look-up, then is
 * SIGKILLed. A retry 1.5 s later (lease 1 s) must not probe yet (the look-up would say 404 and k would execute
 * twice): 409 idempotency-key-in-use with Retry-After, until the lapse + the upstream's timeout + probe.grace;
 * then the probe finds the original's answer, and k executed once. */
Test(paused, the_probe_waits_for_the_original_to_be_over)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n"
                       "      lease: 1s\n"
                       "      on_unknown: probe\n"
                       "      probe:\n"
                       "        path: /_lookup?idempotency_key={key}\n";
    struct e2e_gw *a = gw_start(up, "3s", idem, 0);
    struct e2e_gw *b = gw_start(up, "3s", idem, 0);
    char k[96];
    e2e_mkkey(k, sizeof k, "probewait");
    const char *slow[] = {"X-Test-Delay-Ms: 4000", "X-Test-Commit: end", NULL};
    struct e2e_async *orig = post_async(a->port, "/v1/pay/k", k, slow);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 1, 3000), 1, "the original did not reach the upstream");
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(a->proc.pid, SIGKILL), 0);
    /* reaped here, so that the teardown knows it died on purpose (under ASan a gateway that did not exit 0 at the
     * end fails the test) */
    cr_assert(e2e_proc_wait(&a->proc, 5000), "the gateway survived SIGKILL");
    struct e2e_resp r;
    e2e_http_join(orig, &r);
    e2e_resp_free(&r);
    while (e2e_now_ms() < t0 + 1500)
        e2e_sleep_ms(20);
    post(b->port, "/v1/pay/k", k, NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "a retry before the original can be over");
    cr_expect(e2e_resp_header(&r, "Retry-After") != NULL, "409 with Retry-After");
    e2e_resp_free(&r);
    e2e_sleep_ms(3500); /* the original commits at 4 s */
    cr_expect_eq(e2e_upstream_count(up, k), 1, "the original committed");
    uint64_t deadline = e2e_now_ms() + 20000;
    long st = 0;
    bool replay = false;
    while (e2e_now_ms() < deadline) {
        post(b->port, "/v1/pay/k", k, NULL, &r);
        st = r.status;
        replay = e2e_resp_is_replay(&r);
        e2e_resp_free(&r);
        if (st != 409)
            break;
        e2e_sleep_ms(250);
    }
    cr_expect(st == 200 && replay, "after the wait the probe finds the original's answer: %ld replay=%d", st, replay);
    cr_expect_eq(e2e_upstream_count(up, k), 1, "k executed exactly once");
}

/* ---- 5. claims in doubt under a clock behind */

/* The gateway's only server process is paused past the store timeout while it claims; the gateway's wall clock is
 * shift_ms off. The claim in doubt must be released only once that process is gone (never while it can still
 * commit), whatever the gateway's clock says: a retry then executes once. */
static void claim_in_doubt_with_clock(long shift_ms)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char *conf = NULL;
    cr_assert(asprintf(&conf, E2E_CONF_PORTS
                       "threads: 1\n"
                       "store:\n"
                       "  postgres: \"{{PG_URL}}\"\n"
                       "  redis: \"{{REDIS_URL}}\"\n"
                       "  pool: 1\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "20s") "routes:\n" E2E_CONF_ROUTE(
                           "pay", "/v1/pay", "api") "      key: required\n"
                                                    "      lease: 30s\n") > 0);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true, .env = e2e_clock_env(shift_ms)};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    free(conf);
    char key0[96], key[96];
    e2e_mkkey(key0, sizeof key0, "skew-warm");
    e2e_mkkey(key, sizeof key, "skew-doubt");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/d", key0, NULL, &r);
    cr_assert_eq(r.status, 200, "warm-up: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    char *s = e2e_psql("SELECT string_agg(pid::text, ',') FROM pg_stat_activity WHERE application_name = 'idemgate'"
                       " AND backend_type = 'client backend'");
    cr_assert(*s && strchr(s, ',') == NULL, "expected one gateway connection, got pids '%s'", s);
    pid_t backend = (pid_t)atoi(s);
    free(s);
    pause_proc(backend);
    post(gw->port, "/v1/pay/d", key, NULL, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "claim on a paused server process");
    e2e_resp_free(&r);
    cr_expect(e2e_gw_log_wait(gw, "event=claim_in_doubt ", 3000), "the claim in doubt is logged");
    e2e_sleep_ms(1000);
    cr_expect(!e2e_gw_log_contains(gw, "event=claim_in_doubt_released"),
              "released while the server process that may commit it is alive (paused)");
    resume_proc(backend);
    uint64_t deadline = e2e_now_ms() + 15000;
    long st = 0;
    while (e2e_now_ms() < deadline) {
        post(gw->port, "/v1/pay/d", key, NULL, &r);
        st = r.status;
        e2e_resp_free(&r);
        if (st != 503 && !(st == 409))
            break;
        e2e_sleep_ms(200);
    }
    cr_expect_eq(st, 200, "the retry after the pause must execute (last %ld)", st);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "exactly one execution");
}

Test(paused, a_claim_in_doubt_with_a_clock_5s_behind)
{
    claim_in_doubt_with_clock(-5000);
}

Test(paused, a_claim_in_doubt_with_a_clock_60s_behind)
{
    claim_in_doubt_with_clock(-60000);
}

/* ---- suspected: the in-process replay cache's expiry under skew */

/* B executes k (retention 3 s); A, whose cache has no k, replays it from Postgres and refills Redis with the
 * record's expiry; C, whose wall clock is 60 s behind, replays k from Redis and keeps it in its in-process replay
 * cache. That entry must end with the record (on Postgres's clock), not 60 s later: after retention k is new. */
Test(paused, a_replay_cache_filled_from_redis_ends_with_the_record_under_skew)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "      key: required\n      retention: 3s\n";
    struct e2e_gw *b = gw_start(up, "10s", idem, 0);
    struct e2e_gw *a = gw_start(up, "10s", idem, 0);
    struct e2e_gw *c = gw_start(up, "10s", idem, -60000);
    e2e_sleep_ms(1000); /* every gateway has read Postgres's clock */
    char k[96];
    e2e_mkkey(k, sizeof k, "skewcache");
    struct e2e_resp r;
    post(b->port, "/v1/pay/k", k, NULL, &r);
    cr_assert_eq(r.status, 200, "B executes: %ld", r.status);
    e2e_resp_free(&r);
    post(a->port, "/v1/pay/k", k, NULL, &r);
    cr_assert(r.status == 200 && e2e_resp_is_replay(&r), "A replays from Postgres: %ld", r.status);
    e2e_resp_free(&r);
    post(c->port, "/v1/pay/k", k, NULL, &r);
    cr_assert(r.status == 200 && e2e_resp_is_replay(&r), "C replays: %ld", r.status);
    e2e_resp_free(&r);
    e2e_sleep_ms(4000); /* past the retention (3 s) */
    post(c->port, "/v1/pay/k", k, NULL, &r);
    cr_expect(r.status == 200 && !e2e_resp_is_replay(&r),
              "after its retention the key is new at C (never replayed from C's cache): %ld replay=%d", r.status,
              e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, k), 2, "executed again after the retention");
}
