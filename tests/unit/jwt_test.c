/* jwt_test.c - bearer JWT verification: HS256, RS256 and ES256 tokens signed here with OpenSSL (keys made per run,
 * the JWKS written to a temp file), every way a token is refused, and the claim values scopes read. */
#include <criterion/criterion.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/ecdsa.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rsa.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "tests/tools/b64url.h"
#include "conf/conf.h"
#include "gateway/idem.h"
#include "gateway/jwt.h"

#define SECRET "0123456789abcdef0123456789abcdef-hs256-test"
#define NOW    1900000000LL

static EVP_PKEY *rsa, *rsa_other, *ec;
static char jwks_path[256];

static void b64url_str(const char *s, char *out)
{
    test_b64url((const unsigned char *)s, strlen(s), out);
}

static void bn_b64(EVP_PKEY *k, const char *param, char *out)
{
    BIGNUM *bn = NULL;
    cr_assert(EVP_PKEY_get_bn_param(k, param, &bn) == 1);
    unsigned char buf[512];
    int n = BN_bn2bin(bn, buf);
    test_b64url(buf, (size_t)n, out);
    BN_free(bn);
}

static void ec_xy(EVP_PKEY *k, char *x, char *y)
{
    unsigned char pub[65];
    size_t len = 0;
    cr_assert(EVP_PKEY_get_octet_string_param(k, OSSL_PKEY_PARAM_PUB_KEY, pub, sizeof pub, &len) == 1 && len == 65);
    test_b64url(pub + 1, 32, x);
    test_b64url(pub + 33, 32, y);
}

static void write_jwks(void)
{
    char n[600], e[16], x[64], y[64], n2[600];
    bn_b64(rsa, OSSL_PKEY_PARAM_RSA_N, n);
    bn_b64(rsa, OSSL_PKEY_PARAM_RSA_E, e);
    bn_b64(rsa_other, OSSL_PKEY_PARAM_RSA_N, n2);
    ec_xy(ec, x, y);
    snprintf(jwks_path, sizeof jwks_path, "/tmp/jwt_test_%d.jwks", (int)getpid());
    FILE *f = fopen(jwks_path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"keys\":[{\"kty\":\"RSA\",\"kid\":\"r1\",\"use\":\"sig\",\"alg\":\"RS256\",\"n\":\"%s\",\"e\":\"%s\"},"
            "{\"kty\":\"RSA\",\"kid\":\"r2\",\"n\":\"%s\",\"e\":\"%s\"},"
            "{\"kty\":\"EC\",\"kid\":\"e1\",\"crv\":\"P-256\",\"x\":\"%s\",\"y\":\"%s\"},"
            "{\"kty\":\"oct\",\"kid\":\"skipped\",\"k\":\"AAAA\"}]}",
            n, e, n2, e, x, y);
    fclose(f);
}

static void setup(void)
{
    rsa = EVP_RSA_gen(2048);
    rsa_other = EVP_RSA_gen(2048);
    ec = EVP_EC_gen("P-256");
    cr_assert(rsa && rsa_other && ec);
    write_jwks();
    setenv("JWT_TEST_SECRET", SECRET, 1);
}

static void teardown(void)
{
    EVP_PKEY_free(rsa);
    EVP_PKEY_free(rsa_other);
    EVP_PKEY_free(ec);
    unlink(jwks_path);
}

TestSuite(jwt, .init = setup, .fini = teardown);

/* "Bearer " + a token with header and payload JSON, signed by alg with key (HS256: SECRET). */
static char *token(const char *alg_name, EVP_PKEY *key, const char *hdr_json, const char *payload_json)
{
    static char out[8192];
    char h[2048], p[4096], sig[1024] = "";
    b64url_str(hdr_json, h);
    b64url_str(payload_json, p);
    char msg[6200];
    snprintf(msg, sizeof msg, "%s.%s", h, p);
    unsigned char raw[1024];
    size_t rawlen = 0;
    if (strcmp(alg_name, "HS256") == 0) {
        unsigned int l = 0;
        HMAC(EVP_sha256(), SECRET, (int)strlen(SECRET), (unsigned char *)msg, strlen(msg), raw, &l);
        rawlen = l;
    } else if (key) {
        EVP_MD_CTX *m = EVP_MD_CTX_new();
        unsigned char der[1024];
        size_t dl = sizeof der;
        cr_assert(EVP_DigestSignInit(m, NULL, EVP_sha256(), NULL, key) == 1);
        cr_assert(EVP_DigestSign(m, der, &dl, (unsigned char *)msg, strlen(msg)) == 1);
        EVP_MD_CTX_free(m);
        if (strcmp(alg_name, "ES256") == 0) { /* DER -> r || s */
            const unsigned char *q = der;
            ECDSA_SIG *es = d2i_ECDSA_SIG(NULL, &q, (long)dl);
            cr_assert_not_null(es);
            BN_bn2binpad(ECDSA_SIG_get0_r(es), raw, 32);
            BN_bn2binpad(ECDSA_SIG_get0_s(es), raw + 32, 32);
            ECDSA_SIG_free(es);
            rawlen = 64;
        } else {
            memcpy(raw, der, dl);
            rawlen = dl;
        }
    }
    test_b64url(raw, rawlen, sig);
    snprintf(out, sizeof out, "Bearer %s.%s", msg, sig);
    return out;
}

static struct gw_jwt *verifier(const char *iss, const char *aud)
{
    struct conf_jwt c = {.enabled = true,
                         .keys_file = jwks_path,
                         .secret_env = "JWT_TEST_SECRET",
                         .issuer = (char *)iss,
                         .audience = (char *)aud,
                         .leeway_ms = 30000};
    char *err = NULL;
    struct gw_jwt *j = gw_jwt_create(&c, &err);
    cr_assert_not_null(j, "%s", err ? err : "");
    return j;
}

static enum gw_jwt_result check(const struct gw_jwt *j, const char *authz, char **sub)
{
    struct gw_jwt_claims *cl = NULL;
    enum gw_jwt_result r = gw_jwt_verify(j, authz, NOW, &cl);
    if (sub) {
        size_t len = 0;
        *sub = r == GW_JWT_OK ? gw_jwt_claim(cl, "sub", &len) : NULL;
    }
    cr_assert_eq(r == GW_JWT_OK, cl != NULL, "claims are handed out exactly on success");
    gw_jwt_claims_free(cl);
    return r;
}

#define PAYLOAD(extra) "{\"sub\":\"user-42\",\"exp\":1900000100" extra "}"

Test(jwt, valid_tokens_of_each_algorithm)
{
    struct gw_jwt *j = verifier(NULL, NULL);
    char *sub;
    cr_expect_eq(check(j, token("HS256", NULL, "{\"alg\":\"HS256\",\"typ\":\"JWT\"}", PAYLOAD("")), &sub), GW_JWT_OK);
    cr_expect_str_eq(sub, "user-42");
    free(sub);
    cr_expect_eq(check(j, token("RS256", rsa, "{\"alg\":\"RS256\",\"kid\":\"r1\"}", PAYLOAD("")), NULL), GW_JWT_OK);
    cr_expect_eq(check(j, token("RS256", rsa_other, "{\"alg\":\"RS256\",\"kid\":\"r2\"}", PAYLOAD("")), NULL),
                 GW_JWT_OK);
    cr_expect_eq(check(j, token("RS256", rsa_other, "{\"alg\":\"RS256\"}", PAYLOAD("")), NULL), GW_JWT_OK,
                 "no kid: every key of the algorithm is tried");
    cr_expect_eq(check(j, token("ES256", ec, "{\"alg\":\"ES256\",\"kid\":\"e1\"}", PAYLOAD("")), NULL), GW_JWT_OK);
    cr_expect_eq(check(j, token("ES256", ec, "{\"alg\":\"ES256\"}", PAYLOAD("")), NULL), GW_JWT_OK);
    char *lower = cm_strdup(token("HS256", NULL, "{\"alg\":\"HS256\"}", PAYLOAD("")));
    memcpy(lower, "bEARER", 6);
    cr_expect_eq(check(j, lower, NULL), GW_JWT_OK, "Bearer is case-insensitive");
    free(lower);
    gw_jwt_destroy(j);
}

Test(jwt, a_refreshed_token_has_the_same_subject)
{
    struct gw_jwt *j = verifier(NULL, NULL);
    char *a, *b;
    char *t1 = cm_strdup(token("HS256", NULL, "{\"alg\":\"HS256\"}", PAYLOAD(",\"iat\":1899999000,\"jti\":\"a\"")));
    char *t2 = cm_strdup(token("RS256", rsa, "{\"alg\":\"RS256\"}", PAYLOAD(",\"iat\":1899999900,\"jti\":\"b\"")));
    cr_assert_str_neq(t1, t2);
    cr_assert_eq(check(j, t1, &a), GW_JWT_OK);
    cr_assert_eq(check(j, t2, &b), GW_JWT_OK);
    cr_expect_str_eq(a, b);
    free(a);
    free(b);
    free(t1);
    free(t2);
    gw_jwt_destroy(j);
}

Test(jwt, time_checks_with_leeway)
{
    struct gw_jwt *j = verifier(NULL, NULL);
    const char *h = "{\"alg\":\"HS256\"}";
    cr_expect_eq(check(j, token("HS256", NULL, h, "{\"sub\":\"u\",\"exp\":1899999900}"), NULL), GW_JWT_EXPIRED);
    cr_expect_eq(check(j, token("HS256", NULL, h, "{\"sub\":\"u\",\"exp\":1899999980}"), NULL), GW_JWT_OK,
                 "20 s past exp is within the 30 s leeway");
    cr_expect_eq(check(j, token("HS256", NULL, h, "{\"sub\":\"u\",\"exp\":1899999970}"), NULL), GW_JWT_EXPIRED,
                 "exactly exp + leeway is expired");
    cr_expect_eq(check(j, token("HS256", NULL, h, "{\"sub\":\"u\"}"), NULL), GW_JWT_EXPIRED, "exp is required");
    cr_expect_eq(check(j, token("HS256", NULL, h, "{\"sub\":\"u\",\"exp\":\"1900000100\"}"), NULL), GW_JWT_MALFORMED);
    cr_expect_eq(check(j, token("HS256", NULL, h, PAYLOAD(",\"nbf\":1900000060")), NULL), GW_JWT_NOT_YET);
    cr_expect_eq(check(j, token("HS256", NULL, h, PAYLOAD(",\"nbf\":1900000020")), NULL), GW_JWT_OK,
                 "nbf 20 s ahead is within the leeway");
    cr_expect_eq(check(j, token("HS256", NULL, h, PAYLOAD(",\"nbf\":\"soon\"")), NULL), GW_JWT_MALFORMED);
    gw_jwt_destroy(j);
}

Test(jwt, issuer_and_audience)
{
    struct gw_jwt *j = verifier("https://auth.example", "payments");
    const char *h = "{\"alg\":\"HS256\"}";
    cr_expect_eq(
        check(j, token("HS256", NULL, h, PAYLOAD(",\"iss\":\"https://auth.example\",\"aud\":\"payments\"")), NULL),
        GW_JWT_OK);
    cr_expect_eq(
        check(j,
              token("HS256", NULL, h, PAYLOAD(",\"iss\":\"https://auth.example\",\"aud\":[\"ledger\",\"payments\"]")),
              NULL),
        GW_JWT_OK, "aud may be an array");
    cr_expect_eq(
        check(j, token("HS256", NULL, h, PAYLOAD(",\"iss\":\"https://evil.example\",\"aud\":\"payments\"")), NULL),
        GW_JWT_ISSUER);
    cr_expect_eq(check(j, token("HS256", NULL, h, PAYLOAD(",\"aud\":\"payments\"")), NULL), GW_JWT_ISSUER,
                 "a configured issuer is required");
    cr_expect_eq(check(j,
                       token("HS256", NULL, h,
                             PAYLOAD(",\"iss\":\"https://auth.example\\u0000x\",\"aud\":"
                                     "\"payments\"")),
                       NULL),
                 GW_JWT_MALFORMED, "an embedded NUL: the payload is refused (jansson without JSON_ALLOW_NUL)");
    cr_expect_eq(
        check(j, token("HS256", NULL, h, PAYLOAD(",\"iss\":\"https://auth.example\",\"aud\":[\"ledger\"]")), NULL),
        GW_JWT_AUDIENCE);
    cr_expect_eq(check(j, token("HS256", NULL, h, PAYLOAD(",\"iss\":\"https://auth.example\"")), NULL),
                 GW_JWT_AUDIENCE);
    gw_jwt_destroy(j);
}

Test(jwt, forged_and_malformed_tokens)
{
    struct gw_jwt *j = verifier(NULL, NULL);
    char b1[64], b2[128];
    /* alg none, with and without a signature part */
    b64url_str("{\"alg\":\"none\"}", b1);
    b64url_str(PAYLOAD(""), b2);
    char t[512];
    snprintf(t, sizeof t, "Bearer %s.%s.", b1, b2);
    cr_expect_eq(check(j, t, NULL), GW_JWT_ALG, "alg none");
    b64url_str("{\"alg\":\"None\"}", b1);
    snprintf(t, sizeof t, "Bearer %s.%s.", b1, b2);
    cr_expect_eq(check(j, t, NULL), GW_JWT_ALG, "alg None");
    cr_expect_eq(check(j, token("HS256", NULL, "{\"alg\":\"HS384\"}", PAYLOAD("")), NULL), GW_JWT_ALG);
    cr_expect_eq(check(j, token("HS256", NULL, "{\"alg\":\"HS256\",\"crit\":[\"exp\"]}", PAYLOAD("")), NULL),
                 GW_JWT_ALG, "crit names nothing we understand");
    /* a flipped signature byte, another key, a key of another kid */
    char *good = cm_strdup(token("RS256", rsa, "{\"alg\":\"RS256\"}", PAYLOAD("")));
    size_t n = strlen(good);
    good[n - 3] = good[n - 3] == 'A' ? 'B' : 'A';
    cr_expect_eq(check(j, good, NULL), GW_JWT_BAD_SIGNATURE);
    free(good);
    cr_expect_eq(check(j, token("RS256", rsa, "{\"alg\":\"RS256\",\"kid\":\"r2\"}", PAYLOAD("")), NULL),
                 GW_JWT_BAD_SIGNATURE, "kid r2 is not the key that signed");
    cr_expect_eq(check(j, token("RS256", rsa, "{\"alg\":\"RS256\",\"kid\":\"nope\"}", PAYLOAD("")), NULL),
                 GW_JWT_BAD_SIGNATURE);
    EVP_PKEY *stranger = EVP_RSA_gen(2048);
    cr_expect_eq(check(j, token("RS256", stranger, "{\"alg\":\"RS256\"}", PAYLOAD("")), NULL), GW_JWT_BAD_SIGNATURE);
    EVP_PKEY_free(stranger);
    cr_expect_eq(check(j, token("ES256", ec, "{\"alg\":\"RS256\"}", PAYLOAD("")), NULL), GW_JWT_BAD_SIGNATURE,
                 "an ES256 signature under alg RS256");
    /* the payload changed after signing */
    char *sw = cm_strdup(token("HS256", NULL, "{\"alg\":\"HS256\"}", PAYLOAD("")));
    char *d1 = strchr(sw, '.'), *d2 = strchr(d1 + 1, '.');
    char other[128];
    b64url_str("{\"sub\":\"admin\",\"exp\":1900000100}", other);
    char t2[1024];
    snprintf(t2, sizeof t2, "%.*s.%s%s", (int)(d1 - sw), sw, other, d2);
    cr_expect_eq(check(j, t2, NULL), GW_JWT_BAD_SIGNATURE);
    free(sw);
    /* shapes */
    cr_expect_eq(check(j, NULL, NULL), GW_JWT_MISSING);
    cr_expect_eq(check(j, "Basic dXNlcjpwYXNz", NULL), GW_JWT_MISSING);
    cr_expect_eq(check(j, "Bearer ", NULL), GW_JWT_MISSING);
    cr_expect_eq(check(j, "Bearer abc", NULL), GW_JWT_MALFORMED);
    cr_expect_eq(check(j, "Bearer a.b", NULL), GW_JWT_MALFORMED);
    cr_expect_eq(check(j, "Bearer a.b.c.d", NULL), GW_JWT_MALFORMED);
    cr_expect_eq(check(j, "Bearer !!!.b.c", NULL), GW_JWT_MALFORMED);
    b64url_str("[1,2]", b1);
    snprintf(t, sizeof t, "Bearer %s.%s.abc", b1, b2);
    cr_expect_eq(check(j, t, NULL), GW_JWT_MALFORMED, "a header that is not an object");
    char *pad = cm_strdup(token("HS256", NULL, "{\"alg\":\"HS256\"}", PAYLOAD("")));
    char t3[1024];
    snprintf(t3, sizeof t3, "%s=", pad);
    cr_expect_eq(check(j, t3, NULL), GW_JWT_MALFORMED, "padding is not base64url");
    free(pad);
    gw_jwt_destroy(j);
}

Test(jwt, algorithm_confusion_rsa_key_as_hmac_secret)
{
    /* Only a JWKS: an HS256 token whose secret is the RSA key's public bytes must not pass. */
    struct conf_jwt c = {.enabled = true, .keys_file = jwks_path, .leeway_ms = 30000};
    char *err = NULL;
    struct gw_jwt *j = gw_jwt_create(&c, &err);
    cr_assert_not_null(j, "%s", err ? err : "");
    cr_expect_eq(check(j, token("HS256", NULL, "{\"alg\":\"HS256\"}", PAYLOAD("")), NULL), GW_JWT_ALG,
                 "no HS256 secret configured: no HS256 token is accepted");
    gw_jwt_destroy(j);
}

Test(jwt, claims_as_scope_values)
{
    struct gw_jwt *j = verifier(NULL, NULL);
    struct gw_jwt_claims *cl = NULL;
    cr_assert_eq(gw_jwt_verify(j,
                               token("HS256", NULL, "{\"alg\":\"HS256\"}",
                                     "{\"sub\":\"u\",\"exp\":1900000100,\"org\":{\"b\":2,\"a\":1},\"n\":7,\"z\":null}"),
                               NOW, &cl),
                 GW_JWT_OK);
    size_t len;
    char *v = gw_jwt_claim(cl, "org", &len);
    cr_expect_str_eq(v, "{\"a\":1,\"b\":2}", "objects in compact JSON, keys sorted");
    free(v);
    v = gw_jwt_claim(cl, "n", &len);
    cr_expect_str_eq(v, "7");
    free(v);
    cr_expect_null(gw_jwt_claim(cl, "z", &len), "a null claim is missing");
    cr_expect_null(gw_jwt_claim(cl, "tenant", &len));
    cr_expect(gw_jwt_has_claim(cl, "org") && gw_jwt_has_claim(cl, "n"));
    cr_expect(!gw_jwt_has_claim(cl, "z") && !gw_jwt_has_claim(cl, "tenant"), "has_claim agrees with gw_jwt_claim");
    gw_jwt_claims_free(cl);
    gw_jwt_destroy(j);
}

/* The jwt:sub scope hash of an HS256 token with this payload, verified by j. */
static void sub_scope(const struct gw_jwt *j, const char *payload, uint8_t out[32])
{
    struct gw_jwt_claims *cl = NULL;
    cr_assert_eq(gw_jwt_verify(j, token("HS256", NULL, "{\"alg\":\"HS256\"}", payload), NOW, &cl), GW_JWT_OK, "%s",
                 payload);
    struct conf_part part = {.kind = CONF_PART_JWT, .header = "sub"};
    struct gw_reqparts rp = {.method = "POST", .path = "/", .query = "", .jwt = cl};
    gw_hash_parts(&part, 1, &rp, out);
    gw_jwt_claims_free(cl);
}

/* SPEC 9: claims are scoped with their JSON type ("123" and 123 are two tenants, ["a"] and "[\"a\"]" too), and
 * without jwt.issuer the issuer is part of every jwt: scope (the same sub of two issuers is two tenants). Before,
 * each pair hashed the same. */
Test(jwt, claim_types_and_issuers_are_scopes_apart)
{
    static const struct {
        const char *a, *b;
        bool same;
        const char *what;
    } cases[] = {
        {"{\"sub\":\"123\",\"exp\":1900000100}", "{\"sub\":123,\"exp\":1900000100}", false, "string and number"},
        {"{\"sub\":[\"a\"],\"exp\":1900000100}", "{\"sub\":\"[\\\"a\\\"]\",\"exp\":1900000100}", false,
         "array and its JSON text as a string"},
        {"{\"sub\":true,\"exp\":1900000100}", "{\"sub\":\"true\",\"exp\":1900000100}", false, "true and \"true\""},
        {"{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}",
         "{\"sub\":\"u\",\"iss\":\"https://b.test\",\"exp\":1900000100}", false, "two issuers"},
        {"{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}", "{\"sub\":\"u\",\"exp\":1900000100}", false,
         "an issuer and none"},
        {"{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}",
         "{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000200,\"jti\":\"refreshed\"}", true,
         "a refreshed token of the same issuer"},
        {"{\"sub\":7,\"exp\":1900000100}", "{\"sub\":7,\"exp\":1900000200}", true, "the same number"},
    };
    struct gw_jwt *j = verifier(NULL, NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t a[32], b[32];
        sub_scope(j, cases[i].a, a);
        sub_scope(j, cases[i].b, b);
        cr_expect_eq(memcmp(a, b, 32) == 0, cases[i].same, "%s: %s", cases[i].what,
                     cases[i].same ? "two scopes" : "one scope");
    }
    gw_jwt_destroy(j);
    /* with jwt.issuer set every accepted token has that issuer: a string claim's scope is its bytes alone */
    j = verifier("https://a.test", NULL);
    uint8_t a[32], b[32];
    sub_scope(j, "{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}", a);
    sub_scope(j, "{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000200}", b);
    cr_expect_eq(memcmp(a, b, 32), 0, "the same subject");
    sub_scope(j, "{\"sub\":123,\"iss\":\"https://a.test\",\"exp\":1900000100}", b);
    cr_expect_neq(memcmp(a, b, 32), 0);
    sub_scope(j, "{\"sub\":\"123\",\"iss\":\"https://a.test\",\"exp\":1900000100}", a);
    cr_expect_neq(memcmp(a, b, 32), 0, "\"123\" and 123 with an issuer set");
    gw_jwt_destroy(j);
}

static void expect_create_fails(const struct conf_jwt *c, const char *want)
{
    char *err = NULL;
    struct gw_jwt *j = gw_jwt_create(c, &err);
    cr_expect_null(j);
    cr_expect(err && strstr(err, want), "want '%s', got '%s'", want, err ? err : "(none)");
    free(err);
    gw_jwt_destroy(j);
}

Test(jwt, bad_key_configuration)
{
    struct conf_jwt c = {.enabled = true, .secret_env = "JWT_TEST_UNSET_VAR"};
    unsetenv("JWT_TEST_UNSET_VAR");
    expect_create_fails(&c, "JWT_TEST_UNSET_VAR is not set");
    setenv("JWT_TEST_SHORT", "short", 1);
    c.secret_env = "JWT_TEST_SHORT";
    expect_create_fails(&c, "at least 32 bytes");
    c.secret_env = NULL;
    c.keys_file = "/nonexistent/jwks.json";
    expect_create_fails(&c, "cannot open");
    char path[256];
    snprintf(path, sizeof path, "/tmp/jwt_test_bad_%d.json", (int)getpid());
    static const char *const bad[][2] = {
        {"{\"keys\":[", "invalid JSON"},
        {"{\"nokeys\":[]}", "not a JWKS"},
        {"{\"keys\":[{\"kty\":\"oct\",\"k\":\"AAAA\"}]}", "no RS256"},
        {"{\"keys\":[{\"kty\":\"RSA\",\"kid\":\"x\",\"n\":\"AQAB\",\"e\":\"AQAB\"}]}", "at least 2048 bits"},
        {"{\"keys\":[{\"kty\":\"RSA\",\"n\":\"not base64!\",\"e\":\"AQAB\"}]}", "needs base64url n and e"},
        {"{\"keys\":[{\"kty\":\"EC\",\"crv\":\"P-256\",\"x\":\"AAAA\",\"y\":\"AAAA\"}]}", "32-byte"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FILE *f = fopen(path, "w");
        fputs(bad[i][0], f);
        fclose(f);
        c.keys_file = path;
        expect_create_fails(&c, bad[i][1]);
    }
    unlink(path);
}

/* ---- conf: the jwt: block and jwt:CLAIM scope parts */

#define JWT_BASE                                                                                                       \
    "store:\n  postgres: postgres://u@127.0.0.1/db\n"                                                                  \
    "upstreams:\n  - name: api\n    url: http://127.0.0.1:9000\n"                                                      \
    "routes:\n  - name: p\n    match: {path: /a}\n    upstream: api\n"

static struct conf *load(const char *tail, char **err)
{
    char yaml[2048];
    snprintf(yaml, sizeof yaml, JWT_BASE "%s", tail);
    *err = NULL;
    return conf_load_string("t.yaml", yaml, strlen(yaml), err);
}

Test(jwt_conf, parsed)
{
    char *err;
    struct conf *c = load("    idempotency: {scope: [jwt:sub, 'header:X-Tenant', jwt:org]}\n"
                          "jwt:\n  keys: /etc/idemgate/jwks.json\n  secret_env: IDEMGATE_JWT_SECRET\n"
                          "  issuer: https://auth.example\n  audience: payments\n  leeway: 5s\n",
                          &err);
    cr_assert_not_null(c, "%s", err);
    cr_expect(c->jwt.enabled);
    cr_expect_str_eq(c->jwt.keys_file, "/etc/idemgate/jwks.json");
    cr_expect_str_eq(c->jwt.secret_env, "IDEMGATE_JWT_SECRET");
    cr_expect_str_eq(c->jwt.issuer, "https://auth.example");
    cr_expect_str_eq(c->jwt.audience, "payments");
    cr_expect_eq(c->jwt.leeway_ms, 5000);
    const struct conf_idem *im = &c->routes[0].idem;
    cr_assert_eq(im->scope_n, 3);
    cr_expect_eq(im->scope[0].kind, CONF_PART_JWT);
    cr_expect_str_eq(im->scope[0].header, "sub");
    cr_expect_eq(im->scope[1].kind, CONF_PART_HEADER);
    cr_expect_eq(im->scope[2].kind, CONF_PART_JWT);
    cr_expect_str_eq(im->scope[2].header, "org");
    conf_destroy(c);
    c = load("jwt: {secret_env: S}\n", &err);
    cr_assert_not_null(c, "%s", err);
    cr_expect_eq(c->jwt.leeway_ms, 30000, "leeway defaults to 30s");
    conf_destroy(c);
}

Test(jwt_conf, refused)
{
    static const char *const cases[][2] = {
        {"    idempotency: {scope: [jwt:sub]}\n",
         "t.yaml:10: routes[0].idempotency.scope[0]: a jwt:CLAIM scope needs a top-level jwt: block"},
        {"    idempotency: {fingerprint: [jwt:sub]}\njwt: {secret_env: S}\n", "invalid part 'jwt:sub'"},
        {"    idempotency: {scope: ['jwt:']}\njwt: {secret_env: S}\n", "'jwt:' needs a claim name"},
        {"    idempotency: {scope: [jwt:sub, jwt:sub]}\njwt: {secret_env: S}\n", "duplicate part 'jwt:sub'"},
        {"jwt: {issuer: x}\n", "t.yaml:10: jwt: needs keys (a JWKS file) or secret_env"},
        {"jwt: {secret_env: 1BAD}\n", "invalid environment variable name '1BAD'"},
        {"jwt: {secret_env: S, leeway: 2h}\n", "jwt.leeway: must be at most"},
        {"jwt: {secret_env: S, algs: [none]}\n", "jwt.algs: unknown key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *err;
        struct conf *c = load(cases[i][0], &err);
        cr_expect_null(c, "accepted: %s", cases[i][0]);
        cr_expect(err && strstr(err, cases[i][1]), "%s: want '%s', got '%s'", cases[i][0], cases[i][1],
                  err ? err : "(none)");
        conf_destroy(c);
        free(err);
    }
}

/* Scopes stored by earlier builds must keep matching: jwt: parts hash to these values (computed before the request
 * part reader, gateway/parts.c, existed). */
Test(jwt, scope_hashes_pinned)
{
    static const struct {
        const char *iss; /* jwt.issuer */
        const char *payload, *claim, *hex;
    } cases[] = {
        {NULL, "{\"sub\":\"u\",\"exp\":1900000100}", "sub",
         "ea6bc97e3b3c5aa6b16767a40f5e99a5dfefd3f8a014fb8cfc99e77756849f02"},
        {NULL, "{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}", "sub",
         "804251d7179c38e51428d436b79b34b085c982b224184e373fe762456b51f6a3"},
        {NULL, "{\"sub\":123,\"exp\":1900000100}", "sub",
         "1fc7b981bd23838657349b468dd27eaaaad54b872472cfd54089c60cb5dfbda0"},
        {NULL, "{\"org\":{\"b\":2,\"a\":[1,\"x\"]},\"exp\":1900000100}", "org",
         "c9f713b159f48d12cf005b4f17bcb54945254d85d26153b7bf9de2d3e161c15e"},
        {NULL, "{\"sub\":\"u\",\"exp\":1900000100}", "tenant",
         "565d85e1b214a5c38a81bde28017b6a17e7234a86821ebc8b6b43032ee059365"},
        {"https://a.test", "{\"sub\":\"u\",\"iss\":\"https://a.test\",\"exp\":1900000100}", "sub",
         "ce9beefd8503648d8a1b80f68f7cc8776cacc94e6bc31fa4f2bec3b42f3ebafc"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct gw_jwt *j = verifier(cases[i].iss, NULL);
        struct gw_jwt_claims *cl = NULL;
        cr_assert_eq(gw_jwt_verify(j, token("HS256", NULL, "{\"alg\":\"HS256\"}", cases[i].payload), NOW, &cl),
                     GW_JWT_OK);
        struct conf_part parts[] = {{CONF_PART_METHOD, NULL}, {CONF_PART_JWT, (char *)cases[i].claim}};
        struct gw_reqparts rp = {.method = "POST", .path = "/", .query = "", .jwt = cl};
        uint8_t h[32];
        char got[65];
        gw_hash_parts(parts, 2, &rp, h);
        for (size_t k = 0; k < 32; k++)
            snprintf(got + 2 * k, 3, "%02x", h[k]);
        cr_expect_str_eq(got, cases[i].hex, "case %zu: %s", i, got);
        gw_jwt_claims_free(cl);
        gw_jwt_destroy(j);
    }
}
