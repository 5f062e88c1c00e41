/* head.h - the rules both backends apply to an upstream's answer head (status line, header lines, Content-Length)
 * and to a request's header names and values; pure checks on a transfer's shared part, never I/O, never a backend.
 * Not for other rooms. */
#ifndef IDEMGATE_UPSTREAM_HEAD_H
#define IDEMGATE_UPSTREAM_HEAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct up_transfer;

/* The gateway's replay marker: an upstream's own is dropped from its answer. */
#define UP_REPLAYED_HDR "Idempotent-Replayed"
bool up_token_ok(const char *s, size_t *len);
bool up_value_ok(const char *s, size_t *len);
/* What a request header becomes upstream: sent as is, skipped (framing, Expect, hop-by-hop: the backend frames the
 * body itself), or sent and noted (Accept, Content-Type: libcurl would add its own otherwise). */
enum up_hdr_kind { UP_HDR_SEND, UP_HDR_SKIP, UP_HDR_ACCEPT, UP_HDR_CTYPE };
enum up_hdr_kind up_hdr_kind(const char *name);
/* Response head lines without their CR LF, validated here for both clients: a status line (starts the head over,
 * after a 1xx too) and a header line (trailers after the final head ignored). The name must be a token, the value
 * pass cm_field_value_ok, no obs-fold, the whole head within t->max_head; the upstream's Idempotent-Replayed is
 * dropped. false: the answer is invalid (t->invalid set, see up_invalid). */
bool up_status_line(struct up_transfer *t, const char *p, size_t len);
bool up_header_line(struct up_transfer *t, const char *p, size_t len);
/* Splits header line p (no CRLF) at its first colon: *name_len bytes of name, and the value without the SP and
 * HTAB around it. false when the line has no colon. */
/* A status line's form as both clients take it: "HTTP/1.0" or "HTTP/1.1", SP, a status 100-599, then the end or
 * SP and a reason. false: malformed framing. */
bool up_status_form_ok(const char *p, size_t n);
bool up_header_split(const char *p, size_t len, size_t *name_len, const char **value, size_t *value_len);
/* One Content-Length value (v, vl trimmed) of the head being read, into *have / *length: 1 to 19 digits, and the
 * same number as any before it. false: malformed or conflicting. */
bool up_content_length(const char *v, size_t vl, bool *have, uint64_t *length);
/* Marks t's answer invalid (UP_INVALID_RESPONSE) for why (a constant); returns false. */
bool up_invalid(struct up_transfer *t, const char *why);
#endif
