/* verify.h - verified deliveries (SPEC 12): the sender's HMAC-SHA256 signature of a request's raw body (stripe,
 * standard-webhooks, github, hmac), any of several secrets, the signed timestamp within a tolerance. A leaf: it is
 * handed the body and a header look-up, and answers ok or why not; it never logs a signature or a secret. */
#ifndef IDEMGATE_GW_VERIFY_H
#define IDEMGATE_GW_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct conf_verify;
struct gw_verify; /* one route's verifier: its secrets, immutable after create, shared by every loop */

/* Why a delivery was refused (for logs and tests; the client gets 401 signature-invalid for all of them). */
enum gw_verify_result {
    GW_VERIFY_OK = 0,
    GW_VERIFY_MISSING,   /* a header the scheme needs is absent, or repeated */
    GW_VERIFY_MALFORMED, /* a header is not in the scheme's form (or over its bounds) */
    GW_VERIFY_TIMESTAMP, /* the signed timestamp is older or newer than the tolerance */
    GW_VERIFY_MISMATCH,  /* no signature matches any secret */
};
const char *gw_verify_result_name(enum gw_verify_result r);

/* Loads the secrets c names from the environment. Returns NULL and sets *err (heap, caller frees) when a variable is
 * unset, empty or over 4096 bytes, or (standard-webhooks) not base64 after its "whsec_": "FILE:LINE: WHAT: ..." with
 * c->file and c->secrets_line (what names the key, e.g. "routes[0].verify.secrets_env"; the message names the
 * variable, never its value). */
struct gw_verify *gw_verify_create(const struct conf_verify *c, const char *what, char **err);
void gw_verify_destroy(struct gw_verify *v); /* NULL is a no-op */

/* The only value of header name, or NULL when the request has none or more than one. */
typedef const char *(*gw_verify_header_fn)(void *arg, const char *name);

/* Checks the request whose raw body is body[0..len) and whose headers get(arg, NAME) returns, at now_s (unix
 * seconds). Comparisons of signatures are constant-time (CRYPTO_memcmp); any secret may match any signature the
 * header lists. Never reads past the bounds of a header it parses. */
enum gw_verify_result gw_verify_check(const struct gw_verify *v, gw_verify_header_fn get, void *arg, const void *body,
                                      size_t len, int64_t now_s) CM_MUST_CHECK;

/* The challenge of the 401 (RFC 9110 11.6.1 wants one): "Signature scheme=\"stripe\"" and so on (static). */
const char *gw_verify_challenge(const struct gw_verify *v);

#endif
