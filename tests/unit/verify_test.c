/* verify_test.c - gateway/verify.c: each scheme against signatures made the way its sender makes them (a signer
 * written here from the sender's documented algorithm) and against published or independently computed vectors;
 * rotation, tolerance edges, malformed and oversized headers. */
#include <criterion/criterion.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "conf/types.h"
#include "gateway/verify.h"

/* ---- requests: a few headers */
struct hdrs {
    const char *name[8];
    const char *value[8];
    size_t n;
};

static const char *get(void *arg, const char *name)
{
    struct hdrs *h = arg;
    for (size_t i = 0; i < h->n; i++)
        if (strcasecmp(h->name[i], name) == 0)
            return h->value[i];
    return NULL;
}

static struct gw_verify *make(enum conf_verify_scheme scheme, const char *const *secrets, uint64_t tolerance_ms)
{
    static char *names[] = {"VT_SECRET_0", "VT_SECRET_1", "VT_SECRET_2"};
    struct conf_verify c = {.enabled = true, .scheme = scheme, .secrets_env = names, .tolerance_ms = tolerance_ms};
    for (size_t i = 0; secrets[i] && i < 3; i++) {
        setenv(names[i], secrets[i], 1);
        c.secrets_env_n = i + 1;
    }
    char *err = NULL;
    struct gw_verify *v = gw_verify_create(&c, "routes[0].verify.secrets_env", &err);
    cr_assert_not_null(v, "create: %s", err ? err : "");
    return v;
}

static enum gw_verify_result check(const struct gw_verify *v, struct hdrs *h, const char *body, int64_t now)
{
    return gw_verify_check(v, get, h, body, strlen(body), now);
}

/* ---- Standard Webhooks: the specification's test vector */
#define SW_SECRET "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
#define SW_ID     "msg_p5jXN8AQM9LWM0D4loKWxJek"
#define SW_TS     1614265330
#define SW_BODY   "{\"test\": 2432232314}"
#define SW_SIG    "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

static struct hdrs sw_hdrs(const char *id, const char *ts, const char *sig)
{
    struct hdrs h = {.n = 0};
    if (id)
        h.name[h.n] = "webhook-id", h.value[h.n++] = id;
    if (ts)
        h.name[h.n] = "webhook-timestamp", h.value[h.n++] = ts;
    if (sig)
        h.name[h.n] = "webhook-signature", h.value[h.n++] = sig;
    return h;
}

Test(verify_standard, the_specification_vector_verifies)
{
    static const char *const s[] = {SW_SECRET, NULL};
    struct gw_verify *v = make(CONF_VERIFY_STANDARD, s, 300000);
    struct hdrs h = sw_hdrs(SW_ID, "1614265330", SW_SIG);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_OK);
    /* one byte of the body, the id or the timestamp changed: no match */
    cr_expect_eq(check(v, &h, "{\"test\": 2432232315}", SW_TS), GW_VERIFY_MISMATCH);
    struct hdrs h2 = sw_hdrs("msg_p5jXN8AQM9LWM0D4loKWxJeK", "1614265330", SW_SIG);
    cr_expect_eq(check(v, &h2, SW_BODY, SW_TS), GW_VERIFY_MISMATCH);
    struct hdrs h3 = sw_hdrs(SW_ID, "1614265331", SW_SIG);
    cr_expect_eq(check(v, &h3, SW_BODY, SW_TS), GW_VERIFY_MISMATCH);
    gw_verify_destroy(v);
}

Test(verify_standard, tolerance_edges_either_way)
{
    static const char *const s[] = {SW_SECRET, NULL};
    struct gw_verify *v = make(CONF_VERIFY_STANDARD, s, 300000);
    struct hdrs h = sw_hdrs(SW_ID, "1614265330", SW_SIG);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS + 300), GW_VERIFY_OK, "300 s old: at the edge");
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS + 301), GW_VERIFY_TIMESTAMP, "301 s old");
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS - 300), GW_VERIFY_OK, "300 s ahead: at the edge");
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS - 301), GW_VERIFY_TIMESTAMP, "301 s ahead");
    gw_verify_destroy(v);
}

Test(verify_standard, rotation_several_signatures_and_versions)
{
    /* the secret without its whsec_ prefix is the same key (as the libraries take it) */
    static const char *const s[] = {"whsec_dGhpcyBpcyBhbm90aGVyIHNlY3JldCE=", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STANDARD, s, 300000);
    static const char *const ok[] = {
        SW_SIG,
        "v1,bm9wZQ== " SW_SIG,                            /* a rotated-out signature first */
        "v1a,bm9wZQ== " SW_SIG,                           /* another version is not ours: ignored */
        "  " SW_SIG "  ",                                 /* spaces around */
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE", /* without padding */
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct hdrs h = sw_hdrs(SW_ID, "1614265330", ok[i]);
        cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_OK, "'%s'", ok[i]);
    }
    gw_verify_destroy(v);
}

Test(verify_standard, malformed_headers_are_refused)
{
    static const char *const s[] = {SW_SECRET, NULL};
    struct gw_verify *v = make(CONF_VERIFY_STANDARD, s, 300000);
    struct hdrs h = sw_hdrs(NULL, "1614265330", SW_SIG);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_MISSING, "no webhook-id");
    h = sw_hdrs(SW_ID, NULL, SW_SIG);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_MISSING, "no webhook-timestamp");
    h = sw_hdrs(SW_ID, "1614265330", NULL);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_MISSING, "no webhook-signature");
    static const struct {
        const char *ts, *sig, *why;
        enum gw_verify_result want;
    } cases[] = {
        {"1614265330.0", SW_SIG, "a fractional timestamp", GW_VERIFY_MALFORMED},
        {"-1614265330", SW_SIG, "a signed timestamp", GW_VERIFY_MALFORMED},
        {"", SW_SIG, "an empty timestamp", GW_VERIFY_MALFORMED},
        {"1614265330000000000000", SW_SIG, "a timestamp of 22 digits", GW_VERIFY_MALFORMED},
        {"1614265330", "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=", "no version", GW_VERIFY_MALFORMED},
        {"1614265330", " ", "no signature", GW_VERIFY_MALFORMED},
        {"1614265330", "v1,", "an empty signature", GW_VERIFY_MISMATCH},
        {"1614265330", "v1,!!!!", "not base64", GW_VERIFY_MISMATCH},
        {"1614265330", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE==", "bad padding", GW_VERIFY_MISMATCH},
        {"1614265330", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1O", "a short MAC", GW_VERIFY_MISMATCH},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        h = sw_hdrs(SW_ID, cases[i].ts, cases[i].sig);
        cr_expect_eq(check(v, &h, SW_BODY, SW_TS), cases[i].want, "%s: %s", cases[i].why,
                     gw_verify_result_name(check(v, &h, SW_BODY, SW_TS)));
    }
    /* 17 signatures are over the bound, even with the right one among them */
    char many[2048] = "";
    for (int i = 0; i < 16; i++)
        strcat(many, "v1,bm9wZQ== ");
    strcat(many, SW_SIG);
    h = sw_hdrs(SW_ID, "1614265330", many);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_MALFORMED, "17 signatures");
    /* an id over 256 bytes */
    char id[300];
    memset(id, 'a', 299);
    id[299] = '\0';
    h = sw_hdrs(id, "1614265330", SW_SIG);
    cr_expect_eq(check(v, &h, SW_BODY, SW_TS), GW_VERIFY_MALFORMED, "a long id");
    gw_verify_destroy(v);
}

/* ---- Stripe: the signer from Stripe's documentation (HMAC-SHA256 of "t.body" keyed with the whole secret, hex) */
static void stripe_sig(char out[65], const char *secret, const char *t, const char *body)
{
    char msg[4096];
    int m = snprintf(msg, sizeof msg, "%s.%s", t, body);
    unsigned char mac[32];
    unsigned int n = 0;
    cr_assert_not_null(HMAC(EVP_sha256(), secret, (int)strlen(secret), (unsigned char *)msg, (size_t)m, mac, &n));
    for (size_t i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", mac[i]);
}

static struct hdrs stripe_hdrs(const char *value)
{
    struct hdrs h = {.n = 1, .name = {"Stripe-Signature"}, .value = {value}};
    return h;
}

#define ST_BODY "{\"id\":\"evt_1\",\"object\":\"event\"}"
/* printf '%s' '1700000000.{"id":"evt_1","object":"event"}' | openssl dgst -sha256 -hmac 'whsec_test_secret' */
#define ST_OPENSSL "0c8670ed117751cc551a20e35839447075c42800ea3cf3e8a2fbda99cd1e6edd"

Test(verify_stripe, the_documented_algorithm_and_an_openssl_signature)
{
    static const char *const s[] = {"whsec_test_secret", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STRIPE, s, 300000);
    char sig[65], hdr[256];
    stripe_sig(sig, "whsec_test_secret", "1700000000", ST_BODY);
    cr_expect_str_eq(sig, ST_OPENSSL, "the signer agrees with openssl dgst -hmac");
    struct hdrs h = stripe_hdrs("t=1700000000,v1=" ST_OPENSSL);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_OK);
    cr_expect_eq(check(v, &h, ST_BODY "\n", 1700000000), GW_VERIFY_MISMATCH, "a byte more in the body");
    /* Stripe's own header shape: v1 and v0 (test mode), spaces after commas, upper-case hex */
    h = stripe_hdrs("t=1700000000, v1=" ST_OPENSSL
                    ", v0=6ffbb59b2300aae63f272406069a9788598b792a944a07aba816edb039989a39");
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_OK);
    h = stripe_hdrs("t=1700000000,v1=0C8670ED117751CC551A20E35839447075C42800EA3CF3E8A2FBDA99CD1E6EDD");
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_OK);
    /* a fresh signature of the documented form at another time */
    stripe_sig(sig, "whsec_test_secret", "1700000123", ST_BODY);
    snprintf(hdr, sizeof hdr, "t=1700000123,v1=%s", sig);
    h = stripe_hdrs(hdr);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000100), GW_VERIFY_OK);
    /* the timestamp is signed: sending another one breaks the signature */
    snprintf(hdr, sizeof hdr, "t=1700000124,v1=%s", sig);
    h = stripe_hdrs(hdr);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000100), GW_VERIFY_MISMATCH);
    gw_verify_destroy(v);
}

Test(verify_stripe, a_second_secret_and_a_second_signature_match)
{
    static const char *const s[] = {"whsec_new", "whsec_old", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STRIPE, s, 300000);
    char old[65], other[65], hdr[300];
    stripe_sig(old, "whsec_old", "1700000000", ST_BODY);
    stripe_sig(other, "whsec_unknown", "1700000000", ST_BODY);
    snprintf(hdr, sizeof hdr, "t=1700000000,v1=%s", old);
    struct hdrs h = stripe_hdrs(hdr);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_OK, "signed with the second secret");
    snprintf(hdr, sizeof hdr, "t=1700000000,v1=%s,v1=%s", other, old);
    h = stripe_hdrs(hdr);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_OK, "the second v1 matches");
    snprintf(hdr, sizeof hdr, "t=1700000000,v1=%s", other);
    h = stripe_hdrs(hdr);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_MISMATCH, "a secret not listed");
    gw_verify_destroy(v);
}

Test(verify_stripe, tolerance_edges)
{
    static const char *const s[] = {"whsec_test_secret", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STRIPE, s, 300000);
    struct hdrs h = stripe_hdrs("t=1700000000,v1=" ST_OPENSSL);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000300), GW_VERIFY_OK);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000301), GW_VERIFY_TIMESTAMP);
    cr_expect_eq(check(v, &h, ST_BODY, 1699999700), GW_VERIFY_OK);
    cr_expect_eq(check(v, &h, ST_BODY, 1699999699), GW_VERIFY_TIMESTAMP);
    gw_verify_destroy(v);
    /* a tolerance under a second's multiple counts whole seconds */
    v = make(CONF_VERIFY_STRIPE, s, 1500);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000001), GW_VERIFY_OK);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000002), GW_VERIFY_TIMESTAMP);
    gw_verify_destroy(v);
}

Test(verify_stripe, malformed_headers_are_refused)
{
    static const char *const s[] = {"whsec_test_secret", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STRIPE, s, 300000);
    struct hdrs none = {.n = 0};
    cr_expect_eq(check(v, &none, ST_BODY, 1700000000), GW_VERIFY_MISSING);
    static const struct {
        const char *hdr, *why;
        enum gw_verify_result want;
    } cases[] = {
        {"", "empty", GW_VERIFY_MALFORMED},
        {"v1=" ST_OPENSSL, "no t", GW_VERIFY_MALFORMED},
        {"t=1700000000", "no v1", GW_VERIFY_MALFORMED},
        {"t=1700000000,v0=" ST_OPENSSL, "only v0", GW_VERIFY_MALFORMED},
        {"t=1700000000,t=1700000000,v1=" ST_OPENSSL, "two t", GW_VERIFY_MALFORMED},
        {"t=1700000000,,v1=" ST_OPENSSL, "an empty item", GW_VERIFY_MALFORMED},
        {"t=1700000000,v1=" ST_OPENSSL ",", "a trailing comma", GW_VERIFY_MALFORMED},
        {"t=1700000000;v1=" ST_OPENSSL, "another separator", GW_VERIFY_MALFORMED},
        {"t=17000000x0,v1=" ST_OPENSSL, "a timestamp with a letter", GW_VERIFY_MALFORMED},
        {"t=,v1=" ST_OPENSSL, "an empty timestamp", GW_VERIFY_MALFORMED},
        {"t=1700000000.5,v1=" ST_OPENSSL, "a fractional timestamp", GW_VERIFY_MALFORMED},
        {"t=1700000000,v1=" ST_OPENSSL "00", "a long signature", GW_VERIFY_MISMATCH},
        {"t=1700000000,v1=0c8670ed", "a short signature", GW_VERIFY_MISMATCH},
        {"t=1700000000,v1=zc8670ed117751cc551a20e35839447075c42800ea3cf3e8a2fbda99cd1e6edd", "not hex",
         GW_VERIFY_MISMATCH},
        {"T=1700000000,V1=" ST_OPENSSL, "keys are case-sensitive", GW_VERIFY_MALFORMED},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct hdrs h = stripe_hdrs(cases[i].hdr);
        enum gw_verify_result got = check(v, &h, ST_BODY, 1700000000);
        cr_expect_eq(got, cases[i].want, "%s: %s", cases[i].why, gw_verify_result_name(got));
    }
    /* 17 v1 entries, and a header over 8 KiB, are over the bounds */
    char many[2048] = "t=1700000000";
    for (int i = 0; i < 17; i++)
        strcat(many, ",v1=" ST_OPENSSL);
    struct hdrs h = stripe_hdrs(many);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_MALFORMED, "17 v1");
    char *big = malloc(9000);
    snprintf(big, 9000, "t=1700000000,v1=" ST_OPENSSL ",x=");
    size_t l = strlen(big);
    memset(big + l, 'a', 9000 - l - 1);
    big[8999] = '\0';
    h = stripe_hdrs(big);
    cr_expect_eq(check(v, &h, ST_BODY, 1700000000), GW_VERIFY_MALFORMED, "a 9000-byte header");
    free(big);
    gw_verify_destroy(v);
}

/* ---- GitHub: the vector of GitHub's "Validating webhook deliveries" (also openssl dgst -sha256 -hmac) */
Test(verify_github, the_documented_vector)
{
    static const char *const s[] = {"It's a Secret to Everybody", NULL};
    struct gw_verify *v = make(CONF_VERIFY_GITHUB, s, 300000);
    struct hdrs h = {.n = 1,
                     .name = {"X-Hub-Signature-256"},
                     .value = {"sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"}};
    cr_expect_eq(check(v, &h, "Hello, World!", 0), GW_VERIFY_OK, "no timestamp: any clock");
    cr_expect_eq(check(v, &h, "Hello, World?", 0), GW_VERIFY_MISMATCH);
    h.value[0] = "sha1=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    cr_expect_eq(check(v, &h, "Hello, World!", 0), GW_VERIFY_MALFORMED);
    h.value[0] = "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    cr_expect_eq(check(v, &h, "Hello, World!", 0), GW_VERIFY_MALFORMED);
    h.name[0] = "X-Hub-Signature";
    cr_expect_eq(check(v, &h, "Hello, World!", 0), GW_VERIFY_MISSING, "the SHA-1 header is not read");
    gw_verify_destroy(v);
}

/* ---- hmac: a header, an encoding, a prefix */
Test(verify_hmac, base64_with_a_prefix_and_hex_without)
{
    setenv("VT_SECRET_0", "generic-secret", 1);
    static char *names[] = {"VT_SECRET_0"};
    struct conf_verify c = {.scheme = CONF_VERIFY_HMAC,
                            .secrets_env = names,
                            .secrets_env_n = 1,
                            .header = "X-Signature",
                            .encoding = CONF_VERIFY_BASE64,
                            .prefix = "hmac-sha256 "};
    char *err = NULL;
    struct gw_verify *v = gw_verify_create(&c, "v", &err);
    cr_assert_not_null(v, "%s", err ? err : "");
    /* printf '%s' '{"a":1}' | openssl dgst -sha256 -hmac generic-secret -binary | base64 */
    struct hdrs h = {
        .n = 1, .name = {"x-signature"}, .value = {"hmac-sha256 JTVqh0Y6S4+Mw9RhAvniF5SlEauU4zfB+vMH8dmlZ3w="}};
    cr_expect_eq(check(v, &h, "{\"a\":1}", 0), GW_VERIFY_OK);
    cr_expect_eq(check(v, &h, "{\"a\":2}", 0), GW_VERIFY_MISMATCH);
    h.value[0] = "JTVqh0Y6S4+Mw9RhAvniF5SlEauU4zfB+vMH8dmlZ3w=";
    cr_expect_eq(check(v, &h, "{\"a\":1}", 0), GW_VERIFY_MALFORMED, "no prefix");
    h.value[0] = "hmac-sha256 JTVqh0Y6S4+Mw9RhAvniF5SlEauU4zfB+vMH8dmlZ3w=x";
    cr_expect_eq(check(v, &h, "{\"a\":1}", 0), GW_VERIFY_MALFORMED, "not base64");
    gw_verify_destroy(v);

    c.encoding = CONF_VERIFY_HEX;
    c.prefix = NULL;
    v = gw_verify_create(&c, "v", &err);
    cr_assert_not_null(v);
    h.value[0] = "25356a87463a4b8f8cc3d46102f9e21794a511ab94e337c1faf307f1d9a5677c";
    cr_expect_eq(check(v, &h, "{\"a\":1}", 0), GW_VERIFY_OK);
    gw_verify_destroy(v);
}

/* ---- the secrets: a missing or unusable one is a config error naming the variable, never the value */
Test(verify_create, missing_and_unusable_secrets)
{
    static char *names[] = {"VT_SET", "VT_UNSET"};
    setenv("VT_SET", "whsec_abc", 1);
    unsetenv("VT_UNSET");
    struct conf_verify c = {.scheme = CONF_VERIFY_STRIPE,
                            .secrets_env = names,
                            .secrets_env_n = 2,
                            .file = "/etc/idemgate.yaml",
                            .secrets_line = 12};
    char *err = NULL;
    cr_expect_null(gw_verify_create(&c, "routes[3].verify.secrets_env", &err));
    cr_expect_str_eq(err, "/etc/idemgate.yaml:12: routes[3].verify.secrets_env: the environment variable VT_UNSET "
                          "is unset or empty");
    free(err);
    setenv("VT_UNSET", "", 1);
    err = NULL;
    cr_expect_null(gw_verify_create(&c, "w", &err));
    cr_expect(err && strstr(err, "VT_UNSET is unset or empty"), "%s", err);
    free(err);
    /* standard-webhooks: not base64 after whsec_, or nothing after it */
    c.scheme = CONF_VERIFY_STANDARD;
    c.secrets_env_n = 1;
    static const char *const bad[] = {"whsec_not base64", "whsec_", "whsec_a", "whsec_****"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("VT_SET", bad[i], 1);
        err = NULL;
        cr_expect_null(gw_verify_create(&c, "w", &err), "'%s'", bad[i]);
        cr_expect(err && strstr(err, "VT_SET is not a Standard Webhooks secret (whsec_ then base64)"), "%s", err);
        cr_expect(!err || strlen(bad[i]) <= 7 || !strstr(err, bad[i] + 6), "no value in the message: %s", err);
        free(err);
    }
    unsetenv("VT_SET");
    unsetenv("VT_UNSET");
}

/* ---- a large body is signed and checked whole */
Test(verify_stripe, a_one_mebibyte_body)
{
    static const char *const s[] = {"whsec_big", NULL};
    struct gw_verify *v = make(CONF_VERIFY_STRIPE, s, 300000);
    size_t n = 1 << 20;
    char *body = malloc(n + 1);
    for (size_t i = 0; i < n; i++)
        body[i] = (char)('a' + i % 26);
    body[n] = '\0';
    char *msg = malloc(n + 32);
    int m = snprintf(msg, n + 32, "1700000000.%s", body);
    unsigned char mac[32];
    unsigned int ml = 0;
    HMAC(EVP_sha256(), "whsec_big", 9, (unsigned char *)msg, (size_t)m, mac, &ml);
    char hdr[128] = "t=1700000000,v1=";
    for (size_t i = 0; i < 32; i++)
        snprintf(hdr + strlen(hdr), 3, "%02x", mac[i]);
    struct hdrs h = stripe_hdrs(hdr);
    cr_expect_eq(gw_verify_check(v, get, &h, body, n, 1700000000), GW_VERIFY_OK);
    body[n - 1] ^= 1;
    cr_expect_eq(gw_verify_check(v, get, &h, body, n, 1700000000), GW_VERIFY_MISMATCH, "the last byte counts");
    free(body);
    free(msg);
    gw_verify_destroy(v);
}
