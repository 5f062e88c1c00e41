/* ordering.c - the ordering guard's request side: which requests it covers
 * (resource template) and their sequence (header or JSON Pointer). It never talks to the store: store/order.c holds the
 * guard's statements. */
#include "gateway/ordering.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

static bool order_match(const char *tmpl, const char *path, size_t plen, char **resource)
{
    *resource = NULL;
    while (plen > 1 && path[plen - 1] == '/')
        plen--;
    size_t ti = 0, pi = 0, tlen = strlen(tmpl);
    if (tlen == 0 || plen == 0 || tmpl[0] != '/' || path[0] != '/')
        return false;
    char *out = cm_malloc(tlen + plen + 2); /* '/' + a literal (from tmpl) or a value (from path) per segment */
    size_t o = 0;
    out[o++] = '/';
    while (ti < tlen && pi < plen) {
        /* both at a '/' */
        ti++;
        pi++;
        size_t te = ti, pe = pi, pv;
        while (te < tlen && tmpl[te] != '/')
            te++;
        while (pe < plen && path[pe] != '/')
            pe++;
        for (pv = pi; pv < pe && path[pv] != ';'; pv++) /* the segment without its parameters */
            ;
        size_t tn = te - ti, vn = pv - pi;
        if (tn >= 2 && tmpl[ti] == '{' && tmpl[te - 1] == '}') {
            if (vn == 0)
                goto no; /* a {name} is one non-empty segment */
            memcpy(out + o, path + pi, vn);
            o += vn;
        } else {
            bool last = te == tlen && pe == plen;
            if (vn < tn || strncasecmp(tmpl + ti, path + pi, tn) != 0 || (vn > tn && !(last && path[pi + tn] == '.')))
                goto no;
            memcpy(out + o, tmpl + ti, tn);
            o += tn;
        }
        ti = te;
        pi = pe;
        if (ti < tlen && pi < plen)
            out[o++] = '/';
    }
    if (ti != tlen || pi != plen)
        goto no;
    out[o] = '\0';
    *resource = out;
    return true;
no:
    free(out);
    return false;
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

bool gw_order_match(const char *tmpl, const char *path, char **resource)
{
    return order_match(tmpl, path, strlen(path), resource);
}

bool gw_order_resource(struct gw_reqparts *r, const char *tmpl, char **resource)
{
    struct gw_value v; /* the path: nothing to release */
    *resource = NULL;
    return gw_parts_value(r, GW_PART_PATH, NULL, 0, &v) && order_match(tmpl, v.p, v.n, resource);
}

bool gw_seq_from_parts(struct gw_reqparts *r, enum conf_seq_source source, const char *name, int64_t *out)
{
    struct gw_value v = {0};
    bool ok;
    if (source == CONF_SEQ_HEADER) /* exactly one field line: which of two counts would depend on who reads it */
        ok = gw_parts_count(r, GW_PART_HEADER, name) == 1 && gw_parts_value(r, GW_PART_HEADER, name, 0, &v);
    else /* the value must be an integer token: digits only (no sign, fraction or exponent), 1 .. 2^63-1 */
        ok = gw_parts_value(r, GW_PART_JSON, name, 0, &v);
    ok = ok && gw_seq_parse(v.p, v.n, out);
    gw_value_release(&v);
    return ok;
}

bool gw_seq_from_json(const char *body, size_t len, const char *ptr, int64_t *out)
{
    struct gw_reqparts r = {.body = body, .body_len = len};
    bool ok = gw_seq_from_parts(&r, CONF_SEQ_JSON, ptr, out);
    gw_reqparts_free(&r);
    return ok;
}
