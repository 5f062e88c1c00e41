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

/* ---- trusted proxies (SPEC 7, 11): from a peer inside trusted_proxies the forwarding headers and the request id
 * are believed when valid, and the logged client is the rightmost untrusted X-Forwarded-For address; from any other
 * peer they are the gateway's own. The test client is 127.0.0.1. */

/* What the upstream got for the last request. */
struct seen {
    char *text;
    struct e2e_hdr *h;
    size_t n;
};

static void seen_load(const struct e2e_upstream *up, struct seen *s)
{
    s->text = e2e_upstream_last_headers(up);
    s->n = e2e_parse_header_lines(s->text, &s->h);
}

static const char *seen_one(const struct seen *s, const char *name)
{
    cr_expect_leq(e2e_hdrs_count(s->h, s->n, name), 1, "at most one %s upstream:\n%s", name, s->text);
    return e2e_hdrs_get(s->h, s->n, name);
}

static void seen_free(struct seen *s)
{
    e2e_hdrs_free(s->h, s->n);
    free(s->text);
}

/* The access line of the answer r (found by its request id). */
static char *access_line(const struct e2e_gw *gw, const struct e2e_resp *r)
{
    const char *rid = e2e_resp_header(r, "X-Request-Id");
    cr_assert(rid, "the answer carries a request id");
    char needle[200];
    snprintf(needle, sizeof needle, "request_id=%s ", rid);
    char *l = wait_log_line(gw, "event=access", needle);
    cr_assert(l, "an access line for request %s", rid);
    return l;
}

/* The client= field of an access line (a bounded copy). */
static const char *client_of(const char *line, char *out, size_t n)
{
    const char *p = strstr(line, " client=");
    out[0] = '\0';
    if (p)
        snprintf(out, n, "%.*s", (int)strcspn(p + 8, " "), p + 8);
    return out;
}

/* A GET of /v1/pass/t with extra (NULL-terminated header lines); the answer in *r. */
static void tp_get(const struct e2e_gw *gw, const char *const *extra, struct e2e_resp *r)
{
    e2e_http_key(gw->port, "GET", "/v1/pass/t", NULL, extra, NULL, 0, r);
    cr_assert_eq(r->status, 200, "%ld %s", r->status, r->error);
}

static const char *const edge_headers[] = {"X-Forwarded-Proto: https",
                                           "X-Forwarded-Host: shop.example:443",
                                           "X-Request-Id: edge-4711/a.b",
                                           "X-Forwarded-For: 198.51.100.9, 203.0.113.7, 10.1.2.3",
                                           "X-Forwarded-Ssl: on",
                                           "X-Real-IP: 203.0.113.7",
                                           "Forwarded: for=203.0.113.7;proto=https",
                                           NULL};

Test(access, trusted_proxy_headers_and_request_id_are_believed)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "trusted_proxies: [127.0.0.0/8, 10.0.0.0/8]\n", "key: required\n", NULL);
    char key[64];
    e2e_mkkey(key, sizeof key, "tp");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/pay/x", key, edge_headers, "{\"a\":1}", 0, &r);
    cr_assert_eq(r.status, 200, "%ld %s", r.status, r.error);
    struct seen s;
    seen_load(up, &s);
    /* behind a TLS edge the upstream sees https, the edge's host and the edge's request id */
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-Proto") ?: "(none)", "https", "%s", s.text);
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-Host") ?: "(none)", "shop.example:443", "%s", s.text);
    cr_expect_str_eq(seen_one(&s, "X-Request-Id") ?: "(none)", "edge-4711/a.b", "%s", s.text);
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-For") ?: "(none)", "198.51.100.9, 203.0.113.7, 10.1.2.3, 127.0.0.1",
                     "%s", s.text);
    /* SPEC 7's other forwarding headers are dropped only from untrusted peers */
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-Ssl") ?: "(none)", "on", "%s", s.text);
    cr_expect_str_eq(seen_one(&s, "X-Real-IP") ?: "(none)", "203.0.113.7", "%s", s.text);
    /* Forwarded is never passed on: the gateway does not write its own element into it */
    cr_expect_eq(e2e_hdrs_count(s.h, s.n, "Forwarded"), 0, "%s", s.text);
    seen_free(&s);
    cr_expect_str_eq(e2e_resp_header(&r, "X-Request-Id") ?: "(none)", "edge-4711/a.b", "the answer names it too");
    char *l = access_line(gw, &r);
    char cl[64];
    cr_expect_str_eq(client_of(l, cl, sizeof cl), "203.0.113.7", "the rightmost untrusted address: %s", l);
    cr_log_info("trusted: %s", l);
    free(l);
    e2e_resp_free(&r);

    /* a replay: the stored id is replaced by this request's, and its line names the one that executed */
    const char *const again_h[] = {"X-Request-Id: edge-4712", "X-Forwarded-For: 192.0.2.1", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/x", key, again_h, "{\"a\":1}", 0, &r);
    cr_assert(e2e_resp_is_replay(&r), "a replay: %ld", r.status);
    cr_expect_str_eq(e2e_resp_header(&r, "X-Request-Id") ?: "(none)", "edge-4712");
    l = access_line(gw, &r);
    cr_expect(strstr(l, " original_request_id=edge-4711/a.b") && strstr(l, " client=192.0.2.1"), "%s", l);
    free(l);
    e2e_resp_free(&r);

    /* a problem answer too: the id in its header and body */
    const char *const bad_h[] = {"X-Request-Id: edge-4713", NULL};
    e2e_http_key(gw->port, "POST", "/v1/pay/x", NULL, bad_h, "{}", 0, &r);
    e2e_expect_problem(&r, 400, "idempotency-key-missing", "no key");
    cr_expect_str_eq(e2e_resp_header(&r, "X-Request-Id") ?: "(none)", "edge-4713");
    cr_expect(r.body && strstr((const char *)r.body, "\"request_id\":\"edge-4713\""), "%s", r.body);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

Test(access, untrusted_peer_headers_are_replaced)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    /* a list that does not hold the test client (127.0.0.1) */
    struct e2e_gw *gw = start(up, "trusted_proxies: [10.0.0.0/8, \"::1\", 127.0.0.2/32]\n", "key: required\n", NULL);
    struct e2e_resp r;
    tp_get(gw, edge_headers, &r);
    struct seen s;
    seen_load(up, &s);
    char host[64];
    snprintf(host, sizeof host, "127.0.0.1:%u", (unsigned)gw->port);
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-Proto") ?: "(none)", "http", "%s", s.text);
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-Host") ?: "(none)", host, "%s", s.text);
    const char *rid = seen_one(&s, "X-Request-Id");
    cr_expect(is_hex_id(rid), "a new id: %s", rid ? rid : "(none)");
    cr_expect_str_eq(seen_one(&s, "X-Forwarded-For") ?: "(none)", "198.51.100.9, 203.0.113.7, 10.1.2.3, 127.0.0.1",
                     "kept from any peer, the peer appended: %s", s.text);
    cr_expect_eq(e2e_hdrs_count(s.h, s.n, "X-Forwarded-Ssl"), 0, "%s", s.text);
    cr_expect_eq(e2e_hdrs_count(s.h, s.n, "X-Real-IP"), 0, "%s", s.text);
    cr_expect_eq(e2e_hdrs_count(s.h, s.n, "Forwarded"), 0, "%s", s.text);
    seen_free(&s);
    cr_expect(is_hex_id(e2e_resp_header(&r, "X-Request-Id")), "the answer carries the new id");
    char *l = access_line(gw, &r);
    char cl[64];
    cr_expect_str_eq(client_of(l, cl, sizeof cl), "127.0.0.1", "the peer: %s", l);
    free(l);
    e2e_resp_free(&r);
    e2e_gw_stop(gw, 5000);
}

/* One request from the trusted test client: what the upstream got as X-Forwarded-Proto, -Host and the request id,
 * and the access line's client. */
struct verdict {
    char proto[64], host[300], rid[300], client[64];
};

static void ask(const struct e2e_gw *gw, const struct e2e_upstream *up, const char *const *extra, struct verdict *v)
{
    struct e2e_resp r;
    tp_get(gw, extra, &r);
    struct seen s;
    seen_load(up, &s);
    snprintf(v->proto, sizeof v->proto, "%s", seen_one(&s, "X-Forwarded-Proto") ?: "(none)");
    snprintf(v->host, sizeof v->host, "%s", seen_one(&s, "X-Forwarded-Host") ?: "(none)");
    snprintf(v->rid, sizeof v->rid, "%s", seen_one(&s, "X-Request-Id") ?: "(none)");
    seen_free(&s);
    char *l = access_line(gw, &r);
    client_of(l, v->client, sizeof v->client);
    free(l);
    e2e_resp_free(&r);
}

Test(access, trusted_proxy_invalid_values_are_not_believed)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "trusted_proxies: [127.0.0.1, 10.0.0.0/8]\n", "key: required\n", NULL);
    char host[64];
    snprintf(host, sizeof host, "127.0.0.1:%u", (unsigned)gw->port);
    char long_id[160];
    memset(long_id, 'a', 129);
    long_id[129] = '\0';
    char long_hdr[200];
    snprintf(long_hdr, sizeof long_hdr, "X-Request-Id: %s", long_id);
    struct verdict v;

    const char *const bad1[] = {"X-Forwarded-Proto: javascript", "X-Forwarded-Host: evil.example/x",
                                "X-Request-Id: has space", NULL};
    ask(gw, up, bad1, &v);
    cr_expect_str_eq(v.proto, "http");
    cr_expect_str_eq(v.host, host);
    cr_expect(is_hex_id(v.rid), "an id with a space is replaced: %s", v.rid);
    cr_expect_str_eq(v.client, "127.0.0.1", "no X-Forwarded-For: the peer");

    const char *const bad2[] = {long_hdr, "X-Forwarded-Host: a.example, b.example", "X-Forwarded-Proto: https, http",
                                NULL};
    ask(gw, up, bad2, &v);
    cr_expect(is_hex_id(v.rid), "an id of 129 bytes is replaced: %s", v.rid);
    cr_expect_str_eq(v.host, host, "a list is not one host");
    cr_expect_str_eq(v.proto, "http", "a list is not one scheme");

    /* exactly 128 bytes is an id; two ids are none */
    long_id[128] = '\0';
    snprintf(long_hdr, sizeof long_hdr, "X-Request-Id: %s", long_id);
    const char *const ok128[] = {long_hdr, "X-Forwarded-Host: [2001:db8::1]:8443", "X-Forwarded-Proto: HTTPS", NULL};
    ask(gw, up, ok128, &v);
    cr_expect_str_eq(v.rid, long_id);
    cr_expect_str_eq(v.host, "[2001:db8::1]:8443");
    cr_expect_str_eq(v.proto, "https", "the scheme is case-insensitive, sent in lower case");
    const char *const two[] = {"X-Request-Id: one", "X-Request-Id: two", NULL};
    ask(gw, up, two, &v);
    cr_expect(is_hex_id(v.rid), "two ids are not believed: %s", v.rid);

    /* the X-Forwarded-For walk, right to left over trusted addresses (as nginx's real_ip_recursive) */
    static const struct {
        const char *xff, *client, *what;
    } walks[] = {
        {"203.0.113.7, garbage, 10.1.2.3", "10.1.2.3", "a malformed entry stops the walk at the last good one"},
        {"203.0.113.7, 10.1.2.3, unknown", "127.0.0.1", "the rightmost malformed: the peer"},
        {"10.0.0.1, 10.0.0.2", "10.0.0.1", "all trusted: the leftmost"},
        {"2001:db8::7, 10.0.0.2", "2001:db8::7", "an IPv6 entry"},
        {"[2001:db8::8]:4711,10.9.9.9:80", "2001:db8::8", "ports and brackets are not part of the address"},
        {"::ffff:10.0.0.5, ::ffff:192.0.2.5", "192.0.2.5", "an IPv4-mapped entry is its IPv4 address"},
        {"192.0.2.200, ::ffff:10.0.0.5", "192.0.2.200", "a mapped trusted entry is skipped"},
    };
    for (size_t i = 0; i < sizeof walks / sizeof walks[0]; i++) {
        char h[200];
        snprintf(h, sizeof h, "X-Forwarded-For: %s", walks[i].xff);
        const char *const x[] = {h, NULL};
        ask(gw, up, x, &v);
        cr_expect_str_eq(v.client, walks[i].client, "%s: %s", walks[i].what, walks[i].xff);
    }
    /* two X-Forwarded-For fields are one list, in order */
    const char *const split[] = {"X-Forwarded-For: 192.0.2.9", "X-Forwarded-For: 10.3.3.3", NULL};
    ask(gw, up, split, &v);
    cr_expect_str_eq(v.client, "192.0.2.9", "the walk goes on into the earlier field");
    e2e_gw_stop(gw, 5000);
}

Test(access, trusted_proxies_reloaded_on_sighup)
{
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw *gw = start(up, "trusted_proxies: [10.0.0.0/8]\n", "key: required\n", NULL);
    const char *const h[] = {"X-Request-Id: from-the-edge", "X-Forwarded-For: 192.0.2.44", NULL};
    struct verdict v;
    ask(gw, up, h, &v);
    cr_expect(is_hex_id(v.rid), "not trusted yet: %s", v.rid);
    cr_expect_str_eq(v.client, "127.0.0.1");

    const char *at = strstr(gw->conf_text, "trusted_proxies: [10.0.0.0/8]\n");
    cr_assert(at);
    size_t head = (size_t)(at - gw->conf_text);
    const char *rest = at + strlen("trusted_proxies: [10.0.0.0/8]\n");
    size_t n = strlen(gw->conf_text) + 64;
    char *next = malloc(n);
    cr_assert(next);
    snprintf(next, n, "%.*strusted_proxies: [10.0.0.0/8, \"127.0.0.1/32\"]\n%s", (int)head, gw->conf_text, rest);
    const char *tmp = e2e_write_file("next.yaml", next);
    free(next);
    cr_assert_eq(rename(tmp, gw->conf_path), 0);
    cr_assert_eq(kill(gw->proc.pid, SIGHUP), 0);
    cr_assert(e2e_gw_log_wait(gw, "event=reloaded", 10000), "reloaded");
    ask(gw, up, h, &v);
    cr_expect_str_eq(v.rid, "from-the-edge", "trusted after the reload");
    cr_expect_str_eq(v.client, "192.0.2.44");
    e2e_gw_stop(gw, 5000);
}

Test(access, trusted_proxies_check_refuses_a_bad_cidr)
{
    static const struct {
        const char *value, *want;
    } bad[] = {
        {"[10.0.0.0/33]", "trusted_proxies[0]: '10.0.0.0/33'"},
        {"[10.0.0.1/8]", "trusted_proxies[0]: '10.0.0.1/8'"},
        {"[127.0.0.0/8, 'fe80::/129']", "trusted_proxies[1]: 'fe80::/129'"},
        {"[localhost]", "trusted_proxies[0]: 'localhost'"},
        {"10.0.0.0/8", "trusted_proxies: "},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[512];
        snprintf(text, sizeof text,
                 "store:\n  postgres: postgresql://idemgate@127.0.0.1:5432/idemgate\n"
                 "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"
                 "default_upstream: api\ntrusted_proxies: %s\n",
                 bad[i].value);
        const char *path = e2e_write_file("bad.yaml", text);
        const char *const argv[] = {e2e_env("IDEMGATE_BIN"), "--check", "-c", path, NULL};
        char *out = NULL, *err = NULL;
        int rc = e2e_run(argv, NULL, 10000, &out, &err);
        cr_expect_neq(rc, 0, "%s: --check passed", bad[i].value);
        cr_expect(err && strstr(err, bad[i].want), "%s: want '%s' in: %s", bad[i].value, bad[i].want, err ? err : "");
        free(out);
        free(err);
    }
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
