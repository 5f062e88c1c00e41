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

void gw_json_destroy(struct gw_json *j); /* NULL is a no-op */

#endif
