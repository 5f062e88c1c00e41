/* fuzz_parts.c - libFuzzer: JSON Pointer, form and query-parameter reads never crash and stay inside the input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/json.h"
#include "gateway/parts.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A NUL-terminated heap string of up to the next byte's value bytes of input (NULs become 'x'). */
static char *str(const uint8_t **p, size_t *left)
{
    size_t n = *left ? **p : 0;
    if (*left) {
        (*p)++;
        (*left)--;
    }
    if (n > *left)
        n = *left;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++)
        s[i] = (*p)[i] ? (char)(*p)[i] : 'x';
    s[n] = '\0';
    *p += n;
    *left -= n;
    return s;
}

static void check_value(const struct gw_value *v, const char *base, size_t len)
{
    /* a value the reader did not decode points into what it read */
    if (!v->own && v->n && (v->p < base || v->p + v->n > base + len))
        abort();
    if (v->n > len)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *p = data;
    size_t left = size;
    char *ptr = str(&p, &left), *name = str(&p, &left);
    const char *body = (const char *)p; /* the rest, binary as is */
    char *query = malloc(left + 1);     /* and as a query string */
    for (size_t i = 0; i < left; i++)
        query[i] = p[i] ? (char)p[i] : '&';
    query[left] = '\0';

    struct cm_hdrs h;
    cm_hdrs_init(&h);
    cm_hdrs_add(&h, "Content-Type", "application/x-www-form-urlencoded");
    struct gw_reqparts r = {
        .method = "POST", .path = "/", .query = query, .body = left ? body : NULL, .body_len = left, .hdrs = &h};

    /* json: through the reader, and the index directly */
    struct gw_value v;
    size_t c = gw_parts_count(&r, GW_PART_JSON, ptr);
    bool found = gw_parts_value(&r, GW_PART_JSON, ptr, 0, &v);
    if (c != (found ? 1u : 0u) || (found && (!v.json || v.own)))
        abort();
    if (found) {
        check_value(&v, body, left);
        struct gw_json *sub = gw_json_parse(v.p, v.n); /* a value of a valid document is a valid document */
        if (!sub)
            abort();
        const char *sp, *rp;
        size_t sn, rn;
        if (!gw_json_pointer(sub, "", &sp, &sn) || sp != v.p || sn != v.n)
            abort();
        gw_json_destroy(sub);
        if (!gw_json_pointer(r.json, "", &rp, &rn) || rp < body || rp + rn > body + left)
            abort();
    }
    if (gw_parts_body_is_json(&r) != (r.json != NULL))
        abort();
    gw_value_release(&v);

    /* form fields and query parameters: the count is the number of values there are */
    static const enum gw_part kinds[] = {GW_PART_FORM, GW_PART_QPARAM};
    for (size_t k = 0; k < 2; k++) {
        size_t n = gw_parts_count(&r, kinds[k], name), i = 0;
        for (; gw_parts_value(&r, kinds[k], name, i, &v); i++) {
            check_value(&v, kinds[k] == GW_PART_FORM ? body : query, left);
            gw_value_release(&v);
            if (i > left)
                abort();
        }
        if (i != n)
            abort();
    }
    gw_reqparts_free(&r);
    cm_hdrs_free(&h);
    free(query);
    free(ptr);
    free(name);
    return 0;
}
