/* jwt.h - verification of the bearer JWT that jwt:CLAIM scope parts read (SPEC 9): HS256 with a secret from the
 * environment, RS256 and ES256 with the keys of a JWKS file; signature, exp (required), nbf, iss and aud. It never
 * reads the request: the token is handed to it. */
#ifndef IDEMGATE_GW_JWT_H
#define IDEMGATE_GW_JWT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct conf_jwt;
struct gw_jwt;        /* the verifier: keys and checks, immutable after create, shared by every loop */
struct gw_jwt_claims; /* the payload of one verified token */

/* Why a token was refused (for logs and tests; the client gets 401 invalid-credentials for all of them). */
enum gw_jwt_result {
    GW_JWT_OK = 0,
    GW_JWT_MISSING,       /* no Authorization header, or not "Bearer <token>" */
    GW_JWT_MALFORMED,     /* not three base64url parts of JSON objects, a bad or missing claim type */
    GW_JWT_ALG,           /* alg none, an unknown alg, crit, or no key for that alg */
    GW_JWT_BAD_SIGNATURE, /* no key of its alg (and kid) verifies it */
    GW_JWT_EXPIRED,       /* exp missing or passed (leeway included) */
    GW_JWT_NOT_YET,       /* nbf in the future (leeway included) */
    GW_JWT_ISSUER,        /* iss is not the configured issuer */
    GW_JWT_AUDIENCE,      /* aud (string or array) does not name the configured audience */
};
const char *gw_jwt_result_name(enum gw_jwt_result r);

/* Loads the keys c names (the JWKS file, the secret's environment variable). Returns NULL and sets *err (heap,
 * caller frees) when the file cannot be read, is not a JWKS with at least one usable key, or the variable is unset,
 * empty or too short: a config error "FILE:LINE: jwt.keys: ..." or "FILE:LINE: jwt.secret_env: ..." (c->file and
 * the entry's line; "jwt.KEY: ..." when c has none). */
struct gw_jwt *gw_jwt_create(const struct conf_jwt *c, char **err);
void gw_jwt_destroy(struct gw_jwt *j); /* NULL is a no-op */

/* Verifies the token of an Authorization header value (authz may be NULL: missing) at now_s (unix seconds). On
 * GW_JWT_OK *out is the verified payload (caller frees with gw_jwt_claims_free); otherwise *out is NULL. */
enum gw_jwt_result gw_jwt_verify(const struct gw_jwt *j, const char *authz, int64_t now_s, struct gw_jwt_claims **out);
/* The value of claim name as bytes: a string's UTF-8 bytes, any other JSON value in compact JSON. Returns a heap
 * string (caller frees, *len its length) or NULL when the payload has no such claim (or it is null). */
char *gw_jwt_claim(const struct gw_jwt_claims *c, const char *name, size_t *len);
/* Whether the payload has claim name with a value other than null (what gw_jwt_claim would return), without a copy. */
bool gw_jwt_has_claim(const struct gw_jwt_claims *c, const char *name);
/* Whether claim name is a JSON string (false: missing, null or another type). A scope hashes a string's bytes apart
 * from another type's compact JSON, so "123" and 123 are two scopes (SPEC 9). */
bool gw_jwt_claim_is_string(const struct gw_jwt_claims *c, const char *name);
/* Whether the verifier that accepted these claims checks no issuer (jwt.issuer unset): then tokens of several
 * issuers are accepted, and the issuer is part of every jwt: scope (SPEC 9). */
bool gw_jwt_issuer_scoped(const struct gw_jwt_claims *c);
void gw_jwt_claims_free(struct gw_jwt_claims *c); /* NULL is a no-op */

#endif
