/* upstream.h - forwarding to upstreams on the I/O thread's libevent loop: a built-in HTTP/1.1 client for http://
 * upstreams at an IP address, one libcurl multi handle for the others (keep-alive connections reused). Every call
 * here happens on that one thread. Never a backend's details. */
#ifndef IDEMGATE_UPSTREAM_H
#define IDEMGATE_UPSTREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "upstream/types.h"

struct event_base;
struct up_client;
struct up_transfer;

const char *up_result_name(enum up_result r);

/* A request target up_send accepts: origin-form, starting with '/', of visible ASCII without '#' (no fragment,
 * no space, no control byte, nothing over 0x7e), at most 64 KiB. Anything else could be read as another
 * authority by some parser, so it is refused rather than repaired. */
bool up_target_ok(const char *target);

/* Creates the client bound to base. max_host_connections bounds sockets per
 * upstream host unless a request says otherwise (0: unbounded); transfers beyond it wait for a free
 * connection, and a transfer whose timeout ends while it waits is
 * UP_CONNECT_FAILED (nothing was sent). Returns NULL on failure. */
struct up_client *up_client_create(struct event_base *base, long max_host_connections);
/* Cancels every transfer still running (their callbacks are not called). */
void up_client_destroy(struct up_client *c);

/* Starts a transfer to req->origin; all of req is copied, so it may be freed after return.
 * Returns a handle usable with up_cancel until the callback has run, or NULL
 * when the transfer could not be started (the callback is then not called),
 * e.g. a target refused by up_target_ok, a header name that is not a token or a value with CR/LF. Content-Length,
 * Expect and hop-by-hop headers in req->hdrs are not sent: libcurl frames the
 * body itself. No header is added that the caller did not give, except Host
 * (from the origin, when hdrs has none) and Content-Length. */
struct up_transfer *up_send(struct up_client *c, const struct up_request *req, up_done_cb cb, void *arg);
/* Aborts a running transfer; its callback will not be called. */
void up_cancel(struct up_client *c, struct up_transfer *t);
/* Cancels t (its callback will not be called) when nothing of it has left yet, i.e. it still waits for a
 * connection or for its connect; true then. false: its request may have been sent (t runs on) or it is done. */
bool up_drop_unsent(struct up_client *c, struct up_transfer *t);
/* Transfers currently running. */
size_t up_active(const struct up_client *c);

#endif
