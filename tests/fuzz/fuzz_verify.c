/* fuzz_verify.c - libFuzzer target: gw_verify_check over any signature headers and body, for every scheme: never
 * reads past a header or the body, never leaks, answers one of its results, the same twice; github's answer is OK
 * exactly when the header is "sha256=" and the hex of an independent HMAC-SHA256 of the body. Input: a byte picking
 * the scheme, then up to three '\n'-separated header values, then the body. */
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "conf/types.h"
#include "gateway/verify.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SECRET_A "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
#define SECRET_B "whsec_dGhpcyBpcyBhbm90aGVyIHNlY3JldCE="

struct req {
    const char *names[3];
    char *values[3];
};

static const char *get(void *arg, const char *name)
{
    struct req *r = arg;
    for (size_t i = 0; i < 3; i++)
        if (r->names[i] && r->values[i] && strcasecmp(r->names[i], name) == 0)
            return r->values[i];
    return NULL;
}

static struct gw_verify *verifier(enum conf_verify_scheme s, enum conf_verify_encoding enc)
{
    static char *names[] = {"FUZZ_VERIFY_A", "FUZZ_VERIFY_B"};
    setenv("FUZZ_VERIFY_A", SECRET_A, 1);
    setenv("FUZZ_VERIFY_B", SECRET_B, 1);
    struct conf_verify c = {.scheme = s,
                            .secrets_env = names,
                            .secrets_env_n = 2,
                            .tolerance_ms = 300000,
                            .header = "X-Sig",
                            .encoding = enc,
                            .prefix = enc == CONF_VERIFY_HEX ? "sha256=" : NULL};
    char *err = NULL;
    struct gw_verify *v = gw_verify_create(&c, "fuzz", &err);
    if (!v)
        abort();
    return v;
}

/* A private heap copy of p[0..n) with its NUL, so reading one byte past it is caught by ASan. */
static char *copy(const uint8_t *p, size_t n)
{
    char *s = malloc(n + 1);
    if (n)
        memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

static bool github_reference(const char *hdr, const void *body, size_t len)
{
    unsigned char mac[32];
    unsigned int ml = 0;
    if (!HMAC(EVP_sha256(), SECRET_A, (int)strlen(SECRET_A), body, len, mac, &ml))
        abort();
    bool any = false;
    unsigned char mac2[32];
    if (!HMAC(EVP_sha256(), SECRET_B, (int)strlen(SECRET_B), body, len, mac2, &ml))
        abort();
    static const char hex[] = "0123456789abcdef";
    for (int k = 0; k < 2; k++) {
        const unsigned char *m = k ? mac2 : mac;
        char want[7 + 64 + 1] = "sha256=";
        for (size_t i = 0; i < 32; i++) {
            want[7 + 2 * i] = hex[m[i] >> 4];
            want[8 + 2 * i] = hex[m[i] & 15];
        }
        want[71] = '\0';
        any |= strlen(hdr) == 71 && strncmp(hdr, "sha256=", 7) == 0 && strcasecmp(hdr + 7, want + 7) == 0;
    }
    return any;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct gw_verify *v[5];
    if (!v[0]) {
        v[0] = verifier(CONF_VERIFY_STRIPE, CONF_VERIFY_HEX);
        v[1] = verifier(CONF_VERIFY_STANDARD, CONF_VERIFY_HEX);
        v[2] = verifier(CONF_VERIFY_GITHUB, CONF_VERIFY_HEX);
        v[3] = verifier(CONF_VERIFY_HMAC, CONF_VERIFY_HEX);
        v[4] = verifier(CONF_VERIFY_HMAC, CONF_VERIFY_BASE64);
    }
    if (size < 1)
        return 0;
    unsigned pick = data[0] % 5;
    data++, size--;
    static const char *const header_names[5][3] = {
        {"Stripe-Signature", NULL, NULL},
        {"webhook-id", "webhook-timestamp", "webhook-signature"},
        {"X-Hub-Signature-256", NULL, NULL},
        {"X-Sig", NULL, NULL},
        {"X-Sig", NULL, NULL},
    };
    struct req r = {.names = {header_names[pick][0], header_names[pick][1], header_names[pick][2]}};
    size_t at = 0;
    for (size_t i = 0; i < 3 && r.names[i]; i++) {
        const uint8_t *nl = memchr(data + at, '\n', size - at);
        size_t n = nl ? (size_t)(nl - (data + at)) : size - at;
        r.values[i] = copy(data + at, n);
        at += n + (nl ? 1 : 0);
    }
    uint8_t *body = malloc(size - at ? size - at : 1);
    if (size > at)
        memcpy(body, data + at, size - at);
    int64_t now = 1614265330;
    enum gw_verify_result a = gw_verify_check(v[pick], get, &r, body, size - at, now);
    enum gw_verify_result b = gw_verify_check(v[pick], get, &r, body, size - at, now);
    if (a != b || a < GW_VERIFY_OK || a > GW_VERIFY_MISMATCH || !gw_verify_result_name(a))
        abort();
    if (pick == 2 && r.values[0] && strlen(r.values[0]) > 0 &&
        (a == GW_VERIFY_OK) != github_reference(r.values[0], body, size - at))
        abort();
    free(body);
    for (size_t i = 0; i < 3; i++)
        free(r.values[i]);
    return 0;
}
