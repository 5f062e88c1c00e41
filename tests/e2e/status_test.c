/* status_test.c - the admin status page (SPEC 10) in a real headless Chromium: the rendered DOM under traffic and
 * after it, checked against /metrics; no key, scope or body on the page or in status.json; a screenshot. Skips with
 * a clear message only when Chromium is not installed (scripts/deps.sh installs it). */
#include <ctype.h>

#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/e2e/harness.h"

TestSuite(status, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

#define CHROMIUM "/usr/bin/chromium"

/* clang-format off */
static const char *const conf_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("pay", "/v1/pay", "api")
    "      key: required\n"
    "      scope: [header:Authorization]\n"
    E2E_CONF_ROUTE("pass", "/v1/pass", "api")
    "      key: off\n";
/* clang-format on */

/* Runs headless Chromium on url with extra (one flag or NULL); returns stdout (heap). */
static char *chromium(const char *url, const char *extra)
{
    char profile[512], budget[] = "--virtual-time-budget=4000";
    snprintf(profile, sizeof profile, "--user-data-dir=%s/chromium-%u", e2e_tmpdir(), (unsigned)e2e_now_ms());
    const char *argv[] = {CHROMIUM,
                          "--headless",
                          "--no-sandbox",
                          "--disable-gpu",
                          "--disable-quic",
                          "--no-first-run",
                          "--disable-background-networking",
                          "--disable-component-update",
                          "--disable-sync",
                          "--disable-dev-shm-usage",
                          profile,
                          budget,
                          "--window-size=1100,520",
                          extra ? extra : "--dump-dom",
                          url,
                          NULL};
    char *out = NULL, *err = NULL;
    int rc = e2e_run(argv, NULL, 60000, &out, &err);
    cr_assert_eq(rc, 0, "chromium exited %d: %.2000s", rc, err ? err : "");
    free(err);
    return out;
}

/* The number in <td class="cls"> of the row data-route="route" in the dumped DOM, or -1. */
static long dom_cell(const char *dom, const char *route, const char *cls)
{
    char row[128], cell[64];
    snprintf(row, sizeof row, "<tr data-route=\"%s\">", route);
    const char *r = strstr(dom, row);
    if (!r)
        return -1;
    const char *end = strstr(r, "</tr>");
    snprintf(cell, sizeof cell, "<td class=\"%s", cls);
    const char *c = strstr(r, cell);
    if (!c || (end && c > end))
        return -1;
    c = strchr(c, '>');
    return c ? strtol(c + 1, NULL, 10) : -1;
}

static char *metrics(const struct e2e_gw *gw)
{
    struct e2e_resp r;
    e2e_get(gw->admin_port, "/metrics", &r);
    cr_assert_eq(r.status, 200);
    char *s = strdup((const char *)r.body);
    e2e_resp_free(&r);
    return s;
}

static long route_requests(const char *m, const char *route)
{
    static const char *const outcomes[] = {"forwarded",  "replayed",   "mismatch",          "in_flight",
                                           "rejected",   "unknown",    "store_unavailable", "upstream_error",
                                           "overloaded", "passthrough"};
    char rl[64], ol[64];
    long sum = 0;
    snprintf(rl, sizeof rl, "route=\"%s\"", route);
    for (size_t i = 0; i < sizeof outcomes / sizeof outcomes[0]; i++) {
        snprintf(ol, sizeof ol, "outcome=\"%s\"", outcomes[i]);
        const char *labels[] = {rl, ol, NULL};
        double v = e2e_metric_value(m, "idemgate_requests_total", labels);
        if (v > 0)
            sum += (long)v;
    }
    return sum;
}

static long route_metric(const char *m, const char *name, const char *route)
{
    char rl[64];
    snprintf(rl, sizeof rl, "route=\"%s\"", route);
    const char *labels[] = {rl, NULL};
    return (long)e2e_metric_value(m, name, labels);
}

struct traffic {
    uint16_t port;
    atomic_bool stop;
    atomic_long sent;
};

static void *traffic_main(void *arg)
{
    struct traffic *t = arg;
    /* bounded: at most 3000 requests or until stopped */
    for (int i = 0; i < 3000 && !atomic_load(&t->stop); i++) {
        struct e2e_resp r;
        e2e_get(t->port, "/v1/pass/x", &r);
        e2e_resp_free(&r);
        atomic_fetch_add(&t->sent, 1);
    }
    return NULL;
}

Test(status, page_in_chromium_matches_metrics)
{
    struct stat sb;
    if (stat(CHROMIUM, &sb) != 0)
        cr_skip_test("Chromium is not installed at " CHROMIUM " (scripts/deps.sh installs the chromium package)");
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);

    /* traffic on the idempotent route: 6 executions, 6 replays, 2 mismatches, and a client's mistake (a bad Host:
     * rejected, which SPEC 11 says is not an error) */
    const char *secret_key = "status-page-secret-key";
    const char *tenant = "Authorization: Bearer tenant-secret-scope";
    for (int i = 0; i < 6; i++) {
        char key[96];
        snprintf(key, sizeof key, "%s-%d-%u", secret_key, i, (unsigned)e2e_now_ms());
        const char *h[] = {tenant, NULL};
        struct e2e_resp r;
        e2e_http_key(gw->port, "POST", "/v1/pay/c", key, h, "{\"amount\":4242}", 0, &r);
        cr_assert_eq(r.status, 200);
        e2e_resp_free(&r);
        e2e_http_key(gw->port, "POST", "/v1/pay/c", key, h, "{\"amount\":4242}", 0, &r);
        cr_assert(e2e_resp_is_replay(&r));
        e2e_resp_free(&r);
        if (i < 2) {
            e2e_http_key(gw->port, "POST", "/v1/pay/c", key, h, "{\"amount\":1}", 0, &r);
            cr_assert_eq(r.status, 422);
            e2e_resp_free(&r);
        }
    }
    {
        const char *h[] = {tenant, "Host: bad,host", NULL};
        struct e2e_resp r;
        e2e_http_key(gw->port, "POST", "/v1/pay/c", "status-page-bad-host", h, "{}", 0, &r);
        cr_assert_eq(r.status, 400);
        e2e_resp_free(&r);
    }

    char url[128], jurl[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/", (unsigned)gw->admin_port);
    snprintf(jurl, sizeof jurl, "/status.json");

    /* under traffic: the page's count lies between the metrics read before and after it */
    struct traffic t = {.port = gw->port};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, traffic_main, &t), 0);
    while (atomic_load(&t.sent) < 20)
        e2e_sleep_ms(10);
    char *m0 = metrics(gw);
    char *dom = chromium(url, NULL);
    char *m1 = metrics(gw);
    atomic_store(&t.stop, true);
    pthread_join(th, NULL);
    long before = route_requests(m0, "pass"), after = route_requests(m1, "pass"),
         seen = dom_cell(dom, "pass", "requests");
    cr_expect(seen >= before && seen <= after, "under traffic the page showed %ld pass requests, metrics %ld..%ld",
              seen, before, after);
    cr_expect(before > 0 && after > before, "traffic ran while the page loaded (%ld..%ld)", before, after);
    free(m0);
    free(m1);
    free(dom);

    /* at rest: every number equals /metrics */
    char *m = metrics(gw);
    dom = chromium(url, NULL);
    cr_assert_not_null(strstr(dom, "<tr data-route=\"pay\">"), "no row for route pay: %.3000s", dom);
    cr_expect_eq(dom_cell(dom, "pay", "requests"), route_requests(m, "pay"));
    cr_expect_eq(dom_cell(dom, "pay", "requests"), 15);
    cr_expect_eq(dom_cell(dom, "pay", "errors"), 0, "a client's mistake is rejected, not an error");
    cr_expect_eq(dom_cell(dom, "pay", "replays"), route_metric(m, "idemgate_dedup_hits_total", "pay"));
    cr_expect_eq(dom_cell(dom, "pay", "replays"), 6);
    cr_expect_eq(dom_cell(dom, "pay", "mismatches"), route_metric(m, "idemgate_parameter_conflicts_total", "pay"));
    cr_expect_eq(dom_cell(dom, "pay", "mismatches"), 2);
    cr_expect_eq(dom_cell(dom, "pay", "in_flight"), route_metric(m, "idemgate_in_flight_conflicts_total", "pay"));
    cr_expect_eq(dom_cell(dom, "pay", "stuck"), route_metric(m, "idemgate_stuck_processing", "pay"));
    cr_expect_eq(dom_cell(dom, "pass", "requests"), route_requests(m, "pass"));
    cr_expect_not_null(strstr(dom, "id=\"pg\" class=\"up\">up<"), "Postgres shown up");
    cr_expect_null(strstr(dom, secret_key), "a key on the status page");
    cr_expect_null(strstr(dom, "tenant-secret-scope"), "a scope value on the status page");
    cr_expect_null(strstr(dom, "4242"), "a body on the status page");
    free(dom);
    free(m);

    struct e2e_resp r;
    e2e_get(gw->admin_port, jurl, &r);
    cr_expect_eq(r.status, 200);
    cr_expect_null(strstr((const char *)r.body, secret_key), "a key in status.json");
    cr_expect_null(strstr((const char *)r.body, "tenant-secret-scope"), "a scope value in status.json");
    e2e_resp_free(&r);
    e2e_get(gw->admin_port, "/", &r);
    cr_expect_eq(r.status, 200, "the page needs no admin token");
    cr_expect_str_eq(e2e_resp_header(&r, "Content-Type"), "text/html; charset=utf-8");
    e2e_resp_free(&r);

    /* a screenshot (IDEMGATE_STATUS_SCREENSHOT=path keeps it, e.g. for the README) */
    const char *keep = getenv("IDEMGATE_STATUS_SCREENSHOT");
    char shot[600], flag[640];
    snprintf(shot, sizeof shot, "%s", keep && *keep ? keep : "");
    if (!shot[0])
        snprintf(shot, sizeof shot, "%s/status.png", e2e_tmpdir());
    snprintf(flag, sizeof flag, "--screenshot=%s", shot);
    free(chromium(url, flag));
    cr_expect(stat(shot, &sb) == 0 && sb.st_size > 1000, "no screenshot written at %s", shot);
}

/* ---- the Grafana dashboard: it parses, and every metric its queries name exists in /metrics of a running gateway */

#include <jansson.h>

static void collect_exprs(json_t *v, char ***out, size_t *n)
{
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x)
        {
            if (strcmp(k, "expr") == 0 && json_is_string(x)) {
                *out = realloc(*out, (*n + 1) * sizeof **out);
                (*out)[(*n)++] = strdup(json_string_value(x));
            } else {
                collect_exprs(x, out, n);
            }
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) collect_exprs(x, out, n);
    }
}

/* The next metric name in s (idemgate_* or process_*, at the start of a word), or NULL. */
static const char *next_metric(const char *s)
{
    const char *a = strstr(s, "idemgate_"), *b = strstr(s, "process_");
    while (b && b > s && (isalnum((unsigned char)b[-1]) || b[-1] == '_'))
        b = strstr(b + 1, "process_");
    return !a ? b : !b ? a : a < b ? a : b;
}

Test(status, grafana_dashboard_names_only_real_metrics)
{
    char path[1024];
    const char *src = e2e_env("IDEMGATE_SRC_DIR");
    snprintf(path, sizeof path, "%s/docker/grafana-dashboard.json", src);
    json_error_t je;
    json_t *d = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    cr_assert_not_null(d, "%s:%d: %s", path, je.line, je.text);
    cr_assert(json_is_array(json_object_get(d, "panels")) && json_array_size(json_object_get(d, "panels")) >= 8,
              "the dashboard has its panels");
    /* the instance and job variables, and every query filtered by them */
    bool has_instance = false, has_job = false;
    size_t vi;
    json_t *var;
    json_array_foreach(json_object_get(json_object_get(d, "templating"), "list"), vi, var)
    {
        const char *vn = json_string_value(json_object_get(var, "name"));
        has_instance = has_instance || (vn && strcmp(vn, "instance") == 0);
        has_job = has_job || (vn && strcmp(vn, "job") == 0);
    }
    cr_expect(has_instance && has_job, "the dashboard has instance and job variables");
    char **exprs = NULL;
    size_t n = 0;
    collect_exprs(d, &exprs, &n);
    json_decref(d);
    for (size_t i = 0; i < n; i++)
        cr_expect(strstr(exprs[i], "instance=~\"$instance\"") && strstr(exprs[i], "job=~\"$job\""),
                  "a query not filtered by $instance and $job: %s", exprs[i]);
    cr_assert_geq(n, 10, "queries found: %zu", n);

    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);
    char *m = metrics(gw);
    size_t names = 0;
    static const char *const need[] = {"idemgate_requests_total",
                                       "idemgate_dedup_hits_total",
                                       "idemgate_in_flight_conflicts_total",
                                       "idemgate_parameter_conflicts_total",
                                       "idemgate_stuck_processing",
                                       "idemgate_store_seconds",
                                       "idemgate_upstream_seconds",
                                       "idemgate_store_errors_total",
                                       "idemgate_upstream_responses_total",
                                       "idemgate_stale_version_rejections_total",
                                       "idemgate_sequence_gaps_total",
                                       "idemgate_unknown_resolved_total",
                                       "idemgate_shadow_decisions_total",
                                       "idemgate_replay_cache_hits_total",
                                       "idemgate_replay_cache_entries",
                                       "idemgate_postgres_up",
                                       "idemgate_shed_total",
                                       "process_resident_memory_bytes",
                                       "process_cpu_seconds_total",
                                       "process_open_fds"};
    bool seen[sizeof need / sizeof need[0]] = {false};
    for (size_t i = 0; i < n; i++) {
        for (const char *p = next_metric(exprs[i]); p; p = next_metric(p + 1)) {
            size_t len = strspn(p, "abcdefghijklmnopqrstuvwxyz_0123456789");
            char name[128];
            snprintf(name, sizeof name, "%.*s", (int)len, p);
            static const char *const sfxs[] = {"_bucket", "_sum", "_count"};
            for (size_t s = 0; s < 3; s++) {
                size_t sl = strlen(sfxs[s]), nl = strlen(name);
                if (nl > sl && strcmp(name + nl - sl, sfxs[s]) == 0) {
                    char base[128], t[160];
                    snprintf(base, sizeof base, "%.*s", (int)(nl - sl), name);
                    snprintf(t, sizeof t, "# TYPE %s histogram\n", base);
                    if (strstr(m, t))
                        name[nl - sl] = '\0';
                }
            }
            char type_line[200];
            snprintf(type_line, sizeof type_line, "# TYPE %s ", name);
            cr_expect_not_null(strstr(m, type_line), "the dashboard queries %s, which /metrics does not have (%s)",
                               name, exprs[i]);
            for (size_t k = 0; k < sizeof need / sizeof need[0]; k++)
                seen[k] = seen[k] || strcmp(name, need[k]) == 0;
            names++;
            p += len - 1;
        }
        free(exprs[i]);
    }
    free(exprs);
    free(m);
    cr_expect_geq(names, 10);
    for (size_t k = 0; k < sizeof need / sizeof need[0]; k++)
        cr_expect(seen[k], "the dashboard has no panel over %s", need[k]);
}

/* SPEC 11: every outcome a dashboard query names is one of idemgate_requests_total's, and the Errors panel counts
 * exactly the server-side ones (a client's mistake is rejected, never an error). */
Test(status, grafana_errors_panel_counts_only_server_side_outcomes)
{
    static const char *const spec[] = {"forwarded", "replayed",          "mismatch",       "in_flight",  "rejected",
                                       "unknown",   "store_unavailable", "upstream_error", "overloaded", "passthrough"};
    static const char *const errors[] = {"unknown", "store_unavailable", "upstream_error", "overloaded"};
    char path[1024];
    snprintf(path, sizeof path, "%s/docker/grafana-dashboard.json", e2e_env("IDEMGATE_SRC_DIR"));
    json_error_t je;
    json_t *d = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    cr_assert_not_null(d, "%s:%d: %s", path, je.line, je.text);
    size_t pi, error_panels = 0, error_queries = 0;
    json_t *panel;
    json_array_foreach(json_object_get(d, "panels"), pi, panel)
    {
        const char *title = json_string_value(json_object_get(panel, "title"));
        bool is_errors = title && strcmp(title, "Errors") == 0;
        error_panels += is_errors;
        char **exprs = NULL;
        size_t n = 0;
        collect_exprs(panel, &exprs, &n);
        for (size_t i = 0; i < n; i++) {
            const char *m = strstr(exprs[i], "outcome=");
            bool requests = strstr(exprs[i], "idemgate_requests_total") != NULL;
            if (is_errors && requests) {
                cr_expect(m && strncmp(m, "outcome=~\"", 10) == 0, "the Errors panel selects outcomes: %s", exprs[i]);
                error_queries++;
            }
            if (m) {
                const char *v = strchr(m, '"') + 1, *end = strchr(v, '"');
                cr_assert(end, "%s", exprs[i]);
                bool seen[sizeof errors / sizeof errors[0]] = {false};
                size_t named = 0;
                while (v < end) {
                    size_t len = strcspn(v, "|\"");
                    bool known = false;
                    for (size_t k = 0; k < sizeof spec / sizeof spec[0]; k++)
                        known = known || (strlen(spec[k]) == len && strncmp(spec[k], v, len) == 0);
                    cr_expect(known, "panel %s names outcome %.*s, not one of SPEC 11's: %s", title ? title : "?",
                              (int)len, v, exprs[i]);
                    for (size_t k = 0; k < sizeof errors / sizeof errors[0]; k++)
                        if (strlen(errors[k]) == len && strncmp(errors[k], v, len) == 0)
                            seen[k] = true;
                    named++;
                    v += len + (v[len] == '|');
                }
                if (is_errors && requests) {
                    cr_expect_eq(named, sizeof errors / sizeof errors[0], "the Errors panel names %zu outcomes: %s",
                                 named, exprs[i]);
                    for (size_t k = 0; k < sizeof errors / sizeof errors[0]; k++)
                        cr_expect(seen[k], "the Errors panel does not count %s: %s", errors[k], exprs[i]);
                }
            }
            free(exprs[i]);
        }
        free(exprs);
    }
    cr_expect_eq(error_panels, 1, "one Errors panel");
    cr_expect_geq(error_queries, 1, "the Errors panel counts requests by outcome");
    json_decref(d);
}
