/* problem.h - RFC 9457 problem+json bodies for every error the gateway answers. */
#ifndef IDEMGATE_GW_PROBLEM_H
#define IDEMGATE_GW_PROBLEM_H

#include <stddef.h>

#define GW_PROBLEM_CONTENT_TYPE "application/problem+json"
#define GW_PROBLEM_TYPE_PREFIX  "urn:idemgate:problem:"

/* Returns a heap string (caller frees) with the JSON object
 * {"type":"urn:idemgate:problem:NAME","title":TITLE,"status":STATUS,"detail":DETAIL}
 * with every string JSON-escaped; detail may be NULL (then omitted is NOT
 * allowed: an empty string is written). *len gets the length. Never fails. */
char *gw_problem_json(int status, const char *name, const char *title, const char *detail, size_t *len);

/* One gateway error answer, before it is written in a route's format. */
struct gw_problem {
    int status;
    const char *name;   /* the last part of the problem type, e.g. "idempotency-key-in-use" */
    const char *title;  /* NULL: "" */
    const char *detail; /* NULL: "" */
    const char *extra;  /* NULL, or more JSON members without braces, e.g. "\"current\":11" (our own text) */
};
struct conf_errors;
/* Writes p in the format e (NULL, or kind problem: problem+json; stripe: {"error":{"type","code","message"}}; a
 * template with {status} {name} {title} {detail} JSON-escaped). Returns a heap string (caller frees); *len gets its
 * length and *ctype the Content-Type to send (a constant or e's, valid as long as e). Never fails. */
char *gw_problem_render(const struct conf_errors *e, const struct gw_problem *p, size_t *len, const char **ctype);
/* The Stripe error type of a problem (SPEC 9): 401 authentication_error; the 409/422 idempotency and ordering
 * problems idempotency_error; other 4xx invalid_request_error; 5xx (and anything else) api_error. */
const char *gw_problem_stripe_type(int status, const char *name);

/* Appends s JSON-escaped (without quotes) to out; false when out's cap is hit. */
struct cm_buf;
_Bool gw_json_escape(struct cm_buf *out, const char *s, size_t n) __attribute__((warn_unused_result));

#endif
