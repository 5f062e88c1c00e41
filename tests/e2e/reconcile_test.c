/* reconcile_test.c - end-to-end: `idemgate reconcile` (SPEC 12) on records made through the gateway, against the
 * test upstream's look-up (/_lookup), some of whose writes are forgotten (missing); unknown outcomes resolved with
 * --apply, then replayed or executed by a retry; the rate kept; --json parsed. Runs on Postgres and (suite citus)
 * on the Citus cluster. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gateway/json.h"
#include "tests/e2e/harness.h"

TestSuite(reconcile, .init = e2e_setup, .fini = e2e_teardown, .timeout = 180);

/* The route (a name of this process's: records of other runs in the shared database are not this test's), a 1 s
 * lease, a 1 s upstream timeout and grace 0s: an unknown outcome may be looked up 2 s after its claim. */
static struct e2e_gw *start_route(const struct e2e_upstream *up, const char *route)
{
    static const char idem[] = "key: required\n"
                               "lease: 1s\n"
                               "on_unknown: probe\n"
                               "probe:\n"
                               "  method: GET\n"
                               "  path: /_lookup?idempotency_key={key}\n"
                               "  found: [200]\n"
                               "  absent: [404]\n"
                               "  grace: 0s\n";
    struct e2e_pay_conf c = {.idem = idem, .timeout = "1s", .route = route};
    return e2e_gw_start_pay(up, &c, NULL);
}

static void post(const struct e2e_gw *gw, const char *key, const char *action, long want)
{
    char h[64];
    snprintf(h, sizeof h, "X-Test-Action: %s", action ? action : "none");
    const char *const extra[] = {h, NULL};
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/rc", key, action ? extra : NULL, "{\"r\":1}", 0, &r);
    cr_assert_eq(r.status, want, "POST %s (%s): %ld %s", key, action ? action : "plain", r.status,
                 r.body ? (const char *)r.body : "");
    e2e_resp_free(&r);
}

static void forget(const struct e2e_upstream *up, const char *key)
{
    char path[256];
    snprintf(path, sizeof path, "/_test/forget?key=%s", key);
    struct e2e_req rq = {.method = "POST", .path = path};
    struct e2e_resp r;
    e2e_http(up->port, &rq, &r);
    cr_assert_eq(r.status, 200, "forget %s", key);
    e2e_resp_free(&r);
}

struct run {
    int code;
    char *out, *err;
    double secs;
};

/* idemgate reconcile -c (the gateway's config) --route route, plus args (NULL-terminated). */
static void reconcile(const struct e2e_gw *gw, const char *route, const char *const *args, struct run *out)
{
    const char *argv[24] = {e2e_env("IDEMGATE_BIN"), "reconcile", "-c", gw->conf_path, "--route", route};
    size_t n = 6;
    for (size_t i = 0; args && args[i] && n < 23; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    uint64_t t0 = e2e_now_ms();
    out->code = e2e_run(argv, NULL, 60000, &out->out, &out->err);
    out->secs = (double)(e2e_now_ms() - t0) / 1000.0;
}

static void run_free(struct run *r)
{
    free(r->out);
    free(r->err);
}

/* From --json output: the value at pointer ptr of the line whose "key" is key (or of the summary line when key is
 * NULL), as text (into v); false when there is no such line. Every line must be JSON. */
static bool json_field(const char *out, const char *key, const char *ptr, char *v, size_t vn)
{
    bool found = false;
    for (const char *line = out; line && *line && !found;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        struct gw_json *j = gw_json_parse(line, len);
        cr_assert(j != NULL, "not a JSON line: %.*s", (int)len, line);
        const char *p;
        size_t pn;
        bool mine =
            key ? gw_json_pointer(j, "/key", &p, &pn) && pn == strlen(key) + 2 && memcmp(p + 1, key, pn - 2) == 0
                : gw_json_pointer(j, "/summary", &p, &pn);
        if (mine && gw_json_pointer(j, ptr, &p, &pn)) {
            if (pn >= 2 && p[0] == '"')
                p++, pn -= 2;
            snprintf(v, vn, "%.*s", (int)pn, p);
            found = true;
        }
        gw_json_destroy(j);
        line = nl ? nl + 1 : NULL;
    }
    return found;
}

static void expect_result(const char *out, const char *key, const char *result, const char *applied)
{
    char v[64] = "";
    cr_expect(json_field(out, key, "/result", v, sizeof v) && strcmp(v, result) == 0, "%s: result '%s', want %s", key,
              v, result);
    cr_expect(json_field(out, key, "/applied", v, sizeof v) && strcmp(v, applied) == 0, "%s: applied '%s', want %s",
              key, v, applied);
}

static long summary_count(const char *out, const char *name)
{
    char ptr[64], v[64] = "";
    snprintf(ptr, sizeof ptr, "/summary/%s", name);
    return json_field(out, NULL, ptr, v, sizeof v) ? strtol(v, NULL, 10) : -1;
}

Test(reconcile, reports_missing_and_settles_unknown_outcomes_with_apply)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char route[32];
    snprintf(route, sizeof route, "rc%d", (int)getpid());
    struct e2e_gw *gw = start_route(up, route);
    char a[4][96], found[96], absent[96];
    for (int i = 0; i < 4; i++) {
        char tag[16];
        snprintf(tag, sizeof tag, "rca%d", i);
        e2e_mkkey(a[i], sizeof a[i], tag);
        post(gw, a[i], NULL, 200);
    }
    e2e_mkkey(found, sizeof found, "rcfound");
    e2e_mkkey(absent, sizeof absent, "rcabsent");
    post(gw, found, "close", 502); /* executed, no answer: unknown; the look-up finds it */
    post(gw, absent, "lost", 502); /* never executed, no answer: unknown; the look-up does not */
    forget(up, a[2]);
    forget(up, a[3]);
    /* the gateway's own sweeper would settle the unknown outcomes: stopped; the take may go 2 s after the claim */
    cr_assert_eq(e2e_gw_stop(gw, 10000), 0);
    e2e_sleep_ms(2500);
    long lookups_before = e2e_upstream_count(up, NULL);

    /* 1. without --apply: reported, nothing settled; 6 records at 5/s take at least 1 s */
    static const char *const dry[] = {"--json", "--rate", "5/s", NULL};
    struct run r;
    reconcile(gw, route, dry, &r);
    cr_expect_eq(r.code, 1, "exit 1 when a record is missing: %d\nstdout:\n%s\nstderr:\n%s", r.code, r.out, r.err);
    expect_result(r.out, a[0], "confirmed", "false");
    expect_result(r.out, a[1], "confirmed", "false");
    expect_result(r.out, a[2], "missing", "false");
    expect_result(r.out, a[3], "missing", "false");
    expect_result(r.out, found, "resolved-found", "false");
    expect_result(r.out, absent, "resolved-absent", "false");
    cr_expect_eq(summary_count(r.out, "records"), 6, "%s", r.out);
    cr_expect_eq(summary_count(r.out, "missing"), 2);
    cr_expect_eq(summary_count(r.out, "confirmed"), 2);
    cr_expect_eq(summary_count(r.out, "applied"), 0);
    cr_expect(r.secs >= 0.95, "6 look-ups at 5/s took %.2fs", r.secs);
    run_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), lookups_before, "reconcile forwarded an intent");

    /* the table form: a line per record and the summary line */
    static const char *const table[] = {"--state", "completed", "--rate", "100", NULL};
    reconcile(gw, route, table, &r);
    cr_expect_eq(r.code, 1);
    cr_expect(strstr(r.out, "summary: route=") && strstr(r.out, " missing=2 ") && strstr(r.out, " records=4 "),
              "table summary: %s", r.out);
    cr_expect(strstr(r.out, a[2]) && strstr(r.out, "missing"), "%s", r.out);
    run_free(&r);

    /* 2. --apply on the unknown outcomes: settled through the sweeper's fenced statements */
    static const char *const apply[] = {"--json", "--state", "unknown", "--apply", "--rate", "50/s", NULL};
    reconcile(gw, route, apply, &r);
    cr_expect_eq(r.code, 0, "nothing missing among the unknown outcomes: %d\n%s\n%s", r.code, r.out, r.err);
    expect_result(r.out, found, "resolved-found", "true");
    expect_result(r.out, absent, "resolved-absent", "true");
    cr_expect_eq(summary_count(r.out, "records"), 2, "%s", r.out);
    run_free(&r);
    reconcile(gw, route, apply, &r);
    cr_expect_eq(summary_count(r.out, "records"), 0, "no unknown outcome is left: %s", r.out);
    run_free(&r);

    /* 3. a retry replays the settled answer; the absent one executes once */
    gw = start_route(up, route);
    struct e2e_resp rep;
    e2e_http_key(gw->port, "POST", "/v1/pay/rc", found, NULL, "{\"r\":1}", 0, &rep);
    cr_expect(e2e_resp_is_replay(&rep), "the found outcome replays: %ld %s", rep.status,
              rep.body ? (const char *)rep.body : "");
    cr_expect(rep.body && strstr((const char *)rep.body, "\"found\":true"), "the looked-up answer");
    e2e_resp_free(&rep);
    post(gw, absent, NULL, 200);
    cr_expect_eq(e2e_upstream_count(up, absent), 1, "the absent outcome executes once on its retry");
    cr_expect_eq(e2e_upstream_count(up, found), 1, "the found outcome never executes again");
}

Test(reconcile, a_route_without_probe_is_an_error)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_pay_conf c = {.idem = "key: required\n"};
    struct e2e_gw *gw = e2e_gw_start_pay(up, &c, NULL);
    struct run r;
    reconcile(gw, "pay", NULL, &r);
    cr_expect_eq(r.code, 2, "exit %d", r.code);
    cr_expect(r.err && strstr(r.err, "route 'pay' has no probe"), "stderr: %s", r.err ? r.err : "");
    run_free(&r);
    reconcile(gw, "nosuch", NULL, &r);
    cr_expect_eq(r.code, 2);
    cr_expect(r.err && strstr(r.err, "no route named 'nosuch'"), "stderr: %s", r.err ? r.err : "");
    run_free(&r);
    static const char *const bad[] = {"--rate", "0", NULL};
    reconcile(gw, "pay", bad, &r);
    cr_expect_eq(r.code, 2);
    run_free(&r);
}
