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

/* Appends s JSON-escaped (without quotes) to out; false when out's cap is hit. */
struct cm_buf;
_Bool gw_json_escape(struct cm_buf *out, const char *s, size_t n) __attribute__((warn_unused_result));

#endif
