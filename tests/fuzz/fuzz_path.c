/* fuzz_path.c - libFuzzer target: cm_path_normalize never crashes, and what it accepts comes out normal: starts
 * with '/', no "//", no dot-segment, no escape of an unreserved character, never longer than the input, and a
 * second pass changes nothing. cm_target_parse on the same bytes agrees with it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/uri.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool unreserved(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
           c == '_' || c == '~';
}

static int hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1; /* lower-case hex is not normal either */
}

static void check_normal(const char *p, size_t n, size_t in_len)
{
    if (n == 0 || p[0] != '/' || n > in_len || strlen(p) != n)
        abort();
    if (strstr(p, "//"))
        abort();
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '%') {
            if (i + 2 >= n)
                abort();
            int hi = hexval((unsigned char)p[i + 1]), lo = hexval((unsigned char)p[i + 2]);
            if (hi < 0 || lo < 0)
                abort();
            int v = hi * 16 + lo;
            if (v == 0 || v == '/' || unreserved((unsigned char)v))
                abort();
        }
        if (p[i] == '/') { /* a segment "." or ".." */
            size_t j = i + 1;
            while (j < n && p[j] != '/')
                j++;
            size_t sl = j - i - 1;
            if ((sl == 1 && p[i + 1] == '.') || (sl == 2 && p[i + 1] == '.' && p[i + 2] == '.'))
                abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *in = malloc(size ? size : 1); /* a private copy: ASan sees a read past size */
    if (size)
        memcpy(in, data, size);
    char *out = malloc(size + 1);
    size_t olen = 0;
    const char *why = NULL;
    bool ok = cm_path_normalize(in, size, out, &olen, &why);
    if (!ok && !why)
        abort();
    if (ok) {
        check_normal(out, olen, size);
        char *again = malloc(olen + 1);
        size_t alen = 0;
        if (!cm_path_normalize(out, olen, again, &alen, &why) || alen != olen || memcmp(again, out, olen) != 0)
            abort();
        free(again);
    }
    /* As a whole target: a path without '?' is accepted exactly when the normaliser accepts it. */
    struct cm_target t;
    enum cm_target_result r = cm_target_parse(in, size, 1 << 20, &t, &why);
    if (r == CM_TARGET_OK) {
        check_normal(t.path, strlen(t.path), strlen(t.uri));
        if (size && in[0] == '/' && !memchr(in, '?', size) && (!ok || strcmp(t.path, out) != 0))
            abort();
    } else if (t.uri || !why || (size && in[0] == '/' && !memchr(in, '?', size) && ok)) {
        abort();
    }
    cm_target_free(&t);
    free(out);
    free(in);
    return 0;
}
