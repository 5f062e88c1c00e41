/* citus_haproxy_test.c - the gateway on a Citus cluster (run with IDEMGATE_TEST_ENGINE=citus): it distributes its
 * tables itself, refuses to serve distributed tables with the plain statements (/readyz 503), and three gateways
 * behind HAProxy execute each key once under concurrent duplicates spread over all three. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define HAPROXY "/usr/sbin/haproxy"
#define PSQL    "/usr/bin/psql"

static void citus_setup(void)
{
    e2e_setup();
    cr_assert(e2e_engine_citus(), "citus_haproxy_test runs against the Citus cluster: IDEMGATE_TEST_ENGINE=citus");
}

TestSuite(citus, .init = citus_setup, .fini = e2e_teardown, .timeout = 90);

/* One value (psql -At) of sql on the cluster's coordinator, as the superuser (heap). */
static char *coordinator_query(const char *sql)
{
    const char *argv[] = {PSQL, "-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", e2e_env("IDEMGATE_TEST_PG_ADMIN_URL"),
                          "-c", sql,  NULL};
    char *out = NULL, *err = NULL;
    int rc = e2e_run(argv, NULL, 20000, &out, &err);
    cr_assert_eq(rc, 0, "psql failed (%d): %s", rc, err ? err : "?");
    free(err);
    return out;
}

static void post_req(struct e2e_req *rq, const char **h, char *kh, size_t khn, const char *key, const char *extra)
{
    int w = snprintf(kh, khn, "Idempotency-Key: %s", key);
    cr_assert(w > 0 && (size_t)w < khn, "key too long");
    h[0] = kh;
    h[1] = extra;
    h[2] = NULL;
    *rq = (struct e2e_req){
        .method = "POST", .path = "/v1/pay/c", .headers = h, .body = "{\"c\":1}", .body_len = 7, .timeout_ms = 15000};
}

Test(citus, the_gateway_distributes_its_tables_by_their_key_columns)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const struct e2e_pay_conf pc = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    char *dist = coordinator_query("SELECT string_agg(logicalrelid::text || '=' || column_to_column_name(logicalrelid,"
                                   " partkey), ',' ORDER BY logicalrelid::text) FROM pg_dist_partition"
                                   " WHERE logicalrelid::text LIKE 'idemgate_%'");
    cr_expect_str_eq(dist, "idemgate_keys=key,idemgate_order=resource\n");
    free(dist);
    cr_expect(e2e_gw_log_contains(gw, "event=citus_ready"), "the start logs that the tables are distributed");
    /* a claim is routed and replayed */
    char key[96], kh[160];
    const char *h[3];
    struct e2e_req rq;
    e2e_mkkey(key, sizeof key, "cdist");
    post_req(&rq, h, kh, sizeof kh, key, NULL);
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    cr_expect_eq(r.status, 200, "claim on Citus: %ld %.200s", r.status, (const char *)r.body);
    e2e_resp_free(&r);
    e2e_http(gw->port, &rq, &r);
    cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "replay on Citus: %ld", r.status);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* store.distributed: none on tables Citus distributes: the plain statements are not the ones that run there, so
 * the schema is refused with the setting to use, /readyz stays 503 and nothing is forwarded. */
Test(citus, plain_statements_on_distributed_tables_are_refused_and_not_ready)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const struct e2e_pay_conf pc = {.idem = "key: required\n"};
    struct e2e_gw *first = e2e_gw_start_pay(up, &pc, NULL); /* distributes the tables */
    e2e_gw_stop(first, 5000);
    char *tmpl = e2e_conf_pay(&pc);
    static const char *const env[] = {"IDEMGATE_STORE_DISTRIBUTED=none", NULL};
    struct e2e_gw_opts o = {.up = up, .env = env};
    struct e2e_gw *gw = e2e_gw_start(tmpl, &o);
    free(tmpl);
    cr_expect(e2e_gw_log_wait(gw, "is a Citus table: set store.distributed: citus", 10000),
              "the refusal names the setting");
    cr_expect_eq(e2e_gw_readyz(gw), 503, "not ready while its statements cannot run");
    char key[96], kh[160];
    const char *h[3];
    struct e2e_req rq;
    e2e_mkkey(key, sizeof key, "cplain");
    post_req(&rq, h, kh, sizeof kh, key, NULL);
    struct e2e_resp r;
    e2e_http(gw->port, &rq, &r);
    e2e_expect_problem(&r, 503, "store-unavailable", "a keyed request while the schema is refused");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 0, "nothing forwarded");
    e2e_sleep_ms(1500);
    cr_expect_eq(e2e_gw_readyz(gw), 503, "still not ready");
}

/* Requests counted by one gateway (idemgate_requests_total, all labels), read from its admin /metrics. */
static double gw_requests(const struct e2e_gw *gw)
{
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    double sum = 0;
    const char *p = (const char *)r.body;
    while ((p = strstr(p, "\nidemgate_requests_total")) != NULL) {
        p++;
        const char *sp = strchr(p, ' ');
        if (sp)
            sum += strtod(sp + 1, NULL);
    }
    e2e_resp_free(&r);
    return sum;
}

Test(citus, three_gateways_behind_haproxy_execute_each_key_once)
{
    cr_assert(access(HAPROXY, X_OK) == 0, HAPROXY " missing: run scripts/deps.sh (package haproxy)");
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const struct e2e_pay_conf pc = {.idem = "key: required\nlease: 20s\n"};
    struct e2e_gw *g[3];
    for (int i = 0; i < 3; i++)
        g[i] = e2e_gw_start_pay(up, &pc, NULL);
    uint16_t port = e2e_free_port();
    char cfg[2048];
    int n = snprintf(cfg, sizeof cfg,
                     "global\n  maxconn 512\ndefaults\n  mode http\n  timeout connect 2s\n  timeout client 20s\n"
                     "  timeout server 20s\n  retries 0\n"
                     "frontend f\n  bind 127.0.0.1:%u\n  default_backend gws\n"
                     "backend gws\n  balance roundrobin\n  http-reuse never\n"
                     "  server g0 127.0.0.1:%u\n  server g1 127.0.0.1:%u\n  server g2 127.0.0.1:%u\n",
                     (unsigned)port, (unsigned)g[0]->port, (unsigned)g[1]->port, (unsigned)g[2]->port);
    cr_assert(n > 0 && (size_t)n < sizeof cfg);
    const char *path = e2e_write_file("haproxy.cfg", cfg);
    const char *argv[] = {HAPROXY, "-db", "-f", path, NULL};
    struct e2e_proc *hp = e2e_proc_start(argv, "haproxy");
    /* bounded wait until it forwards */
    uint64_t deadline = e2e_now_ms() + 10000;
    for (;;) {
        struct e2e_resp r;
        struct e2e_req rq = {.path = "/v1/pass/up", .timeout_ms = 1000};
        e2e_http(port, &rq, &r);
        long st = r.status;
        e2e_resp_free(&r);
        if (st == 200)
            break;
        if (e2e_now_ms() > deadline) {
            e2e_proc_dump_log(hp, 4000);
            cr_assert_fail("haproxy on 127.0.0.1:%u did not forward within 10 s (last status %ld)", (unsigned)port, st);
        }
        e2e_sleep_ms(100);
    }
    double before[3];
    for (int i = 0; i < 3; i++)
        before[i] = gw_requests(g[i]);

    enum { KEYS = 8, DUPS = 9, N = KEYS * DUPS };
    char keys[KEYS][96], kh[KEYS][160];
    const char *h[KEYS][3];
    struct e2e_req rq[KEYS];
    for (int k = 0; k < KEYS; k++) {
        e2e_mkkey(keys[k], sizeof keys[k], "hap");
        post_req(&rq[k], h[k], kh[k], sizeof kh[k], keys[k], "X-Test-Delay-Ms: 400");
    }
    struct e2e_async *as[N];
    for (int i = 0; i < N; i++)
        as[i] = e2e_http_async(port, &rq[i % KEYS]);
    int originals[KEYS] = {0}, bad = 0;
    for (int i = 0; i < N; i++) {
        struct e2e_resp r;
        e2e_http_join(as[i], &r);
        if (r.status == 200 && !e2e_resp_is_replay(&r))
            originals[i % KEYS]++;
        else if (!(r.status == 200 || (r.status == 409 && e2e_resp_is_problem(&r, "idempotency-key-in-use"))) &&
                 bad++ < 5)
            cr_log_error("request %d: %ld (%s) %.200s", i, r.status, r.error, (const char *)r.body);
        e2e_resp_free(&r);
    }
    cr_expect_eq(bad, 0, "%d answers were neither the original, a replay nor 409 in-use", bad);
    for (int k = 0; k < KEYS; k++) {
        cr_expect_eq(originals[k], 1, "key %d: one original answer, got %d", k, originals[k]);
        cr_expect_eq(e2e_upstream_count(up, keys[k]), 1, "key %d executed %ld times over three gateways", k,
                     e2e_upstream_count(up, keys[k]));
    }
    /* the duplicates were spread over all three */
    for (int i = 0; i < 3; i++) {
        double got = gw_requests(g[i]) - before[i];
        cr_expect(got >= N / 6, "gateway %d served %.0f of the %d requests (round robin: about a third)", i, got, N);
    }
    /* every gateway replays every key afterwards */
    for (int i = 0; i < 3; i++) {
        for (int k = 0; k < KEYS; k++) {
            struct e2e_resp r;
            e2e_http(g[i]->port, &rq[k], &r);
            cr_expect(r.status == 200 && e2e_resp_is_replay(&r), "gateway %d replays key %d (got %ld)", i, k, r.status);
            e2e_resp_free(&r);
        }
    }
    for (int k = 0; k < KEYS; k++)
        cr_expect_eq(e2e_upstream_count(up, keys[k]), 1);
}

/* The cleaner on Citus (no ctid there): expired completed records go in bounded batches by primary key, unsettled
 * and unexpired ones stay. */
Test(citus, the_cleaner_deletes_expired_records_on_every_shard)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const struct e2e_pay_conf pc = {.idem = "key: required\n"};
    struct e2e_gw *first = e2e_gw_start_pay(up, &pc, NULL); /* distributes the tables */
    e2e_gw_stop(first, 5000);
    char tag[64];
    e2e_mkkey(tag, sizeof tag, "clean");
    char sql[1024];
    snprintf(sql, sizeof sql,
             "INSERT INTO idemgate_keys (route, scope, key, fingerprint, state, token, lease_until, created_at,"
             " expires_at, status) SELECT 'pay', '\\x00'::bytea, '%s-' || i || '-' || s, '\\x00'::bytea,"
             " CASE s WHEN 'old' THEN 'completed' WHEN 'stuck' THEN 'unknown' ELSE 'completed' END, i,"
             " now() - interval '1 hour', now() - interval '2 hours',"
             " CASE s WHEN 'new' THEN now() + interval '1 hour' ELSE now() - interval '1 hour' END, 200"
             " FROM generate_series(1, 1500) i, unnest(ARRAY['old', 'stuck', 'new']) s",
             tag);
    free(coordinator_query(sql));
    struct e2e_gw *gw = e2e_gw_start_pay(up, &pc, NULL);
    snprintf(sql, sizeof sql,
             "SELECT count(*) FILTER (WHERE key LIKE '%%-old') || ',' || count(*) FILTER (WHERE key LIKE '%%-stuck')"
             " || ',' || count(*) FILTER (WHERE key LIKE '%%-new') FROM idemgate_keys WHERE key LIKE '%s-%%'",
             tag);
    char *left = NULL;
    uint64_t deadline = e2e_now_ms() + 20000;
    for (;;) {
        free(left);
        left = coordinator_query(sql);
        if (strcmp(left, "0,1500,1500\n") == 0 || e2e_now_ms() > deadline)
            break;
        e2e_sleep_ms(300);
    }
    cr_expect_str_eq(left, "0,1500,1500\n", "expired,unknown,unexpired left after the cleaner (want 0,1500,1500)");
    free(left);
    e2e_gw_assert_alive(gw, "after cleaning");
    cr_expect_not(e2e_gw_log_contains(gw, "op=clean"), "the cleaner ran without an error");
}
