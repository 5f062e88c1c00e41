/* fuzz_jcs.c - libFuzzer: the RFC 8785 canonical form (gateway/json.h) is valid JSON, its own canonical form, and
 * prints every number so that it reads back as the same double; key_from keys are what SPEC 12 allows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/idem.h"
#include "gateway/json.h"
#include "gateway/parts.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void buf_put(void *arg, const void *p, size_t n)
{
    if (!cm_buf_append(arg, p, n))
        abort(); /* the cap below is far above any canonical form of an input this size */
}

/* The canonical form of the whole of (s, n) into b: what gw_json_canonical said, or -1 when s is not JSON. */
static int canon(const char *s, size_t n, struct cm_buf *b)
{
    struct gw_json *j = gw_json_parse(s, n);
    if (!j)
        return -1;
    int res = (int)gw_json_canonical(j, "", buf_put, b);
    gw_json_destroy(j);
    return res;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* any 8 bytes as a double: ECMAScript's form reads back as it */
    if (size >= 8) {
        double v;
        memcpy(&v, data, sizeof v);
        if (isfinite(v)) {
            char out[GW_JSON_NUM_MAX];
            size_t n = gw_json_number_es(v, out);
            if (n == 0 || n >= GW_JSON_NUM_MAX || strlen(out) != n || (v != 0 && strtod(out, NULL) != v))
                abort();
        }
    }

    const char *s = (const char *)data;
    struct cm_buf a, b;
    cm_buf_init(&a, 64 * size + 64);
    cm_buf_init(&b, 64 * size + 64);
    int res = canon(s, size, &a);
    if (res == GW_JCS_ABSENT)
        abort(); /* "" names the whole document */
    if (res == GW_JCS_OK) {
        /* valid JSON, and its own canonical form */
        if (canon(a.data, a.len, &b) != GW_JCS_OK || a.len != b.len || memcmp(a.data, b.data, a.len) != 0)
            abort();
    }
    cm_buf_free(&a);
    cm_buf_free(&b);

    /* the document's members as keys: a key is 1..255 bytes of UTF-8 without control characters */
    static const char *const ptrs[] = {"", "/id", "/0", "/a/b"};
    struct gw_reqparts r = {.method = "POST", .path = "/", .query = "", .body = size ? s : NULL, .body_len = size};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) {
        struct conf_part src = {.kind = CONF_PART_JSON, .header = (char *)ptrs[i]};
        char key[GW_KEY_MAX + 1];
        size_t n = 0;
        if (gw_key_from(&src, &r, key, &n) == GW_KEY_OK) {
            if (n == 0 || n > GW_KEY_MAX || key[n] != '\0' || !gw_utf8_valid(key, n))
                abort();
            for (size_t k = 0; k < n; k++)
                if ((unsigned char)key[k] < 0x20 || key[k] == 0x7f)
                    abort();
        }
    }
    gw_reqparts_free(&r);
    return 0;
}
