/* syncrep_test.c - a synchronous standby that stops answering: the primary's commits wait for it (wait_event
 * SyncRep) and keep their locks, neither statement_timeout nor a closed socket ends that wait; the gateway's store
 * timeout must end it (a cancel request), or every timeout leaves one more server process holding locks and a
 * connection slot until Postgres refuses connections. A primary and a standby of the test's own. */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"

#define SR_KEYS      4     /* claims sent while the standby is down: each times out */
#define SR_POOL      2     /* the gateway's connections (one loop) */
#define SR_ORPHAN_MS 9000  /* a SyncRep wait older than this outlived the store timeout (5 s) by far */
#define SR_BACK_MS   30000 /* after the standby is back, a retry succeeds within this */
#define SR_REQ_MS    20000 /* per request */
#define SR_SQL_MS    20000 /* per psql */

static char svc_dir[PATH_MAX];
static char *admin_url;

static void sr_setup(void)
{
    e2e_setup();
    snprintf(svc_dir, sizeof svc_dir, "/tmp/idemgate-syncrep.XXXXXX");
    cr_assert(mkdtemp(svc_dir) != NULL, "mkdtemp: %s", strerror(errno));
    cr_assert(chmod(svc_dir, 0755) == 0);
    cr_assert_eq(e2e_services_in(svc_dir, "start", NULL), 0, "a primary and Redis of the test's own");
    cr_assert_eq(e2e_services_in(svc_dir, "standby-start", NULL), 0, "a synchronous streaming standby");
    admin_url = e2e_services_env(svc_dir, "IDEMGATE_TEST_PG_ADMIN_URL");
    cr_assert(admin_url != NULL);
}

static void sr_teardown(void)
{
    /* before e2e_teardown: services.sh runs through e2e_run, which needs the test's temp dir */
    if (svc_dir[0] != '\0') {
        (void)e2e_services_in(svc_dir, "stop", NULL);
        const char *argv[] = {"/bin/rm", "-rf", svc_dir, NULL};
        (void)e2e_run(argv, NULL, 30000, NULL, NULL);
        svc_dir[0] = '\0';
    }
    free(admin_url);
    admin_url = NULL;
    e2e_teardown();
}

TestSuite(syncrep, .init = sr_setup, .fini = sr_teardown, .timeout = 200);

/* One number from sql on the test's primary, as superuser. */
static long sr_sql_long(const char *sql)
{
    const char *const argv[] = {"/usr/bin/psql",   "-X", "-q",      "-A", "-t", "-v",
                                "ON_ERROR_STOP=1", "-d", admin_url, "-c", sql,  NULL};
    char *out = NULL, *err = NULL;
    int rc = e2e_run(argv, NULL, SR_SQL_MS, &out, &err);
    cr_assert_eq(rc, 0, "psql %s: %s", sql, err ? err : "");
    char *end = NULL;
    long v = strtol(out, &end, 10);
    cr_assert(end != out, "psql %s: not a number: '%s'", sql, out);
    free(out);
    free(err);
    return v;
}

static const char sr_conf[] = E2E_CONF_PORTS "threads: 1\n" E2E_CONF_OWN_PAY("{{SR_PG}}", "{{SR_REDIS}}", "2");

static long sr_post(uint16_t port, const char *key)
{
    struct e2e_resp r;
    e2e_http_key(port, "POST", "/v1/pay/charge", key, (const char *const[]){"Content-Type: application/json", NULL},
                 "{\"amount\":1}", SR_REQ_MS, &r);
    long st = r.status;
    e2e_resp_free(&r);
    return st;
}

static const char sr_orphans_sql[] = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate'"
                                     " AND wait_event = 'SyncRep' AND now() - query_start > interval '9 s'";
static const char sr_backends_sql[] = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate'";

/* The standby stops: every claim commit waits for it. Each claim times out (503, nothing forwarded); the gateway
 * cancels what it stopped waiting for, so no server process of its own waits for the standby much past the store
 * timeout and the gateway holds no more server processes than its pool. The standby back: every key's retry is
 * executed, once. */
Test(syncrep, standby_down_leaves_no_server_process_waiting)
{
    char *pg = e2e_services_env(svc_dir, "IDEMGATE_TEST_PG_URL");
    char *redis = e2e_services_env(svc_dir, "IDEMGATE_TEST_REDIS_URL");
    cr_assert(pg != NULL && redis != NULL);
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *vars[] = {"SR_PG", pg, "SR_REDIS", redis, NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .wait_ready = true};
    const struct e2e_gw *gw = e2e_gw_start(sr_conf, &o);

    char keys[SR_KEYS][96], first[96];
    e2e_mkkey(first, sizeof first, "sr-before");
    cr_assert_eq(sr_post(gw->port, first), 200, "with the standby up");

    cr_assert_eq(e2e_services_in(svc_dir, "standby-down", NULL), 0);
    uint64_t t0 = e2e_now_ms();
    for (unsigned i = 0; i < SR_KEYS; i++) {
        e2e_mkkey(keys[i], sizeof keys[i], "sr-down");
        long st = sr_post(gw->port, keys[i]);
        cr_assert_eq(st, 503, "a claim whose commit cannot be confirmed times out (503), got %ld", st);
        cr_assert_eq(e2e_upstream_count(up, keys[i]), 0, "nothing forwarded");
    }
    /* the last claim's wait is at least SR_ORPHAN_MS old by now, whoever cancelled it or not */
    while (e2e_now_ms() - t0 < (uint64_t)SR_KEYS * 5000 + SR_ORPHAN_MS)
        e2e_sleep_ms(200);
    long orphans = sr_sql_long(sr_orphans_sql), backends = sr_sql_long(sr_backends_sql);
    cr_expect_eq(orphans, 0, "server processes of the gateway still waiting for the standby long after it gave up: %ld",
                 orphans);
    cr_expect_leq(backends, SR_POOL + 1, "the gateway's server processes (pool %d): %ld", SR_POOL, backends);

    cr_assert_eq(e2e_services_in(svc_dir, "standby-up", NULL), 0);
    for (unsigned i = 0; i < SR_KEYS; i++) {
        long st = 0;
        uint64_t until = e2e_now_ms() + SR_BACK_MS;
        while ((st = sr_post(gw->port, keys[i])) != 200 && e2e_now_ms() < until)
            e2e_sleep_ms(300);
        cr_expect_eq(st, 200, "%s answered %ld after the standby came back", keys[i], st);
        cr_expect_eq(e2e_upstream_count(up, keys[i]), 1, "%s executed once", keys[i]);
    }
    free(pg);
    free(redis);
}
