/* pgfaults_test.c - end-to-end tests of the idempotency engine under Postgres faults: a claim that commits after
 * the gateway gave up (server process paused), a release or a completion that fails while Postgres restarts, a
 * COMMIT that fails, unknown outcomes past retention, /readyz over several loops, the failover warning. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

/* A test killed by its timeout never runs its .fini: every test starts with Postgres up and nothing paused. */
static void pgf_setup(void)
{
    e2e_setup();
    cr_assert_eq(e2e_services("pg-start"), 0, "Postgres could not be (re)started before the test");
    cr_assert_eq(e2e_services("redis-start"), 0, "Redis could not be (re)started before the test");
}

TestSuite(pgfaults, .init = pgf_setup, .fini = e2e_teardown, .timeout = 120);

static void restore_postgres(void)
{
    if (e2e_services("pg-start") != 0)
        fprintf(stderr, "pgfaults: pg-start failed in .fini\n");
}

/* ---- configuration */

/* A gateway with `threads` loops and a pool of `pool` connections in front of up; idem: the lines of pay's
 * idempotency block (unindented, each ending in \n). Waits until /readyz answers 200. */
static struct e2e_gw *gw_start(const struct e2e_upstream *up, int threads, int pool, const char *idem)
{
    char block[2048];
    size_t n = 0;
    for (const char *p = idem; *p;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        n += (size_t)snprintf(block + n, sizeof block - n, "      %.*s\n", (int)len, p);
        cr_assert(n < sizeof block);
        p = nl ? nl + 1 : p + len;
    }
    char *conf = NULL;
    cr_assert(asprintf(&conf,
                       E2E_CONF_PORTS
                       "threads: %d\n"
                       "store:\n"
                       "  postgres: \"{{PG_URL}}\"\n"
                       "  redis: \"{{REDIS_URL}}\"\n"
                       "  pool: %d\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}",
                                                        "20s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "%s",
                       threads, pool, block) > 0);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    free(conf);
    return gw;
}

/* POST path with the key, the body and one optional extra header line. */
static void post(uint16_t port, const char *path, const char *key, const char *body, const char *extra, long timeout_ms,
                 struct e2e_resp *r)
{
    const char *h[2] = {extra, NULL};
    e2e_http_key(port, "POST", path, key, extra ? h : NULL, body, timeout_ms, r);
}

/* Retries POST (every 200 ms, up to timeout_ms) while it answers 503 or 409 in-use; returns the last status. */
static long post_until_done(uint16_t port, const char *path, const char *key, const char *body, int timeout_ms,
                            bool *replayed)
{
    uint64_t deadline = e2e_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        struct e2e_resp r;
        post(port, path, key, body, NULL, 10000, &r);
        long st = r.status;
        bool busy = st == 503 || (st == 409 && e2e_resp_is_problem(&r, "idempotency-key-in-use"));
        if (!busy || e2e_now_ms() >= deadline) {
            if (replayed)
                *replayed = e2e_resp_is_replay(&r);
            if (st != 200)
                cr_log_warn("last answer %ld %.300s", st, (const char *)r.body);
            e2e_resp_free(&r);
            return st;
        }
        e2e_resp_free(&r);
        e2e_sleep_ms(200);
    }
}

static double metric(const struct e2e_gw *gw, const char *name)
{
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    static const char *const none[] = {NULL};
    double v = e2e_metric_value((const char *)r.body, name, none);
    e2e_resp_free(&r);
    return v;
}

/* ---- 2. claims in doubt */

static int paused_pid;

static void resume_paused(void)
{
    if (paused_pid > 0)
        (void)kill(paused_pid, SIGCONT);
    paused_pid = 0;
}

/* The server process of the gateway's only pool connection. */
static int gateway_backend_pid(void)
{
    char *s = e2e_psql("SELECT string_agg(pid::text, ',') FROM pg_stat_activity WHERE application_name = 'idemgate'"
                       " AND backend_type = 'client backend'");
    cr_assert(*s && strchr(s, ',') == NULL, "expected one gateway connection, got pids '%s'", s);
    int pid = atoi(s);
    free(s);
    cr_assert_gt(pid, 0);
    return pid;
}

/* The server process serving the gateway is paused past the store timeout: the client gets 503 and nothing is
 * forwarded; when it resumes it could still commit the claim under a token nobody owns (the key in flight, then
 * outcome unknown, forever). The gateway remembers the claim and releases it: a retry executes once. */
Test(pgfaults, a_claim_paused_past_the_store_timeout_is_released, .fini = resume_paused)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 1, 1, "key: required\nlease: 30s\non_unknown: reject\n");
    char key0[96], key[96];
    e2e_mkkey(key0, sizeof key0, "doubt-warm");
    e2e_mkkey(key, sizeof key, "doubt");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/d", key0, "{\"w\":1}", NULL, 10000, &r);
    cr_assert_eq(r.status, 200, "warm-up: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    paused_pid = gateway_backend_pid();
    cr_assert_eq(kill(paused_pid, SIGSTOP), 0);
    post(gw->port, "/v1/pay/d", key, "{\"d\":1}", NULL, 15000, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "claim on a paused server process");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 0, "nothing may be forwarded");
    cr_expect(e2e_gw_log_wait(gw, "event=claim_in_doubt ", 3000), "the claim in doubt is logged");
    cr_expect_eq(metric(gw, "idemgate_claims_in_doubt"), 1);
    e2e_sleep_ms(300);
    resume_paused();
    bool replayed = true;
    long st = post_until_done(gw->port, "/v1/pay/d", key, "{\"d\":1}", 15000, &replayed);
    cr_expect_eq(st, 200, "the retry after the pause must execute (last %ld)", st);
    cr_expect(!replayed, "the first success is the execution");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "exactly one execution");
    post(gw->port, "/v1/pay/d", key, "{\"d\":1}", NULL, 10000, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "then it replays (got %ld)", r.status);
    e2e_resp_free(&r);
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemgate_keys WHERE key = '%s' AND state <> 'completed'", key);
    cr_expect_eq(e2e_psql_long(sql), 0, "no row left in flight");
    cr_expect(e2e_gw_log_wait(gw, "event=claim_in_doubt_released", 5000), "the release is logged");
    cr_expect_eq(metric(gw, "idemgate_claims_in_doubt"), 0);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* ---- 3. a release that fails is retried */

/* The upstream answers a release status while Postgres is stopped; Postgres is back within the lease: the release
 * is retried, so the key is free and the retry executes (it was in flight, then unknown, before). */
Test(pgfaults, a_release_that_fails_is_retried, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 1, 2, "key: required\nlease: 15s\nrelease_statuses: [503]\n");
    char key[96];
    e2e_mkkey(key, sizeof key, "release");
    const char *h[] = {"X-Test-Status: 503", "X-Test-Delay-Ms: 2500", NULL};
    char kh[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *hh[] = {kh, h[0], h[1], NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay/r", .headers = hh, .body = "{\"r\":1}", .body_len = 7, .timeout_ms = 20000};
    uint64_t t0 = e2e_now_ms();
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request did not reach the upstream");
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    uint64_t el = e2e_now_ms() - t0;
    cr_assert_lt(el, 2500, "pg-stop took until the upstream answered (%llu ms)", (unsigned long long)el);
    e2e_sleep_ms((int)(3500 - el)); /* the upstream answered 503 at 2.5 s: the release failed at least once */
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 503, "the upstream's release status is the answer (got %ld %.200s)", r.status,
                 (const char *)r.body);
    cr_expect(!e2e_resp_is_problem(&r, "store-unavailable"), "the upstream's own answer, not a gateway problem");
    e2e_resp_free(&r);
    bool replayed = true;
    long st = post_until_done(gw->port, "/v1/pay/r", key, "{\"r\":1}", 10000, &replayed);
    cr_expect_eq(st, 200, "the retry after a release executes (last %ld)", st);
    cr_expect(!replayed);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "released once, executed again once");
}

/* ---- 6. the lease is renewed while the completion is retried */

/* An on_unknown: retry route with a 4 s lease; the upstream answers at 2 s while Postgres is stopped, Postgres is
 * back after the lease would have lapsed but before the completion gives up. Retries spinning from then on must
 * never take the key over from the owner that still retries: one execution, the retries replay. */
Test(pgfaults, the_lease_is_renewed_while_the_completion_is_retried, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 1, 2, "key: required\nlease: 4s\non_unknown: retry\n");
    char key[96];
    e2e_mkkey(key, sizeof key, "renew");
    char kh[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *hh[] = {kh, "X-Test-Delay-Ms: 2000", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay/l", .headers = hh, .body = "{\"l\":1}", .body_len = 7, .timeout_ms = 20000};
    uint64_t t0 = e2e_now_ms();
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request did not reach the upstream");
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    uint64_t el = e2e_now_ms() - t0;
    if (el < 4300)
        e2e_sleep_ms((int)(4300 - el)); /* past the lease of the claim (and of its last renewal before the stop) */
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    cr_log_info("Postgres back %llu ms after the claim", (unsigned long long)(e2e_now_ms() - t0));
    /* retries as fast as they go (the 503s of a reconnecting pool are quick), until the owner answered */
    const char *rh[] = {kh, NULL};
    struct e2e_req rr = {
        .method = "POST", .path = "/v1/pay/l", .headers = rh, .body = "{\"l\":1}", .body_len = 7, .timeout_ms = 10000};
    int replays = 0, others = 0;
    uint64_t deadline = e2e_now_ms() + 6000;
    while (e2e_now_ms() < deadline) {
        struct e2e_resp r;
        e2e_http(gw->port, &rr, &r);
        if (r.status == 200 && e2e_resp_is_replay(&r)) {
            replays++;
            e2e_resp_free(&r);
            break;
        }
        if (r.status == 200)
            cr_expect_fail("a concurrent retry was executed (took the owner's key over)");
        if (r.status != 503 && r.status != 409)
            others++;
        e2e_resp_free(&r);
        e2e_sleep_ms(20);
    }
    struct e2e_resp orig;
    e2e_http_join(a, &orig);
    cr_expect_eq(orig.status, 200, "the owner's answer: %ld (%s)", orig.status, orig.error);
    cr_expect(!e2e_resp_is_replay(&orig));
    e2e_resp_free(&orig);
    cr_expect_eq(others, 0, "answers other than 503, 409 or the replay");
    cr_expect_eq(replays, 1, "the retry replays once the owner's completion is stored");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "one execution");
}

/* SIGTERM while a completion is retried (Postgres stopped after the request was forwarded): when the grace ends
 * the client gets the upstream's answer (SPEC 4: the answer goes out even when the completion cannot be written)
 * and the process exits within the grace and a second. Before, the completion kept retrying for its lease, the
 * process left 7 s after the grace with _exit and the client got no answer at all. */
Test(pgfaults, a_completion_retried_at_shutdown_gives_the_answer_within_the_grace, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char *conf = NULL;
    cr_assert(asprintf(&conf, "listen: 127.0.0.1:{{LISTEN_PORT}}\n"
                              "admin:\n"
                              "  listen: 127.0.0.1:{{ADMIN_PORT}}\n"
                              "shutdown_grace: 2s\n" E2E_CONF_STORE("{{REDIS_URL}}") "upstreams:\n" E2E_CONF_UPSTREAM(
                                  "api", "{{UPSTREAM_URL}}",
                                  "20s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "      key: required\n"
                                                                                             "      lease: 30s\n") > 0);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    free(conf);
    char key[96], kh[160];
    e2e_mkkey(key, sizeof key, "stopcomplete");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *hh[] = {kh, "X-Test-Delay-Ms: 800", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay/s", .headers = hh, .body = "{\"s\":1}", .body_len = 7, .timeout_ms = 20000};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request did not reach the upstream");
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    uint64_t t0 = e2e_now_ms();
    cr_assert_eq(kill(gw->proc.pid, SIGTERM), 0);
    bool exited = e2e_proc_wait(&gw->proc, 15000);
    uint64_t took = e2e_now_ms() - t0;
    cr_expect(exited, "the gateway did not exit");
    cr_expect_leq(took, 3000, "the gateway exited %llu ms after SIGTERM (grace 2 s)", (unsigned long long)took);
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 200, "the client got the upstream's answer: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);
    cr_expect(e2e_gw_log_contains(gw, "event=completion_failed"), "the lost completion is logged");
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* ---- 5. /readyz tells the truth within a second, for every loop */

/* Two loops, no traffic (idle connections that have not noticed anything): after pg-stop, /readyz answers 503
 * within 1.5 s, ten times out of ten; after pg-start, 200 again. */
Test(pgfaults, readyz_covers_every_loop_within_a_second, .fini = restore_postgres, .timeout = 240)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 2, 4, "key: required\n");
    int in_time = 0;
    for (int i = 0; i < 10; i++) {
        cr_assert(e2e_gw_readyz_wait(gw, 200, 15000), "round %d: /readyz not 200 with Postgres up (last %ld)", i,
                  e2e_gw_readyz(gw));
        e2e_sleep_ms(400); /* every loop idle, probed */
        cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
        uint64_t t0 = e2e_now_ms();
        bool down = e2e_gw_readyz_wait(gw, 503, 1500);
        uint64_t took = e2e_now_ms() - t0;
        if (down)
            in_time++;
        else
            cr_log_error("round %d: /readyz still %ld %llu ms after pg-stop", i, e2e_gw_readyz(gw),
                         (unsigned long long)took);
        struct e2e_resp r;
        e2e_get(gw->admin_port, "/readyz", &r);
        if (r.status == 503)
            cr_expect(strstr((const char *)r.body, "\"postgres\":\"down\"") != NULL, "body: %.200s",
                      (const char *)r.body);
        e2e_resp_free(&r);
        cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    }
    cr_expect_eq(in_time, 10, "/readyz went 503 within 1.5 s of pg-stop in %d of 10 rounds", in_time);
    cr_expect(e2e_gw_readyz_wait(gw, 200, 15000), "/readyz 200 again after pg-start (last %ld)", e2e_gw_readyz(gw));
}

static int paused_pids[16];
static int npaused;

static void resume_all(void)
{
    for (int i = 0; i < npaused; i++)
        (void)kill(paused_pids[i], SIGCONT);
    npaused = 0;
}

/* The server processes of the gateway's connections are paused (a black-holed server: no FIN, no answer): within
 * 1.5 s /readyz says so, however idle the loops are; resumed, 200 again. */
Test(pgfaults, readyz_notices_a_server_that_stopped_answering, .fini = resume_all)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 2, 4, "key: required\n");
    cr_assert(e2e_gw_readyz_wait(gw, 200, 15000), "/readyz not 200 with Postgres up");
    e2e_sleep_ms(500);
    char *s = e2e_psql("SELECT string_agg(pid::text, ' ') FROM pg_stat_activity WHERE application_name = 'idemgate'"
                       " AND backend_type = 'client backend'");
    for (char *p = s; *p && npaused < 16;) {
        char *end = NULL;
        long pid = strtol(p, &end, 10);
        if (end == p)
            break;
        paused_pids[npaused++] = (int)pid;
        p = end;
    }
    free(s);
    cr_assert_geq(npaused, 2, "expected a connection per loop, got %d", npaused);
    for (int i = 0; i < npaused; i++)
        cr_assert_eq(kill(paused_pids[i], SIGSTOP), 0);
    uint64_t t0 = e2e_now_ms();
    cr_expect(e2e_gw_readyz_wait(gw, 503, 1500), "/readyz still %ld %llu ms after the server stopped answering",
              e2e_gw_readyz(gw), (unsigned long long)(e2e_now_ms() - t0));
    resume_all();
    cr_expect(e2e_gw_readyz_wait(gw, 200, 15000), "/readyz 200 again once it answers (last %ld)", e2e_gw_readyz(gw));
}

/* ---- 9. the failover readiness warning */

/* The test Postgres has no synchronous standby: a failover could lose acknowledged claims, and the gateway says so
 * at start (level=warn). */
Test(pgfaults, a_postgres_without_synchronous_standby_is_warned_about)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 1, 2, "key: required\n");
    cr_expect(e2e_gw_log_wait(gw, "event=failover_may_lose_claims", 5000), "no failover warning at start");
    char *log = e2e_gw_log(gw);
    const char *line = strstr(log, "event=failover_may_lose_claims");
    cr_expect(line != NULL);
    if (line) {
        const char *bol = line;
        while (bol > log && bol[-1] != '\n')
            bol--;
        cr_expect(strstr(bol, "level=warn") != NULL && strstr(bol, "level=warn") < line, "not a warn line: %.300s",
                  bol);
        cr_expect(strstr(line, "synchronous_standby_names=") != NULL, "%.300s", line);
    }
    free(log);
}

/* ---- 1. a COMMIT that fails is not a claim */

static char trigger_fn[64];

static void drop_commit_trigger(void)
{
    if (!trigger_fn[0])
        return;
    char sql[256];
    snprintf(sql, sizeof sql, "DROP TRIGGER IF EXISTS %s_t ON idemgate_keys; DROP FUNCTION IF EXISTS %s()", trigger_fn,
             trigger_fn);
    free(e2e_psql(sql));
    trigger_fn[0] = '\0';
}

/* A DEFERRABLE INITIALLY DEFERRED constraint trigger on the keys table refuses this test's keys at COMMIT: the
 * claim statement succeeds, its transaction does not. The claim is 503 and nothing is forwarded (it was forwarded,
 * its completion fenced out, and executed again once the marker expired); once the trigger is gone, one
 * execution. */
Test(pgfaults, a_claim_whose_commit_fails_forwards_nothing, .fini = drop_commit_trigger)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, 1, 2, "key: required\nlease: 2s\non_unknown: reject\n");
    char key[96];
    e2e_mkkey(key, sizeof key, "commitfail");
    snprintf(trigger_fn, sizeof trigger_fn, "pgf_commit_%ld", (long)getpid());
    char sql[1024];
    snprintf(sql, sizeof sql,
             "CREATE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN IF NEW.key = '%s' THEN"
             " RAISE EXCEPTION 'refused at commit'; END IF; RETURN NULL; END$$;"
             "CREATE CONSTRAINT TRIGGER %s_t AFTER INSERT OR UPDATE ON idemgate_keys DEFERRABLE INITIALLY DEFERRED"
             " FOR EACH ROW EXECUTE FUNCTION %s()",
             trigger_fn, key, trigger_fn, trigger_fn);
    free(e2e_psql(sql));
    for (int i = 0; i < 3; i++) {
        struct e2e_resp r;
        post(gw->port, "/v1/pay/c", key, "{\"c\":1}", NULL, 10000, &r);
        e2e_expect_problem(&r, 503, "store-unavailable", "a claim whose COMMIT fails");
        e2e_resp_free(&r);
        if (i == 1)
            e2e_sleep_ms(2200); /* past the lease a Redis marker could have had */
    }
    cr_expect_eq(e2e_upstream_count(up, key), 0, "a claim that did not commit must forward nothing");
    snprintf(sql, sizeof sql, "SELECT count(*) FROM idemgate_keys WHERE key = '%s'", key);
    cr_expect_eq(e2e_psql_long(sql), 0, "no record");
    drop_commit_trigger();
    bool replayed = true;
    long st = post_until_done(gw->port, "/v1/pay/c", key, "{\"c\":1}", 10000, &replayed);
    cr_expect_eq(st, 200, "without the trigger the key executes (last %ld)", st);
    cr_expect(!replayed);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "exactly one execution");
}
