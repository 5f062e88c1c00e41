/* idem.h - the idempotency key parser (IETF sf-string or bare token) and the
 * request fingerprint / scope hash (SHA-256 over length-prefixed parts). It never reads a request itself: the parts
 * come from gateway/parts.h. */
#ifndef IDEMGATE_GW_IDEM_H
#define IDEMGATE_GW_IDEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "conf/conf.h"
#include "gateway/parts.h"

#define GW_KEY_MAX 255

/* Parses an Idempotency-Key header value. Accepted: a bare key of 1..255
 * visible ASCII bytes without spaces (0x21..0x7e), or an RFC 8941 sf-string
 * ("..." with \" and \\ escapes, spaces allowed, 0x20..0x7e) whose unquoted
 * content is 1..255 bytes. Optional surrounding spaces/tabs (OWS) are ignored.
 * On success writes the unquoted key to out (GW_KEY_MAX + 1 bytes, NUL
 * terminated), its length to *out_len, and returns true; returns false for
 * anything else ("" included). "abc" and abc give the same key. */
bool gw_key_parse(const char *raw, size_t len, char out[GW_KEY_MAX + 1], size_t *out_len) CM_MUST_CHECK;

/* A key read from a body, the query or (key_from: header:) the key text itself (SPEC 12): 1 to 255 bytes of UTF-8
 * without control characters (C0, DEL, C1). true: copied to out (NUL-terminated) with *out_len. Also what
 * /admin/keys?key= takes for such keys. */
bool gw_key_text(const char *p, size_t n, char out[GW_KEY_MAX + 1], size_t *out_len) CM_MUST_CHECK;

enum gw_key_res { GW_KEY_OK, GW_KEY_ABSENT, GW_KEY_INVALID };

/* The key from src (a key_from part: header:, json:, form: or query:) of r: GW_KEY_OK with out and *out_len;
 * GW_KEY_ABSENT when the part is not there (or the body is not of its type); GW_KEY_INVALID for two values, a header
 * gw_key_parse refuses, text gw_key_text refuses, or a JSON value that is neither a string nor an integer (no
 * fraction, no exponent: its decimal text, -0 as 0). Reads the body once (through r). */
enum gw_key_res gw_key_from(const struct conf_part *src, struct gw_reqparts *r, char out[GW_KEY_MAX + 1],
                            size_t *out_len) CM_MUST_CHECK;

/* SHA-256 over the parts in order: each part is tagged (kind byte) and
 * length-prefixed; a header part covers every value of that header (case-
 * insensitive name) in order, and "absent" hashes differently from "empty"; form: and query: parts likewise; a
 * json: part covers the SHA-256 of its value's RFC 8785 canonical form (absent is a value of its own).
 * With n == 0 the result is the hash of nothing (a fixed value). Every value is read through r (gateway/parts.h);
 * stored records hold these hashes, so the bytes hashed for a part never change (tests pin them). */
void gw_hash_parts(const struct conf_part *parts, size_t n, struct gw_reqparts *r, uint8_t out[32]);

/* The request parts of a scope that an on_unknown: probe look-up carries (SPEC 9), appended to out: every value of
 * each header: part's header in arrival order, and the Authorization header (the verified bearer token) once when
 * the scope has a jwt: part. The other parts (method, path, query, body) cannot travel with a look-up. */
void gw_scope_probe_headers(const struct conf_part *parts, size_t n, struct gw_reqparts *r, struct cm_hdrs *out);

#endif
