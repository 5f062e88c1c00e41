/* probe_test.c - end-to-end tests of on_unknown: probe (SPEC 9): unknown outcomes resolved by asking the real test
 * upstream's look-up endpoint, by a retry after the lease and by the sweeper; real Postgres and Redis. */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

TestSuite(probe, .init = e2e_setup, .fini = e2e_teardown, .timeout = 90);

#define ADMIN_TOKEN "e2e-probe-admin-token-51c2"
#define PROBE_KEY   "probe-secret-93d1"

/* route: a 1 s lease, a 1 s upstream timeout, probe.grace 0s (a record may be looked up 1 s after its lapse), the
 * look-up at the test upstream's /_lookup (extra: more query);
 * more_idem and more_probe: more lines of the idempotency and probe blocks (unindented; NULL: none). */
static struct e2e_gw *gw_start_probe_route(const struct e2e_upstream *up, const char *route, const char *extra_query,
                                           const char *more_idem, const char *more_probe)
{
    char idem[2048];
    snprintf(idem, sizeof idem,
             "key: required\n"
             "lease: 1s\n"
             "on_unknown: probe\n"
             "%s"
             "probe:\n"
             "  method: GET\n"
             "  path: /_lookup?idempotency_key={key}%s\n"
             "  found: [200]\n"
             "  absent: [404]\n"
             "  headers: {X-Api-Key: $PROBE_KEY, X-Probe: static}\n"
             "  grace: 0s\n"
             "%s",
             more_idem ? more_idem : "", extra_query ? extra_query : "", more_probe ? more_probe : "");
    static const char *const env[] = {"IDEMGATE_ADMIN_TOKEN=" ADMIN_TOKEN, "PROBE_KEY=" PROBE_KEY, NULL};
    struct e2e_pay_conf c = {.idem = idem, .timeout = "1s", .route = route};
    return e2e_gw_start_pay(up, &c, env);
}

/* payprobe: a route name of its own, since the sweeper looks at every lapsed record of its probe routes, oldest
 * first, and other tests leave records of route "pay" in the shared database. */
static struct e2e_gw *gw_start_probe(const struct e2e_upstream *up, const char *extra_query)
{
    return gw_start_probe_route(up, "payprobe", extra_query, NULL, NULL);
}

/* Percent-encodes everything but unreserved characters (for admin query values). */
static void pct(char *out, size_t n, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (; *s && o + 4 < n; s++) {
        unsigned char ch = (unsigned char)*s;
        if ((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-' ||
            ch == '.' || ch == '_' || ch == '~') {
            out[o++] = (char)ch;
        } else {
            out[o++] = '%';
            out[o++] = hex[ch >> 4];
            out[o++] = hex[ch & 15];
        }
    }
    out[o] = '\0';
}

/* GET /admin/keys for route and key: the JSON list (heap, caller frees). */
static char *admin_keys_of(const struct e2e_gw *g, const char *route, const char *key)
{
    char path[1024], esc[800];
    pct(esc, sizeof esc, key);
    snprintf(path, sizeof path, "/admin/keys?route=%s&key=%s", route, esc);
    static const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};
    struct e2e_req rq = {.method = "GET", .path = path, .headers = h, .timeout_ms = 5000};
    struct e2e_resp r;
    e2e_http(g->admin_port, &rq, &r);
    cr_assert_eq(r.status, 200, "GET /admin/keys: %ld", r.status);
    char *json = strdup((const char *)r.body);
    e2e_resp_free(&r);
    return json;
}

static char *admin_keys(const struct e2e_gw *g, const char *key)
{
    return admin_keys_of(g, "payprobe", key);
}

static double metric(const struct e2e_gw *g, const char *name, const char *label)
{
    struct e2e_resp r;
    e2e_get(g->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    const char *labels[] = {"route=\"payprobe\"", label, NULL};
    double v = e2e_metric_value((const char *)r.body, name, labels);
    e2e_resp_free(&r);
    return v;
}

/* Look-ups of this key the upstream answered (the sweeper also looks up other tests' records of route pay). */
static long lookups(const struct e2e_upstream *up, const char *key)
{
    char path[1024], esc[800];
    pct(esc, sizeof esc, key);
    snprintf(path, sizeof path, "/_test/lookups?key=%s", esc);
    struct e2e_resp r;
    e2e_get(up->port, path, &r);
    cr_assert_eq(r.status, 200);
    long n = strtol((const char *)r.body, NULL, 10);
    e2e_resp_free(&r);
    return n;
}

static const char *const slow[] = {"X-Test-Delay-Ms: 2500", "Authorization: Bearer client-secret-tok",
                                   "X-Client-Only: yes", NULL};

/* A request that times out after it was sent: 504, its record an unknown outcome for the 1 s lease. */
static void timeout_after_send(const struct e2e_gw *gw, const char *key)
{
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, slow, "{\"amount\":42}", 0, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "first attempt");
    e2e_resp_free(&r);
}

Test(probe, found_replays_the_looked_up_answer_never_within_the_lease)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_probe(up, NULL);
    char base[64], key[96];
    e2e_mkkey(base, sizeof base, "found");
    /* every character of it but the unreserved ones must reach the look-up percent-encoded */
    snprintf(key, sizeof key, "a&b=c+%%2F/%s", base);
    timeout_after_send(gw, key);
    cr_expect_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the first attempt executed once");

    /* within the lease: in use, and nobody asks the upstream */
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
    e2e_expect_problem(&r, 409, "idempotency-key-in-use", "retry within the lease");
    e2e_resp_free(&r);
    cr_expect_eq(lookups(up, key), 0, "no look-up within the lease");

    e2e_sleep_ms(2300); /* the lease (1 s) and the upstream timeout (1 s) after it */
    static const char *const client[] = {"Authorization: Bearer client-secret-tok", "X-Client-Only: yes", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay", key, client, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200, "retry after the lease: %ld %s", r.status, r.body);
    cr_expect(e2e_resp_is_replay(&r), "the found answer is replayed");
    cr_expect(strstr((const char *)r.body, "\"found\":true") != NULL, "the looked-up answer: %s", r.body);
    /* SPEC 9: a found answer never stores a cookie (the look-up's own session is nobody's) */
    cr_expect_eq(e2e_resp_header_count(&r, "Set-Cookie"), 0, "the look-up's Set-Cookie is not replayed");
    cr_expect_eq(e2e_resp_header_count(&r, "Set-Cookie2"), 0, "nor its Set-Cookie2");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "never executed again");
    cr_expect(lookups(up, key) >= 1, "the upstream was asked");

    /* the look-up carried probe.headers only */
    char *h = e2e_upstream_last_headers(up);
    cr_expect(strstr(h, "X-Api-Key: " PROBE_KEY) != NULL, "probe header from the environment: %s", h);
    cr_expect(strstr(h, "X-Probe: static") != NULL, "static probe header: %s", h);
    cr_expect(strstr(h, "client-secret-tok") == NULL, "the client's Authorization is never sent: %s", h);
    cr_expect(strstr(h, "X-Client-Only") == NULL, "no client header: %s", h);
    cr_expect(strstr(h, "Idempotency-Key") == NULL, "no key header: %s", h);
    free(h);

    /* a completed record now: replayed again without asking */
    long asked = lookups(up, key);
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(e2e_resp_is_replay(&r));
    cr_expect(strstr((const char *)r.body, "\"found\":true") != NULL, "same answer: %s", r.body);
    cr_expect_eq(e2e_resp_header_count(&r, "Set-Cookie"), 0, "nor stored");
    e2e_resp_free(&r);
    cr_expect_eq(lookups(up, key), asked, "a completed record is not looked up");
    char *json = admin_keys(gw, key);
    cr_expect(strstr(json, "\"state\":\"completed\"") != NULL, "/admin/keys: %s", json);
    free(json);
    cr_expect_eq(metric(gw, "idemgate_unknown_resolved_total", "how=\"found\""), 1);
    cr_expect(e2e_gw_log_contains(gw, "event=unknown_resolved"), "logged");
    cr_expect(!e2e_gw_log_contains_outside_access(gw, base), "the key is never logged but in the access lines");
}

Test(probe, absent_releases_and_the_retry_executes_once)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_probe(up, NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "absent");
    static const char *const lost[] = {"X-Test-Action: lost", NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, lost, "{\"amount\":7}", 0, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "sent, no answer, never executed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 0);

    e2e_sleep_ms(2300); /* the lease (1 s) and the upstream timeout (1 s) after it */
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":7}", 0, &r);
    cr_expect_eq(r.status, 200, "absent: the retry is forwarded: %ld %s", r.status, r.body);
    cr_expect(!e2e_resp_is_replay(&r), "executed, not replayed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "executed once");
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":7}", 0, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(e2e_resp_is_replay(&r), "then replayed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "still once");
    /* at least this one (the sweeper may release records other tests left on route pay) */
    cr_expect(metric(gw, "idemgate_unknown_resolved_total", "how=\"absent\"") >= 1);
}

Test(probe, failing_lookup_stays_unknown)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_probe(up, "&status=500");
    char key[64];
    e2e_mkkey(key, sizeof key, "fail");
    timeout_after_send(gw, key);
    e2e_sleep_ms(2300); /* the lease (1 s) and the upstream timeout (1 s) after it */
    struct e2e_resp r;
    for (int i = 0; i < 2; i++) {
        e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
        e2e_expect_problem(&r, 409, "idempotency-outcome-unknown", "look-up answered 500");
        e2e_resp_free(&r);
    }
    /* each retry asked again: a failed look-up gives the record back */
    cr_expect(lookups(up, key) >= 2, "looked up per retry: %ld", lookups(up, key));
    cr_expect_eq(e2e_upstream_count(up, key), 1, "never executed again");
    char *json = admin_keys(gw, key);
    cr_expect(strstr(json, "\"state\":\"unknown\"") != NULL, "/admin/keys: %s", json);
    free(json);
    cr_expect(metric(gw, "idemgate_unknown_resolved_total", "how=\"found\"") == 0);
    /* purged: the sweepers of later tests on route pay would keep asking for it */
    struct e2e_resp d;
    char path[256];
    snprintf(path, sizeof path, "/admin/keys?route=payprobe&key=%s", key);
    static const char *const h[] = {"Authorization: Bearer " ADMIN_TOKEN, NULL};
    struct e2e_req rq = {.method = "DELETE", .path = path, .headers = h, .timeout_ms = 5000};
    e2e_http(gw->admin_port, &rq, &d);
    cr_expect_eq(d.status, 200);
    e2e_resp_free(&d);
}

Test(probe, sweeper_resolves_a_record_no_client_retries)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_probe(up, NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "sweep");
    timeout_after_send(gw, key);
    bool done = false;
    for (int i = 0; i < 150 && !done; i++) { /* the sweeper looks every 5 s: at most 15 s */
        char *json = admin_keys(gw, key);
        done = strstr(json, "\"state\":\"completed\"") != NULL;
        free(json);
        if (!done)
            e2e_sleep_ms(100);
    }
    cr_expect(done, "the sweeper completed the record");
    cr_expect(e2e_gw_log_contains(gw, "by=sweeper"), "resolved by the sweeper");
    cr_expect_eq(metric(gw, "idemgate_unknown_resolved_total", "how=\"found\""), 1);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200);
    cr_expect(e2e_resp_is_replay(&r), "the retry is a replay");
    cr_expect(strstr((const char *)r.body, "\"found\":true") != NULL, "%s", r.body);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1);
}

/* A claim orphaned by a crash (the gateway killed while the upstream executes) is in flight until its lease ends,
 * then an unknown outcome (SPEC 4), and on_unknown: probe applies to it: a retry and the sweeper both look it up.
 * Before, the look-up took only records in state unknown: the orphan stayed in flight for good and every retry
 * was 409 idempotency-outcome-unknown without a look-up. */
static void orphan(struct e2e_gw **gw, const struct e2e_upstream *up, const char *key)
{
    static const char *const h[] = {"X-Test-Delay-Ms: 700", NULL};
    struct e2e_resp r;
    e2e_http_key((*gw)->port, "POST", "/v1/pay", key, h, "{\"amount\":42}", 250, &r); /* gives up at 250 ms */
    e2e_resp_free(&r);
    cr_assert_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1, "the upstream executes it");
    cr_assert_eq(kill((*gw)->proc.pid, SIGKILL), 0);
    cr_assert(e2e_proc_wait(&(*gw)->proc, 5000));
    *gw = gw_start_probe(up, NULL);
}

Test(probe, an_orphaned_claim_is_looked_up_after_its_lease)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_probe(up, NULL);
    char key[64], key2[64];
    e2e_mkkey(key, sizeof key, "orphan-retry");
    e2e_mkkey(key2, sizeof key2, "orphan-sweep");
    orphan(&gw, up, key);
    orphan(&gw, up, key2);
    e2e_sleep_ms(2300); /* both leases (1 s) lapsed, and the upstream timeout (1 s) after them */

    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, NULL, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200, "the retry after the lease: %ld %.300s", r.status, r.body ? (char *)r.body : "");
    cr_expect(e2e_resp_is_replay(&r), "the retry is the looked-up answer, replayed");
    e2e_resp_free(&r);
    cr_expect_geq(lookups(up, key), 1, "the retry looked the orphan up");

    bool done = false;
    for (int i = 0; i < 150 && !done; i++) { /* the sweeper looks every 5 s: at most 15 s */
        char *json = admin_keys(gw, key2);
        done = strstr(json, "\"state\":\"completed\"") != NULL;
        free(json);
        if (!done)
            e2e_sleep_ms(100);
    }
    cr_expect(done, "the sweeper looked up the orphan nobody retried and completed it");
    cr_expect_eq(e2e_upstream_count(up, key), 1, "executed once");
    cr_expect_eq(e2e_upstream_count(up, key2), 1, "executed once");
}

Test(probe, config_errors)
{
    static const char *const cases[][2] = {
        {"on_unknown: probe\n", "needs a probe"},
        {"on_unknown: reject\nprobe: {path: /x}\n", "only with on_unknown: probe"},
        {"on_unknown: probe\nprobe: {method: GET}\n", "missing required key"},
        {"on_unknown: probe\nprobe: {path: 'x?k={key}'}\n", "must start with '/'"},
        {"on_unknown: probe\nprobe: {path: '/x?k={key}&j={key}'}\n", "at most once"},
        {"on_unknown: probe\nprobe: {path: '/x/{id}?k={key}'}\n", "only placeholder"},
        {"on_unknown: probe\nprobe: {path: /x, method: 'G T'}\n", "invalid method"},
        {"on_unknown: probe\nprobe: {path: /x, found: [200, 404]}\n", "in both found and absent"},
        {"on_unknown: probe\nprobe: {path: /x, headers: {'Bad Name': v}}\n", "invalid header name"},
        {"on_unknown: probe\nprobe: {path: /x, headers: {X-K: $IDEMGATE_E2E_UNSET_VAR}}\n", "is not set"},
        {"on_unknown: probe\nprobe: {path: /x}\n", "does not carry {key}"},
        {"on_unknown: probe\nforward_key: false\nprobe: {path: '/x?k={key}'}\n", "needs forward_key: true"},
        {"on_unknown: probe\nscope: [body]\nprobe: {path: '/x?k={key}'}\n", "cannot carry scope part 'body'"},
        {"mode: spy\n", "invalid value"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct e2e_pay_conf c = {.idem = cases[i][0]};
        char *tmpl = e2e_conf_pay(&c);
        static const char *const vars[] = {"LISTEN_PORT",        "18080", "ADMIN_PORT", "19090", "UPSTREAM_URL",
                                           "http://127.0.0.1:9", NULL};
        char *text = e2e_render(tmpl, vars);
        const char *file = e2e_write_file("check.yaml", text);
        const char *argv[] = {e2e_env("IDEMGATE_BIN"), "--check", "-c", file, NULL};
        char *err = NULL;
        int rc = e2e_run(argv, NULL, 10000, NULL, &err);
        cr_expect_eq(rc, 1, "case %zu: --check exit %d", i, rc);
        cr_expect(err && strstr(err, cases[i][1]) != NULL, "case %zu: expected '%s' in: %s", i, cases[i][1],
                  err ? err : "");
        free(err);
        free(text);
        free(tmpl);
    }
}

/* A probe route scoped by Authorization (more_probe: more probe lines, NULL: none). */
static struct e2e_gw *gw_start_tenant(const struct e2e_upstream *up, const char *route, const char *more_probe)
{
    return gw_start_probe_route(up, route, NULL, "scope: [header:Authorization]\n", more_probe);
}

/* SPEC 9: the probe asks as the tenant whose request it settles. Tenant A's request with key K is lost (sent, never
 * executed: an unknown outcome); tenant B sends K on the same scoped route and it executes; after the lease, A's
 * retry probes. The test upstream's look-up answers as the tenant of its Authorization, as an API scoping keys per
 * account does. Before, the look-up asked by key alone with the static probe headers: it found B's execution, and
 * A got 200 Idempotent-Replayed with B's answer while its payment never ran. */
Test(probe, another_tenants_execution_never_settles_a_lost_request)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_tenant(up, "paytenant", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "tenant");
    static const char *const a_lost[] = {"Authorization: Bearer tenant-a", "X-Test-Action: lost", NULL};
    static const char *const a[] = {"Authorization: Bearer tenant-a", NULL};
    static const char *const b[] = {"Authorization: Bearer tenant-b", NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, a_lost, "{\"amount\":42}", 0, &r);
    e2e_expect_problem(&r, 502, "upstream-no-response", "A: sent, no answer, never executed");
    e2e_resp_free(&r);
    e2e_http_key(gw->port, "POST", "/v1/pay", key, b, "{\"amount\":1}", 0, &r);
    cr_expect_eq(r.status, 200, "B's own request with the same key executes: %ld", r.status);
    cr_expect(!e2e_resp_is_replay(&r));
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "B's executed");

    e2e_sleep_ms(2300); /* the lease (1 s) and the upstream timeout (1 s) after it */
    e2e_http_key(gw->port, "POST", "/v1/pay", key, a, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200, "A's retry: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(!e2e_resp_is_replay(&r), "A's retry is never B's answer replayed: %s",
              r.body ? (const char *)r.body : "");
    cr_expect(r.body && strstr((const char *)r.body, "found") == NULL, "not a look-up answer: %s",
              r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2, "A's payment executed now (absent as A)");
    cr_expect_geq(lookups(up, key), 1, "the retry looked the key up");
    e2e_http_key(gw->port, "POST", "/v1/pay", key, a, "{\"amount\":42}", 0, &r);
    cr_expect(e2e_resp_is_replay(&r), "then A's own answer is replayed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 2);
    cr_expect(!e2e_gw_log_contains(gw, "tenant-a"), "the scope's value is never logged");
}

/* A found answer on a scoped route: the look-up carried A's Authorization (and only the scope's parts besides
 * probe.headers), found A's own execution, and stored no cookie. */
Test(probe, a_scoped_lookup_carries_the_retrys_scope_parts)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_tenant(up, "paytenant", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "tenant-found");
    static const char *const a_slow[] = {"X-Test-Delay-Ms: 2500", "Authorization: Bearer tenant-a", NULL};
    static const char *const a[] = {"Authorization: Bearer tenant-a", "X-Client-Only: yes", NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay", key, a_slow, "{\"amount\":42}", 0, &r);
    e2e_expect_problem(&r, 504, "upstream-timeout", "A's first attempt");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_wait_count(up, key, 1, 3000), 1);
    e2e_sleep_ms(2300); /* the lease (1 s) and the upstream timeout (1 s) after it */
    e2e_http_key(gw->port, "POST", "/v1/pay", key, a, "{\"amount\":42}", 0, &r);
    cr_expect_eq(r.status, 200, "A's retry: %ld %s", r.status, r.body ? (const char *)r.body : "");
    cr_expect(e2e_resp_is_replay(&r), "A's own execution, found");
    cr_expect(r.body && strstr((const char *)r.body, "\"found\":true") != NULL, "%s",
              r.body ? (const char *)r.body : "");
    cr_expect_eq(e2e_resp_header_count(&r, "Set-Cookie"), 0, "no cookie stored from the look-up");
    e2e_resp_free(&r);
    char *h = e2e_upstream_last_headers(up);
    cr_expect(strstr(h, "Authorization: Bearer tenant-a") != NULL, "the look-up asked as A: %s", h);
    cr_expect(strstr(h, "X-Api-Key: " PROBE_KEY) != NULL, "and with probe.headers: %s", h);
    cr_expect(strstr(h, "X-Client-Only") == NULL, "no other client header: %s", h);
    free(h);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "never executed again");
}

/* The sweeper has no request to take the scope's parts from: it leaves a scoped route's unknown outcomes to their
 * retries, unless probe.keys_unique_upstream says the look-up by key alone is tenant-safe. */
Test(probe, the_sweeper_skips_a_scoped_route_unless_keys_are_unique_upstream)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = gw_start_tenant(up, "paytenantsweep", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "tenant-sweep");
    timeout_after_send(gw, key);
    e2e_sleep_ms(7500); /* the first sweep after 1 s, then every 5 s */
    char *json = admin_keys_of(gw, "paytenantsweep", key);
    cr_expect(strstr(json, "\"state\":\"unknown\"") != NULL, "left unknown by the sweeper: %s", json);
    free(json);
    cr_expect_eq(lookups(up, key), 0, "never looked up without its scope");
    e2e_gw_stop(gw, 5000);

    gw = gw_start_tenant(up, "paytenantsweep", "  keys_unique_upstream: true\n");
    bool done = false;
    for (int i = 0; i < 150 && !done; i++) { /* the sweeper looks every 5 s: at most 15 s */
        json = admin_keys_of(gw, "paytenantsweep", key);
        done = strstr(json, "\"state\":\"completed\"") != NULL;
        free(json);
        if (!done)
            e2e_sleep_ms(100);
    }
    cr_expect(done, "keys_unique_upstream: the sweeper looked it up by key alone");
    cr_expect(e2e_gw_log_contains(gw, "by=sweeper"));
}
