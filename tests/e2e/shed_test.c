/* shed_test.c - the gateway under more new keys than its store can take: every request is answered, or shed with
 * 503 store-unavailable and Retry-After before it was claimed; no key is left claimed by a refused request. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(shed, .init = e2e_setup, .fini = e2e_teardown, .timeout = 180);

#define NREQ 240

/* A slow store: every claim statement costs 400 ms more (a statement-level trigger, so a batch pays once). */
static void slow_store(bool on)
{
    if (on)
        free(e2e_psql("CREATE OR REPLACE FUNCTION idg_test_slow() RETURNS trigger LANGUAGE plpgsql AS "
                      "$$ BEGIN PERFORM pg_sleep(0.4); RETURN NULL; END $$;"
                      "DROP TRIGGER IF EXISTS idg_test_slow ON idemgate_keys;"
                      "CREATE TRIGGER idg_test_slow BEFORE INSERT ON idemgate_keys "
                      "FOR EACH STATEMENT EXECUTE FUNCTION idg_test_slow()"));
    else
        free(
            e2e_psql("DROP TRIGGER IF EXISTS idg_test_slow ON idemgate_keys; DROP FUNCTION IF EXISTS idg_test_slow()"));
}

static void shed_teardown(void)
{
    slow_store(false);
}

/* One loop, one Postgres connection: the store takes far fewer keys per second than the load brings. */
static const char conf[] = E2E_CONF_PORTS
    "store:\n"
    "  postgres: \"{{PG_URL}}\"\n"
    "  pool: 1\n"
    "threads: 1\n"
    "upstreams:\n" E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}",
                                     "5s") "routes:\n" E2E_CONF_ROUTE("pay", "/v1/pay", "api") "      key: required\n"
                                                                                               "      lease: 20s\n";

Test(shed, overload_is_answered_or_shed_before_the_claim, .fini = shed_teardown)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(conf, &o);
    slow_store(true);

    static char keys[NREQ][96];
    static char hdrs[NREQ][128];
    static const char *lines[NREQ][2];
    static struct e2e_req rq[NREQ];
    static struct e2e_resp rs[NREQ];
    for (size_t i = 0; i < NREQ; i++) {
        e2e_mkkey(keys[i], sizeof keys[i], "shed");
        snprintf(hdrs[i], sizeof hdrs[i], "Idempotency-Key: %.95s", keys[i]);
        lines[i][0] = hdrs[i];
        lines[i][1] = NULL;
        rq[i] = (struct e2e_req){.method = "POST",
                                 .path = "/v1/pay/s",
                                 .headers = lines[i],
                                 .body = "{\"amount\":1}",
                                 .body_len = 12,
                                 .timeout_ms = 30000};
    }
    e2e_http_parallel(gw->port, rq, rs, NREQ);

    size_t ok = 0, shed = 0;
    for (size_t i = 0; i < NREQ; i++) {
        if (rs[i].status == 200) {
            ok++;
            continue;
        }
        cr_expect_eq(rs[i].status, 503, "request %zu: status %ld (%s) %.200s", i, rs[i].status, rs[i].error,
                     (const char *)rs[i].body);
        if (rs[i].status != 503)
            continue;
        shed++;
        cr_expect(e2e_resp_is_problem(&rs[i], "store-unavailable"), "a shed request says why: %.200s",
                  (const char *)rs[i].body);
        cr_expect(e2e_resp_header(&rs[i], "Retry-After") != NULL, "a shed request says when to retry");
        cr_expect_eq(e2e_upstream_count(up, keys[i]), 0, "a shed request was forwarded");
    }
    cr_log_info("%zu answered, %zu shed", ok, shed);
    cr_expect_gt(ok, 0, "the store still took some keys");
    slow_store(false);

    /* no refused request left its key claimed: each retry executes (once), each answered key replays */
    for (size_t i = 0; i < NREQ; i++) {
        struct e2e_resp r;
        uint64_t end = e2e_now_ms() + 15000;
        for (;;) {
            e2e_http(gw->port, &rq[i], &r);
            if (r.status != 409 || e2e_now_ms() >= end)
                break;
            e2e_resp_free(&r); /* a claim in doubt is released as soon as Postgres answers again */
            e2e_sleep_ms(100);
        }
        cr_expect_eq(r.status, 200, "retry of request %zu (first %ld): %ld %.200s", i, rs[i].status, r.status,
                     (const char *)r.body);
        if (rs[i].status == 200)
            cr_expect(e2e_resp_is_replay(&r), "an answered key replays");
        cr_expect_eq(e2e_upstream_count(up, keys[i]), 1, "key %zu executed %ld times", i,
                     e2e_upstream_count(up, keys[i]));
        e2e_resp_free(&r);
        e2e_resp_free(&rs[i]);
    }
    char *left = e2e_psql("SELECT count(*) FROM idemgate_keys WHERE key LIKE '%shed%' AND state <> 'completed'");
    cr_expect(strcmp(left, "0") == 0, "records left unsettled: %s", left);
    free(left);
}
