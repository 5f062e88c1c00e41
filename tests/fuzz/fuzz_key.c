/* fuzz_key.c - libFuzzer target: gw_key_parse never crashes, accepts only sane keys, and re-quoting round-trips. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/idem.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* A private copy, so reading one byte past len is caught by ASan. */
    char *raw = malloc(size ? size : 1);
    if (size)
        memcpy(raw, data, size);
    char key[GW_KEY_MAX + 1];
    size_t n = 0;
    bool ok = gw_key_parse(raw, size, key, &n);
    free(raw);
    if (!ok)
        return 0;
    if (n < 1 || n > GW_KEY_MAX || key[n] != '\0')
        abort();
    bool has_space = false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c < 0x20 || c > 0x7e)
            abort();
        has_space |= c == ' ';
    }

    /* Re-quote as an sf-string: must parse back to the same key. */
    char q[2 * GW_KEY_MAX + 2];
    size_t qn = 0;
    q[qn++] = '"';
    for (size_t i = 0; i < n; i++) {
        if (key[i] == '"' || key[i] == '\\')
            q[qn++] = '\\';
        q[qn++] = key[i];
    }
    q[qn++] = '"';
    char again[GW_KEY_MAX + 1];
    size_t an = 0;
    if (!gw_key_parse(q, qn, again, &an) || an != n || memcmp(again, key, n) != 0)
        abort();

    /* A key without spaces that does not start with a quote is also a valid bare key. */
    if (!has_space && key[0] != '"') {
        if (!gw_key_parse(key, n, again, &an) || an != n || memcmp(again, key, n) != 0)
            abort();
    }
    return 0;
}
