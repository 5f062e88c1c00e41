/* hints.h - what an idempotent route tells about a key beyond the answer (SPEC 12): a client's Prefer: wait
 * (RFC 7240) read and capped, and Idempotency-Expires written onto an answer about to be stored. Pure functions:
 * no state, no I/O. */
#ifndef IDEMGATE_GW_HINTS_H
#define IDEMGATE_GW_HINTS_H

#include <stdbool.h>
#include <stdint.h>

struct cm_hdrs;
struct cm_resp;

/* The largest delta-seconds a wait preference may name; more is read as this. */
#define GW_PREFER_WAIT_MAX_S 86400u

/* The first well-formed `wait` preference of the request's Prefer fields (several fields and comma-separated lists;
 * the token is case-insensitive; `wait=N` or `wait="N"` with N decimal delta-seconds, optional parameters after
 * ';'); a malformed one is ignored. true with *wait_s = min(N, GW_PREFER_WAIT_MAX_S) when there is one. */
bool gw_prefer_wait(const struct cm_hdrs *in, uint64_t *wait_s);

#define GW_EXPIRES_HEADER "Idempotency-Expires"
/* Replaces any Idempotency-Expires of resp (an upstream's own included) with ours: now_wall_ms + retention_ms,
 * rounded down to the second, as an IMF-fixdate. Nothing when that time cannot be written. */
void gw_expiry_advertise(struct cm_resp *resp, uint64_t now_wall_ms, uint64_t retention_ms);

#endif
