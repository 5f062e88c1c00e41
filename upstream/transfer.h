/* transfer.h - the transfer core every backend uses: the backend table, the shared part of a transfer and of the
 * client, the running list, the pools, delivery of a result and the client's teardown. It never names a backend:
 * the facade (upstream.c) fills the client's table at create. Not for other rooms. */
#ifndef IDEMGATE_UPSTREAM_TRANSFER_H
#define IDEMGATE_UPSTREAM_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <time.h>

#include "upstream/types.h"

/* Cap on a chunked body's trailer block (trailers are read and dropped); going over is UP_TOO_LARGE. */
#define UP_MAX_HEADER_BYTES (256 * 1024)
/* Longest request target and origin host name up_send takes. */
#define UP_MAX_TARGET (64 * 1024)
#define UP_MAX_HOST   253
/* An idle kept-alive connection older than this is not reused when the request says nothing (up_request's
 * keepalive_ms; conf's keepalive_timeout, default the same, as nginx's upstream keepalive_timeout). A server that
 * closes idle connections earlier and says so (Keep-Alive: timeout=N: node, Apache) is believed, less a margin
 * (h1.c): a request sent on a connection the server is closing at that moment ends as an unknown outcome. One that
 * closes without saying so is seen by the idle connection's read event and the recv(MSG_PEEK) before reuse. */
#define UP_MAX_IDLE_REUSE_S 60L
/* Idle transfers (each with its configured easy handle, or its timer) kept for reuse after a burst. */
#define UP_POOL_MAX 64
/* The receive buffer of a running transfer (libcurl's, allocated per transfer; h1's, per connection). Measured at
 * 1000 concurrent transfers x 100 ms: VmHWM 79.2 MB with 4 KiB against 81.8-85.7 MB with 16 KiB (8 KiB: no
 * gain). A response over 4 KiB costs more recv calls (64 KiB: 16 instead of 4; +2% loop-thread instructions). */
#define UP_RECV_BUFFER 4096L
/* A pooled transfer keeps its request buffer (curl: header list; h1: request head and body) up to this size. */
#define UP_HDR_MEM_KEEP (8 * 1024)

struct up_client;
struct up_transfer;

/* One way of sending requests, behind a small table (redis' ae_*.c, pgbouncer's SBufIO): the client holds one
 * state per backend and asks them in order whether they take a request. */
struct up_backend {
    const char *name;
    /* The backend's state for c (freed by destroy); NULL on failure. */
    void *(*create)(struct up_client *c);
    /* Takes req when it is this backend's (*taken = true): returns the transfer, linked and running (started with
     * up_transfer_begin), or NULL when it could not start (no callback then); a failure after that shows as the
     * transfer's result later, never from inside send. *taken = false: not this backend's. */
    struct up_transfer *(*send)(void *state, const struct up_request *req, bool head, bool with_body, up_done_cb cb,
                                void *arg, bool *taken);
    /* Stops a running transfer without calling back (the facade unlinks it). */
    void (*cancel)(void *state, struct up_transfer *t);
    /* A transfer that is done or stopped: back to the backend's pool when pool, else freed. */
    void (*release)(void *state, struct up_transfer *t, bool pool);
    /* Frees the state and everything it holds; no transfer runs any more. */
    void (*destroy)(void *state);
};

enum { UP_BE_H1, UP_BE_CURL, UP_BE_N };

/* The part of a transfer every backend uses: each backend's transfer struct starts with it. */
struct up_transfer {
    struct up_client *c;
    const struct up_backend *be;
    void *bs; /* be's state */
    up_done_cb cb;
    void *arg;
    struct up_transfer *prev, *next; /* running list; next also links a backend's pool */
    struct cm_resp resp;
    size_t hdr_bytes;        /* of the response head so far (status line and header lines with CR LF) */
    size_t max_head;         /* cap on hdr_bytes, from the request */
    const char *invalid_why; /* a constant, when invalid */
    bool invalid;            /* the answer broke a rule of up_header_line: UP_INVALID_RESPONSE */
    bool hdrs_final;         /* the blank line after a final (>= 200) status line was seen: later lines are trailers */
    bool too_large;          /* body or head went over its cap */
    bool no_resend;          /* from the request */
    bool done;               /* completed: the callback runs or ran, up_cancel is a no-op */
    bool leaving;            /* up_may_send let it leave: some of it may be sent */
    const uint64_t *send_until; /* from the request (NULL: no bound) */
    struct timespec start;
};

struct up_client {
    struct event_base *base;
    struct up_transfer *transfers; /* running, in a doubly linked list */
    size_t active;
    int dispatching;                      /* > 0 while done callbacks run */
    bool destroy_deferred;                /* up_client_destroy was called from a done callback */
    bool closing;                         /* up_client_destroy runs: transfers are stopped, none is started */
    long max_host;                        /* max_host_connections (0: unbounded) */
    const struct up_backend *be[UP_BE_N]; /* set by the facade at create, asked in this order */
    void *state[UP_BE_N];                 /* each backend's */
};

double up_elapsed(const struct timespec *start);
/* The backends ask right before t's first byte would be written: true, and t counts as leaving from then on; false
 * when the request's send_until_ms passed (the backend ends t with UP_LEASE_LOST, nothing sent). */
bool up_may_send(struct up_transfer *t);
/* Resets the shared part of t for req and links it as running (the backend sets its own part). */
void up_transfer_begin(struct up_client *c, struct up_transfer *t, const struct up_request *req, up_done_cb cb,
                       void *arg);
/* Keeps an idle transfer in pool; false: the pool is full (or the client is going away). */
bool up_pool_put(struct up_client *c, struct up_transfer **pool, size_t *n, struct up_transfer *t);
/* A pooled transfer keeps a request buffer of at most UP_HDR_MEM_KEEP bytes. */
void up_trim_buf(char **mem, size_t *cap);
void up_link(struct up_client *c, struct up_transfer *t);
void up_unlink(struct up_client *c, struct up_transfer *t);
/* Runs the callback of a finished transfer (unlinked here) and releases it. Returns true when the client was
 * destroyed from the callback (then nothing of it may be touched). */
bool up_deliver(struct up_client *c, struct up_transfer *t, enum up_result r, const char *err);
/* Brackets a backend's loop over finished transfers: callbacks may destroy the client meanwhile, which then
 * happens at the end. up_dispatch_end returns true when the client is gone. */
void up_dispatch_begin(struct up_client *c);
bool up_dispatch_end(struct up_client *c);

/* Stops a running transfer without calling back; pool false: free it rather than pool it. */
void up_stop(struct up_client *c, struct up_transfer *t, bool pool);
/* up_client_destroy's work (c not NULL): from a done callback, stops every transfer and leaves the freeing to
 * up_dispatch_end; else frees the client now. */
void up_client_teardown(struct up_client *c);
#endif
