/* internal.h - what upstream.c (the libcurl multi path) and h1.c (the built-in HTTP/1.1 path) share: the
 * transfer and client structs, header-line parsing, delivery of a result. Not for other rooms. */
#ifndef IDEMGATE_UPSTREAM_INTERNAL_H
#define IDEMGATE_UPSTREAM_INTERNAL_H

#include <curl/curl.h>
#include <sys/socket.h>
#include <time.h>

#include "upstream/upstream.h"

/* Cap on a chunked body's trailer block (trailers are read and dropped); going over is UP_TOO_LARGE. */
#define UP_MAX_HEADER_BYTES (256 * 1024)
/* Longest request target and origin host name up_send takes. */
#define UP_MAX_TARGET (64 * 1024)
#define UP_MAX_HOST   253
/* The gateway's replay marker: an upstream's own is dropped from its answer. */
#define UP_REPLAYED_HDR "Idempotent-Replayed"
/* An idle kept-alive connection older than this is not reused: many servers close idle connections after 5 s
 * (node, Apache), and a request sent on a connection the server is closing at that moment ends as an unknown
 * outcome. Under load connections are reused long before this. */
#define UP_MAX_IDLE_REUSE_S 2L
/* Idle transfers (each with its configured easy handle, or its timer) kept for reuse after a burst. */
#define UP_POOL_MAX 64
/* The receive buffer of a running transfer (libcurl's, allocated per transfer; h1's, per connection). Measured at
 * 1000 concurrent transfers x 100 ms: VmHWM 79.2 MB with 4 KiB against 81.8-85.7 MB with 16 KiB (8 KiB: no
 * gain). A response over 4 KiB costs more recv calls (64 KiB: 16 instead of 4; +2% loop-thread instructions). */
#define UP_RECV_BUFFER 4096L
/* A pooled transfer keeps its request buffer (curl: header list; h1: request head and body) up to this size. */
#define UP_HDR_MEM_KEEP (8 * 1024)

struct h1_conn;
struct h1_origin;

/* How far a transfer on the built-in client got (h1.c). */
enum h1_phase {
    H1_QUEUED,   /* waiting for a connection slot (max_host_connections) */
    H1_CONNECT,  /* its own connection is connecting */
    H1_ACTIVE,   /* sending the request and/or reading the response */
    H1_DEFERRED, /* its result is set and is delivered from the timer (never inside up_send) */
};

/* A transfer and its easy handle stay paired: after the callback both go back to the pool, and the options
 * that never change (callbacks, their data pointers, protocol settings) are set once, when the pair is made.
 * A built-in (h1) transfer has no easy handle; it keeps its timer in the pool instead. */
struct up_transfer {
    struct up_client *c;
    CURL *easy; /* NULL on the h1 path */
    up_done_cb cb;
    void *arg;
    struct up_transfer *prev, *next; /* running list; next also links the pool */
    struct curl_slist *hdr_list;     /* nodes and text in hdr_mem (libcurl only reads the list) */
    CURLU *cu;                       /* curl only: the URL, set part by part (up_set_url) */
    char *hdr_mem;                   /* curl: header list; h1: the request as it goes on the wire */
    size_t hdr_cap;
    void *body; /* our copy of the request body (CURLOPT_POSTFIELDS does not copy) */
    struct cm_resp resp;
    size_t hdr_bytes;        /* of the response head so far (status line and header lines with CR LF) */
    size_t max_head;         /* cap on hdr_bytes, from the request */
    const char *invalid_why; /* a constant, when invalid */
    bool invalid;            /* the answer broke a rule of up_header_line: UP_INVALID_RESPONSE */
    bool hdrs_final;         /* the blank line after a final (>= 200) status line was seen: later lines are trailers */
    bool too_large;          /* body or headers went over their cap */
    bool no_resend;          /* from the request */
    bool refused_resend;     /* our prereq callback refused libcurl's second send */
    bool done;               /* completed: the callback runs or ran, up_cancel is a no-op */
    bool had_postfields;     /* the easy handle holds a CURLOPT_POSTFIELDS pointer from an earlier request */
    unsigned prereq_calls;   /* times libcurl was about to send the request */
    struct timespec start;
    char errbuf[CURL_ERROR_SIZE];

    /* ---- h1 only */
    bool h1;
    enum h1_phase phase;
    struct h1_origin *origin;
    struct h1_conn *conn;              /* while H1_CONNECT / H1_ACTIVE */
    struct up_transfer *wprev, *wnext; /* the origin's queue, while H1_QUEUED */
    struct event *timer;               /* the transfer's deadline (connect, total) or its deferred result */
    uint64_t deadline_ms;              /* total timeout (cm_now_ms clock); 0: none */
    uint64_t connect_timeout_ms;       /* for each connection it waits on */
    uint64_t connect_deadline_ms;      /* of the connection it waits on now */
    size_t wlen, wpos;                 /* the request in hdr_mem: length, bytes sent */
    bool is_head;                      /* a HEAD request: the response has no body */
    bool sent_any;                     /* the kernel took at least one byte of the request */
    bool got_any;                      /* at least one byte of the response arrived */
    unsigned sends; /* connections the request was started on (a dead reused one may be re-sent once) */
    enum up_result deferred_r;
    const char *deferred_err;
};

struct up_client {
    struct event_base *base;
    CURLM *multi;
    struct event *timer;
    struct up_transfer *transfers; /* running, in a doubly linked list */
    size_t active;
    struct up_sock **socks; /* indexed by fd */
    size_t socks_n;
    struct up_transfer *pool; /* idle transfers, linked by next */
    size_t pool_n;
    int dispatching;       /* > 0 while done callbacks run */
    bool destroy_deferred; /* up_client_destroy was called from a done callback */
    bool closing;          /* up_client_destroy runs: transfers are stopped, none is started */
    long max_host;         /* max_host_connections (0: unbounded) */

    /* ---- h1 */
    struct h1_origin **origins; /* one per upstream address seen, never freed before the client */
    size_t origins_n;
    size_t h1_idle_n;            /* idle connections over all origins */
    struct up_transfer *h1_pool; /* idle h1 transfers, linked by next */
    size_t h1_pool_n;
    int h1_sync; /* > 0: inside up_send, up_cancel or a start of waiting transfers: failures are deferred */
};

double up_elapsed(const struct timespec *start);
/* An idle connection that became readable will not be used again: reads what is waiting (bounded) and shuts the
 * socket down, so that a liveness check before reuse sees the close. The caller still owns and closes fd. */
void up_sock_poison(int fd);
/* Keeps an idle transfer in pool (its request buffer trimmed to UP_HDR_MEM_KEEP); false: the pool is full. */
bool up_pool_put(struct up_client *c, struct up_transfer **pool, size_t *n, struct up_transfer *t);
void up_link(struct up_client *c, struct up_transfer *t);
void up_unlink(struct up_client *c, struct up_transfer *t);
bool up_token_ok(const char *s, size_t *len);
bool up_value_ok(const char *s, size_t *len);
/* What a request header becomes upstream: sent, or skipped (framing, Expect, hop-by-hop). */
bool up_hdr_skipped(const char *name);
/* Response head lines without their CR LF, validated here for both clients: a status line (starts the head over,
 * after a 1xx too) and a header line (trailers after the final head ignored). The name must be a token, the value
 * pass cm_field_value_ok, no obs-fold, the whole head within t->max_head; the upstream's Idempotent-Replayed is
 * dropped. false: the answer is invalid (t->invalid set, see up_invalid). */
bool up_status_line(struct up_transfer *t, const char *p, size_t len);
bool up_header_line(struct up_transfer *t, const char *p, size_t len);
/* Marks t's answer invalid (UP_INVALID_RESPONSE) for why (a constant); returns false. */
bool up_invalid(struct up_transfer *t, const char *why);
/* Runs the callback of a finished transfer (unlinked here) and releases it. Returns true when the client was
 * destroyed from the callback (then nothing of it may be touched). */
bool up_deliver(struct up_client *c, struct up_transfer *t, enum up_result r, const char *err);

/* ---- h1.c: the built-in client for http:// URLs whose host is an IP address */

/* Starts a transfer on the h1 path when req->origin is one it takes (http at an IPv4/IPv6 literal):
 * *taken = true, and the transfer (linked, running) or NULL (a header that cannot be sent) is returned; a failure
 * to connect shows as its result later, never from inside here. *taken = false: use libcurl. */
struct up_transfer *h1_send(struct up_client *c, const struct up_request *req, bool head, bool with_body, up_done_cb cb,
                            void *arg, bool *taken);
/* Stops a running h1 transfer without calling back (its connection is closed when mid-request). */
void h1_abort(struct up_client *c, struct up_transfer *t);
/* Frees everything h1 holds (connections, origins, pooled transfers); transfers must be aborted already. */
void h1_destroy(struct up_client *c);
/* Returns an h1 transfer to the pool, or frees it. */
void h1_transfer_free(struct up_client *c, struct up_transfer *t);

/* The h1 response parser with no socket behind it (tests/fuzz/fuzz_h1.c): the answer to a HEAD request when head,
 * its body capped at max_body, its head at max_head (0: UP_DEFAULT_MAX_HEAD). Never NULL; h1_parser_destroy frees
 * it (NULL: no-op). */
struct h1_parser;
struct h1_parser *h1_parser_create(bool head, size_t max_body, size_t max_head);
/* Feeds n bytes, then the peer's close when eof. Returns 1: a complete answer (h1_parser_resp holds it; bytes after
 * it are not parsed), 0: more wanted, -1: refused (malformed, invalid, over a cap). Once non-zero it stays so. */
int h1_parser_feed(struct h1_parser *p, const void *data, size_t n, bool eof);
const struct cm_resp *h1_parser_resp(const struct h1_parser *p);
/* Bytes of the final head counted against max_head (status line and header lines with CR LF). */
size_t h1_parser_head_bytes(const struct h1_parser *p);
void h1_parser_destroy(struct h1_parser *p);

#endif
