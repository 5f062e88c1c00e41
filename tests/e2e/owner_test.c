/* owner_test.c - end-to-end: a lease lapses only when its owner is gone (SPEC 8). Postgres stopped for longer than
 * the lease while the owner's request is upstream: on Postgres' return the record's lease has run out, and a retry
 * reaching the owner's own process (any of its loops) must be answered in flight, never take the key over
 * (on_unknown: retry) nor be told the outcome is unknown (reject); the owner's answer is stored and replayed. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static void owner_setup(void)
{
    e2e_setup();
    cr_assert_eq(e2e_services("pg-start"), 0, "Postgres could not be (re)started before the test");
}

static void owner_teardown(void)
{
    if (e2e_services("pg-start") != 0)
        fprintf(stderr, "owner_test: pg-start failed in .fini\n");
    e2e_teardown();
}

TestSuite(owner, .init = owner_setup, .fini = owner_teardown, .timeout = 120);

static struct e2e_gw *gw_start(const struct e2e_upstream *up, const char *on_unknown)
{
    char *conf = NULL;
    cr_assert(asprintf(&conf,
                       E2E_CONF_PORTS
                       "threads: 2\n"
                       "store:\n"
                       "  postgres: \"{{PG_URL}}\"\n"
                       "  redis: \"{{REDIS_URL}}\"\n"
                       "  pool: 4\n"
                       "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "20s") "routes:\n" E2E_CONF_ROUTE(
                           "pay", "/v1/pay", "api") "      key: required\n"
                                                    "      lease: 2s\n"
                                                    "      on_unknown: %s\n",
                       on_unknown) > 0);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    free(conf);
    return gw;
}

/* The owner's request takes 7 s upstream; Postgres is down from 0.5 s to 4.5 s (twice the lease). From the moment
 * Postgres answers again, retries arrive every 10 ms on fresh connections (spread over both loops). */
static void owner_outlives_its_lease(const char *on_unknown)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start(up, on_unknown);
    char key[96], kh[160];
    e2e_mkkey(key, sizeof key, "owner");
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *hh[] = {kh, "X-Test-Delay-Ms: 7000", NULL};
    struct e2e_req rq = {
        .method = "POST", .path = "/v1/pay/o", .headers = hh, .body = "{\"o\":1}", .body_len = 7, .timeout_ms = 30000};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the request did not reach the upstream");
    e2e_sleep_ms(500);
    cr_assert_eq(e2e_services("pg-stop"), 0, "pg-stop failed");
    e2e_sleep_ms(4000); /* the lease (2 s) and its last renewal have run out */
    cr_assert_eq(e2e_services("pg-start"), 0, "pg-start failed");
    const char *rh[] = {kh, NULL};
    struct e2e_req rr = {
        .method = "POST", .path = "/v1/pay/o", .headers = rh, .body = "{\"o\":1}", .body_len = 7, .timeout_ms = 10000};
    int in_use = 0, unavailable = 0, replays = 0, others = 0;
    uint64_t deadline = e2e_now_ms() + 12000;
    while (e2e_now_ms() < deadline) {
        struct e2e_resp r;
        e2e_http(gw->port, &rr, &r);
        if (r.status == 200 && e2e_resp_is_replay(&r)) {
            replays++;
            e2e_resp_free(&r);
            break;
        }
        if (r.status == 409 && e2e_resp_is_problem(&r, "idempotency-key-in-use"))
            in_use++;
        else if (r.status == 503)
            unavailable++;
        else {
            others++;
            cr_log_error("retry answered %ld%s", r.status,
                         r.status == 200 ? " (executed again: it took the key over)" : "");
        }
        e2e_resp_free(&r);
        e2e_sleep_ms(10);
    }
    struct e2e_resp orig;
    e2e_http_join(a, &orig);
    cr_log_info("retries: %d in use, %d unavailable, %d other; owner %ld", in_use, unavailable, others, orig.status);
    cr_expect_eq(orig.status, 200, "the owner's answer: %ld (%s)", orig.status, orig.error);
    cr_expect(!e2e_resp_is_replay(&orig));
    e2e_resp_free(&orig);
    cr_expect_eq(others, 0, "retries answered other than 409 in use, 503 or the replay");
    cr_expect_gt(in_use, 0, "the retries found the key in flight");
    cr_expect_eq(replays, 1, "the retry replays once the owner's answer is stored");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "one execution");
}

Test(owner, a_retry_never_takes_a_living_owners_key_over)
{
    owner_outlives_its_lease("retry");
}

Test(owner, a_living_owners_key_is_never_called_unknown)
{
    owner_outlives_its_lease("reject");
}
