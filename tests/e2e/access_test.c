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
