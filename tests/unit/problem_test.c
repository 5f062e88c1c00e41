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
