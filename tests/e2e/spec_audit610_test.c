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
