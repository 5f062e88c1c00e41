/* problem.c - RFC 9457 problem+json bodies and the JSON string escaper they use. */
#include "gateway/problem.h"

#include <stdint.h>
#include <string.h>

#include "common/common.h"

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when it is not one
 * (overlong forms, surrogates and code points above U+10FFFF are invalid). */
static size_t utf8_seq_len(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
        cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return len;
}

/* Escapes ", \ and control bytes (as \u00XX); valid UTF-8 passes through,
 * each invalid byte becomes U+FFFD so that the output is always valid JSON. */
bool gw_json_escape(struct cm_buf *out, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    size_t run = 0; /* start of the pending pass-through bytes */
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        char esc[8];
        size_t esc_len = 0;
        size_t adv = 1;
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            esc_len = 2;
        } else if (c < 0x20 || c == 0x7f) {
            memcpy(esc, "\\u00", 4);
            esc[4] = hex[c >> 4];
            esc[5] = hex[c & 0xf];
            esc_len = 6;
        } else if (c >= 0x80) {
            adv = utf8_seq_len(p + i, n - i);
            if (adv == 0) {
                memcpy(esc, "\\ufffd", 6);
                esc_len = 6;
                adv = 1;
            }
        }
        if (esc_len > 0) {
            if (!cm_buf_append(out, p + run, i - run) || !cm_buf_append(out, esc, esc_len))
                return false;
            run = i + adv;
        }
        i += adv;
    }
    return cm_buf_append(out, p + run, n - run);
}

static bool put_string(struct cm_buf *b, const char *s)
{
    if (!s)
        s = "";
    return cm_buf_append(b, "\"", 1) && gw_json_escape(b, s, strlen(s)) && cm_buf_append(b, "\"", 1);
}

char *gw_problem_json(int status, const char *name, const char *title, const char *detail, size_t *len)
{
    struct cm_buf b;
    /* No real cap: the inputs are our own strings, and the allocator aborts on OOM. */
    cm_buf_init(&b, SIZE_MAX / 4);
    bool ok = cm_buf_append(&b, "{\"type\":\"" GW_PROBLEM_TYPE_PREFIX, strlen("{\"type\":\"" GW_PROBLEM_TYPE_PREFIX)) &&
              gw_json_escape(&b, name ? name : "", name ? strlen(name) : 0) && cm_buf_append(&b, "\",\"title\":", 10) &&
              put_string(&b, title) && cm_buf_appendf(&b, ",\"status\":%d,\"detail\":", status) &&
              put_string(&b, detail) && cm_buf_append(&b, "}", 1);
    if (!ok) {
        /* Unreachable with an uncapped buffer; keep the promise of never failing. */
        cm_buf_free(&b);
        char *s = cm_strdup("{\"type\":\"" GW_PROBLEM_TYPE_PREFIX "error\",\"title\":\"Error\",\"status\":500,"
                            "\"detail\":\"\"}");
        if (len)
            *len = strlen(s);
        return s;
    }
    size_t n = 0;
    char *s = cm_buf_take(&b, &n);
    if (len)
        *len = n;
    return s;
}
