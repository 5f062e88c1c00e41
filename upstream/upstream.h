/* upstream.h - forwarding to upstreams with one libcurl multi handle driven by
 * the I/O thread's libevent loop (keep-alive connections reused). Every call
 * here happens on that one thread. */
#ifndef IDEMGATE_UPSTREAM_H
#define IDEMGATE_UPSTREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

struct event_base;
struct up_client;
struct up_transfer;

enum up_result {
    UP_OK = 0,         /* a complete response arrived */
    UP_CONNECT_FAILED, /* nothing was sent (refused, unresolvable, connect timeout) */
    UP_TIMEOUT,        /* total timeout after the request may have been sent: unknown outcome */
    UP_NO_RESPONSE,    /* closed or reset after the request was sent, no full answer: unknown outcome */
    UP_TOO_LARGE,      /* response over max_response: executed, not stored */
    UP_CANCELLED,      /* up_cancel was called (the callback is not run then) */
    UP_ERROR,          /* anything else (e.g. malformed response): treat as unknown outcome */
};
const char *up_result_name(enum up_result r);

struct up_request {
    const char *method;
    const char *url;            /* full URL: upstream base + path + query */
    const struct cm_hdrs *hdrs; /* already filtered by the caller; Host is passed as given */
    const void *body;           /* may be NULL when body_len == 0 */
    size_t body_len;
    uint64_t connect_timeout_ms;
    uint64_t timeout_ms;
    size_t max_response; /* cap on the response body */
    /* Sockets to this request's host:port at most (0: the client's max_host_connections). Honoured by the built-in
     * client; through libcurl the client's bound applies. */
    size_t max_connections;
    /* true: libcurl must never send this request twice on its own (its
     * silent retry on a dead reused connection becomes UP_NO_RESPONSE). */
    bool no_resend;
};

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

/* Creates the client bound to base. max_host_connections bounds sockets per
 * upstream host unless a request says otherwise (0: unbounded); transfers beyond it wait for a free
 * connection, and a transfer whose timeout ends while it waits is
 * UP_CONNECT_FAILED (nothing was sent). Returns NULL on failure. */
struct up_client *up_client_create(struct event_base *base, long max_host_connections);
/* Cancels every transfer still running (their callbacks are not called). */
void up_client_destroy(struct up_client *c);

/* Starts a transfer; all of req is copied, so it may be freed after return.
 * Returns a handle usable with up_cancel until the callback has run, or NULL
 * when the transfer could not be started (the callback is then not called),
 * e.g. a header name that is not a token or a value with CR/LF. Content-Length,
 * Expect and hop-by-hop headers in req->hdrs are not sent: libcurl frames the
 * body itself. No header is added that the caller did not give, except Host
 * (from the URL, when hdrs has none) and Content-Length. */
struct up_transfer *up_send(struct up_client *c, const struct up_request *req, up_done_cb cb, void *arg);
/* Aborts a running transfer; its callback will not be called. */
void up_cancel(struct up_client *c, struct up_transfer *t);
/* Transfers currently running. */
size_t up_active(const struct up_client *c);

#endif
