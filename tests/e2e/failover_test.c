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

Test(failover, primary_crash_and_promotion_under_traffic)
{
    char *multi = fo_env("IDEMGATE_TEST_PG_MULTI_URL");
    char *redis = fo_env("IDEMGATE_TEST_REDIS_URL");
    cr_assert(multi != NULL && redis != NULL, "services.sh standby-start writes the multi-host URL");
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    const char *vars[] = {"FO_PG", multi, "FO_REDIS", redis, NULL};
    struct e2e_gw_opts o = {.up = up, .vars = vars, .wait_ready = true};
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
    free(multi);
    free(redis);
}
