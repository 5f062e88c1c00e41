/* verify.c - verified deliveries (SPEC 12): parses the sender's signature headers (bounded, malformed is a refusal,
 * never a crash), computes HMAC-SHA256 with each secret through OpenSSL's EVP_MAC and compares with CRYPTO_memcmp. */
#include "gateway/verify.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conf/types.h"

#define SECRET_MAX 4096 /* bytes of one secret as its variable holds it */
#define HEADER_MAX 8192 /* bytes of a signature header; longer: malformed */
#define SIGS_MAX   16   /* signatures one header may list (v1 entries); more: malformed */
#define ITEMS_MAX  64   /* comma-separated items of a Stripe-Signature */
#define ID_MAX     256  /* bytes of a webhook-id */
#define STAMP_MAX  18   /* digits of a signed timestamp (no sign, no fraction) */
#define MAC_LEN    32   /* HMAC-SHA256 */
#define WHSEC      "whsec_"
#define WHSEC_LEN  6

struct secret {
    unsigned char *key;
    size_t len;
};

struct gw_verify {
    enum conf_verify_scheme scheme;
    enum conf_verify_encoding encoding;
    char *header; /* hmac */
    char *prefix; /* hmac, NULL: none */
    uint64_t tolerance_ms;
    EVP_MAC *mac; /* HMAC, fetched once; shared by the threads (each check has its own context) */
    struct secret secrets[CONF_VERIFY_SECRETS_MAX];
    size_t n;
};

const char *gw_verify_result_name(enum gw_verify_result r)
{
    switch (r) {
    case GW_VERIFY_OK:
        return "ok";
    case GW_VERIFY_MISSING:
        return "missing";
    case GW_VERIFY_MALFORMED:
        return "malformed";
    case GW_VERIFY_TIMESTAMP:
        return "timestamp";
    case GW_VERIFY_MISMATCH:
        return "mismatch";
    }
    return "unknown";
}

/* ---- encodings */

/* s[0..n) is exactly the hex of a MAC: true and out holds it. */
static bool hex_mac(const char *s, size_t n, unsigned char out[MAC_LEN])
{
    if (n != 2 * MAC_LEN)
        return false;
    for (size_t i = 0; i < MAC_LEN; i++) {
        int hi = cm_hexval((unsigned char)s[2 * i]), lo = cm_hexval((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        out[i] = (unsigned char)(hi << 4 | lo);
    }
    return true;
}

/* Standard base64 (RFC 4648 4), padding optional (when present the length is a multiple of 4), no white space.
 * Decodes s[0..n) into out (cap bytes at most); false when it is not base64 or does not fit. */
static bool b64_decode(const char *s, size_t n, unsigned char *out, size_t cap, size_t *outlen)
{
    size_t pad = 0;
    while (pad < 2 && n > pad && s[n - 1 - pad] == '=')
        pad++;
    if (pad && n % 4 != 0)
        return false;
    size_t m = n - pad; /* the data characters */
    if (m % 4 == 1)
        return false;
    size_t need = m / 4 * 3 + (m % 4 ? m % 4 - 1 : 0);
    if (need > cap)
        return false;
    uint32_t acc = 0;
    size_t bits = 0, o = 0;
    for (size_t i = 0; i < m; i++) {
        int v = cm_b64val((unsigned char)s[i], false);
        if (v < 0)
            return false;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (unsigned char)(acc >> bits);
            acc &= (1u << bits) - 1;
        }
    }
    *outlen = o;
    return true;
}

static bool b64_mac(const char *s, size_t n, unsigned char out[MAC_LEN])
{
    size_t len = 0;
    return n <= 44 && b64_decode(s, n, out, MAC_LEN, &len) && len == MAC_LEN;
}

/* ---- create */

static bool load_secret(const struct conf_verify *c, const char *name, struct secret *out, const char **why)
{
    const char *val = getenv(name);
    size_t n = val ? strnlen(val, SECRET_MAX + 1) : 0;
    if (n == 0) {
        *why = "is unset or empty";
        return false;
    }
    if (n > SECRET_MAX) {
        *why = "is over 4096 bytes";
        return false;
    }
    if (c->scheme != CONF_VERIFY_STANDARD) { /* Stripe keys with the whole whsec_... text; github, hmac: the text */
        out->key = cm_malloc(n);
        memcpy(out->key, val, n);
        out->len = n;
        return true;
    }
    /* Standard Webhooks: the key is the base64 after "whsec_" (the prefix optional, as its libraries take it) */
    if (n >= WHSEC_LEN && memcmp(val, WHSEC, WHSEC_LEN) == 0)
        val += WHSEC_LEN, n -= WHSEC_LEN;
    out->key = cm_malloc(n ? n : 1);
    if (!b64_decode(val, n, out->key, n, &out->len) || out->len == 0) {
        OPENSSL_cleanse(out->key, n ? n : 1);
        free(out->key);
        out->key = NULL;
        *why = "is not a Standard Webhooks secret (whsec_ then base64)";
        return false;
    }
    return true;
}

struct gw_verify *gw_verify_create(const struct conf_verify *c, const char *what, char **err)
{
    struct gw_verify *v = cm_calloc(1, sizeof *v);
    v->scheme = c->scheme;
    v->encoding = c->encoding;
    v->tolerance_ms = c->tolerance_ms;
    v->header = c->header ? cm_strdup(c->header) : NULL;
    v->prefix = c->prefix ? cm_strdup(c->prefix) : NULL;
    for (size_t i = 0; i < c->secrets_env_n && i < CONF_VERIFY_SECRETS_MAX; i++) {
        const char *why = NULL;
        if (!load_secret(c, c->secrets_env[i], &v->secrets[i], &why)) {
            *err = cm_asprintf("%s:%zu: %s: the environment variable %s %s", c->file ? c->file : "(config)",
                               c->secrets_line, what, c->secrets_env[i], why);
            goto fail;
        }
        v->n = i + 1;
    }
    if (v->n == 0) {
        *err = cm_asprintf("%s:%zu: %s: no secret", c->file ? c->file : "(config)", c->secrets_line, what);
        goto fail;
    }
    v->mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    if (!v->mac) {
        *err = cm_asprintf("%s: OpenSSL has no HMAC", what);
        goto fail;
    }
    return v;
fail:
    gw_verify_destroy(v);
    return NULL;
}

void gw_verify_destroy(struct gw_verify *v)
{
    if (!v)
        return;
    for (size_t i = 0; i < v->n; i++) {
        OPENSSL_cleanse(v->secrets[i].key, v->secrets[i].len);
        free(v->secrets[i].key);
    }
    EVP_MAC_free(v->mac);
    free(v->header);
    free(v->prefix);
    free(v);
}

const char *gw_verify_challenge(const struct gw_verify *v)
{
    switch (v->scheme) {
    case CONF_VERIFY_STRIPE:
        return "Signature scheme=\"stripe\"";
    case CONF_VERIFY_STANDARD:
        return "Signature scheme=\"standard-webhooks\"";
    case CONF_VERIFY_GITHUB:
        return "Signature scheme=\"github\"";
    case CONF_VERIFY_HMAC:
    default:
        return "Signature scheme=\"hmac\"";
    }
}

/* ---- the signed message and its MACs */

struct piece {
    const void *p;
    size_t n;
};

/* HMAC-SHA256 of the pieces with every secret: macs[i] for secret i. false when OpenSSL fails (then nothing
 * matches). */
static bool compute(const struct gw_verify *v, const struct piece *pieces, size_t np, unsigned char (*macs)[MAC_LEN])
{
    EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(v->mac);
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, (char *)"SHA256", 0),
                           OSSL_PARAM_construct_end()};
    bool ok = ctx != NULL && EVP_MAC_CTX_set_params(ctx, params) == 1; /* the digest once, then a key each */
    for (size_t i = 0; ok && i < v->n; i++) {
        size_t outl = 0;
        ok = EVP_MAC_init(ctx, v->secrets[i].key, v->secrets[i].len, NULL) == 1;
        for (size_t k = 0; ok && k < np; k++)
            ok = pieces[k].n == 0 || EVP_MAC_update(ctx, pieces[k].p, pieces[k].n) == 1;
        ok = ok && EVP_MAC_final(ctx, macs[i], &outl, MAC_LEN) == 1 && outl == MAC_LEN;
    }
    EVP_MAC_CTX_free(ctx);
    return ok;
}

/* Whether any of the given signatures equals any secret's MAC of the pieces. Every pair is compared (constant time
 * per pair; the count of pairs depends only on how many were sent and configured). */
static enum gw_verify_result match(const struct gw_verify *v, const struct piece *pieces, size_t np,
                                   unsigned char (*sigs)[MAC_LEN], size_t nsigs)
{
    unsigned char macs[CONF_VERIFY_SECRETS_MAX][MAC_LEN];
    if (!compute(v, pieces, np, macs))
        return GW_VERIFY_MISMATCH;
    int hit = 0;
    for (size_t s = 0; s < nsigs; s++)
        for (size_t i = 0; i < v->n; i++)
            hit |= CRYPTO_memcmp(sigs[s], macs[i], MAC_LEN) == 0;
    OPENSSL_cleanse(macs, sizeof macs);
    return hit ? GW_VERIFY_OK : GW_VERIFY_MISMATCH;
}

/* A signed timestamp: 1..18 digits, no sign, no fraction. */
static bool stamp_parse(const char *s, size_t n, uint64_t *out)
{
    if (n == 0 || n > STAMP_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return false;
    return cm_parse_digits(s, n, STAMP_MAX, out);
}

/* The timestamp is within the tolerance of now, either way (at exactly the tolerance: within). */
static bool stamp_fresh(const struct gw_verify *v, uint64_t t, int64_t now_s)
{
    uint64_t now = now_s > 0 ? (uint64_t)now_s : 0;
    uint64_t diff = t > now ? t - now : now - t;
    return diff <= v->tolerance_ms / 1000;
}

/* The value of header name within HEADER_MAX: its length in *n. */
static enum gw_verify_result header_of(gw_verify_header_fn get, void *arg, const char *name, const char **out,
                                       size_t *n)
{
    const char *s = get(arg, name);
    if (!s)
        return GW_VERIFY_MISSING;
    *n = strnlen(s, HEADER_MAX + 1);
    if (*n == 0 || *n > HEADER_MAX)
        return GW_VERIFY_MALFORMED;
    *out = s;
    return GW_VERIFY_OK;
}

static bool ows(char c)
{
    return c == ' ' || c == '\t';
}

/* ---- stripe: Stripe-Signature: t=TIMESTAMP,v1=HEX[,v1=HEX...][,v0=...] */
static enum gw_verify_result check_stripe(const struct gw_verify *v, gw_verify_header_fn get, void *arg,
                                          const void *body, size_t len, int64_t now_s)
{
    const char *h;
    size_t hn;
    enum gw_verify_result r = header_of(get, arg, "Stripe-Signature", &h, &hn);
    if (r != GW_VERIFY_OK)
        return r;
    unsigned char sigs[SIGS_MAX][MAC_LEN];
    size_t nsigs = 0, v1 = 0, items = 0;
    const char *t = NULL;
    size_t tn = 0;
    for (size_t i = 0; i <= hn;) {
        size_t end = i;
        while (end < hn && h[end] != ',')
            end++;
        size_t a = i, b = end;
        while (a < b && ows(h[a]))
            a++;
        while (b > a && ows(h[b - 1]))
            b--;
        if (++items > ITEMS_MAX)
            return GW_VERIFY_MALFORMED;
        const char *eq = memchr(h + a, '=', b - a);
        if (!eq)
            return GW_VERIFY_MALFORMED;
        size_t kn = (size_t)(eq - (h + a));
        const char *val = eq + 1;
        size_t vn = (size_t)(h + b - val);
        if (kn == 1 && h[a] == 't') {
            if (t)
                return GW_VERIFY_MALFORMED; /* two timestamps: which one was signed is not ours to guess */
            t = val;
            tn = vn;
        } else if (kn == 2 && h[a] == 'v' && h[a + 1] == '1') {
            if (++v1 > SIGS_MAX)
                return GW_VERIFY_MALFORMED;
            if (hex_mac(val, vn, sigs[nsigs])) /* one that is not a MAC's hex matches nothing */
                nsigs++;
        } /* other schemes (v0, the test mode's) are not Stripe's live signatures: ignored, as its libraries do */
        i = end + 1;
    }
    uint64_t ts;
    if (!t || !stamp_parse(t, tn, &ts) || v1 == 0)
        return GW_VERIFY_MALFORMED;
    const struct piece pieces[] = {{t, tn}, {".", 1}, {body, len}};
    r = match(v, pieces, 3, sigs, nsigs);
    if (r == GW_VERIFY_OK && !stamp_fresh(v, ts, now_s))
        r = GW_VERIFY_TIMESTAMP;
    return r;
}

/* ---- standard-webhooks: webhook-id, webhook-timestamp, webhook-signature: v1,BASE64[ v1,BASE64...] */
static enum gw_verify_result check_standard(const struct gw_verify *v, gw_verify_header_fn get, void *arg,
                                            const void *body, size_t len, int64_t now_s)
{
    const char *id, *ts_s, *h;
    size_t idn, tsn, hn;
    enum gw_verify_result r;
    if ((r = header_of(get, arg, "webhook-id", &id, &idn)) != GW_VERIFY_OK ||
        (r = header_of(get, arg, "webhook-timestamp", &ts_s, &tsn)) != GW_VERIFY_OK ||
        (r = header_of(get, arg, "webhook-signature", &h, &hn)) != GW_VERIFY_OK)
        return r;
    uint64_t ts;
    if (idn > ID_MAX || !stamp_parse(ts_s, tsn, &ts))
        return GW_VERIFY_MALFORMED;
    unsigned char sigs[SIGS_MAX][MAC_LEN];
    size_t nsigs = 0, entries = 0;
    for (size_t i = 0; i < hn;) {
        while (i < hn && h[i] == ' ')
            i++;
        size_t end = i;
        while (end < hn && h[end] != ' ')
            end++;
        if (end == i)
            break;
        if (++entries > SIGS_MAX)
            return GW_VERIFY_MALFORMED;
        const char *comma = memchr(h + i, ',', end - i);
        if (!comma)
            return GW_VERIFY_MALFORMED;
        size_t vn = (size_t)(comma - (h + i));
        /* v1 is HMAC-SHA256; others (v1a: ed25519) are not this verifier's: ignored, as its libraries do */
        if (vn == 2 && h[i] == 'v' && h[i + 1] == '1' &&
            b64_mac(comma + 1, (size_t)(h + end - (comma + 1)), sigs[nsigs]))
            nsigs++;
        i = end;
    }
    if (entries == 0)
        return GW_VERIFY_MALFORMED;
    const struct piece pieces[] = {{id, idn}, {".", 1}, {ts_s, tsn}, {".", 1}, {body, len}};
    r = match(v, pieces, 5, sigs, nsigs);
    if (r == GW_VERIFY_OK && !stamp_fresh(v, ts, now_s))
        r = GW_VERIFY_TIMESTAMP;
    return r;
}

/* ---- github (X-Hub-Signature-256: sha256=HEX) and hmac (header, prefix, hex or base64): the body alone */
static enum gw_verify_result check_body_only(const struct gw_verify *v, gw_verify_header_fn get, void *arg,
                                             const void *body, size_t len)
{
    bool github = v->scheme == CONF_VERIFY_GITHUB;
    const char *name = github ? "X-Hub-Signature-256" : v->header;
    const char *prefix = github ? "sha256=" : v->prefix ? v->prefix : "";
    const char *h;
    size_t hn;
    enum gw_verify_result r = header_of(get, arg, name, &h, &hn);
    if (r != GW_VERIFY_OK)
        return r;
    size_t pn = strlen(prefix);
    if (hn < pn || memcmp(h, prefix, pn) != 0)
        return GW_VERIFY_MALFORMED;
    unsigned char sig[1][MAC_LEN];
    bool b64 = !github && v->encoding == CONF_VERIFY_BASE64;
    if (!(b64 ? b64_mac(h + pn, hn - pn, sig[0]) : hex_mac(h + pn, hn - pn, sig[0])))
        return GW_VERIFY_MALFORMED;
    const struct piece pieces[] = {{body, len}};
    return match(v, pieces, 1, sig, 1);
}

enum gw_verify_result gw_verify_check(const struct gw_verify *v, gw_verify_header_fn get, void *arg, const void *body,
                                      size_t len, int64_t now_s)
{
    switch (v->scheme) {
    case CONF_VERIFY_STRIPE:
        return check_stripe(v, get, arg, body, len, now_s);
    case CONF_VERIFY_STANDARD:
        return check_standard(v, get, arg, body, len, now_s);
    case CONF_VERIFY_GITHUB:
    case CONF_VERIFY_HMAC:
    default:
        return check_body_only(v, get, arg, body, len);
    }
}
