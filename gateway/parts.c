/* parts.c - request parts read in place, a JSON body parsed at most once; never copies a value it can point to. */
#include "gateway/parts.h"
#include "gateway/json.h"
#include "gateway/jwt.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char *or_empty(const char *s)
{
    return s ? s : "";
}

/* ---- application/x-www-form-urlencoded (WHATWG URL 5.1), read in place */

static int hexval(unsigned char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* The next decoded byte of [*p, e), -1 at the end: '+' is a space, %XX its byte, a malformed '%' itself. */
static int form_next(const char **p, const char *e)
{
    if (*p >= e)
        return -1;
    unsigned char c = (unsigned char)*(*p)++;
    if (c == '+')
        return ' ';
    if (c == '%' && e - *p >= 2 && hexval((unsigned char)(*p)[0]) >= 0 && hexval((unsigned char)(*p)[1]) >= 0) {
        c = (unsigned char)(hexval((unsigned char)(*p)[0]) << 4 | hexval((unsigned char)(*p)[1]));
        *p += 2;
    }
    return c;
}

/* Does the encoded name [p, e) decode to name (NUL-terminated)? */
static bool form_name_is(const char *p, const char *e, const char *name)
{
    for (const unsigned char *q = (const unsigned char *)name;; q++) {
        int c = form_next(&p, e);
        if (c < 0 || *q == '\0')
            return c < 0 && *q == '\0';
        if (c != *q)
            return false;
    }
}

/* The i-th field of s named name: its encoded value in *vb, *ve. */
static bool form_find(const char *s, size_t n, const char *name, size_t i, const char **vb, const char **ve)
{
    if (!s || !name)
        return false;
    const char *end = s + n;
    for (const char *b = s; b < end;) {
        const char *e = memchr(b, '&', (size_t)(end - b));
        if (!e)
            e = end;
        if (e > b) { /* an empty field ("a&&b") is no field */
            const char *eq = memchr(b, '=', (size_t)(e - b));
            if (form_name_is(b, eq ? eq : e, name) && i-- == 0) {
                *vb = eq ? eq + 1 : e;
                *ve = e;
                return true;
            }
        }
        b = e + 1;
    }
    return false;
}

size_t gw_form_count(const char *s, size_t n, const char *name)
{
    size_t c = 0;
    const char *vb, *ve;
    while (form_find(s, n, name, c, &vb, &ve))
        c++;
    return c;
}

bool gw_form_value(const char *s, size_t n, const char *name, size_t i, struct gw_value *v)
{
    *v = (struct gw_value){0};
    const char *vb, *ve;
    if (!form_find(s, n, name, i, &vb, &ve))
        return false;
    size_t len = (size_t)(ve - vb);
    if (!memchr(vb, '%', len) && !memchr(vb, '+', len)) { /* nothing to decode: the bytes as sent */
        v->p = vb;
        v->n = len;
        return true;
    }
    v->own = cm_malloc(len); /* decoding never lengthens */
    size_t o = 0;
    for (int c; (c = form_next(&vb, ve)) >= 0;)
        v->own[o++] = (char)c;
    v->p = v->own;
    v->n = o;
    return true;
}

/* ---- the request */

static bool header_is(const struct cm_hdr *h, const char *name)
{
    return h->name && strcasecmp(h->name, name) == 0;
}

/* The first Content-Type's media type (parameters and surrounding blanks cut): [*b, *b + *n), or false when none. */
static bool media_type(const struct gw_reqparts *r, const char **b, size_t *n)
{
    const char *ct = r->hdrs ? cm_hdrs_get(r->hdrs, "Content-Type") : NULL;
    if (!ct)
        return false;
    while (*ct == ' ' || *ct == '\t')
        ct++;
    size_t len = strcspn(ct, ";");
    while (len && (ct[len - 1] == ' ' || ct[len - 1] == '\t'))
        len--;
    *b = ct;
    *n = len;
    return true;
}

static bool media_is(const char *b, size_t n, const char *type)
{
    return strlen(type) == n && strncasecmp(b, type, n) == 0;
}

/* Is the body application/x-www-form-urlencoded (the first Content-Type's media type, parameters ignored)? */
static bool body_is_form(const struct gw_reqparts *r)
{
    const char *b;
    size_t n;
    return media_type(r, &b, &n) && media_is(b, n, "application/x-www-form-urlencoded");
}

bool gw_parts_declares_json(const struct gw_reqparts *r)
{
    const char *b;
    size_t n;
    if (!media_type(r, &b, &n))
        return false;
    if (media_is(b, n, "application/json"))
        return true;
    /* application/SUBTYPE+json (RFC 6839) */
    return n > 17 && strncasecmp(b, "application/", 12) == 0 && strncasecmp(b + n - 5, "+json", 5) == 0;
}

bool gw_parts_body_is_json(struct gw_reqparts *r)
{
    if (!r->json_read) {
        r->json_read = true;
        r->json = gw_json_parse(r->body, r->body_len);
    }
    return r->json != NULL;
}

size_t gw_parts_count(struct gw_reqparts *r, enum gw_part kind, const char *name)
{
    switch (kind) {
    case GW_PART_METHOD:
    case GW_PART_PATH:
    case GW_PART_QUERY:
    case GW_PART_BODY:
        return 1;
    case GW_PART_HEADER: {
        size_t c = 0;
        if (r->hdrs && name)
            for (size_t i = 0; i < r->hdrs->n; i++)
                c += header_is(&r->hdrs->v[i], name);
        return c;
    }
    case GW_PART_JWT:
        return r->jwt && name && gw_jwt_has_claim(r->jwt, name) ? 1 : 0;
    case GW_PART_JSON: {
        const char *p;
        size_t n;
        return name && gw_parts_body_is_json(r) && gw_json_pointer(r->json, name, &p, &n) ? 1 : 0;
    }
    case GW_PART_FORM:
        return body_is_form(r) ? gw_form_count(r->body, r->body_len, name) : 0;
    case GW_PART_QPARAM:
        return r->query ? gw_form_count(r->query, strlen(r->query), name) : 0;
    }
    return 0;
}

static bool one(const char *p, size_t n, size_t i, struct gw_value *v)
{
    if (i != 0)
        return false;
    v->p = p;
    v->n = n;
    return true;
}

bool gw_parts_value(struct gw_reqparts *r, enum gw_part kind, const char *name, size_t i, struct gw_value *v)
{
    *v = (struct gw_value){0};
    switch (kind) {
    case GW_PART_METHOD:
        return one(or_empty(r->method), strlen(or_empty(r->method)), i, v);
    case GW_PART_PATH:
        return one(or_empty(r->path), strlen(or_empty(r->path)), i, v);
    case GW_PART_QUERY:
        return one(or_empty(r->query), strlen(or_empty(r->query)), i, v);
    case GW_PART_BODY:
        return one(r->body ? r->body : "", r->body ? r->body_len : 0, i, v);
    case GW_PART_HEADER:
        if (r->hdrs && name)
            for (size_t k = 0; k < r->hdrs->n; k++)
                if (header_is(&r->hdrs->v[k], name) && i-- == 0) {
                    v->name = r->hdrs->v[k].name;
                    return one(r->hdrs->v[k].value, strlen(r->hdrs->v[k].value), 0, v);
                }
        return false;
    case GW_PART_JWT: {
        if (i != 0 || !r->jwt || !name || !(v->own = gw_jwt_claim(r->jwt, name, &v->n)))
            return false;
        v->p = v->own;
        v->json = !gw_jwt_claim_is_string(r->jwt, name);
        return true;
    }
    case GW_PART_JSON:
        v->json = true;
        if (i == 0 && name && gw_parts_body_is_json(r) && gw_json_pointer(r->json, name, &v->p, &v->n))
            return true;
        *v = (struct gw_value){0};
        return false;
    case GW_PART_FORM:
        return body_is_form(r) && gw_form_value(r->body, r->body_len, name, i, v);
    case GW_PART_QPARAM:
        return r->query && gw_form_value(r->query, strlen(r->query), name, i, v);
    }
    return false;
}

enum gw_jcs gw_parts_json_canonical(struct gw_reqparts *r, const char *ptr,
                                    void (*put)(void *arg, const void *p, size_t n), void *arg)
{
    if (!ptr || !gw_parts_body_is_json(r))
        return GW_JCS_ABSENT;
    return gw_json_canonical(r->json, ptr, put, arg);
}

void gw_value_release(struct gw_value *v)
{
    free(v->own);
    v->own = NULL;
}

void gw_reqparts_free(struct gw_reqparts *r)
{
    gw_json_destroy(r->json);
    r->json = NULL;
    r->json_read = false;
}
