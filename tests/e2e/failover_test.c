/* failover_test.c - a Postgres primary failover under traffic: a primary and a synchronous streaming standby of
 * the test's own (scripts/services.sh standby-start), the gateway on both hosts with
 * target_session_attrs=read-write, the primary stopped hard and the standby promoted mid-traffic. */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"

#define FO_PRE_KEYS      16    /* keys completed before the failover */
#define FO_THREADS       4     /* client threads during the failover */
#define FO_MAX_REQS      400   /* per thread */
#define FO_REQ_TIMEOUT   15000 /* per request: longer than the recovery may take */
#define FO_BACK_WITHIN   10000 /* a new key succeeds within this after the promotion */
#define FO_TRAFFIC_AFTER 3000  /* traffic goes on this long after the service is back */
#define FO_SVC_TIMEOUT   90000

static char svc_dir[PATH_MAX];

/* Runs scripts/services.sh CMD on the test's own services directory; its exit code. */
static int fo_services(const char *cmd, const char *arg)
{
    return e2e_services_in(svc_dir, cmd, arg);
}

/* NAME's value in the services' env file (quotes removed), heap; NULL when missing. */
static char *fo_env(const char *name)
{
    return e2e_services_env(svc_dir, name);
}

static void fo_setup(void)
{
    e2e_setup();
    snprintf(svc_dir, sizeof svc_dir, "/tmp/idemgate-failover.XXXXXX");
    cr_assert(mkdtemp(svc_dir) != NULL, "mkdtemp: %s", strerror(errno));
    cr_assert(chmod(svc_dir, 0755) == 0);
    cr_assert_eq(fo_services("start", NULL), 0, "a primary and Redis of the test's own");
    cr_assert_eq(fo_services("standby-start", NULL), 0, "a synchronous streaming standby");
}

static void fo_teardown(void)
{
    /* before e2e_teardown: services.sh runs through e2e_run, which needs the test's temp dir */
    if (svc_dir[0] != '\0') {
        (void)fo_services("stop", NULL);
        const char *argv[] = {"/bin/rm", "-rf", svc_dir, NULL};
        (void)e2e_run(argv, NULL, 30000, NULL, NULL);
        svc_dir[0] = '\0';
    }
    e2e_teardown();
}

TestSuite(failover, .init = fo_setup, .fini = fo_teardown, .timeout = 150);

/* The gateway on both hosts (libpq multi-host, read-write), its own Redis, one route that never re-executes. */
static const char fo_conf[] = E2E_CONF_PORTS E2E_CONF_OWN_PAY("{{FO_PG}}", "{{FO_REDIS}}", "4");

struct fo_req {
    char key[96];
    long status;
    int curl_code;
    bool replayed;
    bool store_unavailable;
    uint64_t t_begin, t_end;
};

struct fo_client {
    pthread_t th;
    unsigned id;
    uint16_t port;
    atomic_bool *stop;
    struct fo_req *reqs;
    size_t n;
};

static void fo_send(uint16_t port, const char *key, bool slow, long timeout_ms, struct fo_req *out)
{
    char kh[128], body[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    snprintf(body, sizeof body, "{\"key\":\"%s\"}", key);
    const char *h[] = {kh, "Content-Type: application/json", slow ? "X-Test-Delay-Ms: 800" : NULL, NULL};
    struct e2e_req rq = {.method = "POST",
                         .path = "/v1/pay/charge",
                         .headers = h,
                         .body = body,
                         .body_len = strlen(body),
                         .timeout_ms = timeout_ms};
    struct e2e_resp r;
    snprintf(out->key, sizeof out->key, "%s", key);
    out->t_begin = e2e_now_ms();
    e2e_http(port, &rq, &r);
    out->t_end = e2e_now_ms();
    out->status = r.status;
    out->curl_code = r.curl_code;
    out->replayed = e2e_resp_is_replay(&r);
    out->store_unavailable = r.status == 503 && e2e_resp_is_problem(&r, "store-unavailable");
    e2e_resp_free(&r);
}

static void *fo_client_main(void *arg)
{
    struct fo_client *c = arg;
    while (!atomic_load(c->stop) && c->n < FO_MAX_REQS) {
        struct fo_req *q = &c->reqs[c->n];
        char key[96];
        snprintf(key, sizeof key, "fo-%d-%u-%zu", (int)getpid(), c->id, c->n);
        fo_send(c->port, key, c->n % 4 == 0, FO_REQ_TIMEOUT, q); /* every 4th is in flight longer */
        c->n++;
        if (q->status == 503)
            e2e_sleep_ms(100);
    }
    return NULL;
}

/* A test's services: the multi-host URL and the Redis URL (heap; fo_rig_free) for fo_conf's placeholders, and an
 * upstream. */
struct fo_rig {
    char *multi, *redis;
    const char *vars[5];
    struct e2e_upstream *up;
};

static void fo_rig_start(struct fo_rig *rig)
{
    rig->multi = fo_env("IDEMGATE_TEST_PG_MULTI_URL");
    rig->redis = fo_env("IDEMGATE_TEST_REDIS_URL");
    cr_assert(rig->multi != NULL && rig->redis != NULL, "services.sh standby-start writes the multi-host URL");
    const char *v[] = {"FO_PG", rig->multi, "FO_REDIS", rig->redis, NULL};
    memcpy(rig->vars, v, sizeof v);
    rig->up = e2e_upstream_start(NULL);
}

static void fo_rig_free(struct fo_rig *rig)
{
    free(rig->multi);
    free(rig->redis);
}

Test(failover, primary_crash_and_promotion_under_traffic)
{
    struct fo_rig rig;
    fo_rig_start(&rig);
    struct e2e_upstream *up = rig.up;
    struct e2e_gw_opts o = {.up = up, .vars = rig.vars, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(fo_conf, &o);

    /* keys completed before the failover: their claims are on the standby too (synchronous commit) */
    struct fo_req pre[FO_PRE_KEYS];
    for (unsigned i = 0; i < FO_PRE_KEYS; i++) {
        char key[96];
        snprintf(key, sizeof key, "fo-pre-%d-%u", (int)getpid(), i);
        fo_send(gw->port, key, false, 5000, &pre[i]);
        cr_assert_eq(pre[i].status, 200, "before the failover: %s answered %ld", key, pre[i].status);
        cr_assert_eq(e2e_upstream_count(up, key), 1);
    }

    atomic_bool stop = false;
    struct fo_client cl[FO_THREADS];
    for (unsigned i = 0; i < FO_THREADS; i++) {
        cl[i] = (struct fo_client){.id = i, .port = gw->port, .stop = &stop};
        cl[i].reqs = calloc(FO_MAX_REQS, sizeof *cl[i].reqs);
        cr_assert(cl[i].reqs != NULL);
        cr_assert_eq(pthread_create(&cl[i].th, NULL, fo_client_main, &cl[i]), 0);
    }
    e2e_sleep_ms(1000);

    /* the failover: the primary stopped hard, the standby promoted */
    uint64_t t_crash = e2e_now_ms();
    int rc_stop = fo_services("pg-stop", "immediate");
    int rc_promote = fo_services("promote", NULL);
    uint64_t t_promoted = e2e_now_ms();

    /* service back: a new key executes within FO_BACK_WITHIN of the promotion */
    bool back = false;
    unsigned probes = 0;
    while (rc_promote == 0 && !back && e2e_now_ms() - t_promoted < FO_BACK_WITHIN) {
        char key[96];
        struct fo_req q;
        snprintf(key, sizeof key, "fo-back-%d-%u", (int)getpid(), probes++);
        fo_send(gw->port, key, false, 2000, &q);
        back = q.status == 200 && !q.replayed && e2e_upstream_count(up, key) == 1;
        if (!back)
            e2e_sleep_ms(200);
    }
    uint64_t t_back = e2e_now_ms();
    e2e_sleep_ms(back ? FO_TRAFFIC_AFTER : 0);
    atomic_store(&stop, true);
    for (unsigned i = 0; i < FO_THREADS; i++)
        pthread_join(cl[i].th, NULL);
    fprintf(stderr,
            "failover_test: primary stopped (rc %d) and standby promoted (rc %d) in %llu ms; a new key executed "
            "%llu ms after the promotion (%u probes)\n",
            rc_stop, rc_promote, (unsigned long long)(t_promoted - t_crash), (unsigned long long)(t_back - t_promoted),
            probes);
    cr_assert_eq(rc_stop, 0, "services.sh pg-stop immediate");
    cr_assert_eq(rc_promote, 0, "services.sh promote");
    e2e_gw_assert_alive(gw, "after the failover");
    if (!back)
        e2e_proc_dump_log(&gw->proc, 4000);
    cr_expect(back, "no new key executed within %d ms of the promotion (the pool did not reach the new primary)",
              FO_BACK_WITHIN);

    /* every request during the failover was answered (any status; 503 store-unavailable forwards nothing), and
     * no key executed twice */
    size_t total = 0, ok200 = 0, unavailable = 0, other = 0, unanswered = 0, dup = 0, across = 0;
    for (unsigned i = 0; i < FO_THREADS; i++)
        for (size_t j = 0; j < cl[i].n; j++) {
            const struct fo_req *q = &cl[i].reqs[j];
            long n = e2e_upstream_count(up, q->key);
            total++;
            across += q->t_begin <= t_crash && q->t_end >= t_crash;
            if (q->status == 0) {
                unanswered++;
                cr_expect_neq(q->status, 0, "%s got no answer (curl %d) within %d ms", q->key, q->curl_code,
                              FO_REQ_TIMEOUT);
            } else if (q->status == 200) {
                ok200++;
                cr_expect_eq(n, 1, "%s answered 200 but executed %ld times", q->key, n);
            } else if (q->store_unavailable) {
                unavailable++;
                cr_expect_eq(n, 0, "%s answered 503 store-unavailable but executed %ld times", q->key, n);
            } else {
                other++;
                fprintf(stderr, "failover_test: %s answered %ld\n", q->key, q->status);
            }
            if (n > 1) {
                dup++;
                cr_expect_leq(n, 1, "%s executed %ld times", q->key, n);
            }
        }
    fprintf(stderr,
            "failover_test: %zu requests during the failover: 200=%zu 503 store-unavailable=%zu other=%zu "
            "unanswered=%zu duplicate executions=%zu; %zu in flight at the crash\n",
            total, ok200, unavailable, other, unanswered, dup, across);
    cr_expect_gt(ok200, 0, "some requests succeeded around the failover");
    cr_expect_gt(across, 0, "no request was in flight when the primary stopped: the test proved nothing");

    /* keys claimed before the failover, and those answered 200 during it, are honoured on the new primary:
     * a replay or 409, never a second execution */
    for (unsigned i = 0; back && i < FO_PRE_KEYS; i++) {
        struct fo_req q;
        fo_send(gw->port, pre[i].key, false, 5000, &q);
        cr_expect((q.status == 200 && q.replayed) || q.status == 409,
                  "after the failover, %s (completed before it) answered %ld replayed=%d", pre[i].key, q.status,
                  q.replayed);
        cr_expect_eq(e2e_upstream_count(up, pre[i].key), 1, "%s executed again after the failover", pre[i].key);
    }
    for (unsigned i = 0; back && i < FO_THREADS; i++)
        for (size_t j = 0; j < cl[i].n; j++) {
            const struct fo_req *p = &cl[i].reqs[j];
            if (p->status != 200)
                continue;
            struct fo_req q;
            fo_send(gw->port, p->key, false, 5000, &q);
            cr_expect((q.status == 200 && q.replayed) || q.status == 409,
                      "after the failover, %s (200 at +%llu ms of the crash) answered %ld replayed=%d", p->key,
                      (unsigned long long)(p->t_end > t_crash ? p->t_end - t_crash : 0), q.status, q.replayed);
            cr_expect_eq(e2e_upstream_count(up, p->key), 1, "%s executed again after the failover", p->key);
        }
    for (unsigned i = 0; i < FO_THREADS; i++)
        free(cl[i].reqs);
    fo_rig_free(&rig);
}

/* The purge listener (store/notify.c) after a failover: it connects with store.postgres as the pool does
 * (target_session_attrs=read-write), and a standby refuses LISTEN, so once the old primary is gone it can only
 * listen on the new one. A purge answered after the promotion must reach the other instance's replay cache and
 * purge epoch: its replay of the purged key executes anew. */
static double fo_metric(const struct e2e_gw *g, const char *name)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    static const char *const none[] = {NULL};
    double v = r.status == 200 ? e2e_metric_value((const char *)r.body, name, none) : -1;
    e2e_resp_free(&r);
    return v;
}

static bool fo_online(const struct e2e_gw *g, int timeout_ms)
{
    for (uint64_t end = e2e_now_ms() + (uint64_t)timeout_ms; e2e_now_ms() < end; e2e_sleep_ms(50))
        if (fo_metric(g, "idemgate_replay_cache_online") == 1)
            return true;
    return false;
}

Test(failover, a_purge_after_the_failover_reaches_the_other_instances_cache)
{
    struct fo_rig rig;
    fo_rig_start(&rig);
    struct e2e_upstream *up = rig.up;
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=fo-admin-token", NULL};
    struct e2e_gw_opts o = {.up = up, .vars = rig.vars, .env = env, .wait_ready = true};
    struct e2e_gw *a = e2e_gw_start(fo_conf, &o), *b = e2e_gw_start(fo_conf, &o);
    cr_assert(fo_online(a, 10000) && fo_online(b, 10000), "the listeners never came up");
    char key[96];
    snprintf(key, sizeof key, "fo-purge-%d", (int)getpid());
    struct fo_req q;
    fo_send(a->port, key, false, 5000, &q);
    cr_assert_eq(q.status, 200);
    fo_send(b->port, key, false, 5000, &q);
    cr_assert(q.status == 200 && q.replayed, "b's replay: %ld", q.status);
    cr_assert_eq(fo_metric(b, "idemgate_replay_cache_entries"), 1, "b's cache does not hold the key");

    cr_assert_eq(fo_services("promote", NULL), 0, "services.sh promote (the primary stopped first)");
    cr_assert(fo_online(a, 15000) && fo_online(b, 15000), "a listener did not come back after the failover");
    char *port = fo_env("PG_PORT"), q_sql[256];
    cr_assert(port != NULL);
    snprintf(q_sql, sizeof q_sql,
             "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate-listen' AND"
             " inet_server_port() = %s",
             port);
    char *admin = fo_env("IDEMGATE_TEST_PG_ADMIN_URL");
    cr_assert(admin != NULL);
    char psql[512];
    const char *argv[] = {e2e_in_path("psql", psql, sizeof psql), "-X", "-At", "-d", admin, "-c", q_sql, NULL};
    char *out = NULL;
    cr_assert_eq(e2e_run(argv, NULL, 10000, &out, NULL), 0, "psql on the new primary");
    cr_expect_eq(strtol(out ? out : "0", NULL, 10), 2, "listeners on the new primary (port %s): %s", port, out);
    free(out);

    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=pay&key=%s", key);
    const char *const h[] = {"Authorization: Bearer fo-admin-token", NULL};
    struct e2e_resp r = {0};
    for (int i = 0; i < 20; i++) { /* the pool may still be reconnecting: 503 */
        e2e_resp_free(&r);
        e2e_http(a->admin_port, &(struct e2e_req){.method = "DELETE", .path = path, .headers = h}, &r);
        if (r.status == 200)
            break;
        e2e_sleep_ms(250);
    }
    cr_assert_eq(r.status, 200, "the purge after the failover: %ld", r.status);
    e2e_resp_free(&r);
    uint64_t end = e2e_now_ms() + 1000;
    while (fo_metric(b, "idemgate_replay_cache_entries") != 0 && e2e_now_ms() < end)
        e2e_sleep_ms(20);
    cr_expect_eq(fo_metric(b, "idemgate_replay_cache_entries"), 0, "b still holds the purged entry 1 s later");
    fo_send(b->port, key, false, 5000, &q);
    cr_expect(q.status == 200 && !q.replayed, "b after the purge: %ld%s", q.status, q.replayed ? " (replayed)" : "");
    cr_expect_eq(e2e_upstream_count(up, key), 2, "the purged key was not executed anew");
    free(port);
    free(admin);
    fo_rig_free(&rig);
}
