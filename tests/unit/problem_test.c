/* problem_test.c - RFC 9457 problem bodies and JSON string escaping. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "gateway/problem.h"

Test(problem, exact_json)
{
    size_t len = 0;
    char *s = gw_problem_json(422, "idempotency-key-mismatch", "Idempotency-Key reused",
                              "This key was used with a different request.", &len);
    const char *want = "{\"type\":\"urn:idemgate:problem:idempotency-key-mismatch\","
                       "\"title\":\"Idempotency-Key reused\",\"status\":422,"
                       "\"detail\":\"This key was used with a different request.\"}";
    cr_assert_str_eq(s, want);
    cr_assert_eq(len, strlen(want));
    free(s);
}

Test(problem, null_detail_is_empty_string)
{
    size_t len = 0;
    char *s = gw_problem_json(503, "store-unavailable", "Store unavailable", NULL, &len);
    cr_assert_str_eq(s, "{\"type\":\"urn:idemgate:problem:store-unavailable\",\"title\":\"Store unavailable\","
                        "\"status\":503,\"detail\":\"\"}");
    cr_assert_eq(len, strlen(s));
    free(s);
    s = gw_problem_json(500, "x", NULL, NULL, NULL); /* len may be NULL */
    cr_assert_str_eq(s, "{\"type\":\"urn:idemgate:problem:x\",\"title\":\"\",\"status\":500,\"detail\":\"\"}");
    free(s);
}

Test(problem, status_and_type)
{
    static const struct {
        int status;
        const char *name;
        const char *want_prefix;
    } cases[] = {
        {400, "idempotency-key-missing", "{\"type\":\"urn:idemgate:problem:idempotency-key-missing\","},
        {409, "idempotency-key-in-use", "{\"type\":\"urn:idemgate:problem:idempotency-key-in-use\","},
        {504, "upstream-timeout", "{\"type\":\"urn:idemgate:problem:upstream-timeout\","},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len;
        char *s = gw_problem_json(cases[i].status, cases[i].name, "t", "d", &len);
        cr_assert_eq(strncmp(s, cases[i].want_prefix, strlen(cases[i].want_prefix)), 0, "%s", s);
        char st[32];
        snprintf(st, sizeof(st), ",\"status\":%d,", cases[i].status);
        cr_assert_not_null(strstr(s, st), "%s", s);
        free(s);
    }
}

Test(problem, fields_escaped)
{
    size_t len;
    char *s = gw_problem_json(400, "n\"x", "a\"b\\c", "line1\nline2\t\x01", &len);
    cr_assert_str_eq(s, "{\"type\":\"urn:idemgate:problem:n\\\"x\",\"title\":\"a\\\"b\\\\c\",\"status\":400,"
                        "\"detail\":\"line1\\u000aline2\\u0009\\u0001\"}");
    free(s);
}

static char *esc(const char *in, size_t n)
{
    struct cm_buf b;
    cm_buf_init(&b, 4096);
    cr_assert(gw_json_escape(&b, in, n));
    size_t len;
    char *s = cm_buf_take(&b, &len);
    return s ? s : cm_strdup("");
}

Test(problem, json_escape_table)
{
    static const struct {
        const char *in;
        size_t n;
        const char *want;
    } cases[] = {
        {"", 0, ""},
        {"plain text", 10, "plain text"},
        {"\"", 1, "\\\""},
        {"\\", 1, "\\\\"},
        {"/", 1, "/"},
        {"\x1f", 1, "\\u001f"},
        {"\r\n", 2, "\\u000d\\u000a"},
        {"a\0b", 3, "a\\u0000b"}, /* embedded NUL is data */
        {"\x7f", 1, "\\u007f"},
        {"caf\xc3\xa9", 5, "caf\xc3\xa9"}, /* valid UTF-8 passes through */
        {"\xe2\x82\xac", 3, "\xe2\x82\xac"},
        {"\xf0\x9f\x98\x80", 4, "\xf0\x9f\x98\x80"},
        {"\xff", 1, "\\ufffd"},                                  /* invalid byte */
        {"a\xc3", 2, "a\\ufffd"},                                /* truncated sequence */
        {"\xc0\xaf", 2, "\\ufffd\\ufffd"},                       /* overlong */
        {"\xed\xa0\x80", 3, "\\ufffd\\ufffd\\ufffd"},            /* surrogate */
        {"\xf4\x90\x80\x80", 4, "\\ufffd\\ufffd\\ufffd\\ufffd"}, /* > U+10FFFF */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *s = esc(cases[i].in, cases[i].n);
        cr_expect_str_eq(s, cases[i].want, "case %zu", i);
        free(s);
    }
}

Test(problem, json_escape_cap)
{
    struct cm_buf b;
    cm_buf_init(&b, 5);
    cr_assert(gw_json_escape(&b, "abcde", 5));
    cr_assert_not(gw_json_escape(&b, "\"", 1));
    cr_assert_eq(b.len, 5);
    cm_buf_free(&b);
}

/* ---- errors: formats (SPEC 9): problem, stripe, template; conf parses them */

#include "conf/conf.h"

#define ERR_BASE                                                                                                       \
    "store:\n  postgres: postgres://u@127.0.0.1/db\n"                                                                  \
    "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"                                                      \
    "routes:\n  - name: p\n    match: {path: /a}\n    upstream: api\n"

static struct conf *load_errors(const char *errors_yaml, char **err)
{
    char yaml[2048];
    snprintf(yaml, sizeof yaml, ERR_BASE "%s", errors_yaml);
    *err = NULL;
    return conf_load_string("t.yaml", yaml, strlen(yaml), err);
}

static char *render(const struct conf_errors *e, int status, const char *name, const char *detail, const char *extra,
                    const char **ct)
{
    struct gw_problem p = {status, name, "A title", detail, extra};
    size_t len = 0;
    char *s = gw_problem_render(e, &p, &len, ct);
    cr_assert_eq(len, strlen(s));
    return s;
}

Test(problem_errors, conf_default_is_problem)
{
    char *err;
    struct conf *c = load_errors("", &err);
    cr_assert_not_null(c, "%s", err);
    cr_assert_eq(c->routes[0].errors.kind, CONF_ERRORS_PROBLEM);
    const char *ct;
    char *s = render(&c->routes[0].errors, 409, "idempotency-key-in-use", "busy", NULL, &ct);
    cr_assert_str_eq(ct, "application/problem+json");
    cr_assert_str_eq(s, "{\"type\":\"urn:idemgate:problem:idempotency-key-in-use\",\"title\":\"A title\","
                        "\"status\":409,\"detail\":\"busy\"}");
    free(s);
    conf_destroy(c);
}

Test(problem_errors, stripe_types_by_status_and_name)
{
    static const struct {
        int status;
        const char *name;
        const char *type;
    } cases[] = {
        {401, "invalid-credentials", "authentication_error"},
        {409, "idempotency-key-in-use", "idempotency_error"},
        {409, "idempotency-outcome-unknown", "idempotency_error"},
        {422, "idempotency-key-mismatch", "idempotency_error"},
        {409, "stale-sequence", "idempotency_error"},
        {409, "sequence-gap", "idempotency_error"},
        {409, "sequence-in-use", "idempotency_error"},
        {400, "idempotency-key-missing", "invalid_request_error"},
        {400, "idempotency-key-invalid", "invalid_request_error"},
        {400, "sequence-invalid", "invalid_request_error"},
        {400, "bad-request", "invalid_request_error"},
        {404, "route-not-found", "invalid_request_error"},
        {413, "payload-too-large", "invalid_request_error"},
        {431, "request-header-fields-too-large", "invalid_request_error"},
        {409, "something-else", "invalid_request_error"},
        {502, "upstream-unavailable", "api_error"},
        {502, "upstream-invalid-response", "api_error"},
        {503, "store-unavailable", "api_error"},
        {504, "upstream-timeout", "api_error"},
    };
    struct conf_errors e = {.kind = CONF_ERRORS_STRIPE};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_expect_str_eq(gw_problem_stripe_type(cases[i].status, cases[i].name), cases[i].type, "%d %s",
                         cases[i].status, cases[i].name);
        const char *ct;
        char *s = render(&e, cases[i].status, cases[i].name, "the \"detail\"", NULL, &ct);
        char want[512];
        snprintf(want, sizeof want, "{\"error\":{\"type\":\"%s\",\"code\":\"%s\",\"message\":\"the \\\"detail\\\"\"}}",
                 cases[i].type, cases[i].name);
        cr_expect_str_eq(s, want);
        cr_expect_str_eq(ct, "application/json");
        free(s);
    }
}

Test(problem_errors, extra_members_go_into_the_object)
{
    const char *ct;
    struct conf_errors stripe = {.kind = CONF_ERRORS_STRIPE};
    char *s = render(&stripe, 409, "stale-sequence", "old", "\"current\":11", &ct);
    cr_assert_str_eq(s, "{\"error\":{\"type\":\"idempotency_error\",\"code\":\"stale-sequence\",\"message\":\"old\","
                        "\"current\":11}}");
    free(s);
    s = render(NULL, 409, "stale-sequence", "old", "\"current\":11", &ct);
    cr_assert_str_eq(s, "{\"type\":\"urn:idemgate:problem:stale-sequence\",\"title\":\"A title\",\"status\":409,"
                        "\"detail\":\"old\",\"current\":11}");
    cr_assert_str_eq(ct, "application/problem+json");
    free(s);
}

Test(problem_errors, template_substitutes_escaped_values)
{
    char *err;
    struct conf *c = load_errors("    errors:\n      template: '{\"err\":{\"code\":\"{name}\",\"http\":{status},"
                                 "\"msg\":\"{title}: {detail}\",\"lit\":\"{x\"}}'\n",
                                 &err);
    cr_assert_not_null(c, "%s", err);
    cr_assert_eq(c->routes[0].errors.kind, CONF_ERRORS_TEMPLATE);
    const char *ct;
    char *s = render(&c->routes[0].errors, 422, "idempotency-key-mismatch", "a \"quoted\"\nline\\", NULL, &ct);
    cr_assert_str_eq(s, "{\"err\":{\"code\":\"idempotency-key-mismatch\",\"http\":422,"
                        "\"msg\":\"A title: a \\\"quoted\\\"\\u000aline\\\\\",\"lit\":\"{x\"}}");
    cr_assert_str_eq(ct, "application/json", "content_type defaults to application/json");
    free(s);
    conf_destroy(c);

    c = load_errors("    errors: {template: '<e>{name}</e>', content_type: 'application/vnd.err+xml; charset=utf-8'}\n",
                    &err);
    cr_assert_not_null(c, "%s", err);
    s = render(&c->routes[0].errors, 503, "store-unavailable", "", NULL, &ct);
    cr_assert_str_eq(s, "<e>store-unavailable</e>");
    cr_assert_str_eq(ct, "application/vnd.err+xml; charset=utf-8");
    free(s);
    conf_destroy(c);
}

Test(problem_errors, conf_refuses_bad_errors)
{
    static const struct {
        const char *yaml;
        const char *want;
    } cases[] = {
        {"    errors: stripes\n", "t.yaml:10: routes[0].errors: invalid value 'stripes'"},
        {"    errors: {template: '{\"e\":\"{nam}\"}'}\n", "routes[0].errors.template: unknown placeholder '{nam}'"},
        {"    errors: {template: '{code}'}\n", "unknown placeholder '{code}'"},
        {"    errors: {content_type: text/plain}\n", "routes[0].errors.template: missing required key"},
        {"    errors: {template: x, content_type: \"text/plain\\r\\nX-Evil: 1\"}\n", "invalid media type"},
        {"    errors: {template: x, content_type: plain}\n", "invalid media type 'plain'"},
        {"    errors: {template: x, colour: red}\n", "routes[0].errors.colour: unknown key"},
        {"    errors: [problem]\n", "routes[0].errors:"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *err;
        struct conf *c = load_errors(cases[i].yaml, &err);
        cr_expect_null(c, "accepted: %s", cases[i].yaml);
        cr_expect(err && strstr(err, cases[i].want), "%s: got %s", cases[i].yaml, err ? err : "(none)");
        conf_destroy(c);
        free(err);
    }
}
