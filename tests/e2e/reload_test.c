/* reload_test.c - SIGHUP reload (SPEC 10) on the real gateway, Postgres, Redis and two test upstreams: a bounded
 * keep-alive load across 20 reloads (two valid files and a broken one), a request in flight across a reload, a
 * replay after a reload, and a refused store change. */
#include <criterion/criterion.h>
#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/e2e/harness.h"

TestSuite(reload, .init = e2e_setup, .fini = e2e_teardown, .timeout = 180);

/* A: /v1/x goes to upstream one (base path /a); no /v1/b route. B: a route only B has comes first (route indices
 * shift), and /v1/x goes to upstream two (base path /b). Every answer's X-Echo-Uri says which config served it. */
/* clang-format off */
#define CONF_PORTS_STORE(pool)                                                                                         \
    "listen: 127.0.0.1:{{LISTEN_PORT}}\n"                                                                              \
    "admin:\n"                                                                                                         \
    "  listen: 127.0.0.1:{{ADMIN_PORT}}\n"                                                                             \
    "shutdown_grace: 5s\n"                                                                                             \
    "store:\n"                                                                                                         \
    "  postgres: \"{{PG_URL}}\"\n"                                                                                     \
    "  pool: " pool "\n"                                                                                               \
    "  redis: \"{{REDIS_URL}}\"\n"

static const char *const conf_a =
    CONF_PORTS_STORE("4")
    "upstreams:\n"
    E2E_CONF_UPSTREAM("one", "{{U1}}/a", "10s")
    "routes:\n"
    E2E_CONF_ROUTE("x", "/v1/x", "one")
    "      key: optional\n";

static const char *const conf_b =
    CONF_PORTS_STORE("4")
    "upstreams:\n"
    E2E_CONF_UPSTREAM("one", "{{U1}}/a", "10s")
    E2E_CONF_UPSTREAM("two", "{{U2}}/b", "10s")
    "routes:\n"
    E2E_CONF_ROUTE("only_b", "/v1/b", "two")
    "      key: optional\n"
    E2E_CONF_ROUTE("x", "/v1/x", "two")
    "      key: optional\n";

/* A with a bad size on line 21 (the max_body of route x). */
static const char *const conf_broken =
    CONF_PORTS_STORE("4")
    "upstreams:\n"
    E2E_CONF_UPSTREAM("one", "{{U1}}/a", "10s")
    "routes:\n"
    E2E_CONF_ROUTE("x", "/v1/x", "one")
    "      key: optional\n"
    "      max_body: lots\n";

/* B's routing with another pool size: refused (needs a restart), so none of it applies. */
static const char *const conf_b_pool =
    CONF_PORTS_STORE("3")
    "upstreams:\n"
    E2E_CONF_UPSTREAM("one", "{{U1}}/a", "10s")
    E2E_CONF_UPSTREAM("two", "{{U2}}/b", "10s")
    "routes:\n"
    E2E_CONF_ROUTE("only_b", "/v1/b", "two")
    "      key: optional\n"
    E2E_CONF_ROUTE("x", "/v1/x", "two")
    "      key: optional\n";
/* clang-format on */

struct rig {
    struct e2e_upstream *u1, *u2;
    struct e2e_gw *gw;
    char lp[8], ap[8];
    const char *vars[9];
};

static void rig_start_with(struct rig *r, const char *tmpl);

static void rig_start(struct rig *r)
{
    rig_start_with(r, conf_a);
}

/* Starts both upstreams and a gateway on tmpl (which may use {{U1}} and {{U2}}); later reloads keep its ports. */
static void rig_start_with(struct rig *r, const char *tmpl)
{
    r->u1 = e2e_upstream_start(NULL);
    r->u2 = e2e_upstream_start(NULL);
    r->vars[0] = "U1";
    r->vars[1] = r->u1->url;
    r->vars[2] = "U2";
    r->vars[3] = r->u2->url;
    r->vars[4] = NULL;
    struct e2e_gw_opts o = {.vars = r->vars, .wait_ready = true};
    r->gw = e2e_gw_start(tmpl, &o);
    snprintf(r->lp, sizeof r->lp, "%u", (unsigned)r->gw->port);
    snprintf(r->ap, sizeof r->ap, "%u", (unsigned)r->gw->admin_port);
    r->vars[4] = "LISTEN_PORT";
    r->vars[5] = r->lp;
    r->vars[6] = "ADMIN_PORT";
    r->vars[7] = r->ap;
    r->vars[8] = NULL;
}

/* Polls until the log holds at least n reload outcome lines (reloaded, reload_failed, reload_refused); bounded. */
static bool wait_outcomes(const struct e2e_gw *g, size_t n, int timeout_ms)
{
    for (int waited = 0; waited <= timeout_ms; waited += 10) {
        if (e2e_gw_log_count(g, "event=reloaded") + e2e_gw_log_count(g, "event=reload_failed") +
                e2e_gw_log_count(g, "event=reload_refused") >=
            n)
            return true;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return false;
}

/* Writes tmpl (rendered) as the gateway's config, atomically (rename), and sends SIGHUP; waits for its outcome. */
static void reload_to(struct rig *r, const char *tmpl)
{
    size_t before = e2e_gw_log_count(r->gw, "event=reloaded") + e2e_gw_log_count(r->gw, "event=reload_failed") +
                    e2e_gw_log_count(r->gw, "event=reload_refused");
    char *text = e2e_render(tmpl, r->vars);
    const char *tmp = e2e_write_file("next.yaml", text);
    free(text);
    cr_assert_eq(rename(tmp, r->gw->conf_path), 0, "rename the new config into place");
    cr_assert_eq(kill(r->gw->proc.pid, SIGHUP), 0);
    if (!wait_outcomes(r->gw, before + 1, 10000)) {
        e2e_proc_dump_log(&r->gw->proc, 4000);
        cr_assert_fail("no reload outcome logged within 10 s");
    }
    e2e_gw_assert_alive(r->gw, "after SIGHUP");
}

/* GET path on a new connection; returns the X-Echo-Uri prefix it was served under ('a', 'b'), '4' for a 404
 * route-not-found, or '?' for anything else. */
static char probe(const struct rig *r, const char *path)
{
    struct e2e_resp resp;
    e2e_get(r->gw->port, path, &resp);
    char c = '?';
    const char *echo = e2e_resp_header(&resp, "X-Echo-Uri");
    if (resp.status == 200 && echo && (strncmp(echo, "/a/", 3) == 0 || strncmp(echo, "/b/", 3) == 0))
        c = echo[1];
    else if (resp.status == 404 && e2e_resp_is_problem(&resp, "route-not-found"))
        c = '4';
    e2e_resp_free(&resp);
    return c;
}

/* ---- the load: threads with one keep-alive connection each (libcurl easy handle), bounded by count and time */

#define LOAD_THREADS    4
#define LOAD_MAX_PER    20000
#define LOAD_MAX_MS     60000
#define LOAD_TIMEOUT_MS 5000L
#define ECHO_CAP        128

struct load {
    uint16_t port;
    unsigned long run; /* keys are unique per run: Postgres keeps the records of earlier runs */
    atomic_bool stop;
    int id;
    /* results */
    long sent_x, sent_b, got_a, got_b, got_404, failed, posts;
    double max_s;
    char first_failure[256];
};

struct echo_cap {
    char echo[ECHO_CAP];
};

static size_t hdr_cb(char *buf, size_t size, size_t n, void *arg)
{
    struct echo_cap *e = arg;
    size_t len = size * n;
    if (len > 12 && strncasecmp(buf, "X-Echo-Uri: ", 12) == 0) {
        size_t v = len - 12;
        while (v > 0 && (buf[12 + v - 1] == '\r' || buf[12 + v - 1] == '\n'))
            v--;
        if (v >= ECHO_CAP)
            v = ECHO_CAP - 1;
        memcpy(e->echo, buf + 12, v);
        e->echo[v] = '\0';
    }
    return len;
}

static size_t body_cb(char *buf, size_t size, size_t n, void *arg)
{
    (void)buf;
    (void)arg;
    return size * n;
}

static void *load_main(void *arg)
{
    struct load *L = arg;
    CURL *h = curl_easy_init();
    if (!h) {
        L->failed++;
        return NULL;
    }
    struct echo_cap e;
    uint64_t start = e2e_now_ms();
    for (long i = 0; i < LOAD_MAX_PER && !atomic_load(&L->stop) && e2e_now_ms() - start < LOAD_MAX_MS; i++) {
        bool to_b = i % 7 == 3;
        bool post = !to_b && i % 5 == 0;
        char url[128], keyhdr[96];
        snprintf(url, sizeof url, "http://127.0.0.1:%u%s", (unsigned)L->port, to_b ? "/v1/b" : "/v1/x");
        struct curl_slist *hl = NULL;
        if (post) {
            snprintf(keyhdr, sizeof keyhdr, "Idempotency-Key: load-%lx-%d-%ld", L->run, L->id, i);
            hl = curl_slist_append(hl, keyhdr);
        }
        e.echo[0] = '\0';
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, LOAD_TIMEOUT_MS);
        curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, hdr_cb);
        curl_easy_setopt(h, CURLOPT_HEADERDATA, &e);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, body_cb);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
        if (post) {
            curl_easy_setopt(h, CURLOPT_POSTFIELDS, "{}");
            curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, 2L);
        } else {
            curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
        }
        CURLcode rc = curl_easy_perform(h);
        curl_slist_free_all(hl);
        long status = 0;
        double secs = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        curl_easy_getinfo(h, CURLINFO_TOTAL_TIME, &secs);
        if (secs > L->max_s)
            L->max_s = secs;
        if (to_b)
            L->sent_b++;
        else
            L->sent_x++;
        L->posts += post;
        const char *want = to_b ? "/v1/b" : "/v1/x";
        bool ok = false;
        if (rc == CURLE_OK && status == 200 && (e.echo[0] == '/' && (e.echo[1] == 'a' || e.echo[1] == 'b')) &&
            strcmp(e.echo + 2, want) == 0) {
            ok = !(to_b && e.echo[1] == 'a'); /* A has no /v1/b route: a /a answer to it would be a mix */
            if (ok && e.echo[1] == 'a')
                L->got_a++;
            else if (ok)
                L->got_b++;
        } else if (rc == CURLE_OK && status == 404 && to_b) {
            ok = true;
            L->got_404++;
        }
        if (!ok) {
            if (L->failed == 0)
                snprintf(L->first_failure, sizeof L->first_failure, "%s %s: curl=%d (%s) status=%ld echo=%s",
                         post ? "POST" : "GET", want, (int)rc, curl_easy_strerror(rc), status, e.echo);
            L->failed++;
        }
    }
    curl_easy_cleanup(h);
    return NULL;
}

static long metric_sum(const char *metrics, const char *prefix)
{
    long sum = 0;
    for (const char *p = metrics; (p = strstr(p, prefix)) != NULL; p += strlen(prefix)) {
        const char *sp = strchr(p, ' ');
        if (sp)
            sum += strtol(sp + 1, NULL, 10);
    }
    return sum;
}

Test(reload, load_across_20_reloads_no_failure_no_mix)
{
    struct rig r;
    rig_start(&r);
    e2e_upstream_reset(r.u1);
    e2e_upstream_reset(r.u2);
    struct load L[LOAD_THREADS];
    pthread_t th[LOAD_THREADS];
    memset(L, 0, sizeof L);
    for (int i = 0; i < LOAD_THREADS; i++) {
        L[i].port = r.gw->port;
        L[i].id = i;
        L[i].run = (unsigned long)e2e_now_ms() ^ ((unsigned long)getpid() << 20);
        cr_assert_eq(pthread_create(&th[i], NULL, load_main, &L[i]), 0);
    }
    e2e_sleep_ms(300);
    /* B, A, broken, B, A, broken ...: after each, a probe on a new connection sees the config that is in force */
    const char *const seq[] = {conf_b, conf_a, conf_broken};
    char in_force = 'a';
    long probes_a = 0, probes_b = 0;
    size_t failed_lines = 0;
    for (int i = 0; i < 20; i++) {
        const char *t = seq[i % 3];
        reload_to(&r, t);
        if (t == conf_broken) {
            failed_lines++;
            cr_expect_eq(e2e_gw_log_count(r.gw, "event=reload_failed"), failed_lines);
        } else {
            in_force = t == conf_a ? 'a' : 'b';
        }
        char got = probe(&r, "/v1/x");
        cr_expect_eq(got, in_force, "reload %d: /v1/x served under '%c', the config in force is '%c'", i, got,
                     in_force);
        probes_a += got == 'a';
        probes_b += got == 'b';
        char gb = probe(&r, "/v1/b");
        cr_expect_eq(gb, in_force == 'a' ? '4' : 'b', "reload %d: /v1/b answered '%c' under '%c'", i, gb, in_force);
        probes_b += gb == 'b';
        e2e_sleep_ms(150);
    }
    for (int i = 0; i < LOAD_THREADS; i++)
        atomic_store(&L[i].stop, true);
    long sent = 0, failed = 0, got_a = 0, got_b = 0, got_404 = 0, sent_x = 0;
    double max_s = 0;
    for (int i = 0; i < LOAD_THREADS; i++) {
        pthread_join(th[i], NULL);
        sent += L[i].sent_x + L[i].sent_b;
        sent_x += L[i].sent_x;
        failed += L[i].failed;
        got_a += L[i].got_a;
        got_b += L[i].got_b;
        got_404 += L[i].got_404;
        max_s = L[i].max_s > max_s ? L[i].max_s : max_s;
        cr_expect_eq(L[i].failed, 0, "load thread %d: %ld failed; first: %s", i, L[i].failed, L[i].first_failure);
    }
    fprintf(stderr,
            "reload load: requests=%ld reloads=20 (broken=%zu) failures=%ld under_a=%ld under_b=%ld 404=%ld "
            "max_latency_ms=%.1f\n",
            sent, failed_lines, failed, got_a, got_b, got_404, max_s * 1000);
    cr_expect_gt(sent, 200, "the load ran (%ld requests)", sent);
    cr_expect_gt(got_a, 0);
    cr_expect_gt(got_b, 0);
    /* every /a answer was executed by upstream one and every /b answer by upstream two: no request got one
     * config's route with the other's upstream */
    cr_expect_eq(e2e_upstream_count(r.u1, NULL), got_a + probes_a);
    cr_expect_eq(e2e_upstream_count(r.u2, NULL), got_b + probes_b);
    cr_expect_eq(e2e_gw_log_count(r.gw, "event=reloaded"), 20 - failed_lines);
    /* the broken file's line names the file, the line and the key */
    char want[600];
    snprintf(want, sizeof want, "event=reload_failed file=\"%s\" error=\"%s:21: ", r.gw->conf_path, r.gw->conf_path);
    cr_expect(e2e_gw_log_contains(r.gw, want), "no '%s' in the log", want);
    cr_expect(e2e_gw_log_contains(r.gw, "max_body"), "the failure names the key");
    /* metrics by route name across index shifts: route x counted every /v1/x answer, only_b exists */
    struct e2e_resp m;
    e2e_get(r.gw->admin_port, "/metrics", &m);
    cr_assert_eq(m.status, 200);
    long x_total = metric_sum((const char *)m.body, "idemgate_requests_total{route=\"x\",");
    cr_expect_eq(x_total, sent_x + 20, "route x counted %ld answers, %ld were sent", x_total, sent_x + 20);
    cr_expect(strstr((const char *)m.body, "idemgate_requests_total{route=\"only_b\",outcome=\"forwarded\"}") != NULL,
              "B's own route has its label");
    e2e_resp_free(&m);
    cr_expect_eq(e2e_gw_stop(r.gw, 10000), 0);
}

Test(reload, in_flight_request_finishes_under_old_config)
{
    struct rig r;
    rig_start(&r);
    static const char *const slow[] = {"X-Test-Delay-Ms: 1500", NULL};
    struct e2e_req rq = {.path = "/v1/x", .headers = slow, .timeout_ms = 8000};
    struct e2e_async *a = e2e_http_async(r.gw->port, &rq);
    cr_assert_eq(e2e_upstream_wait_count(r.u1, NULL, 1, 5000), 1, "the slow request reached upstream one");
    reload_to(&r, conf_b);
    cr_expect(e2e_gw_log_contains(r.gw, "event=reloaded"));
    cr_expect_eq(probe(&r, "/v1/x"), 'b', "a new request is served under B");
    struct e2e_resp resp;
    e2e_http_join(a, &resp);
    cr_expect_eq(resp.status, 200, "the request in flight got %ld (%s)", resp.status, resp.error);
    const char *echo = e2e_resp_header(&resp, "X-Echo-Uri");
    cr_expect(echo && strcmp(echo, "/a/v1/x") == 0, "the request in flight finished under A (echo %s)",
              echo ? echo : "none");
    e2e_resp_free(&resp);
    cr_expect_eq(e2e_upstream_count(r.u2, NULL), 1, "only the probe went to upstream two");
    cr_expect_eq(e2e_gw_stop(r.gw, 10000), 0);
}

Test(reload, replay_after_reload)
{
    struct rig r;
    rig_start(&r);
    struct e2e_resp first, again;
    char key[64];
    snprintf(key, sizeof key, "k-reload-%llx-%d", (unsigned long long)e2e_now_ms(), (int)getpid());
    e2e_http_key(r.gw->port, "POST", "/v1/x", key, NULL, "{\"n\":1}", 0, &first);
    cr_assert_eq(first.status, 200);
    reload_to(&r, conf_b);
    cr_assert(e2e_gw_log_contains(r.gw, "event=reloaded"));
    e2e_http_key(r.gw->port, "POST", "/v1/x", key, NULL, "{\"n\":1}", 0, &again);
    cr_expect_eq(again.status, 200);
    cr_expect(e2e_resp_is_replay(&again), "the retry after the reload is a replay");
    const char *echo = e2e_resp_header(&again, "X-Echo-Uri");
    cr_expect(echo && strcmp(echo, "/a/v1/x") == 0, "the stored answer (from A) is replayed (echo %s)",
              echo ? echo : "none");
    cr_expect_eq(e2e_upstream_count(r.u1, key), 1);
    cr_expect_eq(e2e_upstream_count(r.u2, key), 0, "not executed again on the new upstream");
    e2e_resp_free(&first);
    e2e_resp_free(&again);
    cr_expect_eq(e2e_gw_stop(r.gw, 10000), 0);
}

Test(reload, store_change_refused_all_or_nothing)
{
    struct rig r;
    rig_start(&r);
    reload_to(&r, conf_b_pool);
    cr_expect(e2e_gw_log_contains(r.gw, "level=warn event=reload_refused key=store.pool msg=\"needs a restart\""),
              "the refusal names store.pool");
    cr_expect(!e2e_gw_log_contains(r.gw, "event=reloaded"));
    cr_expect_eq(probe(&r, "/v1/x"), 'a', "nothing of the refused file applies");
    cr_expect_eq(probe(&r, "/v1/b"), '4');
    /* a good file afterwards still reloads */
    reload_to(&r, conf_b);
    cr_expect_eq(probe(&r, "/v1/x"), 'b');
    cr_expect_eq(e2e_gw_stop(r.gw, 10000), 0);
}

/* ---- on_unknown and probe: read from the configuration in force, not the one the gateway started with */

/* payreload on /v1/pay (a route name of its own: the sweeper looks at every lapsed record of its probe routes, and
 * other tests leave records of route "pay" in the shared database): a 1 s lease, upstream one with a 1 s timeout;
 * on_unknown: reject, or (probe) looked up at the test upstream's /_lookup. */
/* clang-format off */
#define CONF_UNKNOWN(on_unknown)                                                                                       \
    CONF_PORTS_STORE("4")                                                                                              \
    "upstreams:\n"                                                                                                     \
    E2E_CONF_UPSTREAM("one", "{{U1}}", "1s")                                                                           \
    "routes:\n"                                                                                                        \
    E2E_CONF_ROUTE("payreload", "/v1/pay", "one")                                                                      \
    "      key: required\n"                                                                                            \
    "      lease: 1s\n"                                                                                                \
    on_unknown
static const char *const conf_reject = CONF_UNKNOWN("      on_unknown: reject\n");
static const char *const conf_probe = CONF_UNKNOWN(
    "      on_unknown: probe\n"
    "      probe:\n"
    "        method: GET\n"
    "        path: /_lookup?idempotency_key={key}\n"
    "        found: [200]\n"
    "        absent: [404]\n");
/* clang-format on */

/* POST path with key, answered 504 after the 1 s upstream timeout: the record is an unknown outcome. */
static void times_out(const struct rig *r, const char *path, const char *key)
{
    static const char *const slow[] = {"X-Test-Delay-Ms: 2500", NULL};
    struct e2e_resp resp;
    e2e_http_key(r->gw->port, "POST", path, key, slow, "{\"amount\":7}", 0, &resp);
    e2e_expect_problem(&resp, 504, "upstream-timeout", "sent, then timed out: an unknown outcome");
    e2e_resp_free(&resp);
}

Test(reload, added_probe_makes_the_sweeper_resolve_an_unknown_outcome)
{
    struct rig r;
    rig_start_with(&r, conf_reject);
    char key[64];
    e2e_mkkey(key, sizeof key, "reload-probe");
    times_out(&r, "/v1/pay", key);
    struct e2e_resp resp;
    e2e_sleep_ms(1200); /* past the lease: on_unknown applies */
    e2e_http_key(r.gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":7}", 0, &resp);
    e2e_expect_problem(&resp, 409, "idempotency-outcome-unknown", "reject, before the reload");
    e2e_resp_free(&resp);

    reload_to(&r, conf_probe);
    cr_assert_eq(e2e_gw_log_count(r.gw, "event=reloaded"), 1, "the probe: block is reloaded");
    bool resolved = false;
    for (int i = 0; i < 200 && !resolved; i++) { /* the sweeper looks every 5 s: at most 20 s */
        resolved = e2e_gw_log_count(r.gw, "event=unknown_resolved route=payreload how=found by=sweeper") > 0;
        if (!resolved)
            e2e_sleep_ms(100);
    }
    cr_expect(resolved, "the sweeper resolved the record under the reloaded on_unknown: probe");
    cr_expect_eq(e2e_gw_log_count(r.gw, "reason=not_a_probe_route"), 0, "the current configuration's route probes");
    e2e_http_key(r.gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":7}", 0, &resp);
    cr_expect_eq(resp.status, 200, "the retry after the look-up: %ld %s", resp.status,
                 resp.body ? (const char *)resp.body : "");
    cr_expect(e2e_resp_is_replay(&resp), "the looked-up answer is replayed");
    e2e_resp_free(&resp);
    cr_expect_eq(e2e_upstream_count(r.u1, key), 1, "executed once");
}

/* pay as conf_reject, and a route "late" that only the reloaded configuration has. */
static const char *const conf_late =
    CONF_UNKNOWN("      on_unknown: reject\n" E2E_CONF_ROUTE("late", "/v1/late", "one") "      key: required\n"
                                                                                        "      lease: 1s\n");

static double stuck_gauge(const struct e2e_gw *g, const char *route_label)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    const char *labels[] = {route_label, NULL};
    double v = e2e_metric_value((const char *)r.body, "idemgate_stuck_processing", labels);
    e2e_resp_free(&r);
    return v;
}

Test(reload, stuck_gauge_counts_a_route_added_by_reload)
{
    struct rig r;
    rig_start_with(&r, conf_reject);
    reload_to(&r, conf_late);
    cr_assert_eq(e2e_gw_log_count(r.gw, "event=reloaded"), 1);
    char key[64];
    e2e_mkkey(key, sizeof key, "reload-stuck");
    times_out(&r, "/v1/late", key);
    /* stuck: in flight or unknown for over 5 minutes (SPEC 5); the record is made older than that */
    char sql[512];
    snprintf(sql, sizeof sql,
             "UPDATE idemgate_keys SET created_at = now() - interval '10 minutes' WHERE route = 'late' AND key = '%s'",
             key);
    free(e2e_psql(sql));
    long want = e2e_psql_long("SELECT count(*) FROM idemgate_keys WHERE route = 'late' AND state IN ('in_flight', "
                              "'unknown') AND created_at < now() - interval '5 minutes'");
    cr_assert_geq(want, 1);
    double got = 0;
    for (int i = 0; i < 250 && got != (double)want; i++) { /* the gauge is refreshed every 10 s: at most 25 s */
        got = stuck_gauge(r.gw, "route=\"late\"");
        if (got != (double)want)
            e2e_sleep_ms(100);
    }
    cr_expect_eq(got, (double)want, "idemgate_stuck_processing{route=\"late\"} counts the reloaded route's records");
    snprintf(sql, sizeof sql, "DELETE FROM idemgate_keys WHERE route = 'late' AND key = '%s'", key);
    free(e2e_psql(sql));
}
