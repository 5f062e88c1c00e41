/* h1.c - the built-in HTTP/1.1 client for upstreams at http://<IP address>: keep-alive connections per address
 * on the loop's libevent base, one request at a time on each (no pipelining), the response framed by RFC 9112
 * section 6.3 (Content-Length, chunked, or read to close). It classifies failures exactly as the libcurl path
 * does (upstream.h): nothing sent, sent with no full answer, timeout after sending, too large, malformed.
 *
 * Why it exists: on the proxy's fast path libcurl cost about a quarter of the gateway's CPU (a connection struct
 * and a URL parse per transfer, ~18 allocations, two poll() calls per request); a request here costs one send()
 * and one recv(). It takes the configured origins that are http:// at an IP literal (https and host names go to
 * libcurl); the address comes from the origin, parsed once per origin, never from the request target. Never libcurl. */
#include <errno.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "upstream/h1.h"
#include "upstream/head.h"
#include "upstream/transfer.h"

/* A chunk-size line (with extensions) longer than this is a malformed response. */
#define H1_MAX_CHUNK_LINE 1024
/* Without max_host_connections, idle connections kept per client at most (libcurl's cache: 1024 here too). */
#define H1_MAX_IDLE 1024
/* Connect timeout when the request gives none (libcurl's default). */
#define H1_DEFAULT_CONNECT_MS 300000

enum h1_body {
    B_HEAD,     /* reading the response head */
    B_LENGTH,   /* Content-Length bytes left in left */
    B_CHUNK,    /* at a chunk-size line */
    B_DATA,     /* inside a chunk: left bytes */
    B_DATA_END, /* the CR LF after a chunk's data */
    B_TRAILER,  /* trailer lines up to the blank line */
    B_CLOSE,    /* everything up to the connection's close */
};

/* How far a transfer on the built-in client got. */
enum h1_phase {
    H1_QUEUED,   /* waiting for a connection slot (max_host_connections) */
    H1_CONNECT,  /* its own connection is connecting */
    H1_ACTIVE,   /* sending the request and/or reading the response */
    H1_DEFERRED, /* its result is set and is delivered from the timer (never inside up_send) */
};

struct h1_conn;
struct h1_origin;

/* A transfer of this backend: the shared part, then the request on the wire and where it is. */
struct h1_xfer {
    struct up_transfer b;
    enum h1_phase phase;
    struct h1_origin *origin;
    struct h1_conn *conn;          /* while H1_CONNECT / H1_ACTIVE */
    struct h1_xfer *wprev, *wnext; /* the origin's queue, while H1_QUEUED */
    struct event *timer;           /* the transfer's deadline (connect, total) or its deferred result */
    uint64_t deadline_ms;          /* total timeout (cm_now_ms clock); 0: none */
    uint64_t connect_timeout_ms;   /* for each connection it waits on */
    uint64_t keepalive_ms;         /* an idle connection older than this is not reused for it */
    uint64_t connect_deadline_ms;  /* of the connection it waits on now */
    char *hdr_mem;                 /* the request as it goes on the wire */
    size_t hdr_cap;
    size_t wlen, wpos; /* the request in hdr_mem: length, bytes sent */
    bool is_head;      /* a HEAD request: the response has no body */
    bool sent_any;     /* the kernel took at least one byte of the request */
    bool got_any;      /* at least one byte of the response arrived */
    unsigned sends;    /* connections the request was started on (a dead reused one may be re-sent once) */
    enum up_result deferred_r;
    const char *deferred_err;
};

#define H1_SPARE_BUFS 8 /* per client (loop); a loop reads one response at a time, so a few are enough */
/* The idle sweep: how often it looks while connections are idle, and at most how many it closes per look (a burst of
 * connections that went idle together is closed in slices, not in one stall of the loop). */
#define H1_SWEEP_MS    1000
#define H1_SWEEP_SLICE 64
#define H1_SWEEP_NEXT  50 /* ms to the next slice when one was full */

/* The backend's state: the origins it has sent to, idle transfers, spare receive buffers, the sync depth. */
struct up_h1 {
    struct up_client *c;
    struct h1_origin **origins; /* one per upstream address seen, never freed before the client */
    size_t origins_n;
    size_t idle_n;            /* idle connections over all origins */
    struct up_transfer *pool; /* idle transfers, linked by next */
    size_t pool_n;
    /* Receive buffers (UP_RECV_BUFFER each) of connections between responses. A connection holds one only while it
     * reads a response: 1000 connections waiting on a slow upstream hold none (4 MB less resident). */
    char *spare_buf[H1_SPARE_BUFS];
    size_t spare_n;
    int sync;            /* > 0: inside up_send, up_cancel or a start of waiting transfers: failures are deferred */
    struct event *sweep; /* closes idle connections past their reuse limit (armed while any is idle) */
};

static struct up_h1 *h1_of(const struct up_client *c)
{
    return c->state[UP_BE_H1];
}

struct h1_conn {
    struct up_client *c;
    struct h1_origin *o;
    int fd;
    struct event *rev, *wev;     /* read: persistent once connected; write: while connecting or send would block */
    struct h1_xfer *t;           /* running on it; NULL: idle */
    struct h1_conn *prev, *next; /* the origin's idle list */
    uint64_t idle_since_ms;
    unsigned requests; /* responses completed on it: > 0 means a request on it reuses the connection */
    char *buf;         /* received bytes not parsed yet: buf[pos..len) */
    size_t cap, len, pos;
    /* response framing */
    enum h1_body body;
    uint64_t left;
    bool want_status; /* the next line starts a head: the status line */
    bool http10, keep_alive, close_after, have_length, have_te, chunked;
    int64_t ka_hint_ms;     /* Keep-Alive: timeout=N of the response being read (ms; -1: none) */
    int64_t server_idle_ms; /* the last one the server announced (-1: none): it closes idle ones after that */
};

struct h1_origin {
    char *host; /* the IP literal as configured: "127.0.0.1", "::1" */
    uint16_t port;
    char *host_hdr; /* "127.0.0.1:8080", "[::1]" */
    struct sockaddr_storage sa;
    socklen_t sa_len;
    size_t conns;          /* open: connecting, busy or idle */
    size_t max;            /* bound on conns (0: none), from the latest request */
    uint64_t keepalive_ms; /* keepalive_timeout of the latest request (0: the default), for the idle sweep */
    struct h1_conn *idle;  /* most recently used first */
    struct h1_xfer *waitq; /* waiting for a connection slot, first in first out (wnext/wprev) */
    struct h1_xfer *waitq_tail;
};

/* ---- origins: the configured upstreams this client has sent to, each address parsed once */

/* The origin for uo (an http:// IP literal), made on first use. NULL: the literal does not parse. */
static struct h1_origin *h1_origin_get(struct up_h1 *h, const struct up_origin *uo)
{
    for (size_t i = 0; i < h->origins_n; i++) {
        struct h1_origin *o = h->origins[i];
        if (o->port == uo->port && strcmp(o->host, uo->host) == 0)
            return o;
    }
    struct sockaddr_storage sa;
    socklen_t sa_len;
    memset(&sa, 0, sizeof sa);
    bool v6 = strchr(uo->host, ':') != NULL;
    if (v6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&sa;
        if (inet_pton(AF_INET6, uo->host, &s6->sin6_addr) != 1)
            return NULL;
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(uo->port);
        sa_len = sizeof *s6;
    } else {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&sa;
        if (inet_pton(AF_INET, uo->host, &s4->sin_addr) != 1)
            return NULL;
        s4->sin_family = AF_INET;
        s4->sin_port = htons(uo->port);
        sa_len = sizeof *s4;
    }
    struct h1_origin *o = cm_calloc(1, sizeof *o);
    o->host = cm_strdup(uo->host);
    o->port = uo->port;
    /* like libcurl: the port is left out of Host when it is the scheme's default */
    if (uo->port == 80)
        o->host_hdr = cm_asprintf(v6 ? "[%s]" : "%s", uo->host);
    else
        o->host_hdr = cm_asprintf(v6 ? "[%s]:%u" : "%s:%u", uo->host, (unsigned)uo->port);
    o->sa = sa;
    o->sa_len = sa_len;
    h->origins = cm_realloc(h->origins, (h->origins_n + 1) * sizeof *h->origins);
    h->origins[h->origins_n++] = o;
    return o;
}

/* ---- the request on the wire */

static bool h1_put(struct h1_xfer *t, const void *p, size_t n)
{
    if (n > t->hdr_cap - t->wlen)
        return false;
    memcpy(t->hdr_mem + t->wlen, p, n);
    t->wlen += n;
    return true;
}

/* Request line, Host (unless given), the caller's headers in order (framing, Expect and hop-by-hop ones left
 * out), Content-Length when there is a body, the blank line, the body: one buffer, one send() most times. */
static bool h1_build(struct h1_xfer *t, const struct up_request *req, const struct h1_origin *o, const char *target,
                     bool with_body)
{
    size_t ml, tl = strlen(target);
    if (!up_token_ok(req->method, &ml))
        return false;
    const struct cm_hdrs *h = req->hdrs;
    size_t n = h ? h->n : 0;
    size_t need = ml + tl + 16 + strlen(o->host_hdr) + 8 + 40 + 2 + (with_body ? req->body_len : 0);
    bool have_host = false;
    for (size_t i = 0; i < n; i++) {
        size_t nl, vl;
        if (!up_token_ok(h->v[i].name, &nl) || !up_value_ok(h->v[i].value, &vl))
            return false;
        have_host = have_host || strcasecmp(h->v[i].name, "Host") == 0;
        need += nl + vl + 4;
    }
    if (need > t->hdr_cap) {
        free(t->hdr_mem);
        t->hdr_mem = cm_malloc(need);
        t->hdr_cap = need;
    }
    t->wlen = t->wpos = 0;
    bool ok = h1_put(t, req->method, ml) && h1_put(t, " ", 1); /* target: origin-form, checked by up_send */
    ok = ok && h1_put(t, target, tl) && h1_put(t, " HTTP/1.1\r\n", 11);
    if (!have_host)
        ok = ok && h1_put(t, "Host: ", 6) && h1_put(t, o->host_hdr, strlen(o->host_hdr)) && h1_put(t, "\r\n", 2);
    for (size_t i = 0; ok && i < n; i++) {
        const char *name = h->v[i].name, *value = h->v[i].value;
        if (up_hdr_kind(name) == UP_HDR_SKIP)
            continue;
        size_t vl = strlen(value);
        ok = h1_put(t, name, strlen(name)) && h1_put(t, vl ? ": " : ":", vl ? 2 : 1) && h1_put(t, value, vl) &&
             h1_put(t, "\r\n", 2);
    }
    if (ok && with_body) {
        char cl[40];
        int w = snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", req->body_len);
        ok = w > 0 && (size_t)w < sizeof cl && h1_put(t, cl, (size_t)w);
    }
    ok = ok && h1_put(t, "\r\n", 2);
    if (ok && with_body && req->body_len > 0)
        ok = h1_put(t, req->body, req->body_len);
    return ok;
}

/* ---- connections */

static void h1_on_read(evutil_socket_t fd, short what, void *arg);
static void h1_on_write(evutil_socket_t fd, short what, void *arg);
static void h1_dispatch(struct up_client *c, struct h1_xfer *t);
static void h1_set_timer(struct h1_xfer *t);
static void h1_sweep_arm(struct up_h1 *h, unsigned ms);

static void h1_idle_unlink(struct up_client *c, struct h1_conn *k)
{
    if (k->prev != NULL)
        k->prev->next = k->next;
    else
        k->o->idle = k->next;
    if (k->next != NULL)
        k->next->prev = k->prev;
    k->prev = k->next = NULL;
    h1_of(c)->idle_n--;
}

/* Closes k (idle, or its transfer already detached). */
static void h1_conn_close(struct up_client *c, struct h1_conn *k)
{
    if (k->t == NULL && (k->prev != NULL || k->o->idle == k))
        h1_idle_unlink(c, k);
    if (k->rev != NULL)
        event_free(k->rev);
    if (k->wev != NULL)
        event_free(k->wev);
    close(k->fd);
    k->o->conns--;
    free(k->buf);
    free(k);
}

static void h1_waitq_remove(struct h1_origin *o, struct h1_xfer *t)
{
    if (t->wprev != NULL)
        t->wprev->wnext = t->wnext;
    else
        o->waitq = t->wnext;
    if (t->wnext != NULL)
        t->wnext->wprev = t->wprev;
    else
        o->waitq_tail = t->wprev;
    t->wprev = t->wnext = NULL;
}

/* Starts transfers waiting for a slot while one is free (after a connection closed or went idle). */
static void h1_pump(struct up_client *c, struct h1_origin *o)
{
    if (c->closing)
        return; /* the client is going away: nothing new leaves */
    h1_of(c)->sync++;
    while (o->waitq != NULL && (o->idle != NULL || o->max == 0 || o->conns < o->max)) {
        struct h1_xfer *t = o->waitq;
        h1_waitq_remove(o, t);
        h1_dispatch(c, t);
    }
    h1_of(c)->sync--;
}

/* The result is delivered from the transfer's timer, in a loop callback of its own. */
static void h1_defer(struct h1_xfer *t, enum up_result r, const char *err)
{
    t->phase = H1_DEFERRED;
    t->deferred_r = r;
    t->deferred_err = err;
    struct timeval tv = {0, 0};
    event_add(t->timer, &tv);
}

/* Detaches t from its connection and closes the connection. */
static void h1_drop_conn(struct up_client *c, struct h1_xfer *t)
{
    struct h1_conn *k = t->conn;
    if (k == NULL)
        return;
    k->t = NULL;
    t->conn = NULL;
    struct h1_origin *o = k->o;
    h1_conn_close(c, k);
    h1_pump(c, o);
}

/* Ends t with r, its connection closed first: now when t's own loop callback got here, from the timer when
 * the failure came up inside up_send, up_cancel or while starting waiting transfers (a callback there could
 * free what the caller still uses). */
static void h1_fail(struct up_client *c, struct h1_xfer *t, enum up_result r, const char *err)
{
    h1_drop_conn(c, t);
    if (h1_of(c)->sync > 0) {
        h1_defer(t, r, err);
        return;
    }
    event_del(t->timer);
    up_deliver(c, &t->b, r, err);
}

static void h1_send_more(struct up_client *c, struct h1_conn *k);
static int64_t h1_keepalive_hint(const char *v, size_t n);
static uint64_t h1_reuse_limit_ms(uint64_t keepalive_ms, const struct h1_conn *k);

/* k waits for a response head: its status line first, no framing known yet. */
static void h1_head_reset(struct h1_conn *k)
{
    k->body = B_HEAD;
    k->left = 0;
    k->want_status = true;
    k->http10 = k->keep_alive = k->close_after = k->have_length = k->have_te = k->chunked = false;
    k->ka_hint_ms = -1;
}

/* The transfer starts on a connected k: a fresh response state, then the request goes out. */
static void h1_attach(struct up_client *c, struct h1_conn *k, struct h1_xfer *t)
{
    k->t = t;
    t->conn = k;
    t->phase = H1_ACTIVE;
    t->sends++;
    t->wpos = 0;
    h1_head_reset(k);
    if (!up_may_send(&t->b)) { /* SPEC 8: its sender's lease ended while it waited */
        h1_fail(c, t, t->sent_any ? UP_NO_RESPONSE : UP_LEASE_LOST, "the lease ended before the request could leave");
        return;
    }
    h1_set_timer(t);
    h1_send_more(c, k);
}

static struct h1_conn *h1_conn_new(struct up_client *c, struct h1_origin *o, int fd)
{
    struct h1_conn *k = cm_calloc(1, sizeof *k);
    k->c = c;
    k->o = o;
    k->fd = fd;
    k->server_idle_ms = -1;
    k->rev = event_new(c->base, fd, EV_READ | EV_PERSIST, h1_on_read, k);
    k->wev = event_new(c->base, fd, EV_WRITE, h1_on_write, k);
    o->conns++;
    if (k->rev == NULL || k->wev == NULL) {
        h1_conn_close(c, k);
        return NULL;
    }
    return k;
}

/* A connection for t could not be had: nothing was sent, unless an earlier send (before a re-send) was. */
static enum up_result h1_unsent(const struct h1_xfer *t)
{
    return t->sent_any ? UP_NO_RESPONSE : UP_CONNECT_FAILED;
}

/* Has fd's handshake completed? One getsockopt(TCP_INFO); false when it cannot tell (the write event decides). */
static bool h1_established(int fd)
{
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    return getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0 && len >= 1 && ti.tcpi_state == TCP_ESTABLISHED;
}

/* A new connection for t; a failure to connect is deferred to t's timer (never a callback from here). Connected
 * at once, t goes on as on an idle connection (h1_attach: a failed send ends t through h1_fail). */
static void h1_connect(struct up_client *c, struct h1_origin *o, struct h1_xfer *t)
{
    int fd = socket(o->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        h1_defer(t, h1_unsent(t), "socket() failed");
        return;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* libcurl's default too */
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    struct h1_conn *k = h1_conn_new(c, o, fd);
    if (k == NULL) {
        h1_defer(t, h1_unsent(t), "out of event slots");
        return;
    }
    int rc;
    do
        rc = connect(fd, (const struct sockaddr *)&o->sa, o->sa_len);
    while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EINPROGRESS) {
        int e = errno;
        h1_conn_close(c, k);
        h1_defer(t, h1_unsent(t), e == ECONNREFUSED ? "connection refused" : "connect failed");
        return;
    }
    /* Connected already (a local server completes the handshake inside connect()): the request goes out now,
     * not after the loop's next turn, which after a burst of new clients comes once all of them are read and
     * connected. Otherwise the write event tells, as for any connect. */
    bool now = rc == 0 || h1_established(fd);
    if (event_add(now ? k->rev : k->wev, NULL) != 0) {
        h1_conn_close(c, k);
        h1_defer(t, h1_unsent(t), "event_add failed");
        return;
    }
    k->t = t;
    t->conn = k;
    t->connect_deadline_ms = cm_now_ms() + t->connect_timeout_ms;
    if (now) {
        h1_attach(c, k, t);
        return;
    }
    t->phase = H1_CONNECT;
    h1_set_timer(t);
}

/* Is an idle connection still usable? Data or EOF waiting on it means the server closed it or broke the
 * protocol; a request sent there would die unanswered. One recv(MSG_PEEK), like libcurl's check before reuse. */
static bool h1_conn_alive(const struct h1_conn *k)
{
    char b;
    ssize_t r = recv(k->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* Gives t a connection: an idle one, a new one under the per-address bound, or a place in the queue. */
static void h1_dispatch(struct up_client *c, struct h1_xfer *t)
{
    struct h1_origin *o = t->origin;
    uint64_t now = cm_now_ms();
    while (o->idle != NULL) {
        struct h1_conn *k = o->idle;
        h1_idle_unlink(c, k);
        /* Every request checks (one recv(MSG_PEEK)): a byte waiting on an idle connection is the server's close
         * or an answer nobody asked for (the rest of an earlier one), which the next request would read as its
         * own. */
        if (now - k->idle_since_ms >= h1_reuse_limit_ms(t->keepalive_ms, k) || !h1_conn_alive(k)) {
            h1_conn_close(c, k);
            continue;
        }
        h1_attach(c, k, t);
        return;
    }
    if (o->max == 0 || o->conns < o->max) {
        h1_connect(c, o, t);
        return;
    }
    t->phase = H1_QUEUED;
    t->wnext = NULL;
    t->wprev = o->waitq_tail;
    if (o->waitq_tail != NULL)
        o->waitq_tail->wnext = t;
    else
        o->waitq = t;
    o->waitq_tail = t;
    h1_set_timer(t);
}

/* ---- timers */

static void h1_set_timer(struct h1_xfer *t)
{
    uint64_t at = t->deadline_ms;
    if (t->phase == H1_CONNECT && (at == 0 || t->connect_deadline_ms < at))
        at = t->connect_deadline_ms;
    if (at == 0) {
        event_del(t->timer);
        return;
    }
    uint64_t now = cm_now_ms();
    uint64_t ms = at > now ? at - now : 0;
    struct timeval tv = {.tv_sec = (time_t)(ms / 1000), .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    event_add(t->timer, &tv);
}

static void h1_on_timer(evutil_socket_t fd, short what, void *arg)
{
    struct h1_xfer *t = arg;
    struct up_client *c = t->b.c;
    uint64_t now = cm_now_ms();
    switch (t->phase) {
    case H1_DEFERRED:
        h1_drop_conn(c, t);
        up_deliver(c, &t->b, t->deferred_r, t->deferred_err);
        return;
    case H1_QUEUED:
        h1_waitq_remove(t->origin, t);
        up_deliver(c, &t->b, UP_CONNECT_FAILED, "timed out waiting for a connection slot");
        return;
    case H1_CONNECT:
        if (now < t->connect_deadline_ms && (t->deadline_ms == 0 || now < t->deadline_ms)) {
            h1_set_timer(t); /* early wake-up */
            return;
        }
        h1_fail(c, t, h1_unsent(t), "connect timed out");
        return;
    case H1_ACTIVE:
        if (t->deadline_ms != 0 && now < t->deadline_ms) {
            h1_set_timer(t);
            return;
        }
        if (!t->sent_any)
            h1_fail(c, t, UP_CONNECT_FAILED, "timed out before the request was sent");
        else
            h1_fail(c, t, UP_TIMEOUT, "timed out waiting for the response");
        return;
    }
}

/* ---- sending */

/* The connection died under t before any response byte. On a reused connection the server may have closed it
 * just as the request left: like libcurl, the request goes once more on a new connection, unless it may not be
 * sent twice (no_resend) and some of it did leave. */
static void h1_conn_lost(struct up_client *c, struct h1_xfer *t, const char *err)
{
    struct h1_conn *k = t->conn;
    bool reused = k != NULL && k->requests > 0;
    if (!t->got_any && reused && t->sends == 1 && (!t->b.no_resend || !t->sent_any)) {
        h1_drop_conn(c, t);
        h1_dispatch(c, t);
        return;
    }
    if (!t->sent_any) {
        h1_fail(c, t, UP_CONNECT_FAILED, err); /* the kernel took no byte of it, on any connection */
        return;
    }
    if (!t->got_any && reused && t->b.no_resend)
        err = "connection closed without a response; re-sending on a new connection was refused";
    h1_fail(c, t, UP_NO_RESPONSE, err);
}

static void h1_send_more(struct up_client *c, struct h1_conn *k)
{
    struct h1_xfer *t = k->t;
    while (t->wpos < t->wlen) {
        ssize_t n = send(k->fd, t->hdr_mem + t->wpos, t->wlen - t->wpos, MSG_NOSIGNAL);
        if (n > 0) {
            t->wpos += (size_t)n;
            t->sent_any = true;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            event_add(k->wev, NULL);
            return;
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
            /* The upstream closed or reset: it may have answered first (an early 413, say), and that answer is
             * in the socket. The read side (readable now) takes the answer or classifies the loss; the request
             * stops here, so the connection is not reused. */
            return;
        }
        h1_conn_lost(c, t, "sending the request failed");
        return;
    }
}

static void h1_on_write(evutil_socket_t fd, short what, void *arg)
{
    struct h1_conn *k = arg;
    struct up_client *c = k->c;
    struct h1_xfer *t = k->t;
    if (t == NULL)
        return;
    if (t->phase == H1_CONNECT) {
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
            err = errno;
        if (err != 0) {
            h1_fail(c, t, h1_unsent(t), err == ECONNREFUSED ? "connection refused" : "connect failed");
            return;
        }
        if (event_add(k->rev, NULL) != 0) {
            h1_fail(c, t, h1_unsent(t), "event_add failed");
            return;
        }
        h1_attach(c, k, t);
        return;
    }
    h1_send_more(c, k);
}

/* ---- receiving */

/* Framing from a finished final head (RFC 9112 section 6.3). */
static void h1_frame(struct h1_conn *k, struct h1_xfer *t)
{
    int st = t->b.resp.status;
    if (k->http10 && !k->keep_alive)
        k->close_after = true;
    if (t->is_head || st == 204 || st == 304) {
        k->body = B_LENGTH; /* no body, whatever the head says */
        k->left = 0;
        return;
    }
    if (k->have_te) {
        /* Transfer-Encoding wins over Content-Length; both at once is suspect: that connection is not reused */
        if (k->have_length)
            k->close_after = true;
        k->left = 0;
        if (k->chunked) {
            k->body = B_CHUNK;
            return;
        }
        k->body = B_CLOSE; /* another last coding: the body runs to the close */
        k->close_after = true;
        return;
    }
    if (k->have_length) {
        k->body = B_LENGTH;
        return;
    }
    k->body = B_CLOSE;
    k->close_after = true;
}

static bool h1_list_has(const char *v, size_t n, const char *token)
{
    size_t tl = strlen(token);
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        size_t s = i;
        while (i < n && v[i] != ',')
            i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e - s == tl && strncasecmp(v + s, token, tl) == 0)
            return true;
    }
    return false;
}

/* The framing headers of the head being read. false: malformed (a bad or conflicting Content-Length). */
static bool h1_framing_header(struct h1_conn *k, const char *p, size_t len)
{
    size_t nl, vl;
    const char *v;
    if (!up_header_split(p, len, &nl, &v, &vl))
        return true;
    if (nl == 14 && strncasecmp(p, "Content-Length", 14) == 0) {
        if (!up_content_length(v, vl, &k->have_length, &k->left))
            return false;
    } else if (nl == 17 && strncasecmp(p, "Transfer-Encoding", 17) == 0) {
        /* chunked when it is the last coding (of the last such line) */
        size_t e = vl;
        while (e > 0 && v[e - 1] != ',')
            e--;
        const char *last = v + e;
        size_t ll = vl - e;
        while (ll > 0 && (*last == ' ' || *last == '\t')) {
            last++;
            ll--;
        }
        k->have_te = true;
        k->chunked = ll == 7 && strncasecmp(last, "chunked", 7) == 0;
    } else if (nl == 10 && strncasecmp(p, "Connection", 10) == 0) {
        if (h1_list_has(v, vl, "close"))
            k->close_after = true;
        if (h1_list_has(v, vl, "keep-alive"))
            k->keep_alive = true;
    } else if (nl == 10 && strncasecmp(p, "Keep-Alive", 10) == 0) {
        int64_t hint = h1_keepalive_hint(v, vl); /* several headers: the smallest */
        if (hint >= 0 && (k->ka_hint_ms < 0 || hint < k->ka_hint_ms))
            k->ka_hint_ms = hint;
    }
    return true;
}

/* The server's "timeout=N" (seconds) of a Keep-Alive value (RFC 2068 19.7.1.1; Apache, node and evhttp send it),
 * in ms: the smallest when it names several, 0 included (the server closes an idle connection at once); -1 when
 * none is well formed: a parameter "timeout" (any case) at the start of a list element, "=", 1 to 6 significant
 * digits, then the element's end. A malformed one is ignored, which leaves the configured keepalive_timeout. */
static int64_t h1_keepalive_hint(const char *v, size_t n)
{
    int64_t best = -1;
    for (size_t i = 0; i + 8 <= n; i++) {
        if (!(i == 0 || v[i - 1] == ' ' || v[i - 1] == ',' || v[i - 1] == ';' || v[i - 1] == '\t') ||
            strncasecmp(v + i, "timeout=", 8) != 0)
            continue;
        size_t s = i + 8, e;
        while (s + 1 < n && v[s] == '0' && v[s + 1] >= '0' && v[s + 1] <= '9')
            s++; /* leading zeros */
        for (e = s; e < n && v[e] >= '0' && v[e] <= '9';)
            e++;
        uint64_t secs;
        bool ends = e == n || v[e] == ',' || v[e] == ';' || v[e] == ' ' || v[e] == '\t';
        if (e > s && ends && cm_parse_digits(v + s, e - s, 6, &secs) && (best < 0 || (int64_t)secs * 1000 < best))
            best = (int64_t)secs * 1000;
        i = e - 1;
    }
    return best;
}

/* How long idle k may be reused under keepalive_timeout keepalive_ms (0: the default), and less than the server
 * announced (it closes at that moment, and a request crossing its close ends as an unknown outcome): a second
 * less, or half of one under 2 s. */
static uint64_t h1_reuse_limit_ms(uint64_t keepalive_ms, const struct h1_conn *k)
{
    uint64_t lim = keepalive_ms > 0 ? keepalive_ms : (uint64_t)UP_MAX_IDLE_REUSE_S * 1000;
    if (k->server_idle_ms >= 0) {
        uint64_t srv = (uint64_t)(k->server_idle_ms >= 2000 ? k->server_idle_ms - 1000 : k->server_idle_ms / 2);
        if (srv < lim)
            lim = srv;
    }
    return lim;
}

/* Finds the next line in buf[pos..len): its start and length without CR LF (a bare LF ends a line too).
 * false: no full line yet. */
static bool h1_line(struct h1_conn *k, const char **line, size_t *n)
{
    const char *s = k->buf + k->pos;
    const char *nl = memchr(s, '\n', k->len - k->pos);
    if (nl == NULL)
        return false;
    size_t l = (size_t)(nl - s);
    k->pos += l + 1;
    if (l > 0 && s[l - 1] == '\r')
        l--;
    *line = s;
    *n = l;
    return true;
}

enum h1_step { STEP_MORE, STEP_DONE, STEP_ERROR, STEP_TOO_LARGE, STEP_INVALID };

/* Moves buffered body bytes to the response: up to k->left of them (counted), or all. false: over the cap. */
static bool h1_take(struct h1_conn *k, struct h1_xfer *t, bool counted)
{
    size_t take = k->len - k->pos;
    if (counted && take > k->left)
        take = (size_t)k->left;
    if (take > 0 && !cm_buf_append(&t->b.resp.body, k->buf + k->pos, take))
        return false;
    k->pos += take;
    if (counted)
        k->left -= take;
    return true;
}

/* Parses what is buffered. STEP_MORE: needs more bytes (or the close, for B_CLOSE). */
static enum h1_step h1_parse(struct h1_conn *k, struct h1_xfer *t, const char **err)
{
    const char *line;
    size_t n;
    for (;;) {
        switch (k->body) {
        case B_HEAD:
            if (!h1_line(k, &line, &n)) {
                if (t->b.hdr_bytes + (k->len - k->pos) > t->b.max_head) {
                    up_invalid(&t->b, "response head over max_response_header_bytes");
                    return STEP_INVALID;
                }
                return STEP_MORE;
            }
            if (k->want_status) {
                if (!up_status_form_ok(line, n)) {
                    *err = "malformed status line";
                    return STEP_ERROR;
                }
                k->want_status = false;
                k->http10 = line[7] == '0';
                if (!up_status_line(&t->b, line, n))
                    return STEP_INVALID;
                continue;
            }
            if (n == 0) {
                int st = t->b.resp.status;
                if (st >= 100 && st < 200) {
                    if (st == 101) {
                        *err = "unexpected 101 Switching Protocols";
                        return STEP_ERROR;
                    }
                    /* an interim response: the final head follows (its status line starts the head over) */
                    h1_head_reset(k);
                    continue;
                }
                (void)up_header_line(&t->b, line, 0);
                h1_frame(k, t);
                continue;
            }
            if (!up_header_line(&t->b, line, n))
                return STEP_INVALID;
            if (!h1_framing_header(k, line, n)) {
                *err = "malformed Content-Length";
                return STEP_ERROR;
            }
            break;
        case B_LENGTH:
            if (!h1_take(k, t, true))
                return STEP_TOO_LARGE;
            return k->left == 0 ? STEP_DONE : STEP_MORE;
        case B_CLOSE:
            return h1_take(k, t, false) ? STEP_MORE : STEP_TOO_LARGE;
        case B_CHUNK: {
            if (!h1_line(k, &line, &n)) {
                if (k->len - k->pos > H1_MAX_CHUNK_LINE) {
                    *err = "malformed chunk size";
                    return STEP_ERROR;
                }
                return STEP_MORE;
            }
            uint64_t x = 0;
            size_t i = 0;
            for (; i < n; i++) {
                char ch = line[i];
                int lc = ch | 0x20;
                int d = ch >= '0' && ch <= '9' ? ch - '0' : lc >= 'a' && lc <= 'f' ? lc - 'a' + 10 : -1;
                if (d < 0)
                    break;
                if (i >= 15) {
                    *err = "chunk size too large";
                    return STEP_ERROR;
                }
                x = x * 16 + (uint64_t)d;
            }
            if (i == 0 || (i < n && line[i] != ';' && line[i] != ' ' && line[i] != '\t')) {
                *err = "malformed chunk size";
                return STEP_ERROR;
            }
            if (x == 0) {
                k->body = B_TRAILER;
                k->left = 0;
            } else {
                k->body = B_DATA;
                k->left = x;
            }
            break;
        }
        case B_DATA:
            if (!h1_take(k, t, true))
                return STEP_TOO_LARGE;
            if (k->left > 0)
                return STEP_MORE;
            k->body = B_DATA_END;
            break;
        case B_DATA_END:
            if (!h1_line(k, &line, &n))
                return k->len - k->pos > 2 ? (*err = "malformed chunk end", STEP_ERROR) : STEP_MORE;
            if (n != 0) {
                *err = "malformed chunk end";
                return STEP_ERROR;
            }
            k->body = B_CHUNK;
            break;
        case B_TRAILER:
            if (!h1_line(k, &line, &n)) {
                if (k->len - k->pos > UP_MAX_HEADER_BYTES)
                    return STEP_TOO_LARGE;
                return STEP_MORE;
            }
            k->left += n;
            if (k->left > UP_MAX_HEADER_BYTES)
                return STEP_TOO_LARGE;
            if (n == 0)
                return STEP_DONE;
            break;
        }
    }
}

/* Makes room for more bytes in k->buf: a buffer when it has none (a spare of the client's if there is one), else the
 * parsed part moved out first, then the buffer doubled. It grows only while
 * h1_parse waits for the end of a line, which its caps bound (the head, a chunk-size line, the trailers). */
static void h1_buf_room(struct h1_conn *k)
{
    if (k->cap == 0) {
        struct up_h1 *h = k->c != NULL ? h1_of(k->c) : NULL; /* none: a standalone h1_parser */
        k->buf = h != NULL && h->spare_n > 0 ? h->spare_buf[--h->spare_n] : cm_malloc(UP_RECV_BUFFER);
        k->cap = UP_RECV_BUFFER;
        return;
    }
    if (k->len < k->cap)
        return;
    if (k->pos > 0) {
        memmove(k->buf, k->buf + k->pos, k->len - k->pos);
        k->len -= k->pos;
        k->pos = 0;
    }
    if (k->len == k->cap) {
        size_t ncap = k->cap * 2;
        k->buf = cm_realloc(k->buf, ncap);
        k->cap = ncap;
    }
}

/* k is between responses: its buffer goes back to the client's spares (one grown for a large head is freed). */
static void h1_buf_put(struct up_client *c, struct h1_conn *k)
{
    struct up_h1 *h = h1_of(c);
    if (k->cap == (size_t)UP_RECV_BUFFER && h->spare_n < H1_SPARE_BUFS)
        h->spare_buf[h->spare_n++] = k->buf;
    else
        free(k->buf);
    k->buf = NULL;
    k->cap = 0;
}

/* The response on k is complete: the connection goes idle (or to a waiting transfer) or closes; then t's
 * callback runs. */
static void h1_complete(struct up_client *c, struct h1_conn *k, struct h1_xfer *t)
{
    bool reuse = !k->close_after && k->pos == k->len && t->wpos == t->wlen;
    k->t = NULL;
    t->conn = NULL;
    event_del(t->timer);
    struct h1_origin *o = k->o;
    if (reuse && h1_of(c)->idle_n < (c->max_host > 0 ? (size_t)c->max_host * 4 : H1_MAX_IDLE)) {
        k->requests++;
        if (k->ka_hint_ms >= 0)
            k->server_idle_ms = k->ka_hint_ms;
        k->pos = k->len = 0;
        h1_buf_put(c, k);
        k->idle_since_ms = cm_now_ms();
        k->prev = NULL;
        k->next = o->idle;
        if (o->idle != NULL)
            o->idle->prev = k;
        o->idle = k;
        /* The sweep is pending whenever a connection is idle (it re-arms itself while any is): only the first
         * idle one arms it, so a busy loop's completions do not each ask libevent (a locked call). */
        if (++h1_of(c)->idle_n == 1)
            h1_sweep_arm(h1_of(c), H1_SWEEP_MS);
    } else {
        h1_conn_close(c, k);
    }
    h1_pump(c, o);
    up_deliver(c, &t->b, UP_OK, "ok");
}

static void h1_on_read(evutil_socket_t fd, short what, void *arg)
{
    struct h1_conn *k = arg;
    struct up_client *c = k->c;
    struct h1_xfer *t = k->t;
    if (t == NULL) {
        /* an idle connection became readable: the server closed it (or sent what nobody asked for) */
        h1_conn_close(c, k);
        return;
    }
    h1_buf_room(k);
    ssize_t r = recv(fd, k->buf + k->len, k->cap - k->len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (r <= 0) {
        if (r == 0 && k->body == B_CLOSE) {
            h1_drop_conn(c, t);
            event_del(t->timer);
            up_deliver(c, &t->b, UP_OK, "ok");
            return;
        }
        if (t->got_any) {
            h1_fail(c, t, UP_NO_RESPONSE,
                    r == 0 ? "connection closed before the response was complete"
                           : "connection reset before the response was complete");
            return;
        }
        h1_conn_lost(c, t, r == 0 ? "connection closed without a response" : "connection reset without a response");
        return;
    }
    k->len += (size_t)r;
    t->got_any = true;
    const char *err = "malformed response";
    switch (h1_parse(k, t, &err)) {
    case STEP_MORE:
        if (k->pos == k->len)
            k->pos = k->len = 0;
        return;
    case STEP_DONE:
        h1_complete(c, k, t);
        return;
    case STEP_TOO_LARGE:
        t->b.too_large = true;
        h1_fail(c, t, UP_TOO_LARGE, "response over its cap");
        return;
    case STEP_ERROR:
        h1_fail(c, t, UP_ERROR, err);
        return;
    case STEP_INVALID:
        h1_fail(c, t, UP_INVALID_RESPONSE, t->b.invalid_why);
        return;
    }
}

/* ---- the idle sweep */

/* Arms the sweep in ms unless it is already pending (it re-arms itself while connections stay idle). */
static void h1_sweep_arm(struct up_h1 *h, unsigned ms)
{
    if (h->sweep == NULL || evtimer_pending(h->sweep, NULL))
        return;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000};
    evtimer_add(h->sweep, &tv);
}

/* Closes idle connections past their reuse limit, as nginx's keepalive timer does, so that a request never pays
 * for the close of connections that expired while the loop was quiet: a wave after a pause longer than
 * keepalive_timeout would otherwise close every stale connection in its first dispatch, one close() and the
 * server's FIN each, before it connects. At most H1_SWEEP_SLICE per run; the reuse check in h1_dispatch stays
 * (a connection can expire between two sweeps). */
static void h1_sweep(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    struct up_h1 *h = arg;
    uint64_t now = cm_now_ms();
    size_t closed = 0;
    for (size_t i = 0; i < h->origins_n && closed < H1_SWEEP_SLICE; i++) {
        struct h1_origin *o = h->origins[i];
        struct h1_conn *k = o->idle;
        while (k != NULL && closed < H1_SWEEP_SLICE) {
            struct h1_conn *next = k->next;
            if (now - k->idle_since_ms >= h1_reuse_limit_ms(o->keepalive_ms, k)) {
                h1_conn_close(h->c, k);
                closed++;
            }
            k = next;
        }
    }
    if (h->idle_n > 0)
        h1_sweep_arm(h, closed == H1_SWEEP_SLICE ? H1_SWEEP_NEXT : H1_SWEEP_MS);
}

/* ---- the backend table */

static struct h1_xfer *h1_transfer_get(struct up_client *c)
{
    struct up_h1 *h = h1_of(c);
    struct up_transfer *pooled = h->pool;
    if (pooled != NULL) {
        h->pool = pooled->next;
        h->pool_n--;
        pooled->next = NULL;
        return (struct h1_xfer *)pooled;
    }
    struct h1_xfer *t;
    t = cm_calloc(1, sizeof *t);
    t->b.be = &up_h1_backend;
    t->b.bs = h;
    t->timer = evtimer_new(c->base, h1_on_timer, t);
    if (t->timer == NULL) {
        free(t);
        return NULL;
    }
    return t;
}

static void h1_release(void *state, struct up_transfer *bt, bool pool)
{
    struct up_h1 *h = state;
    struct h1_xfer *t = (struct h1_xfer *)bt;
    cm_resp_free(&t->b.resp);
    event_del(t->timer);
    up_trim_buf(&t->hdr_mem, &t->hdr_cap);
    if (pool && up_pool_put(h->c, &h->pool, &h->pool_n, &t->b))
        return;
    event_free(t->timer);
    free(t->hdr_mem);
    free(t);
}

static void *h1_create(struct up_client *c)
{
    struct up_h1 *h = cm_calloc(1, sizeof *h);
    h->c = c;
    h->sweep = evtimer_new(c->base, h1_sweep, h); /* NULL: no sweep; the reuse check still closes stale ones */
    return h;
}

static struct up_transfer *h1_send(void *state, const struct up_request *req, bool head, bool with_body, up_done_cb cb,
                                   void *arg, bool *taken)
{
    struct up_h1 *h = state;
    struct up_client *c = h->c;
    *taken = false;
    if (req->origin->https || !req->origin->ip_literal)
        return NULL;
    struct h1_origin *o = h1_origin_get(h, req->origin);
    if (o == NULL)
        return NULL;
    *taken = true;
    o->max = req->max_connections > 0 ? req->max_connections : (size_t)c->max_host;
    o->keepalive_ms = req->keepalive_ms;
    struct h1_xfer *t = h1_transfer_get(c);
    if (t == NULL)
        return NULL;
    if (!h1_build(t, req, o, req->target, with_body)) {
        cm_log(CM_WARN, "upstream_send_failed", "step=headers");
        h1_release(h, &t->b, true);
        return NULL;
    }
    t->origin = o;
    t->conn = NULL;
    t->is_head = head;
    t->sent_any = t->got_any = false;
    t->sends = 0;
    uint64_t now = cm_now_ms();
    t->deadline_ms = req->timeout_ms > 0 ? now + req->timeout_ms : 0;
    t->connect_timeout_ms = req->connect_timeout_ms > 0 ? req->connect_timeout_ms : H1_DEFAULT_CONNECT_MS;
    t->keepalive_ms = req->keepalive_ms;
    up_transfer_begin(c, &t->b, req, cb, arg);
    h->sync++;
    h1_dispatch(c, t);
    h->sync--;
    return &t->b;
}

static void h1_cancel(void *state, struct up_transfer *bt)
{
    struct up_h1 *h = state;
    struct h1_xfer *t = (struct h1_xfer *)bt;
    event_del(t->timer);
    if (t->phase == H1_QUEUED && t->conn == NULL) {
        h1_waitq_remove(t->origin, t);
        return;
    }
    h->sync++;
    h1_drop_conn(h->c, t);
    h->sync--;
}

static void h1_destroy(void *state)
{
    struct up_h1 *h = state;
    if (h->sweep != NULL)
        event_free(h->sweep);
    for (size_t i = 0; i < h->origins_n; i++) {
        struct h1_origin *o = h->origins[i];
        while (o->idle != NULL)
            h1_conn_close(h->c, o->idle);
        free(o->host);
        free(o->host_hdr);
        free(o);
    }
    free(h->origins);
    for (size_t i = 0; i < h->spare_n; i++)
        free(h->spare_buf[i]);
    while (h->pool != NULL) {
        struct up_transfer *pooled = h->pool;
        h->pool = pooled->next;
        h1_release(h, pooled, false);
    }
    free(h);
}

const struct up_backend up_h1_backend = {
    .name = "h1",
    .create = h1_create,
    .send = h1_send,
    .cancel = h1_cancel,
    .release = h1_release,
    .destroy = h1_destroy,
};

/* ---- the parser without a socket (tests/fuzz/fuzz_h1.c): the same h1_parse and buffer as a connection */

struct h1_parser {
    struct h1_conn k;
    struct h1_xfer t;
    int result; /* 0 while more is wanted, then the final h1_parser_feed result */
};

struct h1_parser *h1_parser_create(bool head, size_t max_body, size_t max_head)
{
    struct h1_parser *p = cm_calloc(1, sizeof *p);
    p->k.fd = -1;
    p->k.t = &p->t;
    h1_head_reset(&p->k);
    p->t.is_head = head;
    p->t.b.max_head = max_head > 0 ? max_head : UP_DEFAULT_MAX_HEAD;
    cm_resp_init(&p->t.b.resp, max_body);
    return p;
}

int h1_parser_feed(struct h1_parser *p, const void *data, size_t n, bool eof)
{
    const char *d = data, *err = NULL;
    while (p->result == 0 && n > 0) {
        h1_buf_room(&p->k);
        size_t take = n < p->k.cap - p->k.len ? n : p->k.cap - p->k.len;
        memcpy(p->k.buf + p->k.len, d, take);
        p->k.len += take;
        d += take;
        n -= take;
        switch (h1_parse(&p->k, &p->t, &err)) {
        case STEP_MORE:
            if (p->k.pos == p->k.len)
                p->k.pos = p->k.len = 0;
            break;
        case STEP_DONE:
            p->result = 1;
            break;
        default:
            p->result = -1;
            break;
        }
    }
    if (p->result == 0 && eof)
        p->result = p->k.body == B_CLOSE ? 1 : -1; /* as h1_on_read on a close */
    return p->result;
}

const struct cm_resp *h1_parser_resp(const struct h1_parser *p)
{
    return &p->t.b.resp;
}

size_t h1_parser_head_bytes(const struct h1_parser *p)
{
    return p->t.b.hdr_bytes;
}

void h1_parser_destroy(struct h1_parser *p)
{
    if (p == NULL)
        return;
    cm_resp_free(&p->t.b.resp);
    free(p->k.buf);
    free(p);
}
