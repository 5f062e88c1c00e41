/* idem_test.c - Idempotency-Key parsing (table-driven) and request fingerprint hashing. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "gateway/idem.h"

/* ---- key parsing */

struct key_case {
    const char *raw;
    size_t len;       /* 0: strlen(raw) */
    const char *want; /* NULL: must be rejected */
};

#define OK(r, w)                                                                                                       \
    {                                                                                                                  \
        r, 0, w                                                                                                        \
    }
#define BAD(r)                                                                                                         \
    {                                                                                                                  \
        r, 0, NULL                                                                                                     \
    }
#define OKN(r, w)                                                                                                      \
    {                                                                                                                  \
        r, sizeof(r) - 1, w                                                                                            \
    }
#define BADN(r)                                                                                                        \
    {                                                                                                                  \
        r, sizeof(r) - 1, NULL                                                                                         \
    }

static const struct key_case key_cases[] = {
    /* bare */
    OK("abc", "abc"),
    OK("a", "a"),
    OK("550e8400-e29b-41d4-a716-446655440000", "550e8400-e29b-41d4-a716-446655440000"),
    OK("!#$%&'()*+,-./:;<=>?@[]^_`{|}~", "!#$%&'()*+,-./:;<=>?@[]^_`{|}~"),
    OK("a\"b", "a\"b"), /* a quote inside a bare key is just a visible byte */
    OK("a\\b", "a\\b"),
    OK("ab\"", "ab\""),
    BAD("a b"), /* spaces in bare keys */
    BAD("a\tb"),
    BAD("a\x01"), /* control chars */
    BAD("\x1f"),
    BAD("ab\x7f"),      /* DEL */
    BAD("caf\xc3\xa9"), /* non-ASCII */
    BAD("\x80"),
    BADN("a\0b"), /* embedded NUL */
    /* OWS */
    OK("  abc", "abc"),
    OK("abc \t ", "abc"),
    OK("\t\"abc\" ", "abc"),
    BAD(""),
    BAD("   "),
    BAD("\t \t"),
    BAD("\r\nabc"), /* CR/LF are not OWS */
    BAD("abc\n"),
    /* sf-string */
    OK("\"abc\"", "abc"),
    OK("\"a b c\"", "a b c"),
    OK("\" lead and trail \"", " lead and trail "),
    OK("\" \"", " "),
    OK("\"a\\\"b\"", "a\"b"),
    OK("\"a\\\\b\"", "a\\b"),
    OK("\"\\\\\"", "\\"),
    OK("\"\\\"\"", "\""),
    OK("\"x~!}\"", "x~!}"),
    BAD("\"\""), /* empty */
    BAD("\""),   /* only a quote */
    BAD("\"\"\""),
    BAD("\"abc"),     /* unterminated */
    BAD("\"abc\\\""), /* escaped quote, still unterminated */
    BAD("\"abc\\"),   /* lone trailing backslash */
    BAD("\"a\\nb\""), /* only \" and \\ are escapes */
    BAD("\"a\\tb\""),
    BAD("\"a\\'b\""),
    BAD("\"abc\"def"), /* trailing garbage */
    BAD("\"abc\" x"),
    BAD("\"abc\";x"),
    BAD("\"a\"b\""),
    BAD("\"a\tb\""), /* tab is not allowed inside */
    BAD("\"a\x01\""),
    BAD("\"a\x7f\""),
    BAD("\"caf\xc3\xa9\""),
    BADN("\"a\0b\""),
};

Test(idem, key_table)
{
    for (size_t i = 0; i < sizeof(key_cases) / sizeof(key_cases[0]); i++) {
        const struct key_case *c = &key_cases[i];
        size_t len = c->len ? c->len : strlen(c->raw);
        char out[GW_KEY_MAX + 1];
        size_t out_len = 999;
        bool ok = gw_key_parse(c->raw, len, out, &out_len);
        if (!c->want) {
            cr_expect_not(ok, "case %zu should be rejected", i);
            continue;
        }
        cr_expect(ok, "case %zu should be accepted", i);
        if (ok) {
            cr_expect_eq(out_len, strlen(c->want), "case %zu length", i);
            cr_expect_str_eq(out, c->want, "case %zu value", i);
        }
    }
}

Test(idem, key_not_nul_terminated_input)
{
    /* len is authoritative: bytes past it are ignored */
    char out[GW_KEY_MAX + 1];
    size_t n;
    cr_assert(gw_key_parse("abcdef", 3, out, &n));
    cr_assert_str_eq(out, "abc");
    cr_assert(gw_key_parse("\"ab\"garbage", 4, out, &n));
    cr_assert_str_eq(out, "ab");
    cr_assert_not(gw_key_parse(NULL, 0, out, &n));
    cr_assert_not(gw_key_parse("abc", 0, out, &n));
}

Test(idem, quoted_equals_bare)
{
    char a[GW_KEY_MAX + 1], b[GW_KEY_MAX + 1];
    size_t an, bn;
    cr_assert(gw_key_parse("\"abc\"", 5, a, &an));
    cr_assert(gw_key_parse("abc", 3, b, &bn));
    cr_assert_eq(an, bn);
    cr_assert_eq(memcmp(a, b, an), 0);
}

Test(idem, key_length_limit)
{
    char raw[600];
    char out[GW_KEY_MAX + 1];
    size_t n;

    /* bare: 255 ok, 256 rejected */
    memset(raw, 'k', 256);
    cr_assert(gw_key_parse(raw, 255, out, &n));
    cr_assert_eq(n, 255);
    cr_assert_eq(out[255], '\0');
    cr_assert_not(gw_key_parse(raw, 256, out, &n));
    /* ... OWS does not count */
    raw[0] = ' ';
    cr_assert(gw_key_parse(raw, 256, out, &n));
    cr_assert_eq(n, 255);

    /* quoted: the limit counts the unquoted content (257 raw bytes -> 255) */
    raw[0] = '"';
    memset(raw + 1, 'q', 255);
    raw[256] = '"';
    cr_assert(gw_key_parse(raw, 257, out, &n));
    cr_assert_eq(n, 255);
    raw[256] = 'q';
    raw[257] = '"';
    cr_assert_not(gw_key_parse(raw, 258, out, &n)); /* 256 unquoted */

    /* escapes count as one byte each: 255 escaped quotes = 510 + 2 raw bytes */
    raw[0] = '"';
    for (size_t i = 0; i < 255; i++) {
        raw[1 + 2 * i] = '\\';
        raw[2 + 2 * i] = '"';
    }
    raw[511] = '"';
    cr_assert(gw_key_parse(raw, 512, out, &n));
    cr_assert_eq(n, 255);
    for (size_t i = 0; i < 255; i++)
        cr_assert_eq(out[i], '"');
    raw[511] = '\\';
    raw[512] = '\\';
    raw[513] = '"';
    cr_assert_not(gw_key_parse(raw, 514, out, &n)); /* 256 unquoted */
}

/* ---- fingerprint */

static struct conf_part P_METHOD = {CONF_PART_METHOD, NULL};
static struct conf_part P_PATH = {CONF_PART_PATH, NULL};
static struct conf_part P_QUERY = {CONF_PART_QUERY, NULL};
static struct conf_part P_BODY = {CONF_PART_BODY, NULL};

static void fp(const struct conf_part *parts, size_t n, struct gw_reqparts *r, uint8_t out[32])
{
    gw_hash_parts(parts, n, r, out);
}

static bool same(const uint8_t a[32], const uint8_t b[32])
{
    return memcmp(a, b, 32) == 0;
}

static struct gw_reqparts base_req(void)
{
    struct gw_reqparts r = {
        .method = "POST", .path = "/v1/payments", .query = "a=1", .body = "{\"amount\":10}", .body_len = 13};
    return r;
}

static const struct conf_part DEFAULT_FP[4] = {
    {CONF_PART_METHOD, NULL}, {CONF_PART_PATH, NULL}, {CONF_PART_QUERY, NULL}, {CONF_PART_BODY, NULL}};

Test(idem, fingerprint_deterministic_and_sensitive)
{
    uint8_t h0[32], h1[32];
    struct gw_reqparts r = base_req();
    fp(DEFAULT_FP, 4, &r, h0);
    fp(DEFAULT_FP, 4, &r, h1);
    cr_assert(same(h0, h1));

    /* equal content from different buffers */
    char path[] = "/v1/payments", body[] = "{\"amount\":10}";
    r.path = path;
    r.body = body;
    fp(DEFAULT_FP, 4, &r, h1);
    cr_assert(same(h0, h1));

    const struct {
        const char *method, *path, *query, *body;
    } changes[] = {
        {"PATCH", NULL, NULL, NULL},
        {"post", NULL, NULL, NULL},
        {NULL, "/v1/payment", NULL, NULL},
        {NULL, "/v1/payments/", NULL, NULL},
        {NULL, NULL, "a=2", NULL},
        {NULL, NULL, "", NULL},
        {NULL, NULL, NULL, "{\"amount\":11}"},
        {NULL, NULL, NULL, "{\"amount\":10} "},
    };
    for (size_t i = 0; i < sizeof(changes) / sizeof(changes[0]); i++) {
        r = base_req();
        if (changes[i].method)
            r.method = changes[i].method;
        if (changes[i].path)
            r.path = changes[i].path;
        if (changes[i].query)
            r.query = changes[i].query;
        if (changes[i].body) {
            r.body = changes[i].body;
            r.body_len = strlen(changes[i].body);
        }
        fp(DEFAULT_FP, 4, &r, h1);
        cr_assert_not(same(h0, h1), "change %zu not detected", i);
    }

    /* the body length counts even when the bytes agree on a prefix */
    r = base_req();
    r.body_len = 12;
    fp(DEFAULT_FP, 4, &r, h1);
    cr_assert_not(same(h0, h1));
}

Test(idem, fingerprint_no_concatenation_ambiguity)
{
    struct conf_part pq[2] = {P_PATH, P_QUERY};
    uint8_t a[32], b[32];
    struct gw_reqparts r1 = {
        .method = "POST", .path = "ab", .query = "c", .body = "", .body_len = 0, .hdrs = NULL, .jwt = NULL};
    struct gw_reqparts r2 = {
        .method = "POST", .path = "a", .query = "bc", .body = "", .body_len = 0, .hdrs = NULL, .jwt = NULL};
    fp(pq, 2, &r1, a);
    fp(pq, 2, &r2, b);
    cr_assert_not(same(a, b));

    /* same bytes, different part kinds */
    struct conf_part just_path[1] = {P_PATH};
    struct conf_part just_query[1] = {P_QUERY};
    struct gw_reqparts r3 = {
        .method = "POST", .path = "x", .query = "x", .body = "", .body_len = 0, .hdrs = NULL, .jwt = NULL};
    fp(just_path, 1, &r3, a);
    fp(just_query, 1, &r3, b);
    cr_assert_not(same(a, b));

    /* body "" vs no body part at all vs query "" */
    struct conf_part just_body[1] = {P_BODY};
    fp(just_body, 1, &r3, a);
    fp(NULL, 0, &r3, b);
    cr_assert_not(same(a, b));
}

Test(idem, fingerprint_part_order)
{
    struct conf_part mp[2] = {P_METHOD, P_PATH};
    struct conf_part pm[2] = {P_PATH, P_METHOD};
    struct gw_reqparts r = {
        .method = "POST", .path = "POST", .query = "", .body = "", .body_len = 0, .hdrs = NULL, .jwt = NULL};
    uint8_t a[32], b[32];
    /* method == path: only the kind tags tell the orders apart */
    fp(mp, 2, &r, a);
    fp(pm, 2, &r, b);
    cr_assert_not(same(a, b));
}

Test(idem, empty_parts_is_fixed_hash)
{
    uint8_t a[32], b[32], want[32];
    struct gw_reqparts r1 = base_req();
    struct gw_reqparts r2 = {
        .method = "GET", .path = "/", .query = "", .body = NULL, .body_len = 0, .hdrs = NULL, .jwt = NULL};
    fp(NULL, 0, &r1, a);
    fp(NULL, 0, &r2, b);
    cr_assert(same(a, b));
    cm_sha256("", 0, want);
    cr_assert(same(a, want));
}

Test(idem, fingerprint_binary_body)
{
    static const char b1[] = {'a', 0, 'b', 0, 0};
    static const char b2[] = {'a', 0, 'c', 0, 0};
    struct conf_part body[1] = {P_BODY};
    struct gw_reqparts r = {
        .method = "POST", .path = "/", .query = "", .body = b1, .body_len = sizeof(b1), .hdrs = NULL, .jwt = NULL};
    uint8_t a[32], b[32];
    fp(body, 1, &r, a);
    r.body = b2; /* differs after the first NUL */
    fp(body, 1, &r, b);
    cr_assert_not(same(a, b));
    r.body = b1;
    r.body_len = 4; /* trailing NUL dropped */
    fp(body, 1, &r, b);
    cr_assert_not(same(a, b));
}

Test(idem, header_parts)
{
    struct conf_part hp[1] = {{CONF_PART_HEADER, "X-Tenant"}};
    struct conf_part hp_lower[1] = {{CONF_PART_HEADER, "x-tenant"}};
    struct conf_part other[1] = {{CONF_PART_HEADER, "X-Other"}};
    struct cm_hdrs absent, empty, one, one_case, two, two_swapped, joined;
    cm_hdrs_init(&absent);
    cm_hdrs_add(&absent, "Host", "x");
    cm_hdrs_init(&empty);
    cm_hdrs_add(&empty, "X-Tenant", "");
    cm_hdrs_init(&one);
    cm_hdrs_add(&one, "Host", "x");
    cm_hdrs_add(&one, "X-Tenant", "acme");
    cm_hdrs_init(&one_case);
    cm_hdrs_add(&one_case, "x-TENANT", "acme");
    cm_hdrs_add(&one_case, "Accept", "*/*"); /* unrelated headers do not matter */
    cm_hdrs_init(&two);
    cm_hdrs_add(&two, "X-Tenant", "a");
    cm_hdrs_add(&two, "X-Tenant", "b");
    cm_hdrs_init(&two_swapped);
    cm_hdrs_add(&two_swapped, "X-Tenant", "b");
    cm_hdrs_add(&two_swapped, "x-tenant", "a");
    cm_hdrs_init(&joined);
    cm_hdrs_add(&joined, "X-Tenant", "ab");

    struct gw_reqparts r = {
        .method = "POST", .path = "/", .query = "", .body = "", .body_len = 0, .hdrs = NULL, .jwt = NULL};
    uint8_t h_null[32], h_abs[32], h_emp[32], h_one[32], h_case[32], h_two[32], h_swap[32], h_join[32], h[32];
    fp(hp, 1, &r, h_null); /* no header list at all == absent */
    r.hdrs = &absent;
    fp(hp, 1, &r, h_abs);
    r.hdrs = &empty;
    fp(hp, 1, &r, h_emp);
    r.hdrs = &one;
    fp(hp, 1, &r, h_one);
    r.hdrs = &one_case;
    fp(hp, 1, &r, h_case);
    r.hdrs = &two;
    fp(hp, 1, &r, h_two);
    r.hdrs = &two_swapped;
    fp(hp, 1, &r, h_swap);
    r.hdrs = &joined;
    fp(hp, 1, &r, h_join);

    cr_assert(same(h_null, h_abs));
    cr_assert_not(same(h_abs, h_emp), "absent != empty");
    cr_assert_not(same(h_emp, h_one));
    cr_assert(same(h_one, h_case), "header names are case-insensitive");
    cr_assert_not(same(h_two, h_swap), "value order matters");
    cr_assert_not(same(h_two, h_join), "two values != their concatenation");
    cr_assert_not(same(h_two, h_one));

    /* the configured name's case does not matter either */
    r.hdrs = &one;
    fp(hp_lower, 1, &r, h);
    cr_assert(same(h, h_one));
    /* but which header is covered does */
    struct cm_hdrs oth;
    cm_hdrs_init(&oth);
    cm_hdrs_add(&oth, "X-Other", "acme");
    r.hdrs = &oth;
    fp(other, 1, &r, h);
    cr_assert_not(same(h, h_one));

    cm_hdrs_free(&absent);
    cm_hdrs_free(&empty);
    cm_hdrs_free(&one);
    cm_hdrs_free(&one_case);
    cm_hdrs_free(&two);
    cm_hdrs_free(&two_swapped);
    cm_hdrs_free(&joined);
    cm_hdrs_free(&oth);
}

/* SPEC 9: what a probe's look-up carries of a scope: every value of each header: part in order, the Authorization
 * (the verified bearer token) once for jwt: parts, nothing of the other parts. */
Test(idem, scope_probe_headers)
{
    struct conf_part parts[] = {{CONF_PART_HEADER, "x-tenant"},
                                {CONF_PART_BODY, NULL},
                                {CONF_PART_JWT, "sub"},
                                {CONF_PART_HEADER, "Authorization"},
                                {CONF_PART_JWT, "org"}};
    struct cm_hdrs in, out;
    cm_hdrs_init(&in);
    cm_hdrs_init(&out);
    cm_hdrs_add(&in, "X-Tenant", "a");
    cm_hdrs_add(&in, "Cookie", "secret");
    cm_hdrs_add(&in, "Authorization", "Bearer t");
    cm_hdrs_add(&in, "X-TENANT", "b");
    struct gw_reqparts rp = {.method = "POST", .path = "/", .query = "", .hdrs = &in};
    gw_scope_probe_headers(parts, sizeof parts / sizeof parts[0], &rp, &out);
    cr_assert_eq(out.n, 3, "X-Tenant twice, Authorization once: %zu", out.n);
    cr_expect_str_eq(out.v[0].value, "a");
    cr_expect_str_eq(out.v[1].value, "b", "in arrival order");
    cr_expect_str_eq(out.v[1].name, "X-TENANT", "names as they arrived");
    cr_expect_str_eq(out.v[2].name, "Authorization");
    cr_expect_null(cm_hdrs_get(&out, "Cookie"), "nothing but the scope's parts");
    cm_hdrs_free(&out);
    cm_hdrs_init(&out);
    struct conf_part body[] = {{CONF_PART_BODY, NULL}, {CONF_PART_QUERY, NULL}};
    gw_scope_probe_headers(body, 2, &rp, &out);
    cr_expect_eq(out.n, 0, "parts a look-up cannot carry add nothing");
    cm_hdrs_free(&out);
    cm_hdrs_free(&in);
}

/* Records in Postgres carry fingerprints and scopes hashed by earlier builds: the hash of a request must never
 * change. These values were computed by the code before the request-part reader (gateway/parts.c) existed. */
static void hex32(const uint8_t h[32], char out[65])
{
    for (size_t i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", h[i]);
}

Test(idem, hashes_pinned)
{
    struct cm_hdrs none, hs;
    cm_hdrs_init(&none);
    cm_hdrs_init(&hs);
    cm_hdrs_add(&hs, "Host", "api.test");
    cm_hdrs_add(&hs, "X-Tenant", "acme");
    cm_hdrs_add(&hs, "content-type", "application/json");
    cm_hdrs_add(&hs, "x-tenant", "");
    cm_hdrs_add(&hs, "X-Region", "eu west");
    static const struct conf_part p_hdr[] = {
        {CONF_PART_HEADER, "X-Tenant"}, {CONF_PART_HEADER, "x-region"}, {CONF_PART_HEADER, "X-Absent"}};
    static const struct conf_part p_mix[] = {
        {CONF_PART_BODY, NULL}, {CONF_PART_HEADER, "Content-Type"}, {CONF_PART_QUERY, NULL}, {CONF_PART_METHOD, NULL}};
    static const char bin[] = {'a', '\0', 'b', '\xff'};
    const struct {
        const struct conf_part *parts;
        size_t n;
        struct gw_reqparts r;
        const char *hex;
    } cases[] = {
        {DEFAULT_FP,
         4,
         {.method = "POST",
          .path = "/v1/payments",
          .query = "a=1",
          .body = "{\"amount\":10}",
          .body_len = 13,
          .hdrs = &none},
         "d391143324d644fd809712afc329fe162ade06a7c121a68a0067081168658efd"},
        {DEFAULT_FP,
         4,
         {.method = "PUT", .path = "/", .query = "", .body = NULL, .body_len = 0, .hdrs = NULL, .jwt = NULL},
         "c5e62665127068d8d231a3b9affbbddaf93b9080fcc01b4059b156d5bcce263e"},
        {DEFAULT_FP,
         4,
         {.method = "POST",
          .path = "/x",
          .query = "b=%20&c",
          .body = bin,
          .body_len = sizeof bin,
          .hdrs = &hs,
          .jwt = NULL},
         "2ad2dd6fadea462f5e3d5519a2597140df03ec1712b2918cdec4d6bd18a8d59d"},
        {p_hdr,
         3,
         {.method = "POST", .path = "/", .query = "", .body = NULL, .body_len = 0, .hdrs = &hs, .jwt = NULL},
         "e9220fa05a59442b5c3c406e6834b6ac899551ca06f500de8ffe24f8ee975686"},
        {p_hdr,
         3,
         {.method = "POST", .path = "/", .query = "", .body = NULL, .body_len = 0, .hdrs = &none, .jwt = NULL},
         "36c1732e56dc2f965a7f909c9964cafb37d0be7f9da6e2ad3abce787fbe9c6fa"},
        {p_mix,
         4,
         {.method = "DELETE", .path = "/a/b", .query = "q", .body = "[1,2]", .body_len = 5, .hdrs = &hs, .jwt = NULL},
         "7a249e0edf8afff8a2e953efbee419d52c9f63b7584fe1b75d9506af2f839b97"},
        {NULL,
         0,
         {.method = "POST", .path = "/", .query = "", .body = NULL, .body_len = 0, .hdrs = NULL, .jwt = NULL},
         "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t h[32];
        char got[65];
        struct gw_reqparts r = cases[i].r;
        gw_hash_parts(cases[i].parts, cases[i].n, &r, h);
        hex32(h, got);
        cr_expect_str_eq(got, cases[i].hex, "case %zu: %s", i, got);
    }
    cm_hdrs_free(&none);
    cm_hdrs_free(&hs);
}
