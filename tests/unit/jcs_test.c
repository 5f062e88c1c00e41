/* jcs_test.c - RFC 8785 canonical JSON (gateway/json.h), business keys and json:/form:/query: parts (idem.h); no
 * server. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/idem.h"
#include "gateway/json.h"
#include "gateway/parts.h"

static void buf_put(void *arg, const void *p, size_t n)
{
    cr_assert(cm_buf_append(arg, p, n));
}

/* The canonical form of the value at ptr in doc (NULL when doc is not JSON); *res what gw_json_canonical said. */
static char *canon(const char *doc, const char *ptr, enum gw_jcs *res)
{
    struct gw_json *j = gw_json_parse(doc, strlen(doc));
    if (!j)
        return NULL;
    struct cm_buf b;
    cm_buf_init(&b, 1 << 20);
    *res = gw_json_canonical(j, ptr, buf_put, &b);
    gw_json_destroy(j);
    cr_assert(cm_buf_append(&b, "", 1));
    size_t n;
    char *s = cm_buf_take(&b, &n);
    cm_buf_free(&b);
    return s;
}

static void expect_canon(const char *doc, const char *want)
{
    enum gw_jcs res;
    char *got = canon(doc, "", &res);
    cr_assert_not_null(got, "parses: %s", doc);
    cr_expect_eq(res, GW_JCS_OK, "canonical: %s", doc);
    cr_expect_str_eq(got, want, "canonical form of %s", doc);
    free(got);
}

/* RFC 8785 3.2.2: the sample input and its canonical output (3.2.4 shows its bytes). */
Test(jcs, rfc8785_3_2_2_sample)
{
    expect_canon("{\n"
                 "  \"numbers\": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],\n"
                 "  \"string\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n"
                 "  \"literals\": [null, true, false]\n"
                 "}",
                 "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],"
                 "\"string\":\"\xe2\x82\xac$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}");
}

/* RFC 8785 3.2.3: members sorted by their names' UTF-16 code units (the emoji's surrogates before U+FB33). */
Test(jcs, rfc8785_3_2_3_sorting)
{
    expect_canon("{\n"
                 "  \"\\u20ac\": \"Euro Sign\",\n"
                 "  \"\\r\": \"Carriage Return\",\n"
                 "  \"\\ufb33\": \"Hebrew Letter Dalet With Dagesh\",\n"
                 "  \"1\": \"One\",\n"
                 "  \"\\ud83d\\ude00\": \"Emoji: Grinning Face\",\n"
                 "  \"\\u0080\": \"Control\",\n"
                 "  \"\\u00f6\": \"Latin Small Letter O With Diaeresis\"\n"
                 "}",
                 "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\xc2\x80\":\"Control\","
                 "\"\xc3\xb6\":\"Latin Small Letter O With Diaeresis\",\"\xe2\x82\xac\":\"Euro Sign\","
                 "\"\xf0\x9f\x98\x80\":\"Emoji: Grinning Face\",\"\xef\xac\xb3\":\"Hebrew Letter Dalet With Dagesh\"}");
}

/* RFC 8785 Appendix B: IEEE 754 bit patterns and their serialisation (NaN and Infinity are not JSON). */
Test(jcs, rfc8785_appendix_b_numbers)
{
    static const struct {
        uint64_t bits;
        const char *want;
    } cases[] = {
        {0x0000000000000000, "0"},
        {0x8000000000000000, "0"}, /* minus zero */
        {0x0000000000000001, "5e-324"},
        {0x8000000000000001, "-5e-324"},
        {0x7fefffffffffffff, "1.7976931348623157e+308"},
        {0xffefffffffffffff, "-1.7976931348623157e+308"},
        {0x4340000000000000, "9007199254740992"},
        {0xc340000000000000, "-9007199254740992"},
        {0x4430000000000000, "295147905179352830000"},
        {0x44b52d02c7e14af5, "9.999999999999997e+22"},
        {0x44b52d02c7e14af6, "1e+23"},
        {0x44b52d02c7e14af7, "1.0000000000000001e+23"},
        {0x444b1ae4d6e2ef4e, "999999999999999700000"},
        {0x444b1ae4d6e2ef4f, "999999999999999900000"},
        {0x444b1ae4d6e2ef50, "1e+21"},
        {0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"},
        {0x3eb0c6f7a0b5ed8d, "0.000001"},
        {0x41b3de4355555553, "333333333.3333332"},
        {0x41b3de4355555554, "333333333.33333325"},
        {0x41b3de4355555555, "333333333.3333333"},
        {0x41b3de4355555556, "333333333.3333334"},
        {0x41b3de4355555557, "333333333.33333343"},
        {0xbecbf647612f3696, "-0.0000033333333333333333"},
        {0x43143ff3c1cb0959, "1424953923781206.2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double v;
        memcpy(&v, &cases[i].bits, sizeof v);
        char out[GW_JSON_NUM_MAX];
        size_t n = gw_json_number_es(v, out);
        cr_expect_str_eq(out, cases[i].want, "%016llx", (unsigned long long)cases[i].bits);
        cr_expect_eq(n, strlen(cases[i].want));
        /* and through a document: the shortest text that reads back as v, printed with %.17g */
        char doc[64];
        snprintf(doc, sizeof doc, "[%.17g]", v);
        char want[64];
        snprintf(want, sizeof want, "[%s]", cases[i].want);
        expect_canon(doc, want);
    }
}

Test(jcs, edges)
{
    expect_canon(" { } ", "{}");
    expect_canon("[ ]", "[]");
    expect_canon("-0", "0");
    expect_canon("-0.0e5", "0");
    expect_canon("1e21", "1e+21");
    expect_canon("1e20", "100000000000000000000");
    expect_canon("123e-9", "1.23e-7");
    expect_canon("0.0000010", "0.000001");
    expect_canon("100", "100");
    expect_canon("1.5E+2", "150");
    expect_canon("1e-400", "0"); /* underflow: the nearest double */
    expect_canon("\"\\u0000\\u001f\\u007f\\/\\b\\f\\n\\r\\t\"", "\"\\u0000\\u001f\x7f/\\b\\f\\n\\r\\t\"");
    expect_canon("\"\\u2028<>&\"", "\"\xe2\x80\xa8<>&\"");
    expect_canon("\"\\uD83D\\uDE00\"", "\"\xf0\x9f\x98\x80\"");
    expect_canon("{\"b\":[{\"z\":1,\"a\":[true,{\"y\":null,\"x\":\"\"}]}],\"a\":{\"\":0}}",
                 "{\"a\":{\"\":0},\"b\":[{\"a\":[true,{\"x\":\"\",\"y\":null}],\"z\":1}]}");
    expect_canon("{\"ab\":1,\"a\":2,\"b\":3,\"\\u0061c\":4}", "{\"a\":2,\"ab\":1,\"ac\":4,\"b\":3}");
    /* no canonical form: a lone surrogate (also as a member name), a number beyond a double */
    static const char *const bad[] = {"\"\\ud800\"", "{\"\\udc00\":1}", "[1e400]", "-1e309"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        enum gw_jcs res;
        char *got = canon(bad[i], "", &res);
        cr_assert_not_null(got, "%s parses", bad[i]);
        cr_expect_eq(res, GW_JCS_NOT_IJSON, "%s has no canonical form", bad[i]);
        free(got);
    }
    enum gw_jcs res;
    char *got = canon("{\"a\":{\"b\":[1, 2.0]}}", "/a/b", &res);
    cr_expect_eq(res, GW_JCS_OK);
    cr_expect_str_eq(got, "[1,2]");
    free(got);
    got = canon("{\"a\":1}", "/b", &res);
    cr_expect_eq(res, GW_JCS_ABSENT);
    cr_expect_str_eq(got, "");
    free(got);
}

/* Deep nesting is iterative: as deep as the parser allows. */
Test(jcs, deep)
{
    size_t d = GW_JSON_MAX_DEPTH;
    char *doc = malloc(2 * d + 1), *want = malloc(2 * d + 1);
    for (size_t i = 0; i < d; i++)
        doc[i] = want[i] = '[', doc[d + i] = want[d + i] = ']';
    doc[2 * d] = want[2 * d] = '\0';
    expect_canon(doc, want);
    free(doc);
    free(want);
}

/* ---- business keys (key_from) */

static enum gw_key_res key_of(const char *ctype, const char *body, const char *query, enum conf_part_kind kind,
                              const char *name, char out[GW_KEY_MAX + 1])
{
    struct cm_hdrs h = {0};
    if (ctype)
        cm_hdrs_add(&h, "Content-Type", ctype);
    struct gw_reqparts r = {.method = "POST",
                            .path = "/",
                            .query = query ? query : "",
                            .body = body,
                            .body_len = body ? strlen(body) : 0,
                            .hdrs = &h};
    struct conf_part src = {.kind = kind, .header = (char *)name};
    size_t n = 0;
    enum gw_key_res res = gw_key_from(&src, &r, out, &n);
    if (res == GW_KEY_OK)
        cr_expect_eq(n, strlen(out));
    gw_reqparts_free(&r);
    cm_hdrs_free(&h);
    return res;
}

Test(jcs, key_from_json)
{
    static const struct {
        const char *body, *want; /* want NULL: invalid; "" absent */
    } cases[] = {
        {"{\"k\":\"ord-1\"}", "ord-1"},
        {"{\"k\":\"\\u00e9t\\u00e9 \\ud83d\\ude00\"}", "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80"},
        {"{\"k\":\"a\\/b\"}", "a/b"},
        {"{\"k\":123}", "123"},
        {"{\"k\":-42}", "-42"},
        {"{\"k\":-0}", "0"},
        {"{\"k\":123456789012345678901234567890}", "123456789012345678901234567890"},
        {"{\"k\":1.0}", NULL},
        {"{\"k\":1e3}", NULL},
        {"{\"k\":\"\"}", NULL},
        {"{\"k\":\"a\\nb\"}", NULL},
        {"{\"k\":\"a\\u007fb\"}", NULL},
        {"{\"k\":\"a\\u0085b\"}", NULL}, /* C1 */
        {"{\"k\":\"\\ud800\"}", NULL},   /* lone surrogate: not UTF-8 */
        {"{\"k\":{\"id\":1}}", NULL},
        {"{\"k\":[1]}", NULL},
        {"{\"k\":true}", NULL},
        {"{\"k\":null}", NULL},
        {"{\"other\":1}", ""},
        {"not json", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char out[GW_KEY_MAX + 1];
        enum gw_key_res res = key_of("application/json", cases[i].body, NULL, CONF_PART_JSON, "/k", out);
        if (!cases[i].want) {
            cr_expect_eq(res, GW_KEY_INVALID, "%s: invalid", cases[i].body);
        } else if (!*cases[i].want) {
            cr_expect_eq(res, GW_KEY_ABSENT, "%s: absent", cases[i].body);
        } else {
            cr_expect_eq(res, GW_KEY_OK, "%s: ok", cases[i].body);
            if (res == GW_KEY_OK)
                cr_expect_str_eq(out, cases[i].want);
        }
    }
    char big[400], out[GW_KEY_MAX + 1];
    snprintf(big, sizeof big, "{\"k\":\"%0255d\"}", 7);
    cr_expect_eq(key_of(NULL, big, NULL, CONF_PART_JSON, "/k", out), GW_KEY_OK, "255 bytes");
    snprintf(big, sizeof big, "{\"k\":\"%0256d\"}", 7);
    cr_expect_eq(key_of(NULL, big, NULL, CONF_PART_JSON, "/k", out), GW_KEY_INVALID, "256 bytes");
}

Test(jcs, key_from_form_and_query)
{
    char out[GW_KEY_MAX + 1];
    const char *form = "application/x-www-form-urlencoded; charset=utf-8";
    cr_expect_eq(key_of(form, "a=1&event_id=evt%20%C3%A9+1", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_OK);
    cr_expect_str_eq(out, "evt \xc3\xa9 1");
    cr_expect_eq(key_of(form, "event_id=x&event_id=y", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_INVALID);
    cr_expect_eq(key_of(form, "event_id=", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_INVALID);
    cr_expect_eq(key_of(form, "event_id=%FF", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_INVALID);
    cr_expect_eq(key_of(form, "event_id=a%0Ab", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_INVALID);
    cr_expect_eq(key_of(form, "other=1", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_ABSENT);
    cr_expect_eq(key_of("text/plain", "event_id=1", NULL, CONF_PART_FORM, "event_id", out), GW_KEY_ABSENT);
    cr_expect_eq(key_of(NULL, NULL, "x=1&msg=m%2F1", CONF_PART_QPARAM, "msg", out), GW_KEY_OK);
    cr_expect_str_eq(out, "m/1");
    cr_expect_eq(key_of(NULL, NULL, "x=1", CONF_PART_QPARAM, "msg", out), GW_KEY_ABSENT);
}

/* ---- json: parts in a fingerprint: the canonical form counts, nothing else */

static void fp_of(const char *body, const struct conf_part *parts, size_t n, uint8_t out[32])
{
    struct gw_reqparts r = {.method = "POST", .path = "/", .query = "", .body = body, .body_len = strlen(body)};
    gw_hash_parts(parts, n, &r, out);
    gw_reqparts_free(&r);
}

Test(jcs, fingerprint_of_json_parts)
{
    struct conf_part fp[] = {{.kind = CONF_PART_JSON, .header = "/data"}, {.kind = CONF_PART_JSON, .header = "/x"}};
    uint8_t a[32], b[32];
    fp_of("{\"data\":{\"amount\":1000,\"currency\":\"eur\"},\"delivery_attempt\":1,\"sent_at\":\"t1\"}", fp, 2, a);
    fp_of("{ \"sent_at\":\"t2\", \"delivery_attempt\":7,\n \"data\": {\"currency\":\"\\u0065ur\", \"amount\":1000.0}}",
          fp, 2, b);
    cr_expect_arr_eq(a, b, 32, "order, whitespace, escapes, number spelling and other members do not count");
    fp_of("{\"data\":{\"amount\":1001,\"currency\":\"eur\"}}", fp, 2, b);
    cr_expect_arr_neq(a, b, 32, "the data differ");
    uint8_t absent[32], null[32], empty[32];
    fp_of("{\"data\":{\"amount\":1000,\"currency\":\"eur\"},\"x\":null}", fp, 2, null);
    fp_of("{\"data\":{\"amount\":1000,\"currency\":\"eur\"},\"x\":\"\"}", fp, 2, empty);
    fp_of("{\"data\":{\"amount\":1000,\"currency\":\"eur\"}}", fp, 2, absent);
    cr_expect_arr_neq(absent, null, 32, "absent is not null");
    cr_expect_arr_neq(absent, empty, 32, "absent is not \"\"");
    cr_expect_arr_eq(absent, a, 32);
    /* "1" and 1 differ; a value with no canonical form is hashed as sent */
    struct conf_part k[] = {{.kind = CONF_PART_JSON, .header = "/k"}};
    fp_of("{\"k\":\"1\"}", k, 1, a);
    fp_of("{\"k\":1}", k, 1, b);
    cr_expect_arr_neq(a, b, 32);
    fp_of("{\"k\":\"\\ud800\"}", k, 1, a);
    fp_of("{\"k\":\"\\uD800\"}", k, 1, b);
    cr_expect_arr_neq(a, b, 32, "no canonical form: the text as sent");
}
