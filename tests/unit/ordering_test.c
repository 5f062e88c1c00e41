/* ordering_test.c - the ordering guard's request side (gateway/ordering.c) and its ordering: config block. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conf/conf.h"
#include "gateway/ordering.h"

Test(order_match, templates)
{
    static const struct {
        const char *tmpl, *path;
        bool match;
        const char *resource;
    } cases[] = {
        {"/v1/accounts/{id}/address", "/v1/accounts/42/address", true, "/v1/accounts/42/address"},
        {"/v1/accounts/{id}/address", "/v1/accounts/42/address/", true, "/v1/accounts/42/address"},
        {"/v1/accounts/{id}/address", "/v1/accounts//address", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accounts/42/address/x", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accounts/42", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accounts/4/2/address", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accountsx/42/address", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accounts/42/addressx", false, NULL},
        /* SPEC 7: case, segment parameters and a format suffix on the last segment do not make another resource;
         * the {id} is kept as sent (ids are case-sensitive), without its parameters */
        {"/v1/accounts/{id}/address", "/V1/accounts/42/address", true, "/v1/accounts/42/address"},
        {"/v1/accounts/{id}/address", "/V1/Accounts;x=1/AbC;y/ADDRESS.json", true, "/v1/accounts/AbC/address"},
        {"/v1/accounts/{id}/address", "/v1/accounts/42/address;", true, "/v1/accounts/42/address"},
        {"/v1/accounts/{id}/address", "/v1/accounts.json/42/address", false, NULL},
        {"/v1/accounts/{id}/address", "/v1/accounts/;x/address", false, NULL},
        {"/v1/Accounts/{id}", "/v1/accounts/a.b", true, "/v1/Accounts/a.b"},
        {"/v1/{a}/{b}", "/v1/x/y", true, "/v1/x/y"},
        {"/v1/{a}/{b}", "/v1/x", false, NULL},
        {"/v1/items/{id}", "/v1/items/%41", true, "/v1/items/%41"},
        {"/", "/", true, "/"},
        {"/v1", "/", false, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *res = NULL;
        bool m = gw_order_match(cases[i].tmpl, cases[i].path, &res);
        cr_expect_eq(m, cases[i].match, "%s vs %s", cases[i].tmpl, cases[i].path);
        if (m && cases[i].match)
            cr_expect_str_eq(res, cases[i].resource, "%s: %s", cases[i].path, res);
        free(res);
        /* the same through the request part reader, as the front asks */
        struct gw_reqparts r = {.method = "PUT", .path = cases[i].path, .query = ""};
        res = NULL;
        m = gw_order_resource(&r, cases[i].tmpl, &res);
        cr_expect_eq(m, cases[i].match, "reader: %s vs %s", cases[i].tmpl, cases[i].path);
        if (m && cases[i].match)
            cr_expect_str_eq(res, cases[i].resource, "reader: %s: %s", cases[i].path, res);
        free(res);
    }
}

Test(seq_parse, header_values)
{
    static const struct {
        const char *v;
        bool ok;
        int64_t want;
    } cases[] = {
        {"1", true, 1},
        {"11", true, 11},
        {" 12\t", true, 12},
        {"9223372036854775807", true, INT64_MAX},
        {"9223372036854775808", false, 0},
        {"18446744073709551616", false, 0},
        {"99999999999999999999", false, 0},
        {"0", false, 0},
        {"00", false, 0},
        {"011", false, 0},
        {"-1", false, 0},
        {"+1", false, 0},
        {"1.0", false, 0},
        {"1e3", false, 0},
        {"0x10", false, 0},
        {"abc", false, 0},
        {"1 2", false, 0},
        {"", false, 0},
        {"  ", false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = -7;
        bool ok = gw_seq_parse(cases[i].v, strlen(cases[i].v), &v);
        cr_expect_eq(ok, cases[i].ok, "'%s'", cases[i].v);
        if (ok)
            cr_expect_eq(v, cases[i].want, "'%s': %lld", cases[i].v, (long long)v);
    }
}

Test(seq_parse, json_pointer)
{
    static const struct {
        const char *body, *ptr;
        bool ok;
        int64_t want;
    } cases[] = {
        {"{\"version\":3}", "/version", true, 3},
        {"{\"a\":{\"b\":[5,6]}}", "/a/b/1", true, 6},
        {"{\"a/b\":7,\"m~n\":8}", "/a~1b", true, 7},
        {"{\"a/b\":7,\"m~n\":8}", "/m~0n", true, 8},
        {"9", "", true, 9},
        {"{\"version\":9223372036854775807}", "/version", true, INT64_MAX},
        {"{\"version\":9223372036854775808}", "/version", false, 0},
        {"{\"version\":0}", "/version", false, 0},
        {"{\"version\":-3}", "/version", false, 0},
        {"{\"version\":3.0}", "/version", false, 0},
        {"{\"version\":\"3\"}", "/version", false, 0},
        {"{\"version\":null}", "/version", false, 0},
        {"{\"version\":true}", "/version", false, 0},
        {"{\"other\":3}", "/version", false, 0},
        {"{\"a\":{\"b\":[5,6]}}", "/a/b/2", false, 0},
        {"{\"a\":{\"b\":[5,6]}}", "/a/b/01", false, 0},
        {"{\"a\":{\"b\":[5,6]}}", "/a/b/-", false, 0},
        {"{\"version\":3,\"version\":4}", "/version", false, 0},
        {"{\"version\":3", "/version", false, 0},
        {"not json", "/version", false, 0},
        {"", "/version", false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = -7;
        bool ok = gw_seq_from_json(cases[i].body, strlen(cases[i].body), cases[i].ptr, &v);
        cr_expect_eq(ok, cases[i].ok, "%s at '%s'", cases[i].body, cases[i].ptr);
        if (ok)
            cr_expect_eq(v, cases[i].want, "%s: %lld", cases[i].body, (long long)v);
    }
    int64_t v;
    cr_expect(!gw_seq_from_json(NULL, 0, "/x", &v));
}

/* Valid JSON (RFC 8259) beyond what jansson loads: numbers outside int64/double, "\u0000", lone surrogates. The
 * value at the pointer is read exactly; the rest of the document is only validated. */
Test(seq_parse, json_pointer_valid_documents_jansson_refuses)
{
    static const struct {
        const char *body, *ptr;
        int64_t want;
    } cases[] = {
        {"{\"seq\":1,\"account\":18446744073709551615}", "/seq", 1},
        {"{\"seq\":1,\"x\":-9223372036854775809}", "/seq", 1},
        {"{\"seq\":1,\"x\":1e400}", "/seq", 1},
        {"{\"seq\":7,\"x\":\"\\u0000\"}", "/seq", 7},
        {"{\"x\":-1e400,\"seq\":2,\"y\":[1E+999,0.0e-99999,123456789012345678901234567890]}", "/seq", 2},
        {"{\"a\\u0000b\":1,\"a\\u0000c\":2,\"seq\":3}", "/seq", 3},
        {"{\"x\":\"\\ud800\",\"y\":\"\\udc00\\ud800\",\"seq\":4}", "/seq", 4},
        {"{\"m\":{\"v\":[18446744073709551616,{\"seq\":5}]}}", "/m/v/1/seq", 5},
        {"[1e400,\"\\u0000\",9223372036854775807]", "/2", INT64_MAX},
        {" \t\r\n{ \"seq\" : 6 , \"z\" : [ ] , \"o\" : { } } \n", "/seq", 6},
        {"{\"\\u00e9t\\u00E9\":8,\"s\\u00e9q\":9}", "/s\xc3\xa9q", 9},
        {"{\"\\ud83d\\ude00\":10}", "/\xf0\x9f\x98\x80", 10},
        {"{\"seq\":11,\"t\":[true,false,null,\"\\\"\\\\\\/\\b\\f\\n\\r\\t\",-0,0.5,1e5]}", "/seq", 11},
        {"{\"\":12}", "/", 12},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = -7;
        bool ok = gw_seq_from_json(cases[i].body, strlen(cases[i].body), cases[i].ptr, &v);
        cr_expect(ok, "refused: %s at '%s'", cases[i].body, cases[i].ptr);
        if (ok)
            cr_expect_eq(v, cases[i].want, "%s: %lld", cases[i].body, (long long)v);
    }
}

/* What stays refused: a bad value at the pointer, invalid JSON anywhere, trailing garbage, duplicates, deep nesting.
 */
Test(seq_parse, json_pointer_refusals)
{
    static const struct {
        const char *body, *ptr;
    } cases[] = {
        {"{\"seq\":1.0}", "/seq"},
        {"{\"seq\":1e3}", "/seq"},
        {"{\"seq\":1E3}", "/seq"},
        {"{\"seq\":-0}", "/seq"},
        {"{\"seq\":18446744073709551615}", "/seq"},
        {"{\"seq\":1e400}", "/seq"},
        {"{\"seq\":[1]}", "/seq"},
        {"{\"seq\":{}}", "/seq"},
        {"{\"seq\":01}", "/seq"},
        {"{\"seq\":+1}", "/seq"},
        {"{\"seq\":1,\"x\":01}", "/seq"},
        {"{\"seq\":1,\"x\":1.}", "/seq"},
        {"{\"seq\":1,\"x\":.5}", "/seq"},
        {"{\"seq\":1,\"x\":1e}", "/seq"},
        {"{\"seq\":1,\"x\":-}", "/seq"},
        {"{\"seq\":1,\"x\":1e400.5}", "/seq"},
        {"{\"seq\":1,\"x\":NaN}", "/seq"},
        {"{\"seq\":1,\"x\":Infinity}", "/seq"},
        {"{\"seq\":1,\"x\":tru}", "/seq"},
        {"{\"seq\":1,\"x\":\"\\x\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\\u12\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\\u12G4\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"a\tb\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\xff\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\xc0\xaf\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\xed\xa0\x80\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\xf4\x90\x80\x80\"}", "/seq"},
        {"{\"seq\":1,\"x\":\"\xe2\x82\"}", "/seq"},
        {"{\"seq\":1,\"x\":'a'}", "/seq"},
        {"{\"seq\":1,}", "/seq"},
        {"{\"seq\":1,\"x\":[1,]}", "/seq"},
        {"{\"seq\":1 \"x\":2}", "/seq"},
        {"{seq:1}", "/seq"},
        {"{\"seq\" 1}", "/seq"},
        {"{\"seq\":1]", "/seq"},
        {"[1}", "/0"},
        {"{\"seq\":1}}", "/seq"},
        {"{\"seq\":1} x", "/seq"},
        {"{\"seq\":1}{}", "/seq"},
        {"\xef\xbb\xbf{\"seq\":1}", "/seq"},
        {"{\"seq\":1,\"x\":1e400,\"seq\":2}", "/seq"},
        {"{\"seq\":1,\"x\":{\"a\":1e400,\"a\":2}}", "/seq"},
        {"{\"seq\":1,\"x\":{\"\\u0061\":0,\"a\":2}}", "/seq"},
        {"{\"seq\":1,\"x\":{\"\\ud83d\\ude00\":0,\"\xf0\x9f\x98\x80\":2}}", "/seq"},
        {"{\"seq\":1,\"x\":{\"a\\u0000\":0,\"a\\u0000\":2}}", "/seq"},
        {"{\"seq\":1,\"x\":\"\\u0000\"", "/seq"},
        {"{\"seq\":1,\"x\":\"abc", "/seq"},
        {"{\"seq\":1,\"x\":\"abc\\", "/seq"},
        {"{\"seq\":1", "/seq"},
        {"{\"seq\":", "/seq"},
        {"{\"seq\"", "/seq"},
        {"[", "/0"},
        {"  ", ""},
        {"{\"seq\":1}", "/seq/0"},
        {"{\"seq\":1}", ""},
        {"{\"seq\":1}", "/Seq"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t v = -7;
        cr_expect(!gw_seq_from_json(cases[i].body, strlen(cases[i].body), cases[i].ptr, &v), "accepted: %s at '%s'",
                  cases[i].body, cases[i].ptr);
    }
    static const char nul_after[] = "{\"seq\":1}\0";
    int64_t v;
    cr_expect(!gw_seq_from_json(nul_after, sizeof nul_after - 1, "/seq", &v), "a NUL byte after the document");
}

/* Nesting is bounded (2048 levels, as jansson's parser was): deeper is refused, iteratively (no recursion). */
Test(seq_parse, json_pointer_nesting_bound)
{
    enum { MAX = 2048 };
    size_t cap = 2 * (MAX + 1) + 64;
    char *b = malloc(cap);
    cr_assert_not_null(b);
    int64_t v;
    for (int depth = MAX - 1; depth <= MAX + 1; depth++) {
        /* {"seq":1,"d":[[[...]]]} with depth - 1 arrays: depth containers in all */
        size_t n = (size_t)snprintf(b, cap, "{\"seq\":1,\"d\":");
        for (int i = 1; i < depth; i++)
            b[n++] = '[';
        for (int i = 1; i < depth; i++)
            b[n++] = ']';
        b[n++] = '}';
        bool ok = gw_seq_from_json(b, n, "/seq", &v);
        cr_expect_eq(ok, depth <= MAX, "depth %d: %d", depth, ok);
    }
    /* a very deep unbalanced prefix: refused at the bound, no stack growth */
    size_t big = 1u << 20;
    char *d = malloc(big);
    cr_assert_not_null(d);
    memset(d, '[', big);
    cr_expect(!gw_seq_from_json(d, big, "/0", &v));
    free(d);
    free(b);
}

/* Large objects: duplicates found among many members (sorted, not compared pairwise), the pointer's value read. */
Test(seq_parse, json_pointer_many_members)
{
    enum { N = 50000 };
    size_t cap = (size_t)N * 24 + 64;
    char *b = malloc(cap);
    cr_assert_not_null(b);
    size_t n = 0;
    b[n++] = '{';
    for (int i = 0; i < N; i++)
        n += (size_t)snprintf(b + n, cap - n, "\"k%d\":%d,", i, i);
    n += (size_t)snprintf(b + n, cap - n, "\"seq\":42}");
    int64_t v = 0;
    cr_expect(gw_seq_from_json(b, n, "/seq", &v));
    cr_expect_eq(v, 42);
    n -= 10; /* back over "seq":42} */
    n += (size_t)snprintf(b + n, cap - n, "\"k%d\":42}", N / 2);
    cr_expect(!gw_seq_from_json(b, n, "/k1", &v), "a duplicate among %d members", N);
    free(b);
}

#define ORD_BASE                                                                                                       \
    "store:\n"                                                                                                         \
    "  postgres: postgres://u@127.0.0.1/db\n"                                                                          \
    "upstreams:\n"                                                                                                     \
    "  - name: api\n"                                                                                                  \
    "    url: http://127.0.0.1:9000\n"                                                                                 \
    "routes:\n"                                                                                                        \
    "  - name: address\n"                                                                                              \
    "    match: { path_prefix: /v1/accounts }\n"                                                                       \
    "    upstream: api\n"                                                                                              \
    "    ordering:\n"

static struct conf *load(const char *ordering, char **err)
{
    char *y = NULL;
    if (asprintf(&y, ORD_BASE "%s", ordering) < 0)
        abort();
    *err = NULL;
    struct conf *c = conf_load_string("t.yaml", y, strlen(y), err);
    free(y);
    return c;
}

Test(ordering_conf, defaults_and_values)
{
    char *err;
    struct conf *c = load("      resource: /v1/accounts/{id}/address/\n      sequence: header:X-Sequence\n", &err);
    cr_assert_not_null(c, "%s", err ? err : "");
    const struct conf_ordering *o = &c->routes[0].ordering;
    cr_expect(o->enabled);
    cr_expect_str_eq(o->resource, "/v1/accounts/{id}/address");
    cr_expect_eq(o->source, CONF_SEQ_HEADER);
    cr_expect_str_eq(o->seq_name, "X-Sequence");
    cr_expect_eq(o->on_gap, CONF_GAP_ACCEPT);
    cr_expect_eq(o->hold_ms, 2000);
    conf_destroy(c);

    c = load("      resource: /v1/accounts/{id}\n      sequence: json:/meta/v\n      on_gap: hold\n      hold: 500ms\n",
             &err);
    cr_assert_not_null(c, "%s", err ? err : "");
    o = &c->routes[0].ordering;
    cr_expect_eq(o->source, CONF_SEQ_JSON);
    cr_expect_str_eq(o->seq_name, "/meta/v");
    cr_expect_eq(o->on_gap, CONF_GAP_HOLD);
    cr_expect_eq(o->hold_ms, 500);
    conf_destroy(c);
}

Test(ordering_conf, bad_blocks_name_line_and_key)
{
    static const struct {
        const char *yaml, *needle;
    } cases[] = {
        {"      sequence: header:X-Sequence\n", "resource"},
        {"      resource: /v1/a/{id}\n", "sequence"},
        {"      resource: v1/a/{id}\n      sequence: header:X-S\n", "must start with '/'"},
        {"      resource: /v1/a/x{id}\n      sequence: header:X-S\n", "no braces"},
        {"      resource: /v1/a/{id}x\n      sequence: header:X-S\n", "whole segment"},
        {"      resource: /v1//{id}\n      sequence: header:X-S\n", "empty segment"},
        {"      resource: /v1/{i-d}\n      sequence: header:X-S\n", "letters"},
        {"      resource: /v1/{id}\n      sequence: query:x\n", "header:NAME or json:/pointer"},
        {"      resource: /v1/{id}\n      sequence: \"header:\"\n", "header:NAME or json:/pointer"},
        {"      resource: /v1/{id}\n      sequence: \"header:X S\"\n", "header:NAME or json:/pointer"},
        {"      resource: /v1/{id}\n      sequence: json:version\n", "JSON Pointer"},
        {"      resource: /v1/{id}\n      sequence: json:/a~2\n", "JSON Pointer"},
        {"      resource: /v1/{id}\n      sequence: header:X-S\n      on_gap: wait\n", "on_gap"},
        {"      resource: /v1/{id}\n      sequence: header:X-S\n      hold: 0s\n", "hold"},
        {"      resource: /v1/{id}\n      sequence: header:X-S\n      holdd: 1s\n", "unknown key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *err;
        struct conf *c = load(cases[i].yaml, &err);
        cr_expect_null(c, "accepted: %s", cases[i].yaml);
        cr_expect(err && strstr(err, cases[i].needle), "%s: error '%s' lacks '%s'", cases[i].yaml, err ? err : "",
                  cases[i].needle);
        cr_expect(err && strstr(err, "t.yaml:"), "names the file and line: %s", err ? err : "");
        conf_destroy(c);
        free(err);
    }
}

/* The sequence as the front reads it, through the request part reader: a header needs exactly one field line. */
Test(seq_parse, from_parts)
{
    static const struct {
        const char *h1, *h2; /* Seq field lines (NULL: none) */
        const char *body;
        enum conf_seq_source src;
        bool ok;
        int64_t want;
    } cases[] = {
        {"7", NULL, NULL, CONF_SEQ_HEADER, true, 7},
        {NULL, NULL, NULL, CONF_SEQ_HEADER, false, 0},
        {"7", "7", NULL, CONF_SEQ_HEADER, false, 0},
        {" 9223372036854775807\t", NULL, NULL, CONF_SEQ_HEADER, true, INT64_MAX},
        {"07", NULL, NULL, CONF_SEQ_HEADER, false, 0},
        {NULL, NULL, "{\"seq\": 12}", CONF_SEQ_JSON, true, 12},
        {NULL, NULL, "{\"seq\": \"12\"}", CONF_SEQ_JSON, false, 0},
        {NULL, NULL, "{\"seq\": 12", CONF_SEQ_JSON, false, 0},
        {NULL, NULL, NULL, CONF_SEQ_JSON, false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct cm_hdrs h;
        cm_hdrs_init(&h);
        if (cases[i].h1)
            cm_hdrs_add(&h, "Seq", cases[i].h1);
        if (cases[i].h2)
            cm_hdrs_add(&h, "seq", cases[i].h2);
        struct gw_reqparts r = {.method = "PUT",
                                .path = "/",
                                .query = "",
                                .hdrs = &h,
                                .body = cases[i].body,
                                .body_len = cases[i].body ? strlen(cases[i].body) : 0};
        int64_t seq = 0;
        bool ok = gw_seq_from_parts(&r, cases[i].src, cases[i].src == CONF_SEQ_HEADER ? "SEQ" : "/seq", &seq);
        cr_expect_eq(ok, cases[i].ok, "case %zu", i);
        if (ok)
            cr_expect_eq(seq, cases[i].want, "case %zu", i);
        gw_reqparts_free(&r);
        cm_hdrs_free(&h);
    }
}
