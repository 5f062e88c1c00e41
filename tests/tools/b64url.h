/* b64url.h - base64url without padding (RFC 7515 2), for the tests that sign JWTs themselves: written apart from
 * the gateway's decoder in gateway/jwt.c, so that a bug there cannot hide in both. */
#ifndef IDEMGATE_TESTS_B64URL_H
#define IDEMGATE_TESTS_B64URL_H

#include <stddef.h>

/* Encodes p[0..n) into out (at least 4 * n / 3 + 4 bytes), NUL-terminated. */
static inline void test_b64url(const unsigned char *p, size_t n, char *out)
{
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)p[i] << 16 | (i + 1 < n ? (unsigned)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        out[o++] = a[v >> 18 & 63];
        out[o++] = a[v >> 12 & 63];
        if (i + 1 < n)
            out[o++] = a[v >> 6 & 63];
        if (i + 2 < n)
            out[o++] = a[v & 63];
    }
    out[o] = '\0';
}

#endif
