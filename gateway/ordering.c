/* ordering.c - the ordering guard's request side: which requests it covers
 * (resource template) and their sequence (header or JSON Pointer). */
#include "gateway/ordering.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

bool gw_order_match(const char *tmpl, const char *path, size_t *inst_len)
{
    size_t plen = strlen(path);
    while (plen > 1 && path[plen - 1] == '/')
        plen--;
    size_t ti = 0, pi = 0, tlen = strlen(tmpl);
    if (tlen == 0 || plen == 0 || tmpl[0] != '/' || path[0] != '/')
        return false;
    while (ti < tlen && pi < plen) {
        /* both at a '/' */
        ti++;
        pi++;
        size_t te = ti, pe = pi;
        while (te < tlen && tmpl[te] != '/')
            te++;
        while (pe < plen && path[pe] != '/')
            pe++;
        if (te - ti >= 2 && tmpl[ti] == '{' && tmpl[te - 1] == '}') {
            if (pe == pi)
                return false; /* a {name} is one non-empty segment */
        } else if (te - ti != pe - pi || memcmp(tmpl + ti, path + pi, te - ti) != 0) {
            return false;
        }
        ti = te;
        pi = pe;
    }
    if (ti != tlen || pi != plen)
        return false;
    *inst_len = plen;
    return true;
}

bool gw_seq_parse(const char *v, size_t len, int64_t *out)
{
    while (len && (v[0] == ' ' || v[0] == '\t')) {
        v++;
        len--;
    }
    while (len && (v[len - 1] == ' ' || v[len - 1] == '\t'))
        len--;
    if (len == 0 || len > 19 || v[0] == '0')
        return false;
    uint64_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (v[i] < '0' || v[i] > '9')
            return false;
        n = n * 10 + (uint64_t)(v[i] - '0'); /* 19 digits fit in uint64_t */
    }
    if (n > (uint64_t)GW_SEQ_MAX)
        return false;
    *out = (int64_t)n;
    return true;
}

/* Decodes one reference token (~1 is '/', ~0 is '~') into out (cap bytes with the NUL). false when too long. */
static bool pointer_token(const char *p, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '~' && i + 1 < n) {
            ch = p[i + 1] == '1' ? '/' : '~';
            i++;
        }
        if (o + 1 >= cap)
            return false;
        out[o++] = ch;
    }
    out[o] = '\0';
    return true;
}

/* An array index token: "0" or digits without a leading zero. */
static bool array_index(const char *t, size_t *idx)
{
    size_t n = strlen(t);
    if (n == 0 || n > 9 || (n > 1 && t[0] == '0'))
        return false;
    size_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i] < '0' || t[i] > '9')
            return false;
        v = v * 10 + (size_t)(t[i] - '0');
    }
    *idx = v;
    return true;
}

bool gw_seq_from_json(const char *body, size_t len, const char *ptr, int64_t *out)
{
    if (body == NULL || len == 0)
        return false;
    json_error_t err;
    json_t *root = json_loadb(body, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &err);
    if (root == NULL)
        return false;
    json_t *cur = root;
    const char *p = ptr;
    char tok[1025];
    bool ok = false;
    while (cur && *p == '/') {
        const char *s = p + 1;
        const char *e = strchr(s, '/');
        size_t n = e ? (size_t)(e - s) : strlen(s);
        if (!pointer_token(s, n, tok, sizeof tok))
            goto done;
        if (json_is_object(cur)) {
            cur = json_object_get(cur, tok);
        } else if (json_is_array(cur)) {
            size_t idx;
            cur = array_index(tok, &idx) ? json_array_get(cur, idx) : NULL;
        } else {
            cur = NULL;
        }
        p = s + n;
    }
    if (cur && json_is_integer(cur)) {
        json_int_t v = json_integer_value(cur);
        if (v >= 1) {
            *out = (int64_t)v;
            ok = true;
        }
    }
done:
    json_decref(root);
    return ok;
}
