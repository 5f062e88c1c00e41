/* parts.h - the one reader of a request's parts for key, scope, fingerprint, sequence; never parses a body unasked. */
#ifndef IDEMGATE_GW_PARTS_H
#define IDEMGATE_GW_PARTS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/common.h"
#include "gateway/json.h"

struct gw_jwt_claims;

/* What a part names. A new kind of request part is added here and in parts.c; consumers ask through
 * gw_parts_count / gw_parts_value and need no change. */
enum gw_part {
    GW_PART_METHOD, /* one value each: method, path (without query), query (without '?'), body bytes */
    GW_PART_PATH,
    GW_PART_QUERY,
    GW_PART_BODY,
    GW_PART_HEADER, /* name: a header name (any case); one value per field line, in arrival order */
    GW_PART_JWT,    /* name: a claim of the verified bearer JWT; none when absent or null */
    GW_PART_JSON,   /* name: a JSON Pointer into a JSON body (gateway/json.h); its raw JSON text */
    GW_PART_FORM,   /* name: a field of an application/x-www-form-urlencoded body; decoded, one value per field */
    GW_PART_QPARAM, /* name: a query parameter, read as form fields are; decoded, one value per parameter */
};

/* A request's parts. The caller fills the first fields (positional initializers of those seven stay valid) and
 * keeps what they point to alive while the reader is used; the reader owns only what it builds itself (the body's
 * JSON index, made on the first question that needs it, once): gw_reqparts_free releases it. Set body before the
 * first question about it, and do not change it after. The index takes one 20-byte entry per JSON value (at most
 * one per body byte); the front frees it in the same call that built it, so a loop holds at most one. */
struct gw_reqparts {
    const char *method;
    const char *path;  /* without query */
    const char *query; /* without '?', "" when none */
    const void *body;
    size_t body_len;
    const struct cm_hdrs *hdrs; /* request headers in arrival order (NULL: none) */
    /* the verified bearer JWT's claims, for jwt:CLAIM parts (NULL: none; the front answers 401 before hashing a
     * scope that needs them) */
    const struct gw_jwt_claims *jwt;
    /* the reader's own */
    struct gw_json *json; /* the body's index once read, when it is JSON */
    bool json_read;       /* the body was read as JSON (json tells whether it is) */
};

/* One value of a part. p is not NUL-terminated (a header's value happens to be) and stays valid while the request
 * and the reader do, and until gw_value_release when own is set. */
struct gw_value {
    const char *p;
    size_t n;
    bool json;        /* p is JSON text (a json: value, a jwt: claim that is not a string), not plain bytes */
    const char *name; /* a header: the name as it arrived; NULL for the other kinds */
    char *own;        /* heap the value was decoded or copied into, or NULL */
};

/* How many values part (kind, name) has in r: 1 for method, path, query and body; 0 .. n for the others (0 when
 * absent, when name is NULL, for json: when the body is not JSON, for form: when the Content-Type is not
 * application/x-www-form-urlencoded). May read the body (json:, form:), once. */
size_t gw_parts_count(struct gw_reqparts *r, enum gw_part kind, const char *name);

/* The i-th value (from 0, in request order) of part (kind, name): true and *v filled (the caller calls
 * gw_value_release), or false and *v zeroed when there is no such value. A NULL method, path or query reads as "",
 * a NULL body as no bytes. */
bool gw_parts_value(struct gw_reqparts *r, enum gw_part kind, const char *name, size_t i,
                    struct gw_value *v) CM_MUST_CHECK;

/* Whether the body is one valid JSON document (gateway/json.h's rules); reads it once, and only the first time. */
bool gw_parts_body_is_json(struct gw_reqparts *r);

/* Whether the request declares a JSON body: its first Content-Type is application/json or application/SUBTYPE+json
 * (RFC 6839), parameters ignored. Reads no body. */
bool gw_parts_declares_json(const struct gw_reqparts *r);

/* The RFC 8785 canonical form of the JSON value at ptr, written through put (gateway/json.h, gw_json_canonical);
 * GW_JCS_ABSENT also when the body is not JSON. Reads the body once, as gw_parts_value. */
enum gw_jcs gw_parts_json_canonical(struct gw_reqparts *r, const char *ptr,
                                    void (*put)(void *arg, const void *p, size_t n), void *arg);

void gw_value_release(struct gw_value *v);    /* frees v->own; v may be zeroed */
void gw_reqparts_free(struct gw_reqparts *r); /* frees what the reader built (the caller's fields untouched) */

/* The value of name in an application/x-www-form-urlencoded string s (n bytes; WHATWG URL 5.1: '&'-separated,
 * '+' is a space, %XX a byte, a malformed % kept as is, a field without '=' has the value ""): the i-th field of
 * that decoded name, as gw_parts_value. Exposed for the query and body readers and their tests. */
bool gw_form_value(const char *s, size_t n, const char *name, size_t i, struct gw_value *v) CM_MUST_CHECK;
size_t gw_form_count(const char *s, size_t n, const char *name);

#endif
