/* spec_audit610_test.c - statements of SPEC 6-10 no other test checked, on the real binary, Postgres, Redis and the
 * counting upstream: a stripe or template route answers the gateway's early refusals (431, obs-fold 400, a method's
 * case variant 501) in its own format, not problem+json (SPEC 9 "every gateway problem"). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/e2e/harness.h"

TestSuite(spec_audit610, .init = e2e_setup, .fini = e2e_teardown, .timeout = 60);

/* clang-format off */
static const char *const conf_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("st", "/v1/stripe", "api")
    "      key: required\n"
    "    errors: stripe\n"
    E2E_CONF_ROUTE("tpl", "/v1/tpl", "api")
    "      key: required\n"
    "    errors:\n"
    "      template: '{\"fault\":\"{name}\",\"http\":{status}}'\n"
    E2E_CONF_ROUTE("prob", "/v1/prob", "api")
    "      key: required\n";
/* clang-format on */

/* A raw request (head lines after the request line, each ending in CRLF) for METHOD PATH, Idempotency-Key k1 and
 * a body "{}"; the answer's status and its body's start are checked. */
static void raw_expect(uint16_t port, const char *method, const char *path, const char *extra, long status,
                       const char *body_prefix, const char *what)
{
    char req[40000];
    int n = snprintf(req, sizeof req,
                     "%s %s HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k1\r\n%sContent-Length: 2\r\n"
                     "Connection: close\r\n\r\n{}",
                     method, path, extra);
    cr_assert(n > 0 && (size_t)n < sizeof req);
    struct e2e_raw r;
    e2e_raw_send(port, req, (size_t)n, 5000, &r);
    cr_expect_eq(r.status, status, "%s: status %d, want %ld", what, r.status, status);
    const char *blank = r.data ? strstr(r.data, "\r\n\r\n") : NULL;
    cr_expect(blank && strncmp(blank + 4, body_prefix, strlen(body_prefix)) == 0, "%s: body %s, want it to start %s",
              what, blank ? blank + 4 : "(none)", body_prefix);
    free(r.data);
}

/* SPEC 9: errors: stripe answers every gateway problem as {"error":{...}}, a template route in its template. The
 * refusals made before the route was looked up (431, obs-fold, a lowercase method) were problem+json. */
Test(spec_audit610, early_refusals_use_the_routes_error_format)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);

    static char big[20100];
    memcpy(big, "X-Big: ", 7);
    memset(big + 7, 'a', 20000);
    memcpy(big + 20007, "\r\n", 3);
    raw_expect(gw->port, "POST", "/v1/stripe/1", big, 431,
               "{\"error\":{\"type\":\"invalid_request_error\",\"code\":\"request-header-fields-too-large\"",
               "stripe 431");
    raw_expect(gw->port, "POST", "/v1/stripe/1", "X-A: b\r\n c\r\n", 400,
               "{\"error\":{\"type\":\"invalid_request_error\",\"code\":\"bad-request\"", "stripe obs-fold");
    raw_expect(gw->port, "post", "/v1/stripe/1", "", 501,
               "{\"error\":{\"type\":\"api_error\",\"code\":\"not-implemented\"", "stripe lowercase method");
    raw_expect(gw->port, "POST", "/v1/tpl/1", big, 431, "{\"fault\":\"request-header-fields-too-large\",\"http\":431}",
               "template 431");
    raw_expect(gw->port, "POST", "/v1/tpl/1", "X-A: b\r\n\tc\r\n", 400, "{\"fault\":\"bad-request\",\"http\":400}",
               "template obs-fold");
    /* a problem route and a target no route can match keep problem+json */
    raw_expect(gw->port, "POST", "/v1/prob/1", big, 431,
               "{\"type\":\"urn:idemgate:problem:request-header-fields-too-large\"", "problem route 431");
    raw_expect(gw->port, "POST", "/v1/stripe/%2F", "", 400, "{\"type\":\"urn:idemgate:problem:bad-request\"",
               "an invalid target matches no route");
    cr_expect_eq(e2e_upstream_count(up, NULL), 0, "nothing was forwarded");
}

/* clang-format off */
static const char *const order_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "10s")
    "routes:\n"
    E2E_CONF_ROUTE("acc", "/v1/acc", "api")
    "      key: optional\n"
    "      scope: [header:X-Tenant]\n"
    "    errors: stripe\n"
    "    ordering:\n"
    "      resource: /v1/acc/{id}\n"
    "      sequence: header:X-Sequence\n"
    E2E_CONF_ROUTE("held", "/v1/held", "api")
    "      key: optional\n"
    "    ordering:\n"
    "      resource: /v1/held/{id}\n"
    "      sequence: json:/m~1n/a~0b/1\n"
    "      on_gap: hold\n"
    "      hold: 1s\n";
/* clang-format on */

/* POST path with the given header lines (NULL-terminated) and body; the status, and the time taken in *ms. */
static long post(uint16_t port, const char *path, const char *const *h, const char *body, uint64_t *ms,
                 struct e2e_resp *out)
{
    struct e2e_req rq = {.method = "POST", .path = path, .headers = h, .body = body, .body_len = strlen(body)};
    uint64_t t0 = e2e_now_ms();
    e2e_http(port, &rq, out);
    if (ms)
        *ms = e2e_now_ms() - t0;
    return out->status;
}

/* SPEC 6: a second request for a resource instance waits up to hold (default 2 s), then 409 sequence-in-use with
 * Retry-After (stripe: an idempotency_error); the applied sequence is kept per (route, scope, resource instance),
 * so another tenant's request for the same path is neither held nor stale. */
Test(spec_audit610, in_use_waits_the_default_hold_per_scope)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(order_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);
    struct e2e_resp r;
    uint64_t ms;
    char id[96], path[128]; /* a resource no earlier run applied a sequence to */
    e2e_mkkey(id, sizeof id, "acc");
    snprintf(path, sizeof path, "/v1/acc/%s", id);

    static const char *const a5[] = {"X-Tenant: A", "X-Sequence: 5", NULL};
    cr_assert_eq(post(gw->port, path, a5, "{}", NULL, &r), 200);
    e2e_resp_free(&r);
    static const char *const a6slow[] = {"X-Tenant: A", "X-Sequence: 6", "X-Test-Delay-Ms: 3500", NULL};
    struct e2e_req slow = {.method = "POST", .path = path, .headers = a6slow, .body = "{}", .body_len = 2};
    struct e2e_async *as = e2e_http_async(gw->port, &slow);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 2, 3000), 2, "the slow one reached the upstream");

    static const char *const b1[] = {"X-Tenant: B", "X-Sequence: 1", NULL};
    cr_expect_eq(post(gw->port, path, b1, "{}", &ms, &r), 200, "tenant B has its own sequence: %s",
                 (const char *)r.body);
    cr_expect(ms < 1000, "tenant B was not held behind tenant A (%llu ms)", (unsigned long long)ms);
    e2e_resp_free(&r);

    static const char *const a7[] = {"X-Tenant: A", "X-Sequence: 7", NULL};
    post(gw->port, path, a7, "{}", &ms, &r);
    cr_expect_eq(r.status, 409, "in use after hold: %ld %s", r.status, (const char *)r.body);
    cr_expect(r.body && strstr((const char *)r.body,
                               "{\"error\":{\"type\":\"idempotency_error\",\"code\":\"sequence-in-use\"") ==
                            (const char *)r.body,
              "stripe sequence-in-use: %s", (const char *)r.body);
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "sequence-in-use carries Retry-After");
    cr_expect(ms >= 1800 && ms < 3000, "waited the default hold of 2 s (%llu ms)", (unsigned long long)ms);
    e2e_resp_free(&r);
    e2e_http_join(as, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);

    static const char *const a4[] = {"X-Tenant: A", "X-Sequence: 4", NULL};
    post(gw->port, path, a4, "{}", NULL, &r);
    cr_expect_eq(r.status, 409);
    /* inside the error object: before its end (the request's id may follow it there) */
    const char *cur = r.body ? strstr((const char *)r.body, "\"current\":6") : NULL;
    cr_expect(r.body && strstr((const char *)r.body, "\"code\":\"stale-sequence\"") && cur &&
                  (cur[11] == '}' || cur[11] == ',') && cur < strstr((const char *)r.body, "}}"),
              "stale with current 6 inside error: %s", (const char *)r.body);
    e2e_resp_free(&r);
}

/* SPEC 6: hold bounds both waits (for the lower request in flight, then for the missing ones); the sequence comes
 * from a JSON Pointer with ~1 and ~0 escapes and an array index. */
Test(spec_audit610, hold_bounds_the_in_flight_and_the_gap_wait_together)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(order_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);
    struct e2e_resp r;
    uint64_t ms;
    char id[96], path[128];
    e2e_mkkey(id, sizeof id, "held");
    snprintf(path, sizeof path, "/v1/held/%s", id);

    cr_assert_eq(post(gw->port, path, NULL, "{\"m/n\":{\"a~b\":[0,1]}}", NULL, &r), 200);
    e2e_resp_free(&r);
    cr_expect_eq(post(gw->port, path, NULL, "{\"m/n\":{\"a~b\":[0,1]}}", NULL, &r), 409, "1 again is stale");
    e2e_resp_free(&r);
    cr_expect_eq(post(gw->port, path, NULL, "{\"m~1n\":{\"a~b\":[0,2]}}", NULL, &r), 400,
                 "the pointer's ~1 is a '/' of the member's name");
    e2e_resp_free(&r);

    static const char *const slow[] = {"X-Test-Delay-Ms: 700", NULL};
    const char *b2 = "{\"m/n\":{\"a~b\":[0,2]}}";
    struct e2e_req s2 = {.method = "POST", .path = path, .headers = slow, .body = b2, .body_len = strlen(b2)};
    struct e2e_async *as = e2e_http_async(gw->port, &s2);
    cr_assert_eq(e2e_upstream_wait_count(up, NULL, 2, 3000), 2, "2 reached the upstream");
    post(gw->port, path, NULL, "{\"m/n\":{\"a~b\":[0,4]}}", &ms, &r);
    e2e_expect_problem(&r, 409, "sequence-gap", "4 while 2 is in flight and 3 never comes");
    cr_expect(r.body && strstr((const char *)r.body, "\"current\":2"), "current is 2: %s", (const char *)r.body);
    cr_expect(ms >= 800 && ms < 1500, "one hold of 1 s in all, not 0.7 s + 1 s (%llu ms)", (unsigned long long)ms);
    e2e_resp_free(&r);
    e2e_http_join(as, &r);
    cr_expect_eq(r.status, 200);
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 2, "neither the stale, the invalid nor the gap was forwarded");
}

/* SPEC 9: errors: stripe maps 401 (a JWT-scoped route without a token) to authentication_error, with the
 * WWW-Authenticate header kept; the route's other methods need no token. */
Test(spec_audit610, stripe_401_is_an_authentication_error)
{
    /* clang-format off */
    static const char *const tmpl =
        E2E_CONF_HEAD
        "upstreams:\n"
        E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
        "routes:\n"
        E2E_CONF_ROUTE("jw", "/v1/jw", "api")
        "      key: required\n"
        "      scope: [jwt:sub]\n"
        "    errors: stripe\n"
        "jwt:\n"
        "  secret_env: IDEMGATE_E2E_JWT_SECRET\n";
    /* clang-format on */
    static const char *const env[] = {"IDEMGATE_E2E_JWT_SECRET=0123456789abcdef0123456789abcdef", NULL};
    struct e2e_upstream *up = e2e_upstream_start(NULL);
    struct e2e_gw_opts o = {.up = up, .env = env, .wait_ready = true};
    struct e2e_gw *gw = e2e_gw_start(tmpl, &o);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/jw/1", "bad key with spaces", NULL, "{}", 0, &r);
    cr_expect_eq(r.status, 401, "the token is checked before the key (401 before any 400): %ld", r.status);
    static const char want[] = "{\"error\":{\"type\":\"authentication_error\",\"code\":\"invalid-credentials\"";
    cr_expect(r.body && strncmp((const char *)r.body, want, sizeof want - 1) == 0, "stripe 401: %s",
              (const char *)r.body);
    const char *ct = e2e_resp_header(&r, "Content-Type");
    cr_expect(ct && strcmp(ct, "application/json") == 0, "Content-Type %s", ct ? ct : "(none)");
    cr_expect_not_null(e2e_resp_header(&r, "WWW-Authenticate"), "WWW-Authenticate stays");
    e2e_resp_free(&r);
    e2e_get(gw->port, "/v1/jw/1", &r);
    cr_expect_eq(r.status, 200, "GET is not an idempotent method of the route: no token needed");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, NULL), 1, "only the GET was forwarded");
}
