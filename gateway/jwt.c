/* jwt.c - bearer JWT verification with OpenSSL and jansson: HS256, RS256, ES256 (RFC 7515/7518/7519). It never reads
 * the request: the token is handed to it. */
#include "gateway/jwt.h"

#include <errno.h>
#include <jansson.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/ecdsa.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/param_build.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/common.h"
#include "conf/conf.h"

#define JWT_MAX_TOKEN   8192          /* bytes of a compact token; the request head is capped anyway */
#define JWKS_MAX_BYTES  (1024 * 1024) /* a JWKS file */
#define JWKS_MAX_KEYS   64
#define RSA_MIN_BITS    2048
#define HS256_MIN_BYTES 32 /* RFC 7518 3.2: a key of at least the hash size */

enum jwt_alg { ALG_HS256, ALG_RS256, ALG_ES256 };

struct jwt_key {
    enum jwt_alg alg;
    char *kid; /* NULL: none */
    EVP_PKEY *pkey;
};

struct gw_jwt {
    unsigned char *secret; /* HS256, or NULL */
    size_t secret_len;
    struct jwt_key *keys;
    size_t keys_n;
    char *issuer;
    char *audience;
    int64_t leeway_s;
};

struct gw_jwt_claims {
    json_t *payload;
    bool issuer_scoped; /* the verifier checks no issuer */
};

const char *gw_jwt_result_name(enum gw_jwt_result r)
{
    switch (r) {
    case GW_JWT_OK:
        return "ok";
    case GW_JWT_MISSING:
        return "missing";
    case GW_JWT_MALFORMED:
        return "malformed";
    case GW_JWT_ALG:
        return "algorithm";
    case GW_JWT_BAD_SIGNATURE:
        return "bad_signature";
    case GW_JWT_EXPIRED:
        return "expired";
    case GW_JWT_NOT_YET:
        return "not_yet_valid";
    case GW_JWT_ISSUER:
        return "issuer";
    case GW_JWT_AUDIENCE:
        return "audience";
    }
    return "unknown";
}

/* ---- base64url without padding (RFC 7515 2): strict, no '=', no white space */

/* Decodes s[0..n) into a fresh heap buffer (*out, *outlen; NUL-terminated beyond outlen). false: not base64url. */
static bool b64url_decode(const char *s, size_t n, unsigned char **out, size_t *outlen)
{
    if (n % 4 == 1)
        return false;
    unsigned char *b = cm_malloc(n * 3 / 4 + 3);
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = cm_b64val((unsigned char)s[i], true);
        if (v < 0) {
            free(b);
            return false;
        }
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            b[o++] = (unsigned char)(acc >> bits);
        }
    }
    /* The unused low bits of the last character must be zero (one encoding per byte string). */
    if (bits > 0 && (acc & ((1u << bits) - 1)) != 0) {
        free(b);
        return false;
    }
    b[o] = '\0';
    *out = b;
    *outlen = o;
    return true;
}

static json_t *b64url_json_object(const char *s, size_t n)
{
    unsigned char *raw;
    size_t len;
    if (!b64url_decode(s, n, &raw, &len))
        return NULL;
    json_error_t e;
    json_t *j = json_loadb((const char *)raw, len, JSON_REJECT_DUPLICATES, &e);
    free(raw);
    if (j && !json_is_object(j)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

/* ---- keys */

static BIGNUM *jwk_bn(json_t *k, const char *name)
{
    const char *s = json_string_value(json_object_get(k, name));
    unsigned char *raw;
    size_t len;
    if (!s || !b64url_decode(s, strlen(s), &raw, &len))
        return NULL;
    if (len == 0) {
        free(raw);
        return NULL;
    }
    BIGNUM *bn = BN_bin2bn(raw, (int)len, NULL);
    free(raw);
    return bn;
}

static EVP_PKEY *pkey_fromdata(const char *type, OSSL_PARAM_BLD *bld)
{
    EVP_PKEY *pkey = NULL;
    OSSL_PARAM *params = OSSL_PARAM_BLD_to_param(bld);
    EVP_PKEY_CTX *ctx = params ? EVP_PKEY_CTX_new_from_name(NULL, type, NULL) : NULL;
    if (!ctx || EVP_PKEY_fromdata_init(ctx) <= 0 || EVP_PKEY_fromdata(ctx, &pkey, EVP_PKEY_PUBLIC_KEY, params) <= 0)
        pkey = NULL;
    EVP_PKEY_CTX_free(ctx);
    OSSL_PARAM_free(params);
    return pkey;
}

static EVP_PKEY *rsa_key(json_t *k, const char **why)
{
    BIGNUM *n = jwk_bn(k, "n"), *e = jwk_bn(k, "e");
    EVP_PKEY *pkey = NULL;
    OSSL_PARAM_BLD *bld = OSSL_PARAM_BLD_new();
    *why = "an RSA key needs base64url n and e";
    if (n && e && bld && OSSL_PARAM_BLD_push_BN(bld, OSSL_PKEY_PARAM_RSA_N, n) &&
        OSSL_PARAM_BLD_push_BN(bld, OSSL_PKEY_PARAM_RSA_E, e))
        pkey = pkey_fromdata("RSA", bld);
    if (pkey && EVP_PKEY_get_bits(pkey) < RSA_MIN_BITS) {
        *why = "an RSA key must have at least 2048 bits";
        EVP_PKEY_free(pkey);
        pkey = NULL;
    }
    OSSL_PARAM_BLD_free(bld);
    BN_free(n);
    BN_free(e);
    return pkey;
}

static EVP_PKEY *ec_key(json_t *k, const char **why)
{
    const char *crv = json_string_value(json_object_get(k, "crv"));
    const char *xs = json_string_value(json_object_get(k, "x"));
    const char *ys = json_string_value(json_object_get(k, "y"));
    unsigned char *x = NULL, *y = NULL;
    size_t xl = 0, yl = 0;
    EVP_PKEY *pkey = NULL;
    *why = "an EC key needs crv P-256 and 32-byte base64url x and y";
    if (crv && strcmp(crv, "P-256") == 0 && xs && ys && b64url_decode(xs, strlen(xs), &x, &xl) &&
        b64url_decode(ys, strlen(ys), &y, &yl) && xl == 32 && yl == 32) {
        unsigned char pub[65];
        pub[0] = 0x04; /* uncompressed point */
        memcpy(pub + 1, x, 32);
        memcpy(pub + 33, y, 32);
        OSSL_PARAM_BLD *bld = OSSL_PARAM_BLD_new();
        if (bld && OSSL_PARAM_BLD_push_utf8_string(bld, OSSL_PKEY_PARAM_GROUP_NAME, "prime256v1", 0) &&
            OSSL_PARAM_BLD_push_octet_string(bld, OSSL_PKEY_PARAM_PUB_KEY, pub, sizeof pub))
            pkey = pkey_fromdata("EC", bld);
        OSSL_PARAM_BLD_free(bld);
        if (!pkey)
            *why = "the EC point is not on P-256";
    }
    free(x);
    free(y);
    return pkey;
}

/* Adds the keys of a JWKS text. Keys of other types (oct, OKP, other curves) are skipped; a key of a supported type
 * that is broken is an error. */
static bool load_jwks(struct gw_jwt *j, const char *file, const char *text, size_t len, char **err)
{
    json_error_t e;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &e);
    json_t *keys = root ? json_object_get(root, "keys") : NULL;
    if (!json_is_array(keys)) {
        *err = root ? cm_asprintf("%s: not a JWKS (an object with a \"keys\" array)", file)
                    : cm_asprintf("%s:%d: invalid JSON: %s", file, e.line, e.text);
        json_decref(root);
        return false;
    }
    size_t n = json_array_size(keys);
    j->keys = cm_calloc(n ? n : 1, sizeof *j->keys);
    for (size_t i = 0; i < n; i++) {
        json_t *k = json_array_get(keys, i);
        const char *kty = json_string_value(json_object_get(k, "kty"));
        const char *alg = json_string_value(json_object_get(k, "alg"));
        const char *use = json_string_value(json_object_get(k, "use"));
        const char *kid = json_string_value(json_object_get(k, "kid"));
        const char *why = NULL;
        EVP_PKEY *pkey = NULL;
        enum jwt_alg a;
        if (!kty || (use && strcmp(use, "sig") != 0))
            continue;
        if (strcmp(kty, "RSA") == 0 && (!alg || strcmp(alg, "RS256") == 0)) {
            a = ALG_RS256;
            pkey = rsa_key(k, &why);
        } else if (strcmp(kty, "EC") == 0 && (!alg || strcmp(alg, "ES256") == 0)) {
            const char *crv = json_string_value(json_object_get(k, "crv"));
            if (crv && strcmp(crv, "P-256") != 0)
                continue; /* another curve: not ES256 */
            a = ALG_ES256;
            pkey = ec_key(k, &why);
        } else {
            continue;
        }
        if (!pkey) {
            *err = cm_asprintf("%s: keys[%zu]%s%s%s: %s", file, i, kid ? " (kid " : "", kid ? kid : "", kid ? ")" : "",
                               why);
            json_decref(root);
            return false;
        }
        if (j->keys_n == JWKS_MAX_KEYS) {
            EVP_PKEY_free(pkey);
            *err = cm_asprintf("%s: more than %d keys", file, JWKS_MAX_KEYS);
            json_decref(root);
            return false;
        }
        j->keys[j->keys_n++] = (struct jwt_key){a, kid ? cm_strdup(kid) : NULL, pkey};
    }
    json_decref(root);
    if (j->keys_n == 0) {
        *err = cm_asprintf("%s: no RS256 (RSA) or ES256 (EC P-256) signing key", file);
        return false;
    }
    return true;
}

/* The key loader's message msg as a config error, "FILE:LINE: jwt.KEY: msg" (SPEC 2: file, line and key) with the
 * config file and line conf recorded, "jwt.KEY: msg" without them. Takes msg; returns a heap string. */
static char *config_error(const struct conf_jwt *c, const char *key, size_t line, char *msg)
{
    char *e = (c->file && line) ? cm_asprintf("%s:%zu: jwt.%s: %s", c->file, line, key, msg)
                                : cm_asprintf("jwt.%s: %s", key, msg);
    free(msg);
    return e;
}

struct gw_jwt *gw_jwt_create(const struct conf_jwt *c, char **err)
{
    struct gw_jwt *j = cm_calloc(1, sizeof *j);
    j->leeway_s = (int64_t)(c->leeway_ms / 1000);
    j->issuer = c->issuer ? cm_strdup(c->issuer) : NULL;
    j->audience = c->audience ? cm_strdup(c->audience) : NULL;
    if (c->secret_env) {
        const char *v = getenv(c->secret_env);
        if (!v || !*v) {
            *err = config_error(c, "secret_env", c->secret_env_line,
                                cm_asprintf("the environment variable %s is not set or empty", c->secret_env));
            goto fail;
        }
        if (strlen(v) < HS256_MIN_BYTES) {
            *err = config_error(
                c, "secret_env", c->secret_env_line,
                cm_asprintf("the HS256 secret in %s must have at least %d bytes", c->secret_env, HS256_MIN_BYTES));
            goto fail;
        }
        j->secret_len = strlen(v);
        j->secret = (unsigned char *)cm_strdup(v);
    }
    if (c->keys_file) {
        size_t len;
        char *text = cm_read_file(c->keys_file, JWKS_MAX_BYTES, &len, err);
        bool ok = text && load_jwks(j, c->keys_file, text, len, err);
        free(text);
        if (!ok) {
            *err = config_error(c, "keys", c->keys_line, *err); /* "FILE:LINE: jwt.keys: JWKS: what is wrong" */
            goto fail;
        }
    }
    if (!j->secret && j->keys_n == 0) {
        *err = cm_strdup("jwt: needs keys (a JWKS file) or secret_env");
        goto fail;
    }
    return j;
fail:
    gw_jwt_destroy(j);
    return NULL;
}

void gw_jwt_destroy(struct gw_jwt *j)
{
    if (!j)
        return;
    if (j->secret)
        OPENSSL_cleanse(j->secret, j->secret_len);
    free(j->secret);
    for (size_t i = 0; i < j->keys_n; i++) {
        free(j->keys[i].kid);
        EVP_PKEY_free(j->keys[i].pkey);
    }
    free(j->keys);
    free(j->issuer);
    free(j->audience);
    free(j);
}

/* ---- verification */

static bool verify_pkey(EVP_PKEY *pkey, const unsigned char *sig, size_t siglen, const char *msg, size_t msglen)
{
    EVP_MD_CTX *m = EVP_MD_CTX_new();
    bool ok = m && EVP_DigestVerifyInit(m, NULL, EVP_sha256(), NULL, pkey) == 1 &&
              EVP_DigestVerify(m, sig, siglen, (const unsigned char *)msg, msglen) == 1;
    EVP_MD_CTX_free(m);
    return ok;
}

/* ES256 signatures are r || s, 32 bytes each (RFC 7518 3.4); OpenSSL verifies DER. */
static bool verify_es256(EVP_PKEY *pkey, const unsigned char *sig, size_t siglen, const char *msg, size_t msglen)
{
    if (siglen != 64)
        return false;
    ECDSA_SIG *es = ECDSA_SIG_new();
    BIGNUM *r = BN_bin2bn(sig, 32, NULL), *s = BN_bin2bn(sig + 32, 32, NULL);
    unsigned char *der = NULL;
    int derlen = -1;
    if (es && r && s && ECDSA_SIG_set0(es, r, s) == 1) {
        r = s = NULL; /* owned by es now */
        derlen = i2d_ECDSA_SIG(es, &der);
    }
    bool ok = derlen > 0 && verify_pkey(pkey, der, (size_t)derlen, msg, msglen);
    OPENSSL_free(der);
    BN_free(r);
    BN_free(s);
    ECDSA_SIG_free(es);
    return ok;
}

static bool verify_sig(const struct gw_jwt *j, enum jwt_alg alg, const char *kid, const unsigned char *sig,
                       size_t siglen, const char *msg, size_t msglen)
{
    if (alg == ALG_HS256) {
        unsigned char mac[EVP_MAX_MD_SIZE];
        unsigned int maclen = 0;
        if (!j->secret ||
            !HMAC(EVP_sha256(), j->secret, (int)j->secret_len, (const unsigned char *)msg, msglen, mac, &maclen))
            return false;
        return cm_consttime_eq(mac, maclen, sig, siglen);
    }
    /* A token without kid is tried against every key of its algorithm; with one, only keys of that kid. */
    for (size_t i = 0; i < j->keys_n; i++) {
        const struct jwt_key *k = &j->keys[i];
        if (k->alg != alg || (kid && (!k->kid || strcmp(k->kid, kid) != 0)))
            continue;
        bool ok = alg == ALG_ES256 ? verify_es256(k->pkey, sig, siglen, msg, msglen)
                                   : verify_pkey(k->pkey, sig, siglen, msg, msglen);
        if (ok)
            return true;
    }
    return false;
}

/* v is a JSON string equal to s, embedded NULs included (strcmp would stop at one). */
static bool json_str_eq(json_t *v, const char *s)
{
    return json_is_string(v) && json_string_length(v) == strlen(s) && memcmp(json_string_value(v), s, strlen(s)) == 0;
}

static bool has_key_for(const struct gw_jwt *j, enum jwt_alg alg)
{
    if (alg == ALG_HS256)
        return j->secret != NULL;
    for (size_t i = 0; i < j->keys_n; i++)
        if (j->keys[i].alg == alg)
            return true;
    return false;
}

static enum gw_jwt_result check_claims(const struct gw_jwt *j, json_t *p, int64_t now)
{
    json_t *exp = json_object_get(p, "exp"), *nbf = json_object_get(p, "nbf");
    if (!exp)
        return GW_JWT_EXPIRED; /* exp is required (SPEC 9) */
    if (!json_is_number(exp) || (nbf && !json_is_number(nbf)))
        return GW_JWT_MALFORMED;
    /* RFC 7519 4.1.4: accepted only before exp; 4.1.5: not before nbf. */
    if ((double)now >= json_number_value(exp) + (double)j->leeway_s)
        return GW_JWT_EXPIRED;
    if (nbf && (double)now + (double)j->leeway_s < json_number_value(nbf))
        return GW_JWT_NOT_YET;
    if (j->issuer) {
        if (!json_str_eq(json_object_get(p, "iss"), j->issuer))
            return GW_JWT_ISSUER;
    }
    if (j->audience) {
        json_t *aud = json_object_get(p, "aud");
        bool found = json_str_eq(aud, j->audience);
        for (size_t i = 0; i < json_array_size(aud); i++)
            found = found || json_str_eq(json_array_get(aud, i), j->audience);
        if (!found)
            return GW_JWT_AUDIENCE;
    }
    return GW_JWT_OK;
}

enum gw_jwt_result gw_jwt_verify(const struct gw_jwt *j, const char *authz, int64_t now_s, struct gw_jwt_claims **out)
{
    *out = NULL;
    if (!authz || strncasecmp(authz, "Bearer ", 7) != 0)
        return GW_JWT_MISSING;
    const char *t = authz + 7;
    while (*t == ' ')
        t++;
    size_t tlen = strlen(t);
    while (tlen && (t[tlen - 1] == ' ' || t[tlen - 1] == '\t'))
        tlen--;
    if (tlen == 0)
        return GW_JWT_MISSING;
    if (tlen > JWT_MAX_TOKEN)
        return GW_JWT_MALFORMED;
    const char *d1 = memchr(t, '.', tlen);
    const char *d2 = d1 ? memchr(d1 + 1, '.', tlen - (size_t)(d1 + 1 - t)) : NULL;
    if (!d1 || !d2 || memchr(d2 + 1, '.', tlen - (size_t)(d2 + 1 - t)))
        return GW_JWT_MALFORMED;

    enum gw_jwt_result res = GW_JWT_MALFORMED;
    json_t *hdr = b64url_json_object(t, (size_t)(d1 - t));
    json_t *payload = NULL;
    unsigned char *sig = NULL;
    size_t siglen = 0;
    if (!hdr)
        goto done;
    json_t *algj = json_object_get(hdr, "alg"), *kidj = json_object_get(hdr, "kid");
    if (!json_is_string(algj) ||
        (kidj && (!json_is_string(kidj) || strlen(json_string_value(kidj)) != json_string_length(kidj))))
        goto done;
    res = GW_JWT_ALG;
    enum jwt_alg a;
    if (json_str_eq(algj, "HS256"))
        a = ALG_HS256;
    else if (json_str_eq(algj, "RS256"))
        a = ALG_RS256;
    else if (json_str_eq(algj, "ES256"))
        a = ALG_ES256;
    else
        goto done; /* none, HS384, PS256, ...: never accepted */
    if (json_object_get(hdr, "crit") || !has_key_for(j, a))
        goto done;
    res = GW_JWT_MALFORMED;
    if (!b64url_decode(d2 + 1, tlen - (size_t)(d2 + 1 - t), &sig, &siglen))
        goto done;
    res = GW_JWT_BAD_SIGNATURE;
    if (!verify_sig(j, a, json_string_value(kidj), sig, siglen, t, (size_t)(d2 - t)))
        goto done;
    res = GW_JWT_MALFORMED;
    payload = b64url_json_object(d1 + 1, (size_t)(d2 - d1 - 1));
    if (!payload)
        goto done;
    res = check_claims(j, payload, now_s);
    if (res == GW_JWT_OK) {
        *out = cm_calloc(1, sizeof **out);
        (*out)->payload = payload;
        (*out)->issuer_scoped = j->issuer == NULL;
        payload = NULL;
    }
done:
    json_decref(hdr);
    json_decref(payload);
    free(sig);
    return res;
}

char *gw_jwt_claim(const struct gw_jwt_claims *c, const char *name, size_t *len)
{
    json_t *v = c ? json_object_get(c->payload, name) : NULL;
    if (!v || json_is_null(v))
        return NULL;
    if (json_is_string(v)) {
        *len = json_string_length(v);
        char *s = cm_malloc(*len + 1);
        memcpy(s, json_string_value(v), *len);
        s[*len] = '\0';
        return s;
    }
    char *dump = json_dumps(v, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    if (!dump)
        return NULL;
    char *s = cm_strdup(dump);
    free(dump);
    *len = strlen(s);
    return s;
}

bool gw_jwt_has_claim(const struct gw_jwt_claims *c, const char *name)
{
    json_t *v = c ? json_object_get(c->payload, name) : NULL;
    return v && !json_is_null(v);
}

bool gw_jwt_claim_is_string(const struct gw_jwt_claims *c, const char *name)
{
    json_t *v = c ? json_object_get(c->payload, name) : NULL;
    return v && json_is_string(v);
}

bool gw_jwt_issuer_scoped(const struct gw_jwt_claims *c)
{
    return c && c->issuer_scoped;
}

void gw_jwt_claims_free(struct gw_jwt_claims *c)
{
    if (!c)
        return;
    json_decref(c->payload);
    free(c);
}
