/* types.h - the types a request and its result are made of (enum up_result, struct up_origin, struct up_request,
 * up_done_cb), shared by the facade and the transfer core; declarations only, never a function. */
#ifndef IDEMGATE_UPSTREAM_TYPES_H
#define IDEMGATE_UPSTREAM_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

enum up_result {
    UP_OK = 0,         /* a complete response arrived */
    UP_CONNECT_FAILED, /* nothing was sent (refused, unresolvable, connect timeout) */
    UP_TIMEOUT,        /* total timeout after the request may have been sent: unknown outcome */
    UP_NO_RESPONSE,    /* closed or reset after the request was sent, no full answer: unknown outcome */
    UP_TOO_LARGE,      /* response over max_response: executed, not stored */
    UP_CANCELLED,      /* up_cancel was called (the callback is not run then) */
    UP_ERROR,          /* anything else (e.g. malformed framing): treat as unknown outcome */
    /* The request was sent and the answer's head is one the gateway will not pass on: a header name that is not a
     * token, a value with a control byte other than HTAB, an obs-fold line, a line without a colon, or a head over
     * max_header_bytes. Unknown outcome. */
    UP_INVALID_RESPONSE,
    /* Nothing was sent: at the instant it would have left, the caller's send_until_ms had passed (its lease is
     * lost, SPEC 8), or up_drop_unsent dropped it. */
    UP_LEASE_LOST,
};

/* Where a request goes: taken from the configuration (parsed once there), never from a request. The strings are
 * borrowed for the duration of up_send only. */
/* An https origin's TLS settings (strings borrowed for the send call: libcurl copies them). */
struct up_tls {
    const char *ca;          /* CA bundle; NULL: libcurl's default */
    const char *cert, *key;  /* client certificate and key (PEM); NULL: none */
    bool verify;             /* verify the peer's chain and name */
    const char *server_name; /* the name for SNI, verification (and the URL); the connection still goes to host */
};

struct up_origin {
    const struct up_tls *tls; /* https only; NULL: libcurl's defaults (system CAs, verification on) */
    bool https;               /* false: http */
    const char *host;         /* a host name, or an IP literal without brackets ("127.0.0.1", "::1") */
    uint16_t port;            /* 1..65535 */
    bool ip_literal;          /* host is an IPv4 or IPv6 literal */
};

struct up_request {
    const char *method;
    const struct up_origin *origin; /* the configured upstream: the only place the connection goes */
    const char *target;             /* origin-form request target (base path + path + query); see up_target_ok */
    const struct cm_hdrs *hdrs;     /* already filtered by the caller; Host is passed as given */
    const void *body;               /* may be NULL when body_len == 0 */
    size_t body_len;
    uint64_t connect_timeout_ms;
    uint64_t timeout_ms;
    size_t max_response; /* cap on the response body */
    /* Cap on the response head (status line and header lines with their CR LF; 0: UP_DEFAULT_MAX_HEAD). A head
     * over it is UP_INVALID_RESPONSE. */
    size_t max_header_bytes;
    /* Sockets to this request's host:port at most (0: the client's max_host_connections). Honoured by the built-in
     * client; through libcurl the client's bound applies. */
    size_t max_connections;
    /* An idle connection to this request's host:port is reused only if it went idle less than this long ago
     * (0: UP_MAX_IDLE_REUSE_S); older ones are closed. libcurl takes it in whole seconds (at least 1). */
    uint64_t keepalive_ms;
    /* true: libcurl must never send this request twice on its own (its
     * silent retry on a dead reused connection becomes UP_NO_RESPONSE). */
    bool no_resend;
    /* NULL: no bound. Else the request leaves only while cm_now_ms() < *send_until_ms at the instant its first
     * byte would be written (read then, on every connection it starts on, so the caller may move it on); past it
     * the transfer ends with UP_LEASE_LOST, nothing sent. The caller keeps *send_until_ms alive until the
     * callback ran or the transfer was cancelled. */
    const uint64_t *send_until_ms;
};

/* The head cap when up_request.max_header_bytes is 0 (conf's max_response_header_bytes default). */
#define UP_DEFAULT_MAX_HEAD (16 * 1024)

/* Called once per transfer on the I/O thread. resp is valid (status,
 * hop-by-hop-stripped headers in order, body) only when r == UP_OK; the
 * callee may move its contents out (cm_resp fields) and the caller of the
 * callback frees whatever is left after it returns. resp is never NULL (its
 * contents mean nothing unless r == UP_OK). errmsg is never NULL: a constant
 * or short-lived string, for logs only. upstream_seconds is the time since
 * up_send (queueing for a connection included). The callback may call
 * up_send, up_cancel (on other transfers) and up_client_destroy. */
typedef void (*up_done_cb)(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg,
                           double upstream_seconds);

#endif
