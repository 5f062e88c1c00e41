/* errors_test.c - gateway errors in the API's own format (SPEC 9, errors:): stripe and template routes answer
 * every gateway problem in their format with the same status and headers; other routes and the admin listener keep
 * problem+json. Real binary, real Postgres and Redis, the counting upstream. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/e2e/harness.h"

TestSuite(errors, .init = e2e_setup, .fini = e2e_teardown, .timeout = 60);

/* clang-format off */
static const char *const conf_tmpl =
    E2E_CONF_HEAD
    "upstreams:\n"
    E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
    E2E_CONF_UPSTREAM("dead", "http://127.0.0.1:{{DEAD_PORT}}", "5s")
    "routes:\n"
    E2E_CONF_ROUTE("st", "/v1/stripe", "api")
    "      key: required\n"
    "    errors: stripe\n"
    E2E_CONF_ROUTE("stdead", "/v1/down", "dead")
    "      key: required\n"
    "    errors: stripe\n"
    E2E_CONF_ROUTE("tpl", "/v1/tpl", "api")
    "      key: required\n"
    "    errors:\n"
    "      template: '{\"fault\":{\"kind\":\"{name}\",\"http\":{status},\"text\":\"{detail}\"}}'\n"
    "      content_type: application/vnd.fault+json\n"
    E2E_CONF_ROUTE("prob", "/v1/prob", "api")
    "      key: required\n";
/* clang-format on */

static void expect_stripe(const struct e2e_resp *r, long status, const char *type, const char *code)
{
    char want[256];
    cr_expect_eq(r->status, status, "status %ld, want %ld: %s", r->status, status, (const char *)r->body);
    const char *ct = e2e_resp_header(r, "Content-Type");
    cr_expect(ct && strcmp(ct, "application/json") == 0, "Content-Type %s", ct ? ct : "(none)");
    snprintf(want, sizeof want, "{\"error\":{\"type\":\"%s\",\"code\":\"%s\",\"message\":\"", type, code);
    cr_expect(r->body && strncmp((const char *)r->body, want, strlen(want)) == 0, "body %s, want prefix %s",
              (const char *)r->body, want);
    cr_expect(r->body_len > 3 && strcmp((const char *)r->body + r->body_len - 3, "\"}}") == 0, "body %s",
              (const char *)r->body);
}

/* SPEC 9: Stripe's SDKs retry a 409 unless told not to: with errors: stripe, Stripe-Should-Retry is true on 409
 * idempotency-key-in-use and on a 503 with Retry-After, false on every other gateway problem; an upstream's own
 * answer gets none. */
static void expect_should_retry(const struct e2e_resp *r, const char *want, const char *what)
{
    const char *v = e2e_resp_header(r, "Stripe-Should-Retry");
    cr_expect(v && strcmp(v, want) == 0, "%s: Stripe-Should-Retry %s, want %s (status %ld)", what, v ? v : "(none)",
              want, r->status);
}

Test(errors, stripe_format_for_every_gateway_problem)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);
    struct e2e_resp r;

    e2e_http_key(gw->port, "POST", "/v1/stripe/c", NULL, NULL, "{}", 0, &r);
    expect_stripe(&r, 400, "invalid_request_error", "idempotency-key-missing");
    expect_should_retry(&r, "false", "400 idempotency-key-missing");
    e2e_resp_free(&r);

    e2e_http_key(gw->port, "POST", "/v1/stripe/c", "bad key with spaces", NULL, "{}", 0, &r);
    expect_stripe(&r, 400, "invalid_request_error", "idempotency-key-invalid");
    e2e_resp_free(&r);

    char key[96];
    e2e_mkkey(key, sizeof key, "stripe");
    const char *slow[] = {"X-Test-Delay-Ms: 1500", NULL};
    char kh[160];
    snprintf(kh, sizeof kh, "Idempotency-Key: %s", key);
    const char *h[] = {kh, "X-Test-Delay-Ms: 1500", NULL};
    struct e2e_req rq = {.method = "POST", .path = "/v1/stripe/c", .headers = h, .body = "one", .body_len = 3};
    struct e2e_async *a = e2e_http_async(gw->port, &rq);
    cr_assert(e2e_upstream_wait_count(up, key, 1, 5000) == 1, "the first request did not reach the upstream");
    e2e_http_key(gw->port, "POST", "/v1/stripe/c", key, slow, "one", 0, &r);
    expect_stripe(&r, 409, "idempotency_error", "idempotency-key-in-use");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"), "Retry-After stays with the stripe format");
    expect_should_retry(&r, "true", "409 idempotency-key-in-use");
    e2e_resp_free(&r);
    struct e2e_resp first;
    e2e_http_join(a, &first);
    cr_expect_eq(first.status, 200, "the upstream's own answer passes as is");
    cr_expect_null(e2e_resp_header(&first, "Stripe-Should-Retry"), "the upstream's answer gets none");
    e2e_resp_free(&first);
    e2e_http_key(gw->port, "POST", "/v1/stripe/c", key, NULL, "one", 0, &r);
    cr_expect(e2e_resp_is_replay(&r));
    cr_expect_null(e2e_resp_header(&r, "Stripe-Should-Retry"), "a replay gets none");
    e2e_resp_free(&r);

    e2e_http_key(gw->port, "POST", "/v1/stripe/c", key, NULL, "two", 0, &r);
    expect_stripe(&r, 422, "idempotency_error", "idempotency-key-mismatch");
    expect_should_retry(&r, "false", "422 idempotency-key-mismatch");
    e2e_resp_free(&r);

    e2e_http_key(gw->port, "POST", "/v1/down/c", key, NULL, "x", 0, &r);
    expect_stripe(&r, 502, "api_error", "upstream-unavailable");
    expect_should_retry(&r, "false", "502 upstream-unavailable");
    e2e_resp_free(&r);

    e2e_http_key(gw->port, "POST", "/v1/prob/c", NULL, NULL, "{}", 0, &r);
    cr_expect(e2e_resp_is_problem(&r, "idempotency-key-missing"), "a route without errors: keeps problem+json");
    cr_expect_str_eq(e2e_resp_header(&r, "Content-Type"), "application/problem+json");
    cr_expect_null(e2e_resp_header(&r, "Stripe-Should-Retry"), "a problem+json route gets none");
    e2e_resp_free(&r);

    e2e_get(gw->port, "/nowhere", &r);
    cr_expect(e2e_resp_is_problem(&r, "route-not-found"), "no route: problem+json");
    e2e_resp_free(&r);

    /* a target over max_header_bytes on the route's path: 414 in the route's format (it was problem+json) */
    enum { LONG = 17000 };
    char *path = malloc(LONG + 32);
    cr_assert_not_null(path);
    int pl = snprintf(path, 32, "/v1/stripe/");
    memset(path + pl, 'a', LONG);
    path[pl + LONG] = '\0';
    e2e_http_key(gw->port, "POST", path, key, NULL, "x", 0, &r);
    expect_stripe(&r, 414, "invalid_request_error", "uri-too-long");
    expect_should_retry(&r, "false", "414 uri-too-long");
    e2e_resp_free(&r);
    free(path);
    cr_expect_eq(e2e_upstream_count(up, key), 1, "nothing but the first request executed");
}

Test(errors, template_format)
{
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(conf_tmpl, &up, &gw);
    e2e_gw_wait_ready(gw);
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/tpl/c", NULL, NULL, "{}", 0, &r);
    cr_expect_eq(r.status, 400);
    cr_expect_str_eq(e2e_resp_header(&r, "Content-Type"), "application/vnd.fault+json");
    const char *want = "{\"fault\":{\"kind\":\"idempotency-key-missing\",\"http\":400,\"text\":\"";
    cr_expect(strncmp((const char *)r.body, want, strlen(want)) == 0, "body %s", (const char *)r.body);
    e2e_resp_free(&r);
}

/* The same route in front of a Postgres nobody listens on: 503 store-unavailable with Retry-After. */
Test(errors, stripe_should_retry_on_a_503_with_retry_after)
{
    /* clang-format off */
    static const char *const tmpl =
        E2E_CONF_PORTS
        "store:\n"
        "  postgres: \"postgresql://idemgate@127.0.0.1:{{DEAD_PORT}}/idemgate?connect_timeout=1\"\n"
        "upstreams:\n"
        E2E_CONF_UPSTREAM("api", "{{UPSTREAM_URL}}", "5s")
        "routes:\n"
        E2E_CONF_ROUTE("st", "/v1/stripe", "api")
        "      key: required\n"
        "    errors: stripe\n";
    /* clang-format on */
    struct e2e_upstream *up;
    struct e2e_gw *gw;
    e2e_start(tmpl, &up, &gw);
    char key[96];
    e2e_mkkey(key, sizeof key, "should-retry-503");
    struct e2e_resp r;
    e2e_http_key(gw->port, "POST", "/v1/stripe/c", key, NULL, "{}", 0, &r);
    expect_stripe(&r, 503, "api_error", "store-unavailable");
    cr_expect_not_null(e2e_resp_header(&r, "Retry-After"));
    expect_should_retry(&r, "true", "503 store-unavailable with Retry-After");
    e2e_resp_free(&r);
    cr_expect_eq(e2e_upstream_count(up, key), 0);
}
