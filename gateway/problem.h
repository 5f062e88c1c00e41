/* problem.h - RFC 9457 problem+json bodies for every error the gateway answers, and a job's error answer in its
 * route's errors: format. Writes into the job only; never sends, never looks the configuration up. */
#ifndef IDEMGATE_GW_PROBLEM_H
#define IDEMGATE_GW_PROBLEM_H

#include <stddef.h>
#include <stdint.h>

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

/* ---- a job's error answer (gateway/gateway.h) */
struct gw_job;
/* Fills the answer with the gateway error, written in the route's errors format (problem+json without a route);
 * gateway/problem.c. extra: NULL or more JSON members ("\"current\":11"). Every error the pipeline and the front
 * answer goes through here. */
void gw_job_problem(struct gw_job *job, int status, const char *name, const char *title, const char *detail);
void gw_job_problem_ext(struct gw_job *job, int status, const char *name, const char *title, const char *detail,
                        const char *extra);
/* Adds Retry-After (ms rounded up to whole seconds, at least 1) to the problem answer just written; on an errors:
 * stripe route a 503 then says Stripe-Should-Retry: true (SPEC 9). */
void gw_job_retry_after(struct gw_job *job, uint64_t ms);

#endif
