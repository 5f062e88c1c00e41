/* faults_test.c - end-to-end tests of the idempotency guarantees under faults: Redis flushed, stopped or absent,
 * Postgres stopped and restarted, the gateway killed mid-request, two instances racing on one key. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>

#include "harness.h"

/* A test killed by its timeout never runs its .fini: make sure every test starts with both services up. */
static void faults_setup(void)
{
    e2e_setup();
    cr_assert_eq(e2e_services("pg-start"), 0, "Postgres could not be (re)started before the test");
    cr_assert_eq(e2e_services("redis-start"), 0, "Redis could not be (re)started before the test");
}

TestSuite(faults, .init = faults_setup, .fini = e2e_teardown, .timeout = 60);

/* Test-level .fini runs before the suite's e2e_teardown. */
static void restore_redis(void)
{
    if (e2e_services("redis-start") != 0)
        fprintf(stderr, "faults: redis-start failed in .fini\n");
}

static void restore_postgres(void)
{
    if (e2e_services("pg-start") != 0)
        fprintf(stderr, "faults: pg-start failed in .fini\n");
}

/* ---- configuration */

/* Starts a gateway with e2e_conf_pay (idem: pay's idempotency block; redis: a template such as "{{REDIS_URL}}",
 * with a 50 ms Redis timeout; the upstream with a 10 s timeout) and waits until it is ready. */
static struct e2e_gw *gw_start(const struct e2e_upstream *up, const char *idem, const char *redis)
{
    struct e2e_pay_conf c = {.idem = idem, .timeout = "10s", .redis = redis, .redis_timeout = "50ms"};
    return e2e_gw_start_pay(up, &c, NULL);
}

/* ---- helpers */

/* Fills rq for a POST with the key (kh receives the header line; 160 bytes) and one optional extra header. */
static void mkreq(struct e2e_req *rq, const char **h, char *kh, const char *path, const char *key, const char *body,
                  const char *extra, long timeout_ms)
{
    snprintf(kh, 160, "Idempotency-Key: %s", key);
    h[0] = kh;
    h[1] = extra;
    h[2] = NULL;
    *rq = (struct e2e_req){
        .method = "POST", .path = path, .headers = h, .body = body, .body_len = strlen(body), .timeout_ms = timeout_ms};
}

/* Starts a POST with the key and one extra header (e.g. a delay) in the background, and waits (bounded) until the
 * upstream has counted it once: the request is then in flight there. */
static struct e2e_async *post_in_flight(const struct e2e_gw *gw, const struct e2e_upstream *up, const char *path,
                                        const char *key, const char *body, const char *extra)
{
    const char *h[3];
    char kh[160];
    struct e2e_req rq;
    mkreq(&rq, h, kh, path, key, body, extra, 8000);
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1,
                 "the first request did not reach the upstream within 3000 ms");
    return a;
}

static void post(uint16_t port, const char *path, const char *key, const char *body, const char *extra,
                 struct e2e_resp *r)
{
    const char *h[3];
    char kh[160];
    struct e2e_req rq;
    mkreq(&rq, h, kh, path, key, body, extra, 8000);
    e2e_http(port, &rq, r);
}

/* ---- Redis */

Test(faults, redis_flushed_mid_request_never_costs_a_second_execution, .fini = restore_redis)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\nlease: 10s\n", "{{REDIS_URL}}");
    char key[96];
    e2e_mkkey(key, sizeof key, "flush");
    struct e2e_async *a = post_in_flight(gw, up, "/v1/pay/flush", key, "{\"f\":1}", "X-Test-Delay-Ms: 1500");
    cr_assert_eq(e2e_services("redis-flush"), 0, "redis-flush failed");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/flush", key, "{\"f\":1}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry after Redis lost the in-flight marker");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "a flushed Redis must not cause a second execution");
    struct e2e_resp orig;
    e2e_http_join(a, &orig);
    cr_expect_eq(orig.status, 200, "first: %ld (%s)", orig.status, orig.error);
    cr_expect(!e2e_resp_is_replay(&orig));
    /* the answer is cached in Redis now; flush it: the replay must come from Postgres */
    cr_assert_eq(e2e_services("redis-flush"), 0, "redis-flush failed");
    post(gw->port, "/v1/pay/flush", key, "{\"f\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "replay after flush: %ld %.300s", r.status, (const char *)r.body);
    cr_expect(e2e_resp_is_replay(&r), "after a flush the retry replays from Postgres");
    cr_expect(r.body_len == orig.body_len && memcmp(r.body, orig.body, r.body_len) == 0, "replayed body differs");
    const char *e1 = e2e_resp_header(&orig, "X-Upstream-Exec"), *e2 = e2e_resp_header(&r, "X-Upstream-Exec");
    cr_expect(e1 && e2 && strcmp(e1, e2) == 0, "replay of another execution (%s vs %s)", e1 ? e1 : "-", e2 ? e2 : "-");
    e2e_resp_free(&r);
    e2e_resp_free(&orig);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

Test(faults, redis_stopped_still_deduplicates, .fini = restore_redis)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", "{{REDIS_URL}}");
    char key0[96];
    e2e_mkkey(key0, sizeof key0, "redis-before");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/r", key0, "{\"r\":0}", NULL, &r);
    cr_expect_eq(r.status, 200, "status %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    e2e_resp_free(&r);

    cr_assert_eq(e2e_services("redis-stop"), 0, "redis-stop failed");
    char key[96];
    e2e_mkkey(key, sizeof key, "redis-down");
    post(gw->port, "/v1/pay/r", key, "{\"r\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "with Redis down: %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/r", key, "{\"r\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "with Redis down the retry replays (got %ld %.200s)", r.status,
              (const char *)r.body);
    e2e_resp_free(&r);
    /* a record made while Redis was up replays too */
    post(gw->port, "/v1/pay/r", key0, "{\"r\":0}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "an older record replays with Redis down (got %ld)", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "Redis down: one execution for two requests");
    cr_expect_eq(e2e_upstream_count(up, key0), 1);

    cr_assert_eq(e2e_services("redis-start"), 0, "redis-start failed");
    post(gw->port, "/v1/pay/r", key, "{\"r\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "after Redis came back (empty) the retry replays (got %ld)",
              r.status);
    e2e_resp_free(&r);
    char key2[96];
    e2e_mkkey(key2, sizeof key2, "redis-back");
    post(gw->port, "/v1/pay/r", key2, "{\"r\":2}", NULL, &r);
    cr_expect(r.status == 200 && !e2e_resp_is_replay(&r), "a new key after Redis came back (got %ld)", r.status);
    e2e_resp_free(&r);
    e2e_sleep_ms(300); /* the reconnect may lag: both paths must be correct */
    post(gw->port, "/v1/pay/r", key2, "{\"r\":2}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "its retry replays (got %ld)", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    cr_expect_eq(e2e_upstream_count(up, key2), 1);
}

/* ---- Redis and Postgres asked at once (issue 14) */

/* A gateway on the test Postgres, the given Redis (a URL) with a 3 s redis_timeout, and the extra top-level
 * lines (e.g. "replay_cache: off\n"); route "pay" on /v1/pay, key required. */
static struct e2e_gw *gw_start_at_once(const struct e2e_upstream *up, const char *redis, const char *extra)
{
    const char *vars[] = {"RD", redis, "EXTRA", extra, NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .wait_ready = true};
    return e2e_gw_start(
        E2E_CONF_PORTS E2E_CONF_STORE(
            "{{RD}}") "  redis_timeout: 3s\n"
                      "{{EXTRA}}"
                      "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s") "routes:\n" E2E_CONF_ROUTE(
                          "pay", "/v1/pay", "api") "      key: "
                                                   "required\n",
        &o);
}

static double gw_metric(const struct e2e_gw *gw, const char *name, const char *const *labels)
{
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    double v = e2e_metric_value((const char *)r.body, name, labels);
    e2e_resp_free(&r);
    return v;
}

/* Redis paused after it answered (so the link is up): a new key's claim is decided by Postgres and forwarded
 * without waiting for Redis' reply. Before, the claim asked Redis first and went to Postgres only at
 * redis_timeout (3 s here). */
Test(faults, a_new_key_does_not_wait_for_a_paused_redis)
{
    char path[512];
    pid_t rpid = e2e_redis_unix_start(path, sizeof path);
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char url[600];
    snprintf(url, sizeof url, "unix://%s", path);
    struct e2e_gw *gw = gw_start_at_once(up, url, "");
    cr_assert(e2e_gw_log_wait(gw, "event=redis_up", 5000), "the gateway never connected to its Redis");
    char k0[96], key[96];
    e2e_mkkey(k0, sizeof k0, "rd-warm");
    e2e_mkkey(key, sizeof key, "rd-paused");
    struct e2e_resp r;
    post(gw->port, "/v1/pay", k0, "{\"w\":1}", NULL, &r);
    cr_expect_eq(r.status, 200, "with Redis up: %ld (%s)", r.status, r.error);
    e2e_resp_free(&r);

    cr_assert_eq(kill(rpid, SIGSTOP), 0);
    uint64_t t0 = e2e_now_ms();
    post(gw->port, "/v1/pay", key, "{\"p\":1}", NULL, &r);
    uint64_t took = e2e_now_ms() - t0;
    cr_expect_eq(r.status, 200, "Redis paused: %ld (%s) %.300s", r.status, r.error, (const char *)r.body);
    cr_expect(!e2e_resp_is_replay(&r));
    cr_expect_lt(took, 1500, "a new key waited %llu ms for a paused Redis (redis_timeout 3 s)",
                 (unsigned long long)took);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay", key, "{\"p\":1}", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "the retry while Redis is paused: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    kill(rpid, SIGCONT);
    e2e_gw_stop(gw, 5000);
    kill(rpid, SIGTERM);
    waitpid(rpid, NULL, 0);
}

/* Redis holds a completed answer for a record Postgres no longer has (a purge between the two, the race the
 * purge's compare-and-set narrows): the answer Redis holds is given at once, while the claim Postgres makes meanwhile
 * (here held back by a row lock until the row is deleted) is not used: it is released, fenced by its token, and the
 * key is free again; nothing is forwarded. */
Test(faults, a_claim_made_after_redis_answered_is_released)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_at_once(up, e2e_env("IDEMGATE_TEST_REDIS_URL"), "replay_cache: off\n");
    char key[96];
    e2e_mkkey(key, sizeof key, "rd-first");
    struct e2e_resp orig, r;
    post(gw->port, "/v1/pay", key, "{\"u\":1}", NULL, &orig);
    cr_assert_eq(orig.status, 200, "first: %ld (%s)", orig.status, orig.error);
    /* the retry replays from Postgres and refills Redis over the claim's marker (its SET NX and the EVAL) */
    const char *const rd[] = {"store", "redis", NULL};
    double before = gw_metric(gw, "idemgate_store_seconds_count", rd);
    post(gw->port, "/v1/pay", key, "{\"u\":1}", NULL, &r);
    cr_expect(e2e_resp_is_replay(&r), "the retry: %ld", r.status);
    e2e_resp_free(&r);
    for (uint64_t end = e2e_now_ms() + 3000;
         gw_metric(gw, "idemgate_store_seconds_count", rd) < before + 2 && e2e_now_ms() < end;)
        e2e_sleep_ms(20);
    cr_assert_geq(gw_metric(gw, "idemgate_store_seconds_count", rd), before + 2, "Redis was not refilled");

    /* a session locks the record, then deletes it after 3 s (long enough that a poll slowed by a busy machine, each
     * one a psql process, still sees it sleeping) */
    char sql[512];
    snprintf(sql, sizeof sql,
             "BEGIN; SELECT 1 FROM idemgate_keys WHERE key = '%s' FOR UPDATE; SELECT pg_sleep(3);"
             " DELETE FROM idemgate_keys WHERE key = '%s'; COMMIT;",
             key, key);
    const char *const argv[] = {"/usr/bin/psql",
                                "-X",
                                "-q",
                                "-v",
                                "ON_ERROR_STOP=1",
                                "-d",
                                e2e_env("IDEMGATE_TEST_PG_ADMIN_URL"),
                                "-c",
                                sql,
                                NULL};
    struct e2e_proc *locker = e2e_proc_start(argv, "psql locker");
    char q[256];
    snprintf(q, sizeof q,
             "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%%%s%%'"
             " AND pid <> pg_backend_pid()",
             key);
    uint64_t end = e2e_now_ms() + 10000;
    long sleeping = 0;
    while ((sleeping = e2e_psql_long(q)) == 0 && e2e_now_ms() < end && !e2e_proc_wait(locker, 0))
        e2e_sleep_ms(20);
    if (sleeping <= 0) {
        char *log = e2e_proc_log(locker);
        cr_log_error("psql locker (exit %d): %.2000s", e2e_proc_exit_code(locker), log ? log : "");
        free(log);
    }
    cr_assert(sleeping > 0, "the locking session never slept");

    uint64_t t0 = e2e_now_ms();
    post(gw->port, "/v1/pay", key, "{\"u\":1}", NULL, &r);
    uint64_t took = e2e_now_ms() - t0;
    cr_expect(e2e_resp_is_replay(&r), "Redis' answer: %ld (%s)", r.status, r.error);
    e2e_expect_same_answer(&orig, &r, "the answer Redis holds");
    cr_expect_lt(took, 800, "the answer waited %llu ms for the locked record", (unsigned long long)took);
    e2e_resp_free(&r);
    e2e_resp_free(&orig);

    cr_expect(e2e_proc_wait(locker, 10000), "the locking session did not end");
    cr_expect(e2e_gw_log_wait(gw, "event=claim_unused", 5000), "the claim Postgres made was not noticed");
    snprintf(q, sizeof q, "SELECT count(*) FROM idemgate_keys WHERE key = '%s'", key);
    end = e2e_now_ms() + 5000;
    while (e2e_psql_long(q) != 0 && e2e_now_ms() < end)
        e2e_sleep_ms(20);
    cr_expect_eq(e2e_psql_long(q), 0, "the unused claim was not released");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "nothing is forwarded for the unused claim");
    cr_expect_eq(gw_metric(gw, "idemgate_claims_in_doubt", (const char *const[]){NULL}), 0.0);
}

Test(faults, redis_on_a_dead_port_from_the_start)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", "redis://127.0.0.1:{{DEAD_PORT}}/0");
    char key[96];
    e2e_mkkey(key, sizeof key, "noredis");
    struct e2e_resp a, b;
    post(gw->port, "/v1/pay/d", key, "{\"d\":1}", NULL, &a);
    cr_expect_eq(a.status, 200, "Redis unreachable: %ld (%s) %.300s", a.status, a.error, (const char *)a.body);
    cr_expect(!e2e_resp_is_replay(&a));
    post(gw->port, "/v1/pay/d", key, "{\"d\":1}", NULL, &b);
    cr_expect(b.status == 200 && e2e_resp_is_replay(&b), "Redis unreachable: the retry replays (got %ld)", b.status);
    cr_expect(a.body_len == b.body_len && memcmp(a.body, b.body, a.body_len) == 0);
    e2e_resp_free(&a);
    e2e_resp_free(&b);
    post(gw->port, "/v1/pay/d", key, "{\"d\":2}", NULL, &a);
    e2e_expect_problem(&a, 422, "idempotency-key-mismatch", "Redis unreachable, other body");
    e2e_resp_free(&a);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    cr_expect(e2e_gw_readyz_wait(gw, 200, 5000), "/readyz must be 200 with Postgres up, whatever Redis does");
}

/* ---- Postgres */

Test(faults, postgres_down_is_503_and_forwards_nothing, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", "{{REDIS_URL}}");
    char key0[96];
    e2e_mkkey(key0, sizeof key0, "pg-before");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/p", key0, "{\"p\":0}", NULL, &r);
    cr_assert_eq(r.status, 200, "before: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    cr_assert(e2e_gw_readyz_wait(gw, 200, 5000), "/readyz must be 200 before the fault");
    long before = e2e_upstream_count(up, NULL);

    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    char key[96];
    e2e_mkkey(key, sizeof key, "pg-down");
    for (int i = 0; i < 3; i++) {
        post(gw->port, "/v1/pay/p", key, "{\"p\":1}", NULL, &r);
        e2e_expect_problem(&r, 503, "store-unavailable", "idempotent request with Postgres down");
        cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "503 store-unavailable must carry Retry-After");
        cr_expect(r.seconds < 5.0, "the 503 took %.2fs", r.seconds);
        e2e_resp_free(&r);
        e2e_gw_assert_alive(gw, "while Postgres was down");
    }
    cr_expect_eq(e2e_upstream_count(up, key), 0, "nothing may be forwarded while Postgres is down");
    cr_expect_eq(e2e_upstream_count(up, NULL), before, "nothing may be forwarded while Postgres is down");
    /* a request whose answer sits in Redis must not be forwarded either */
    post(gw->port, "/v1/pay/p", key0, "{\"p\":0}", NULL, &r);
    cr_expect(r.status == 503 || (r.status == 200 && e2e_resp_is_replay(&r)),
              "a completed key with Postgres down: 503 or a replay, got %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key0), 1);

    /* pass-through is not affected */
    struct e2e_req pq = {.method = "POST", .path = "/v1/pass/x", .body = "through", .body_len = 7, .timeout_ms = 5000};
    e2e_http(gw->port, &pq, &r);
    cr_expect_eq(r.status, 200, "a key: off route must work with Postgres down: %ld (%s) %.200s", r.status, r.error,
                 (const char *)r.body);
    cr_expect(r.body_len == 7 && memcmp(r.body, "through", 7) == 0);
    e2e_resp_free(&r);
    cr_expect(e2e_gw_readyz_wait(gw, 503, 5000), "/readyz must be 503 while Postgres is down (last %ld)",
              e2e_gw_readyz(gw));

    /* back up: within 20 s the same key executes, once */
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    uint64_t t0 = e2e_now_ms(), deadline = t0 + 20000;
    long status = 0;
    int tries = 0;
    for (;;) {
        post(gw->port, "/v1/pay/p", key, "{\"p\":1}", NULL, &r);
        status = r.status;
        tries++;
        bool replay = e2e_resp_is_replay(&r);
        e2e_resp_free(&r);
        if (status == 200) {
            cr_expect(!replay || tries > 1, "the first success must be the execution");
            break;
        }
        if (status != 503) {
            e2e_gw_assert_alive(gw, "while Postgres came back");
            cr_expect_fail("while Postgres comes back: 503 or 200 expected, got %ld", status);
            break;
        }
        if (e2e_now_ms() >= deadline)
            break;
        e2e_sleep_ms(200);
    }
    cr_expect_eq(status, 200, "requests must succeed again within 20 s of Postgres' restart (last %ld)", status);
    cr_log_info("recovered after %llu ms", (unsigned long long)(e2e_now_ms() - t0));
    cr_expect_eq(e2e_upstream_count(up, key), 1, "after the restart the key executes once");
    post(gw->port, "/v1/pay/p", key, "{\"p\":1}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "then it replays (got %ld)", r.status);
    e2e_resp_free(&r);
    post(gw->port, "/v1/pay/p", key0, "{\"p\":0}", NULL, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "the record made before the fault replays (got %ld)",
              r.status);
    e2e_resp_free(&r);
    cr_expect(e2e_gw_readyz_wait(gw, 200, 20000), "/readyz must be 200 again after Postgres' restart (last %ld)",
              e2e_gw_readyz(gw));
    cr_expect_eq(e2e_upstream_count(up, key), 1);
    cr_expect_eq(e2e_upstream_count(up, key0), 1);
}

/* Each I/O loop has a pool of its own, and each pool retries a lost Postgres after its own backoff (up to 2 s). Once
 * Postgres answers one loop again, a request that another loop takes must not be answered 503 while that loop's
 * pool still waits out its backoff: it connects at once. Four loops; Postgres down long enough that every pool
 * backs off to its longest wait; then, as soon as one request succeeds, 24 new keys on new connections (spread over
 * the loops by the kernel) all execute. */
Test(faults, postgres_back_serves_every_loop_at_once, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_at_once(up, e2e_env("IDEMGATE_TEST_REDIS_URL"), "threads: 4\n");
    char key[96];
    struct e2e_resp r;
    e2e_mkkey(key, sizeof key, "pg-loops-before");
    post(gw->port, "/v1/pay", key, "{}", NULL, &r);
    cr_assert_eq(r.status, 200, "before: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);

    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    /* 100 + 200 + 400 + 800 + 1600 ms: after 3.5 s every pool waits 2 s between attempts; requests meanwhile
     * (new connections, so every loop gets some) are 503 */
    for (uint64_t end = e2e_now_ms() + 3500; e2e_now_ms() < end;) {
        e2e_mkkey(key, sizeof key, "pg-loops-down");
        post(gw->port, "/v1/pay", key, "{}", NULL, &r);
        cr_expect_eq(r.status, 503, "with Postgres down: %ld", r.status);
        e2e_resp_free(&r);
        e2e_sleep_ms(100);
    }
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    long status = 0;
    for (uint64_t end = e2e_now_ms() + 20000; status != 200 && e2e_now_ms() < end;) {
        e2e_mkkey(key, sizeof key, "pg-loops-first");
        post(gw->port, "/v1/pay", key, "{}", NULL, &r);
        status = r.status;
        e2e_resp_free(&r);
        if (status != 200)
            e2e_sleep_ms(20);
    }
    cr_assert_eq(status, 200, "no request succeeded within 20 s of Postgres' restart (last %ld)", status);
    int ok = 0, n503 = 0;
    for (int i = 0; i < 24; i++) {
        e2e_mkkey(key, sizeof key, "pg-loops-after");
        post(gw->port, "/v1/pay", key, "{}", NULL, &r);
        if (r.status == 200)
            ok++;
        else if (r.status == 503)
            n503++;
        else
            cr_expect_fail("after Postgres came back: %ld %.200s", r.status, (const char *)r.body);
        e2e_resp_free(&r);
    }
    cr_expect_eq(ok, 24, "once one loop reached Postgres again, every request must: %d of 24 were 503", n503);
}

Test(faults, postgres_down_is_visible_in_metrics, .fini = restore_postgres)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, "key: required\n", "{{REDIS_URL}}");
    cr_assert(e2e_gw_readyz_wait(gw, 200, 5000), "/readyz must be 200 before the fault");
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    char key[96];
    e2e_mkkey(key, sizeof key, "pg-metrics");
    struct e2e_resp r;
    post(gw->port, "/v1/pay/m", key, "{}", NULL, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "Postgres down");
    e2e_resp_free(&r);
    e2e_gw_assert_alive(gw, "while Postgres was down");
    static const char *const none[] = {NULL};
    static const char *const pg[] = {"store=\"postgres\"", NULL};
    double up_v = -1, err_v = -1;
    uint64_t deadline = e2e_now_ms() + 5000;
    for (;;) {
        e2e_get(gw->admin_port, "/metrics", &r);
        cr_assert_eq(r.status, 200, "/metrics with Postgres down: %ld", r.status);
        up_v = e2e_metric_value((const char *)r.body, "idemgate_postgres_up", none);
        err_v = e2e_metric_value((const char *)r.body, "idemgate_store_errors_total", pg);
        bool seen = up_v == 0 || err_v >= 1;
        if (seen || e2e_now_ms() >= deadline) {
            if (!seen)
                cr_log_error("/metrics:\n%.4000s", (const char *)r.body);
            e2e_resp_free(&r);
            break;
        }
        e2e_resp_free(&r);
        e2e_sleep_ms(100);
    }
    cr_expect(up_v == 0 || err_v >= 1,
              "with Postgres down, /metrics must show idemgate_postgres_up 0 (got %g) or "
              "idemgate_store_errors_total{store=\"postgres\"} >= 1 (got %g)",
              up_v, err_v);
    cr_expect_eq(e2e_upstream_count(up, NULL), 0);
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    /* and it comes back in the metrics */
    deadline = e2e_now_ms() + 20000;
    for (;;) {
        e2e_get(gw->admin_port, "/metrics", &r);
        up_v = e2e_metric_value((const char *)r.body, "idemgate_postgres_up", none);
        e2e_resp_free(&r);
        if (up_v == 1 || e2e_now_ms() >= deadline)
            break;
        e2e_sleep_ms(200);
    }
    cr_expect(up_v == 1, "idemgate_postgres_up must be 1 again after the restart (got %g)", up_v);
}

/* ---- the gateway itself */

Test(faults, sigkill_mid_request_never_executes_twice)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "key: required\nlease: 2s\n";
    struct e2e_gw *gw = gw_start(up, idem, "{{REDIS_URL}}");
    char key[96];
    e2e_mkkey(key, sizeof key, "sigkill");
    struct e2e_async *a = post_in_flight(gw, up, "/v1/pay/kill", key, "{\"k\":1}", "X-Test-Delay-Ms: 3000");
    uint64_t t0 = e2e_now_ms(); /* the claim happened just before */
    cr_assert_eq(kill(gw->proc.pid, SIGKILL), 0);
    cr_assert(e2e_proc_wait(&gw->proc, 5000), "the gateway survived SIGKILL");
    struct e2e_resp r;
    e2e_http_join(a, &r);
    cr_expect_eq(r.status, 0, "the killed gateway cannot have answered (got %ld)", r.status);
    e2e_resp_free(&r);

    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=faults-admin", NULL};
    struct e2e_pay_conf pc = {.idem = idem, .timeout = "10s", .redis = "{{REDIS_URL}}", .redis_timeout = "50ms"};
    struct e2e_gw *gw2 = e2e_gw_start_pay(up, &pc, env);
    uint64_t since = e2e_now_ms() - t0;
    cr_log_info("restarted %llu ms after the kill", (unsigned long long)since);
    post(gw2->port, "/v1/pay/kill", key, "{\"k\":1}", NULL, &r);
    if (since < 1700) {
        e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry within the orphaned claim's lease");
        cr_expect_not_null(e2e_resp_header(&r, "Retry-After"));
    } else { /* the restart took most of the lease: it may have lapsed already */
        cr_log_warn("the restart took %llu ms of the 2 s lease", (unsigned long long)since);
        cr_expect(r.status == 409 && (e2e_resp_is_problem(&r, "idempotency-key-in-use") ||
                                      e2e_resp_is_problem(&r, "idempotency-outcome-unknown")),
                  "retry of an orphaned claim: 409 expected, got %ld %.300s", r.status, (const char *)r.body);
    }
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);

    /* after the lease and after the upstream finished the original call */
    uint64_t elapsed = e2e_now_ms() - t0;
    if (elapsed < 3300)
        e2e_sleep_ms((int)(3300 - elapsed));
    post(gw2->port, "/v1/pay/kill", key, "{\"k\":1}", NULL, &r);
    e2e_expect_problem(&r, 409, "idempotency-outcome-unknown",
                       "retry after the orphaned claim's lease (on_unknown reject)");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "a crash mid-request must never lead to a second execution");
    /* what /admin/keys says of it is what the retry was told: an unknown outcome (it said in_flight) */
    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=pay&key=%s", key);
    static const char *const ah[] = {"Authorization: Bearer faults-admin", NULL};
    struct e2e_req arq = {.method = "GET", .path = path, .headers = ah};
    e2e_http(gw2->admin_port, &arq, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(r.body && strstr((const char *)r.body, "\"state\":\"unknown\"") != NULL,
              "the orphan past its lease is listed as unknown: %s", r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
}

Test(faults, two_instances_forty_duplicates_execute_once)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *idem = "key: required\nlease: 10s\n";
    struct e2e_gw *g[2];
    g[0] = gw_start(up, idem, "{{REDIS_URL}}");
    g[1] = gw_start(up, idem, "{{REDIS_URL}}");
    enum { N = 40 };
    char key[96];
    e2e_mkkey(key, sizeof key, "twogw");
    const char *h[3];
    char kh[160];
    struct e2e_req rq;
    mkreq(&rq, h, kh, "/v1/pay/two", key, "{\"two\":1}", "X-Test-Delay-Ms: 500", 10000);
    struct e2e_async *as[N];
    for (int i = 0; i < N; i++)
        as[i] = e2e_http_async(g[i % 2]->port, &rq);
    int originals = 0, replays = 0, conflicts = 0, bad = 0;
    for (int i = 0; i < N; i++) {
        struct e2e_resp r;
        e2e_http_join(as[i], &r);
        if (r.status == 200 && !e2e_resp_is_replay(&r)) {
            originals++;
        } else if (r.status == 200) {
            replays++;
        } else if (r.status == 409 && e2e_resp_is_problem(&r, "idempotency-key-in-use") &&
                   e2e_resp_header(&r, "Retry-After") != NULL) {
            conflicts++;
        } else if (bad++ < 5) {
            cr_log_error("request %d (gateway %d): %ld (%s) %.200s", i, i % 2, r.status, r.error, (const char *)r.body);
        }
        e2e_resp_free(&r);
    }
    cr_expect_eq(originals, 1, "exactly one original answer over two instances, got %d (replays %d, 409 %d)", originals,
                 replays, conflicts);
    cr_expect_eq(bad, 0, "%d answers were neither the original, a replay nor 409 in-use", bad);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "40 duplicates over two instances must execute once");
    cr_expect_eq(e2e_upstream_count(up, NULL), 1);
    /* both instances replay it afterwards */
    for (int i = 0; i < 2; i++) {
        struct e2e_resp r;
        e2e_http(g[i]->port, &rq, &r);
        cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "gateway %d replays afterwards (got %ld)", i, r.status);
        e2e_resp_free(&r);
    }
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}
