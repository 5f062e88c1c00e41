/* uri_test.c - the request-target normaliser and the strict percent-decoder (common/uri.c), table-driven. */
#include <criterion/criterion.h>
#include <string.h>

#include "common/uri.h"

struct path_case {
    const char *in;
    const char *out; /* NULL: refused */
};

static const struct path_case path_cases[] = {
    {"/", "/"},
    {"/v1/payments", "/v1/payments"},
    {"/v1/%70ayments", "/v1/payments"},
    {"/v1/open/../payments", "/v1/payments"},
    {"//v1/payments", "/v1/payments"},
    {"/v1/./payments", "/v1/payments"},
    {"/v1//payments//", "/v1/payments/"},
    {"/v1/payments/", "/v1/payments/"},
    {"/a/b/..", "/a/"},
    {"/a/b/../", "/a/"},
    {"/a/.", "/a/"},
    {"/a/..", "/"},
    {"/.", "/"},
    {"//", "/"},
    {"/a/%2e%2E/b", "/b"},
    {"/a/%2E/b", "/a/b"},
    {"/a/.%2e/b", "/b"},
    {"/a/..b/c", "/a/..b/c"},
    {"/a/.b", "/a/.b"},
    {"/%7e%41%5f%2D%30", "/~A_-0"},
    {"/a%2fb", NULL},
    {"/a%2Fb", NULL},
    {"/a%00b", NULL},
    {"/a%zz", NULL},
    {"/a%4", NULL},
    {"/a%", NULL},
    {"/a%g0", NULL},
    {"/a%3a%3F%5c%25", "/a%3A%3F%5C%25"},
    {"/%2541", "/%2541"},
    {"/..", NULL},
    {"/../a", NULL},
    {"/a/../../b", NULL},
    {"/a/%2e%2e/%2e%2e/b", NULL},
    {"/a b", NULL},
    {"/a\tb", NULL},
    {"/a\x7f", NULL},
    {"/a#b", NULL},
    {"/a\\b", NULL},
    {"/a\x80", NULL},
    {"/\xc3\xa9", NULL},
    {"/a?b", NULL},
    {"a", NULL},
    {"", NULL},
    {"*", NULL},
};

Test(uri, path_table)
{
    for (size_t i = 0; i < sizeof path_cases / sizeof path_cases[0]; i++) {
        const struct path_case *c = &path_cases[i];
        size_t n = strlen(c->in);
        char out[256];
        size_t olen = 12345;
        const char *why = NULL;
        bool ok = cm_path_normalize(c->in, n, out, &olen, &why);
        if (!c->out) {
            cr_expect_not(ok, "'%s' must be refused, got '%s'", c->in, ok ? out : "");
            cr_expect_not_null(why, "'%s': a refusal says why", c->in);
            continue;
        }
        cr_expect(ok, "'%s' must be accepted (%s)", c->in, why ? why : "");
        if (ok) {
            cr_expect_str_eq(out, c->out, "'%s' -> '%s', want '%s'", c->in, out, c->out);
            cr_expect_eq(olen, strlen(c->out));
            cr_expect_leq(olen, n);
        }
    }
}

Test(uri, path_normalize_is_idempotent_on_the_table)
{
    for (size_t i = 0; i < sizeof path_cases / sizeof path_cases[0]; i++) {
        if (!path_cases[i].out)
            continue;
        const char *o = path_cases[i].out;
        char out[256];
        size_t olen;
        const char *why;
        cr_assert(cm_path_normalize(o, strlen(o), out, &olen, &why), "'%s' refused on a second pass", o);
        cr_expect_str_eq(out, o);
    }
}

struct target_case {
    const char *in;
    enum cm_target_result res;
    const char *uri, *path, *query;
};

static const struct target_case target_cases[] = {
    {"/v1/x?a=1&b=%zz", CM_TARGET_OK, "/v1/x?a=1&b=%zz", "/v1/x", "a=1&b=%zz"},
    {"/v1/./x?", CM_TARGET_OK, "/v1/x?", "/v1/x", ""},
    {"/v1/x?a/../b", CM_TARGET_OK, "/v1/x?a/../b", "/v1/x", "a/../b"},
    {"/v1/x?a?b", CM_TARGET_OK, "/v1/x?a?b", "/v1/x", "a?b"},
    {"http://127.0.0.1:1/x?q=1", CM_TARGET_OK, "/x?q=1", "/x", "q=1"},
    {"HTTPS://evil.example/a/../b", CM_TARGET_OK, "/b", "/b", ""},
    {"http://evil", CM_TARGET_OK, "/", "/", ""},
    {"http://evil?x", CM_TARGET_OK, "/?x", "/", "x"},
    {"http://u:p@evil:1//x", CM_TARGET_OK, "/x", "/x", ""},
    {"@127.0.0.1:1/x", CM_TARGET_BAD, NULL, NULL, NULL},
    {":1/x", CM_TARGET_BAD, NULL, NULL, NULL},
    {"x", CM_TARGET_BAD, NULL, NULL, NULL},
    {"*", CM_TARGET_BAD, NULL, NULL, NULL},
    {"", CM_TARGET_BAD, NULL, NULL, NULL},
    {"ftp://h/x", CM_TARGET_BAD, NULL, NULL, NULL},
    {"http:/x", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x?a b", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x?a#b", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x?a\x01", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x?a\x7f", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x?\xff", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/x/..%2f..?q", CM_TARGET_BAD, NULL, NULL, NULL},
    {"http://ev il/x", CM_TARGET_BAD, NULL, NULL, NULL},
    {"/..?q", CM_TARGET_BAD, NULL, NULL, NULL},
};

Test(uri, target_table)
{
    for (size_t i = 0; i < sizeof target_cases / sizeof target_cases[0]; i++) {
        const struct target_case *c = &target_cases[i];
        struct cm_target t;
        const char *why = NULL;
        enum cm_target_result r = cm_target_parse(c->in, strlen(c->in), 1024, &t, &why);
        cr_expect_eq(r, c->res, "'%s': result %d, want %d (%s)", c->in, r, c->res, why ? why : "");
        if (r == CM_TARGET_OK && c->res == CM_TARGET_OK) {
            cr_expect_str_eq(t.uri, c->uri, "'%s' uri '%s'", c->in, t.uri);
            cr_expect_str_eq(t.path, c->path, "'%s' path '%s'", c->in, t.path);
            cr_expect_str_eq(t.query, c->query, "'%s' query '%s'", c->in, t.query);
        } else if (r != CM_TARGET_OK) {
            cr_expect_null(t.uri);
            cr_expect_not_null(why);
        }
        cm_target_free(&t);
    }
}

Test(uri, target_over_the_bound_is_too_long)
{
    char big[2049];
    memset(big, 'a', sizeof big - 1);
    big[0] = '/';
    big[sizeof big - 1] = '\0';
    struct cm_target t;
    const char *why;
    cr_expect_eq(cm_target_parse(big, 2048, 2047, &t, &why), CM_TARGET_TOO_LONG);
    cr_expect_null(t.uri);
    cr_expect_eq(cm_target_parse(big, 2048, 2048, &t, &why), CM_TARGET_OK);
    cm_target_free(&t);
}

struct dec_case {
    const char *in;
    bool plus;
    const char *out; /* NULL: refused */
    size_t out_len;
};

static const struct dec_case dec_cases[] = {
    {"abc", false, "abc", 3},   {"a%41%62", false, "aAb", 3}, {"a+b", true, "a b", 3},  {"a+b", false, "a+b", 3},
    {"%2B", true, "+", 1},      {"%ff", false, "\xff", 1},    {"", false, "", 0},       {"abc%00X", false, NULL, 0},
    {"abc%zz", false, NULL, 0}, {"abc%4", false, NULL, 0},    {"abc%", false, NULL, 0}, {"%%41", false, NULL, 0},
};

Test(uri, pct_decode_table)
{
    for (size_t i = 0; i < sizeof dec_cases / sizeof dec_cases[0]; i++) {
        const struct dec_case *c = &dec_cases[i];
        char out[64];
        size_t n = 999;
        bool ok = cm_pct_decode(c->in, strlen(c->in), c->plus, out, &n);
        if (!c->out) {
            cr_expect_not(ok, "'%s' must be refused", c->in);
            continue;
        }
        cr_expect(ok, "'%s' must decode", c->in);
        cr_expect_eq(n, c->out_len, "'%s' length %zu", c->in, n);
        cr_expect(memcmp(out, c->out, n) == 0 && out[n] == '\0', "'%s' decodes to '%s'", c->in, c->out);
    }
}

Test(uri, pct_decode_refuses_a_raw_nul)
{
    char out[8];
    size_t n;
    cr_expect_not(cm_pct_decode("a\0b", 3, false, out, &n));
}

/* SPEC 7: the Host forms accepted */
Test(uri, host_table)
{
    static const struct {
        const char *h;
        bool ok;
    } cases[] = {
        {"good.example", true},
        {"good.example:8080", true},
        {"127.0.0.1", true},
        {"127.0.0.1:80", true},
        {"[::1]", true},
        {"[::1]:8080", true},
        {"a_b~c-d.E", true},
        {"x:65535", true},
        {"", false},
        {":80", false},
        {"x:", false},
        {"x:65536", false},
        {"x:123456", false},
        {"x:8a", false},
        {"a b", false},
        {"a,b", false},
        {"a, b", false},
        {"a/b", false},
        {"a@b", false},
        {"a%41", false},
        {"[::1", false},
        {"[]", false},
        {"[zz::1]", false},
        {"[::1]x", false},
        {"::1", false},
        {"a\tb", false},
        {"a\x80", false},
        {"[::1]:", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(cm_host_ok(cases[i].h, strlen(cases[i].h)), cases[i].ok, "'%s' must be %s", cases[i].h,
                     cases[i].ok ? "accepted" : "refused");
}

/* SPEC 7: the form routes match on, and when a route's path meets a request's */
Test(uri, match_form_and_meets)
{
    static const struct {
        const char *in, *out;
    } forms[] = {
        {"/V1/Pay", "/v1/pay"},
        {"/v1/pay;", "/v1/pay"},
        {"/v1;a=b/pay;jsessionid=X", "/v1/pay"},
        {"/", "/"},
        {"/a;b/", "/a"},
        {"/%7E;x", "/%7e"},
        /* a trailing '/' is ignored; an encoded ';' starts the segment's parameters as ';' does (an upstream may
           decode it first) */
        {"/v1/jwt/", "/v1/jwt"},
        {"/v1/jwt%3Bx", "/v1/jwt"},
        {"/v1/jwt%3bx/y", "/v1/jwt/y"},
        {"/v1/jwt.json/", "/v1/jwt.json"},
        {"/v1%3B/", "/v1"},
        {"/%3", "/%3"},
        {"/a%3", "/a%3"},
    };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        char out[64];
        size_t n = cm_path_match_form(forms[i].in, strlen(forms[i].in), out);
        cr_expect_str_eq(out, forms[i].out, "%s", forms[i].in);
        cr_expect_eq(n, strlen(forms[i].out));
    }
    static const struct {
        const char *rk, *k;
        bool prefix, meets;
    } meets[] = {
        {"/v1/pay", "/v1/pay", false, true},
        {"/v1/pay", "/v1/pay.json", false, true},
        {"/v1/pay", "/v1/pay.", false, true},
        {"/v1/pay", "/v1/pay/x", false, false},
        {"/v1/pay", "/v1/pay/x", true, true},
        {"/v1/pay", "/v1/payx", true, false},
        {"/v1/pay", "/v1/pay.json/x", true, false},
        {"/v1/pay/", "/v1/pay/.json", false, false},
        {"/", "/anything", true, true},
        {"/", "/x", false, false},
    };
    for (size_t i = 0; i < sizeof meets / sizeof meets[0]; i++)
        cr_expect_eq(cm_path_meets(meets[i].rk, meets[i].k, meets[i].prefix), meets[i].meets, "%s %s %s", meets[i].rk,
                     meets[i].prefix ? "prefix" : "path", meets[i].k);
}
