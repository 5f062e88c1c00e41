/* parts_test.c - table-driven tests of gateway/parts.h and gateway/json.h (pointers, form, query); never a server. */
#include <criterion/criterion.h>
#include <string.h>

#include "gateway/idem.h"
#include "gateway/json.h"
#include "gateway/parts.h"

/* ---- JSON Pointer: the raw text span of the value (NULL: names nothing) */

static const char DOC[] = " {\"a\": {\"b\": [10, \"x\\u0041\", {\"c\": null}], \"\": 1, \"m~n\": 2, \"s/t\": 3},"
                          " \"n\": -1.5e3, \"big\": 123456789012345678901234567890, \"e\": {}, \"l\": [],"
                          " \"u\\u00e9\": true, \"\\u00e9\\ud83d\\ude00\": \"p\"} ";

Test(parts, json_pointer_spans)
{
    static const struct {
        const char *ptr, *want;
    } cases[] = {
        {"", "{\"a\": {\"b\": [10, \"x\\u0041\", {\"c\": null}], \"\": 1, \"m~n\": 2, \"s/t\": 3}, \"n\": -1.5e3, "
             "\"big\": 123456789012345678901234567890, \"e\": {}, \"l\": [], \"u\\u00e9\": true, "
             "\"\\u00e9\\ud83d\\ude00\": \"p\"}"},
        {"/a/b", "[10, \"x\\u0041\", {\"c\": null}]"},
        {"/a/b/0", "10"},
        {"/a/b/1", "\"x\\u0041\""},
        {"/a/b/2/c", "null"},
        {"/a/b/3", NULL},
        {"/a/b/01", NULL}, /* a leading zero is no index */
        {"/a/b/-", NULL},  /* past the end names nothing here */
        {"/a/", "1"},      /* the member named "" */
        {"/a/m~0n", "2"},  /* ~0 is ~ */
        {"/a/s~1t", "3"},  /* ~1 is / */
        {"/a/s/t", NULL},
        {"/n", "-1.5e3"},
        {"/big", "123456789012345678901234567890"},
        {"/e", "{}"},
        {"/l", "[]"},
        {"/l/0", NULL},
        {"/u\xc3\xa9", "true"},                 /* a name with an escape matches its decoded UTF-8 */
        {"/\xc3\xa9\xf0\x9f\x98\x80", "\"p\""}, /* a surrogate pair as one code point */
        {"/A", NULL},                           /* names are case-sensitive */
        {"a", NULL},                            /* not a pointer */
        {"/n/0", NULL},                         /* into a scalar */
        {"/a/b/0/x", NULL},
    };
    struct gw_json *j = gw_json_parse(DOC, strlen(DOC));
    cr_assert_not_null(j);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *p = NULL;
        size_t n = 0;
        bool found = gw_json_pointer(j, cases[i].ptr, &p, &n);
        if (!cases[i].want) {
            cr_expect_not(found, "%s names nothing", cases[i].ptr);
            continue;
        }
        cr_expect(found, "%s", cases[i].ptr);
        if (found)
            cr_expect(n == strlen(cases[i].want) && memcmp(p, cases[i].want, n) == 0, "%s: got %.*s", cases[i].ptr,
                      (int)n, p);
    }
    gw_json_destroy(j);
}

Test(parts, json_documents_refused)
{
    static const char *const bad[] = {
        "",      " ",         "{",     "{\"a\":1,}", "[1,]",    "{\"a\":1,\"a\":2}", "{\"a\":1,\"\\u0061\":2}",
        "01",    "1.",        "-",     "tru",        "\"\\x\"", "\"\x01\"",          "\"\xc0\xaf\"",
        "{} {}", "{\"a\" 1}", "[1 2]", "\"abc",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_expect_null(gw_json_parse(bad[i], strlen(bad[i])), "case %zu refused", i);
    cr_expect_null(gw_json_parse(NULL, 0));
    /* nesting: 2048 open, not 2049 */
    static char deep[2 * 2049 + 1];
    for (size_t d = 2048; d <= 2049; d++) {
        memset(deep, '[', d);
        memset(deep + d, ']', d);
        struct gw_json *j = gw_json_parse(deep, 2 * d);
        cr_expect_eq(j != NULL, d == 2048, "depth %zu", d);
        gw_json_destroy(j);
    }
}

/* ---- form fields and query parameters */

Test(parts, form_fields)
{
    static const struct {
        const char *s, *name;
        size_t i;
        const char *want; /* NULL: no such value */
        size_t count;
    } cases[] = {
        {"a=1&b=2", "a", 0, "1", 1},
        {"a=1&b=2", "b", 0, "2", 1},
        {"a=1&b=2&a=3", "a", 1, "3", 2},
        {"a=1&b=2&a=3", "a", 2, NULL, 2},
        {"a", "a", 0, "", 1}, /* no '=': the value "" */
        {"a=", "a", 0, "", 1},
        {"&&a=1&&", "a", 0, "1", 1}, /* empty fields are skipped */
        {"x=a+b%20c", "x", 0, "a b c", 1},
        {"%61=1", "a", 0, "1", 1}, /* names are decoded before comparing */
        {"a+b=1", "a b", 0, "1", 1},
        {"x=%zz%4", "x", 0, "%zz%4", 1}, /* a malformed escape stays as sent */
        {"x=%00", "x", 0, "\0", 1},
        {"A=1", "a", 0, NULL, 0}, /* case-sensitive */
        {"ab=1", "a", 0, NULL, 0},
        {"a=1=2", "a", 0, "1=2", 1},
        {"", "a", 0, NULL, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct gw_value v;
        size_t len = strlen(cases[k].s);
        cr_expect_eq(gw_form_count(cases[k].s, len, cases[k].name), cases[k].count, "case %zu count", k);
        bool found = gw_form_value(cases[k].s, len, cases[k].name, cases[k].i, &v);
        cr_expect_eq(found, cases[k].want != NULL, "case %zu", k);
        if (found && cases[k].want) {
            size_t wn = strcmp(cases[k].s, "x=%00") == 0 ? 1 : strlen(cases[k].want);
            cr_expect(v.n == wn && memcmp(v.p, cases[k].want, wn) == 0, "case %zu: got %.*s", k, (int)v.n, v.p);
        }
        gw_value_release(&v);
    }
}

/* ---- the reader */

static bool value_is(struct gw_reqparts *r, enum gw_part kind, const char *name, size_t i, const char *want)
{
    struct gw_value v;
    bool found = gw_parts_value(r, kind, name, i, &v);
    bool ok = want ? found && v.n == strlen(want) && memcmp(v.p, want, v.n) == 0 : !found;
    gw_value_release(&v);
    return ok;
}

Test(parts, reader_kinds)
{
    struct cm_hdrs h;
    cm_hdrs_init(&h);
    cm_hdrs_add(&h, "X-Tenant", "a");
    cm_hdrs_add(&h, "Content-Type", "Application/X-WWW-Form-URLencoded ; charset=utf-8");
    cm_hdrs_add(&h, "x-tenant", "b");
    const char body[] = "f=1&g=%7B%7D&f=2";
    struct gw_reqparts r = {
        .method = "POST", .path = "/p", .query = "q=1&r=x+y", .body = body, .body_len = strlen(body), .hdrs = &h};
    static const struct {
        enum gw_part kind;
        const char *name;
        size_t i;
        const char *want;
        size_t count;
    } cases[] = {
        {GW_PART_METHOD, NULL, 0, "POST", 1},
        {GW_PART_PATH, NULL, 0, "/p", 1},
        {GW_PART_QUERY, NULL, 0, "q=1&r=x+y", 1},
        {GW_PART_QUERY, NULL, 1, NULL, 1},
        {GW_PART_BODY, NULL, 0, "f=1&g=%7B%7D&f=2", 1},
        {GW_PART_HEADER, "X-TENANT", 0, "a", 2},
        {GW_PART_HEADER, "x-tenant", 1, "b", 2},
        {GW_PART_HEADER, "X-None", 0, NULL, 0},
        {GW_PART_HEADER, NULL, 0, NULL, 0},
        {GW_PART_JWT, "sub", 0, NULL, 0}, /* no token */
        {GW_PART_FORM, "f", 1, "2", 2},
        {GW_PART_FORM, "g", 0, "{}", 1},
        {GW_PART_QPARAM, "r", 0, "x y", 1},
        {GW_PART_QPARAM, "f", 0, NULL, 0},
        {GW_PART_JSON, "", 0, NULL, 0}, /* the body is not JSON */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        cr_expect_eq(gw_parts_count(&r, cases[k].kind, cases[k].name), cases[k].count, "case %zu count", k);
        cr_expect(value_is(&r, cases[k].kind, cases[k].name, cases[k].i, cases[k].want), "case %zu", k);
    }
    struct gw_value v;
    cr_assert(gw_parts_value(&r, GW_PART_HEADER, "X-TENANT", 1, &v));
    cr_expect_str_eq(v.name, "x-tenant", "a header value carries its name as it arrived");
    gw_reqparts_free(&r);

    /* form: needs the form media type */
    h.v[1].value = "application/json";
    r.body = "f=1";
    r.body_len = 3;
    cr_expect_eq(gw_parts_count(&r, GW_PART_FORM, "f"), 0);
    cr_expect(value_is(&r, GW_PART_FORM, "f", 0, NULL));
    cm_hdrs_free(&h);
}

Test(parts, json_body_read_once_and_only_when_asked)
{
    const char body[] = "{\"seq\": 42, \"o\": {\"k\": \"v\"}}";
    struct gw_reqparts r = {.method = "POST", .path = "/", .query = "", .body = body, .body_len = strlen(body)};
    static const struct conf_part fp[] = {
        {CONF_PART_METHOD, NULL}, {CONF_PART_PATH, NULL}, {CONF_PART_QUERY, NULL}, {CONF_PART_BODY, NULL}};
    uint8_t h[32];
    gw_hash_parts(fp, 4, &r, h);
    cr_expect_not(r.json_read, "hashing the body bytes does not parse them");
    cr_expect(value_is(&r, GW_PART_JSON, "/seq", 0, "42"));
    struct gw_json *index = r.json;
    cr_assert_not_null(index);
    cr_expect(value_is(&r, GW_PART_JSON, "/o", 0, "{\"k\": \"v\"}"));
    cr_expect(value_is(&r, GW_PART_JSON, "/o/k", 0, "\"v\""));
    cr_expect(value_is(&r, GW_PART_JSON, "/none", 0, NULL));
    cr_expect_eq(gw_parts_count(&r, GW_PART_JSON, "/o/k"), 1);
    cr_expect_eq(r.json, index, "one parse answers every pointer");
    struct gw_value v;
    cr_assert(gw_parts_value(&r, GW_PART_JSON, "/seq", 0, &v));
    cr_expect(v.json && v.own == NULL, "a json: value is JSON text pointing into the body");
    gw_reqparts_free(&r);
    cr_expect_null(r.json);
}
