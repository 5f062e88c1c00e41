/* json.h - bounded one-pass RFC 8259 validator that indexes values for JSON Pointers; never copies the document. */
#ifndef IDEMGATE_GW_JSON_H
#define IDEMGATE_GW_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include "common/common.h"

/* Nesting bound (jansson's parser had the same): deeper documents are refused. */
#define GW_JSON_MAX_DEPTH 2048

struct gw_json; /* a validated document's index: one entry per value, in document order */

/* Validates s (len bytes) as one RFC 8259 JSON text (UTF-8, any number magnitude, "\u0000" and lone surrogate
 * escapes allowed) with no two members of an object named alike (after decoding escapes) and nesting at most
 * GW_JSON_MAX_DEPTH deep, and indexes it. Returns the index (the caller frees it with gw_json_destroy; it points
 * into s, which must outlive it), or NULL when s is not such a document (empty included) or len exceeds 4 GiB - 1.
 * One iterative pass; memory in proportion to the number of values, which len bounds. */
struct gw_json *gw_json_parse(const char *s, size_t len) CM_MUST_CHECK;

/* The value at the JSON Pointer ptr (RFC 6901, NUL-terminated; "" is the whole document; "~1" is '/', "~0" is
 * '~'; an array index is "0" or up to 9 digits without a leading zero): true with its raw JSON text (no surrounding
 * whitespace; a string with its quotes, escapes as sent) in *p, *n, pointing into the document. false when ptr is
 * not a JSON Pointer or names nothing. No allocation. */
bool gw_json_pointer(const struct gw_json *j, const char *ptr, const char **p, size_t *n) CM_MUST_CHECK;

/* What gw_json_canonical found at a pointer. */
enum gw_jcs {
    GW_JCS_OK,        /* the value's RFC 8785 canonical form was written */
    GW_JCS_ABSENT,    /* the pointer names nothing (nothing written) */
    GW_JCS_NOT_IJSON, /* a lone surrogate, or a number beyond a double: no canonical form (what was written is void) */
};

/* Writes the RFC 8785 (JCS) canonical form of the value at JSON Pointer ptr through put(arg, bytes, n): no
 * whitespace, members sorted by the UTF-16 code units of their names, strings with JCS's escapes (\" \\ \b \f
 * \n \r \t, other controls \u00xx, everything else as UTF-8), numbers as ECMAScript prints the nearest double.
 * Iterative (nesting bounded by the parse); allocates only the member order of the open containers. */
enum gw_jcs gw_json_canonical(const struct gw_json *j, const char *ptr, void (*put)(void *arg, const void *p, size_t n),
                              void *arg);

#define GW_JSON_NUM_MAX 32 /* the longest ECMAScript form of a double, with its NUL */

/* ECMAScript's Number::toString of a finite v (shortest digits that read back as v; -0 is "0"): its length,
 * written NUL-terminated to out. */
size_t gw_json_number_es(double v, char out[GW_JSON_NUM_MAX]);

/* The decoded UTF-8 bytes of the JSON string token s (n bytes, with its quotes, validated by gw_json_parse) into out
 * (cap bytes, not terminated): true with *len, or false when it holds a lone surrogate (not UTF-8) or needs more than
 * cap bytes. */
bool gw_json_string_utf8(const char *s, size_t n, char *out, size_t cap, size_t *len) CM_MUST_CHECK;

/* Is s (n bytes) well-formed UTF-8 (RFC 3629)? */
bool gw_utf8_valid(const char *s, size_t n);

void gw_json_destroy(struct gw_json *j); /* NULL is a no-op */

#endif
