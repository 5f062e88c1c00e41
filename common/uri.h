/* uri.h - request-target validation and normalisation (RFC 3986 6.2.2, RFC 9112 3.2) and one strict
 * percent-decoder, pure functions shared by the HTTP front and the admin listener. Never I/O. */
#ifndef IDEMGATE_CM_URI_H
#define IDEMGATE_CM_URI_H

#include <stdbool.h>
#include <stddef.h>

#include "common/common.h"

/* Normalises an origin-form path p[0..n) (it must start with '/'): percent-encoded unreserved characters
 * (ALPHA DIGIT - . _ ~) are decoded, the hex digits of every other escape are upper-cased, dot-segments are
 * removed (also ones written %2E) and empty segments merged ("//" -> "/"); a trailing '/' is kept. out must hold
 * n + 1 bytes: the result is never longer than the input; it is NUL-terminated and its length goes to *out_len.
 * Returns false, with a constant reason in *why, for a path that does not start with '/', escapes the root
 * ("/..", "/a/../../b"), holds %00 or an encoded '/', invalid percent-encoding ("%zz", "%4"), a space, a
 * control byte, DEL, '#', '?', '\' or a byte >= 0x80. */
bool cm_path_normalize(const char *p, size_t n, char *out, size_t *out_len, const char **why) CM_MUST_CHECK;

/* A query q[0..n) (without its '?') that may be forwarded as sent: no control byte, space, DEL, '#' or byte
 * >= 0x80. */
bool cm_query_ok(const char *q, size_t n);

/* The request target, validated and normalised once. */
struct cm_target {
    char *uri;   /* normalised path, then '?' and the query when the target had one */
    char *path;  /* normalised path */
    char *query; /* the query as sent, without '?'; "" when none */
};

enum cm_target_result {
    CM_TARGET_OK,
    CM_TARGET_BAD,      /* not origin-form nor absolute-form http(s), or a bad path or query */
    CM_TARGET_TOO_LONG, /* over max bytes */
};

/* Parses a request target t[0..n): origin-form ("/path?query") or absolute-form ("http://host/path?query",
 * https too, scheme case-insensitive: only its path and query are kept, an empty path is "/"). Anything else
 * ("*", "x", "@host:port/x", ":port/x") is CM_TARGET_BAD. On CM_TARGET_OK fills *out (heap strings the caller
 * frees with cm_target_free); otherwise *out is zeroed and *why is a constant reason. */
enum cm_target_result cm_target_parse(const char *t, size_t n, size_t max, struct cm_target *out,
                                      const char **why) CM_MUST_CHECK;
/* Frees the strings of t (not t itself); a zeroed t is a no-op. */
void cm_target_free(struct cm_target *t);

/* Percent-decodes s[0..n) into out (room for n + 1 bytes; NUL-terminated; length in *out_len). With plus_space,
 * '+' decodes to a space (application/x-www-form-urlencoded). Returns false for a '%' not followed by two hex
 * digits and for a decoded NUL (out is then unspecified). */
bool cm_pct_decode(const char *s, size_t n, bool plus_space, char *out, size_t *out_len) CM_MUST_CHECK;

/* SPEC 7: routes match a path in its match form: ASCII letters lowercased, segment parameters (';' or an encoded
 * "%3B" and the rest of its segment) removed and a trailing '/' dropped ("/V1/Pay;x=1/A/" -> "/v1/pay/a"). Writes the
 * form of p[0..n) into out (room for n + 1 bytes, NUL-terminated) and returns its length. */
size_t cm_path_match_form(const char *p, size_t n, char *out);

/* Whether a route's path rk (in match form; a whole-segment prefix when prefix) meets a request path k (in match
 * form): k is rk, or (prefix) lies under it, or its last segment is rk's last one followed by a format suffix
 * ".EXT" ("/v1/pay" meets "/v1/pay.json"). A prefix "/" meets every path. */
bool cm_path_meets(const char *rk, const char *k, bool prefix);

/* A Host header value h[0..n) of the one form SPEC 7 accepts: a host name (letters, digits, '-', '.', '_', '~';
 * an IPv4 address is one), or an IPv6 address in brackets, then optionally ':' and a port of 1 to 5 digits up to
 * 65535. A list, a path, a space, user info, percent-encoding or an empty value is false. */
bool cm_host_ok(const char *h, size_t n);

#endif
