/* access_test.c - end-to-end tests of what makes every request traceable (SPEC 11): request ids, the access log,
 * the outcome classes, Retry-After on a key in use and trusted proxies; the real idemgate in front of the real test
 * upstream, with the real Postgres and Redis. */
#include <criterion/criterion.h>

#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <jansson.h>

#include "harness.h"

TestSuite(access, .init = e2e_setup, .fini = e2e_teardown, .timeout = 120);

/* A gateway from e2e_conf_pay's template (pay's idempotency block idem, the upstream's timeout) with the top-level
 * lines top (may be NULL) put before it. */
static struct e2e_gw *start(const struct e2e_upstream *up, const char *top, const char *idem, const char *timeout)
{
    struct e2e_pay_conf c = {.idem = idem, .timeout = timeout};
    char *pay = e2e_conf_pay(&c);
    size_t n = strlen(pay) + (top ? strlen(top) : 0) + 1;
    char *tmpl = malloc(n);
    cr_assert(tmpl);
    snprintf(tmpl, n, "%s%s", top ? top : "", pay);
    free(pay);
    struct e2e_gw_opts o = {.up = up, .wait_ready = true};
    struct e2e_gw *g = e2e_gw_start(tmpl, &o);
    free(tmpl);
    return g;
}

static bool is_hex_id(const char *s)
{
    if (!s || strlen(s) != 32)
        return false;
    for (const char *p = s; *p; p++)
        if (!isxdigit((unsigned char)*p) || isupper((unsigned char)*p))
            return false;
    return true;
}

/* The value of "name": "..." in a JSON body (a bounded copy into out), or NULL. */
static const char *json_str(const struct e2e_resp *r, const char *name, char *out, size_t n)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":\"", name);
    const char *p = r->body ? strstr((const char *)r->body, pat) : NULL;
    if (!p)
        return NULL;
    p += strlen(pat);
    const char *q = strchr(p, '"');
    if (!q || (size_t)(q - p) >= n)
        return NULL;
    snprintf(out, n, "%.*s", (int)(q - p), p);
    return out;
}

/* The upstream's copy of the last request's header name (heap, caller frees), or NULL. */
static char *upstream_header(const struct e2e_upstream *up, const char *name)
{
    char *text = e2e_upstream_last_headers(up);
    struct e2e_hdr *hd;
    size_t n = e2e_parse_header_lines(text, &hd);
    cr_expect_eq(e2e_hdrs_count(hd, n, name), 1, "one %s upstream expected:\n%s", name, text);
    const char *v = e2e_hdrs_get(hd, n, name);
    char *out = v ? strdup(v) : NULL;
    e2e_hdrs_free(hd, n);
    free(text);
    return out;
}

/* ---- request ids */

Test(access, request_ids_are_made_forwarded_and_set_on_every_answer)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "key: required\n", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "rid");
    /* a client's own id is not believed (no trusted proxy): it is replaced, and so is the upstream's */
    const char *const extra[] = {"X-Request-Id: client-chose-this", "X-Test-Header: X-Request-Id: upstream-chose",
                                 NULL};
    struct e2e_resp first, again, bad;
    e2e_http_key(gw->port, "POST", "/v1/pay/x", key, extra, "{\"a\":1}", 0, &first);
    cr_assert_eq(first.status, 200, "first: %ld %s", first.status, first.error);
    cr_expect_eq(e2e_resp_header_count(&first, "X-Request-Id"), 1);
    const char *rid1 = e2e_resp_header(&first, "X-Request-Id");
    cr_assert(is_hex_id(rid1), "a new id is 128 random bits in hex: %s", rid1 ? rid1 : "(none)");
    char *sent = upstream_header(up, "X-Request-Id");
    cr_expect(sent && strcmp(sent, rid1) == 0, "the upstream got the request's id: %s vs %s", sent, rid1);
    free(sent);
    /* the record keeps the id of the request that executed */
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT request_id FROM idemgate_keys WHERE route = 'pay' AND key = '%s'", key);
    char *kept = e2e_psql(sql);
    cr_expect(kept && strstr(kept, rid1), "the record's request_id is the first request's: %s", kept ? kept : "");
    free(kept);

    e2e_http_key(gw->port, "POST", "/v1/pay/x", key, extra, "{\"a\":1}", 0, &again);
    cr_assert(e2e_resp_is_replay(&again), "a replay: %ld", again.status);
    cr_expect_eq(e2e_resp_header_count(&again, "X-Request-Id"), 1, "the stored value is replaced, not added to");
    const char *rid2 = e2e_resp_header(&again, "X-Request-Id");
    cr_expect(is_hex_id(rid2) && strcmp(rid1, rid2) != 0, "the replay names its own request: %s vs %s", rid2, rid1);

    /* a problem body names the request too */
    const char *const badkey[] = {"Idempotency-Key: a\x01", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/x", NULL, badkey, "{}", 0, &bad);
    cr_assert_eq(bad.status, 400, "%ld", bad.status);
    const char *rid3 = e2e_resp_header(&bad, "X-Request-Id");
    char body_rid[160];
    cr_expect(is_hex_id(rid3), "a problem answer has an id too");
    cr_expect(json_str(&bad, "request_id", body_rid, sizeof body_rid) && rid3 && strcmp(body_rid, rid3) == 0,
              "request_id in the problem body equals the header: %s", bad.body);
    e2e_resp_free(&first);
    e2e_resp_free(&again);
    e2e_resp_free(&bad);
    e2e_gw_stop(gw, 5000);
}

Test(access, request_id_header_is_configurable)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "request_id_header: X-Correlation-Id\n", "key: required\n", NULL);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pass/x", NULL, NULL, "{}", 0, &r);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.error);
    const char *rid = e2e_resp_header(&r, "X-Correlation-Id");
    cr_expect(is_hex_id(rid), "the configured header carries the id");
    char *sent = upstream_header(up, "X-Correlation-Id");
    cr_expect(sent && rid && strcmp(sent, rid) == 0, "forwarded in the configured header");
    free(sent);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

/* ---- the access log */

/* The first line of text holding every needle (heap, caller frees), or NULL. */
static char *line_with(const char *text, const char *a, const char *b)
{
    for (const char *p = text; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        char *l = strndup(p, n);
        if (strstr(l, a) && (!b || strstr(l, b)))
            return l;
        free(l);
        p = nl ? nl + 1 : NULL;
    }
    return NULL;
}

/* Waits (bounded) for a line of the gateway's log with both needles; returns it (heap) or NULL. */
static char *wait_log_line(const struct e2e_gw *gw, const char *a, const char *b)
{
    for (int i = 0; i < 100; i++) {
        char *log = e2e_gw_log(gw);
        char *l = line_with(log, a, b);
        free(log);
        if (l)
            return l;
        e2e_sleep_ms(50);
    }
    return NULL;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *buf = calloc(1, 1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    (void)n;
    fclose(f);
    return buf;
}

static char *wait_file_line(const char *path, const char *a, const char *b)
{
    for (int i = 0; i < 100; i++) {
        char *t = read_file(path);
        char *l = t ? line_with(t, a, b) : NULL;
        free(t);
        if (l)
            return l;
        e2e_sleep_ms(50);
    }
    return NULL;
}

Test(access, a_504_unknown_outcome_and_its_retry_are_logged)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, NULL, "key: required\nlease: 30s\n", "1s");
    char key[64], needle[128];
    e2e_mkkey(key, sizeof key, "t504");
    const char *const slow[] = {"X-Test-Delay-Ms: 3000", NULL};
    struct e2e_resp r1, r2;
    e2e_http_key(gw->port, "POST", "/v1/pay/x?card=1", key, slow, "{\"a\":1}", 0, &r1);
    cr_assert_eq(r1.status, 504, "%ld", r1.status);
    const char *rid1 = e2e_resp_header(&r1, "X-Request-Id");
    cr_assert(rid1);
    snprintf(needle, sizeof needle, "request_id=%s", rid1);
    char *l1 = wait_log_line(gw, "event=access", needle);
    cr_assert(l1, "the 504 unknown outcome has an access line");
    cr_log_info("504 line: %s", l1);
    cr_expect(strstr(l1, " status=504 ") && strstr(l1, " route=pay ") && strstr(l1, " method=POST ") &&
                  strstr(l1, " path=/v1/pay/x ") && strstr(l1, " upstream_ms=") && strstr(l1, " token=") &&
                  strstr(l1, " replayed=false"),
              "%s", l1);
    cr_expect(!strstr(l1, "card=1"), "never the query: %s", l1);
    snprintf(needle, sizeof needle, " key=\"%s\"", key);
    cr_expect(strstr(l1, needle), "the key as sent: %s", l1);

    e2e_http_key(gw->port, "POST", "/v1/pay/x?card=1", key, NULL, "{\"a\":1}", 0, &r2);
    cr_assert_eq(r2.status, 409, "the retry: %ld", r2.status);
    const char *rid2 = e2e_resp_header(&r2, "X-Request-Id");
    snprintf(needle, sizeof needle, "request_id=%s", rid2);
    char *l2 = wait_log_line(gw, "event=access", needle);
    cr_assert(l2, "the retry has an access line");
    cr_log_info("retry line: %s", l2);
    snprintf(needle, sizeof needle, " original_request_id=%s", rid1);
    cr_expect(strstr(l2, needle) && strstr(l2, " status=409 "), "the retry names the request that executed: %s", l2);
    free(l1);
    free(l2);
    e2e_resp_free(&r1);
    e2e_resp_free(&r2);
    e2e_gw_stop(gw, 5000);
}

Test(access, json_lines_parse_with_jansson)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "log_format: json\n", "key: required\n", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "json");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/x", key, NULL, "{\"a\":1}", 0, &r);
    cr_assert_eq(r.status, 200);
    char *l = wait_log_line(gw, "\"event\":\"access\"", e2e_resp_header(&r, "X-Request-Id"));
    cr_assert(l, "a JSON access line");
    json_error_t je;
    json_t *o = json_loads(l, 0, &je);
    cr_assert(o && json_is_object(o), "one JSON object: %s (%s)", l, je.text);
    cr_expect_str_eq(json_string_value(json_object_get(o, "route")), "pay");
    cr_expect_eq(json_integer_value(json_object_get(o, "status")), 200);
    cr_expect_str_eq(json_string_value(json_object_get(o, "outcome")), "forwarded");
    cr_expect_str_eq(json_string_value(json_object_get(o, "key")), key);
    cr_expect(json_is_false(json_object_get(o, "replayed")));
    json_decref(o);
    /* every other line is JSON too */
    char *log = e2e_gw_log(gw);
    char *start_line = line_with(log, "\"event\":\"started\"", NULL);
    cr_assert(start_line, "the start line in JSON");
    json_t *s = json_loads(start_line, 0, &je);
    cr_expect(s && json_is_object(s), "%s", start_line);
    json_decref(s);
    free(start_line);
    free(log);
    free(l);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

Test(access, the_file_is_reopened_on_sigusr1)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char path[512], moved[512], top[600];
    snprintf(path, sizeof path, "%s/access.log", e2e_tmpdir());
    snprintf(moved, sizeof moved, "%s/access.log.1", e2e_tmpdir());
    snprintf(top, sizeof top, "access_log: %s\n", path);
    struct e2e_gw *gw = start(up, top, "key: required\n", NULL);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pass/one", NULL, NULL, "{}", 0, &r);
    cr_assert_eq(r.status, 200);
    char *l = wait_file_line(path, "event=access", "path=/v1/pass/one");
    cr_assert(l, "the line is in the file");
    free(l);
    e2e_resp_free(&r);
    cr_assert_eq(rename(path, moved), 0);
    kill(gw->proc.pid, SIGUSR1);
    e2e_sleep_ms(300);
    e2e_http_key(gw->port, "POST", "/v1/pass/two", NULL, NULL, "{}", 0, &r);
    cr_assert_eq(r.status, 200);
    l = wait_file_line(path, "event=access", "path=/v1/pass/two");
    cr_expect(l, "after SIGUSR1 a new file at the path gets the lines");
    free(l);
    char *old = read_file(moved);
    cr_expect(old && !strstr(old, "/v1/pass/two"), "the moved file gets no more lines");
    free(old);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

Test(access, a_full_disk_drops_and_counts_lines)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "access_log: /dev/full\n", "key: required\n", NULL);
    for (int i = 0; i < 20; i++) {
        struct e2e_resp r;
        e2e_http_key(gw->port, "POST", "/v1/pass/x", NULL, NULL, "{}", 0, &r);
        cr_assert_eq(r.status, 200, "requests are answered whatever the log: %ld", r.status);
        e2e_resp_free(&r);
    }
    double dropped = 0;
    for (int i = 0; i < 40 && dropped < 20; i++) {
        struct e2e_resp m;
        e2e_get(gw->admin_port, "/metrics", &m);
        const char *const none[] = {NULL};
        dropped = e2e_metric_value((const char *)m.body, "idemgate_log_dropped_total", none);
        e2e_resp_free(&m);
        if (dropped < 20)
            e2e_sleep_ms(50);
    }
    cr_expect_geq(dropped, 20, "every line that could not be written is counted: %f", dropped);
    e2e_gw_stop(gw, 5000);
}

Test(access, no_secret_reaches_a_log_a_metric_or_the_status_page)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    char path[512], top[600];
    snprintf(path, sizeof path, "%s/secret.log", e2e_tmpdir());
    snprintf(top, sizeof top, "access_log: %s\n", path);
    struct e2e_gw *gw = start(up, top, "key: required\nscope: [header:Authorization]\n", NULL);
    const char *jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJzZWNyZXQtdXNlciJ9.c2lnbmF0dXJlLXNlY3JldA";
    char auth[256];
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", jwt);
    const char *const extra[] = {auth, NULL};
    char key[64];
    e2e_mkkey(key, sizeof key, "secret");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/x?password=hunter2secret", key, extra, "{\"pan\":\"4111111111111111\"}", 0,
                 &r);
    cr_assert_eq(r.status, 200, "%ld", r.status);
    char *l = wait_file_line(path, "event=access", key);
    cr_assert(l, "the request's line");
    cr_expect(strstr(l, " scope="), "the scope's hash prefix is there: %s", l);
    free(l);
    e2e_resp_free(&r);
    struct e2e_resp m, st, sj;
    e2e_get(gw->admin_port, "/metrics", &m);
    e2e_get(gw->admin_port, "/", &st);
    e2e_get(gw->admin_port, "/status.json", &sj);
    char *log = e2e_gw_log(gw), *file = read_file(path);
    const char *outputs[] = {log, file, (const char *)m.body, (const char *)st.body, (const char *)sj.body};
    const char *secrets[] = {jwt, "hunter2secret", "password=", "4111111111111111", "c2lnbmF0dXJlLXNlY3JldA"};
    for (size_t i = 0; i < sizeof outputs / sizeof outputs[0]; i++)
        for (size_t j = 0; j < sizeof secrets / sizeof secrets[0]; j++)
            cr_expect(outputs[i] && !strstr(outputs[i], secrets[j]), "output %zu holds secret %zu", i, j);
    free(log);
    free(file);
    e2e_resp_free(&m);
    e2e_resp_free(&st);
    e2e_resp_free(&sj);
    e2e_gw_stop(gw, 5000);
}
