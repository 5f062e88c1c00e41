/* testupstream.c - a single-threaded libevent (evhttp) test upstream that counts executions per idempotency key and
 * can delay, echo, send large binary or chunked bodies, or close/reset the connection without answering. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/bufferevent_ssl.h>
#include <event2/util.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "tests/tools/body_pattern.h"

/*
 * Request headers understood (on every path not under /_test/, each one an "execution"):
 *   X-Test-Delay-Ms: N     answer after N ms (overrides --delay-ms)
 *   X-Test-Status: N       status code (default 200)
 *   X-Test-Action: close   count, then close the connection without answering (FIN)
 *   X-Test-Action: reset   count, then reset the connection without answering (RST)
 *   X-Test-Action: lost    close without answering and without counting (the request never executed)
 *   X-Test-Body-Size: N    answer N bytes of test_body_byte() (body_pattern.h) instead of the echo
 *   X-Test-Chunked: 1      answer with Transfer-Encoding: chunked
 *   X-Test-Header: N: V    add the response header "N: V" (repeatable, in order)
 *   X-Test-Header-Bytes: N add about N bytes of response headers (X-Pad-1: aaa... lines of about 90 bytes)
 *   X-Test-Keep-Alive: V   the response's Keep-Alive value instead of timeout=5 (empty: no Keep-Alive header)
 *   X-Test-Commit: end     the write is applied when its answer goes out (after the delay), not when it arrives:
 *                          until then the key counts nothing and the look-up says it did not execute (an API that
 *                          shows committed work only)
 *   X-Sequence: N          the write applies sequence N to its path (when it is applied, see X-Test-Commit); one
 *                          lower than the path's highest applied one is an order violation (a lost update)
 * A HEAD answer carries the Content-Length its GET would have.
 * Default body: the request body echoed, or {"ok":true,"exec":N} when it is empty.
 *
 * Response headers on each execution: X-Upstream-Exec, X-Echo-Method, X-Echo-Uri, X-Conn-Id, Set-Cookie: a=1,
 * Set-Cookie: b=2, X-Multi: one, X-Multi: two, and the hop-by-hop ones a gateway must strip:
 * Connection: keep-alive, X-Hop / X-Hop: secret / Keep-Alive: timeout=5. evhttp (2.1) does not touch a
 * Connection header we set (it only looks whether it equals "close"), so the connection stays persistent.
 *
 * Test endpoints (not counted): GET /_test/count[?key=K], POST /_test/reset, GET /_test/last-headers,
 * GET /_test/health, GET /_test/lookups[?key=K] (how many look-ups were answered, for key K),
 * POST /_test/forget?key=K (key K's executions forgotten: its look-up answers 404, as an API that lost the write),
 * GET /_test/order-violations (writes applied with a lower X-Sequence than their path's highest applied one).
 * Look-up (an API's "find by idempotency key" endpoint, not counted as an execution; its request headers are
 * recorded for /_test/last-headers): GET /_lookup?idempotency_key=K answers 200 {"found":true,"exec":N} when key
 * K executed, 404 {"found":false} when it did not; &status=N forces status N (a failing look-up). A look-up with an
 * Authorization header asks as that tenant, as an API scoping keys per account does: found only when a request
 * with key K and the same Authorization value executed. Every look-up answer sets the cookies lookup=1
 * (Set-Cookie) and lookup2=1 (Set-Cookie2).
 *
 * The binary body: byte i is 0 when i % 64 == 1, else byte (i % 8) (little-endian) of splitmix64(i / 8).
 */

#define TU_MAX_KEYS       1000000u
#define TU_MAX_DELAY_MS   3600000ull
#define TU_MAX_BODY_SIZE  (256ull * 1024 * 1024)
#define TU_MAX_REQ_BODY   (64 * 1024 * 1024)
#define TU_LAST_HDRS_MAX  65536
#define TU_CHUNK          16384
#define TU_CONN_BUCKETS   16384
#define TU_IDLE_TIMEOUT_S 60
#define TU_LOOKUP_PREFIX  "lookup\n" /* a key never holds a newline: look-up counts share the key table */
#define TU_TENANT_PREFIX  "tenant\n" /* executions per (Authorization, key): "tenant\nAUTH\nKEY" */
#define TU_TENANT_KEY_MAX 8192
#define TU_SEQ_PREFIX     "seq\n" /* a path's highest applied X-Sequence, in the key table too */

struct tu_key {
    char *key;
    size_t len;
    uint64_t hash;
    uint64_t count;
};

struct tu_conn {
    struct evhttp_connection *evcon;
    uint64_t id;
    uint16_t peer_port;
    struct tu_conn *next;
};

struct tu_pending;

struct tu_server {
    struct event_base *base;
    struct evhttp *http;
    uint64_t default_delay_ms;
    bool quiet;
    uint64_t exec_total;
    uint64_t lookups;          /* GET /_lookup requests answered */
    uint64_t order_violations; /* writes applied below their path's highest applied X-Sequence */
    /* per-key counters: open addressing, grows up to TU_MAX_KEYS entries */
    struct tu_key **keys;
    size_t keys_cap; /* power of two */
    size_t keys_n;
    bool keys_full_logged;
    /* per-TCP-connection ids */
    struct tu_conn *conns[TU_CONN_BUCKETS];
    uint64_t conn_seq;
    /* headers of the last execution, "Name: value\n" each */
    char *last_hdrs;
    size_t last_hdrs_len;
    /* replies waiting on a timer */
    struct tu_pending *pending;
};

enum tu_action { TU_ACT_REPLY, TU_ACT_CLOSE, TU_ACT_RESET };

struct tu_pending {
    struct tu_server *srv;
    struct evhttp_request *req;
    struct event *timer;
    enum tu_action action;
    struct tu_pending *prev, *next;
};

static bool tu_quiet; /* --quiet: errors only */

static void tu_log(const char *event, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void tu_log(const char *event, const char *fmt, ...)
{
    struct timespec ts;
    struct tm tm;
    char tbuf[32];
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
    char line[1024];
    int n = snprintf(line, sizeof line, "ts=%s.%03ldZ level=info app=testupstream event=%s ", tbuf,
                     ts.tv_nsec / 1000000, event);
    if (n < 0 || (size_t)n >= sizeof line)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}

static void *tu_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "event=oom size=%zu\n", n);
        abort();
    }
    return p;
}

static void *tu_xcalloc(size_t a, size_t b)
{
    void *p = calloc(a ? a : 1, b ? b : 1);
    if (p == NULL) {
        fprintf(stderr, "event=oom\n");
        abort();
    }
    return p;
}

/* Parses a decimal unsigned number (the whole string); false when malformed or over max. */
static bool tu_parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (s == NULL || *s < '0' || *s > '9')
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v > max)
        return false;
    *out = v;
    return true;
}

static uint64_t tu_hash(const char *p, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ---- per-key counters */

static struct tu_key **tu_key_slot(struct tu_key **tab, size_t cap, const char *k, size_t n, uint64_t h)
{
    size_t i = (size_t)h & (cap - 1);
    for (size_t probes = 0; probes < cap; probes++) {
        struct tu_key *e = tab[i];
        if (e == NULL || (e->hash == h && e->len == n && memcmp(e->key, k, n) == 0))
            return &tab[i];
        i = (i + 1) & (cap - 1);
    }
    return NULL; /* not reached: load factor stays under 3/4 */
}

static void tu_keys_grow(struct tu_server *s)
{
    size_t ncap = s->keys_cap ? s->keys_cap * 2 : 1024;
    struct tu_key **ntab = tu_xcalloc(ncap, sizeof *ntab);
    for (size_t i = 0; i < s->keys_cap; i++) {
        struct tu_key *e = s->keys[i];
        if (e != NULL)
            *tu_key_slot(ntab, ncap, e->key, e->len, e->hash) = e;
    }
    free(s->keys);
    s->keys = ntab;
    s->keys_cap = ncap;
}

static void tu_keys_clear(struct tu_server *s)
{
    for (size_t i = 0; i < s->keys_cap; i++)
        if (s->keys[i] != NULL) {
            free(s->keys[i]->key);
            free(s->keys[i]);
        }
    free(s->keys);
    s->keys = NULL;
    s->keys_cap = 0;
    s->keys_n = 0;
    s->keys_full_logged = false;
}

static void tu_key_count(struct tu_server *s, const char *k)
{
    size_t n = strlen(k);
    uint64_t h = tu_hash(k, n);
    if (s->keys_cap == 0 || (s->keys_n + 1) * 4 > s->keys_cap * 3)
        tu_keys_grow(s);
    struct tu_key **slot = tu_key_slot(s->keys, s->keys_cap, k, n, h);
    if (*slot != NULL) {
        (*slot)->count++;
        return;
    }
    if (s->keys_n >= TU_MAX_KEYS) {
        if (!s->keys_full_logged)
            tu_log("keys_full", "max=%u note=\"further new keys are only counted in the total\"", TU_MAX_KEYS);
        s->keys_full_logged = true;
        return;
    }
    struct tu_key *e = tu_xcalloc(1, sizeof *e);
    e->key = tu_xmalloc(n + 1);
    memcpy(e->key, k, n + 1);
    e->len = n;
    e->hash = h;
    e->count = 1;
    *slot = e;
    s->keys_n++;
}

static uint64_t tu_key_get(struct tu_server *s, const char *k)
{
    if (s->keys_cap == 0)
        return 0;
    size_t n = strlen(k);
    struct tu_key **slot = tu_key_slot(s->keys, s->keys_cap, k, n, tu_hash(k, n));
    return (slot != NULL && *slot != NULL) ? (*slot)->count : 0;
}

/* Raises k's value to v; returns the value it had (0: none). */
static uint64_t tu_key_max(struct tu_server *s, const char *k, uint64_t v)
{
    uint64_t old = tu_key_get(s, k);
    if (old == 0)
        tu_key_count(s, k); /* now 1 */
    if (v > old && s->keys_cap != 0) {
        size_t n = strlen(k);
        struct tu_key **slot = tu_key_slot(s->keys, s->keys_cap, k, n, tu_hash(k, n));
        if (slot != NULL && *slot != NULL)
            (*slot)->count = v;
    }
    return old;
}

/* ---- connection ids: keyed by the evhttp_connection, checked against the peer port in case a close callback
 * was missed and the pointer got reused */

static size_t tu_conn_bucket(const struct evhttp_connection *evcon)
{
    return (size_t)(test_splitmix64((uint64_t)(uintptr_t)evcon) & (TU_CONN_BUCKETS - 1));
}

static void tu_conn_closed(struct evhttp_connection *evcon, void *arg)
{
    struct tu_server *s = arg;
    struct tu_conn **pp = &s->conns[tu_conn_bucket(evcon)];
    while (*pp != NULL) {
        if ((*pp)->evcon == evcon) {
            struct tu_conn *c = *pp;
            *pp = c->next;
            free(c);
            return;
        }
        pp = &(*pp)->next;
    }
}

static uint64_t tu_conn_id(struct tu_server *s, struct evhttp_connection *evcon)
{
    char *addr = NULL;
    ev_uint16_t port = 0;
    evhttp_connection_get_peer(evcon, &addr, &port);
    size_t b = tu_conn_bucket(evcon);
    for (struct tu_conn *c = s->conns[b]; c != NULL; c = c->next)
        if (c->evcon == evcon) {
            if (c->peer_port != port) {
                c->peer_port = port;
                c->id = ++s->conn_seq;
            }
            return c->id;
        }
    struct tu_conn *c = tu_xcalloc(1, sizeof *c);
    c->evcon = evcon;
    c->id = ++s->conn_seq;
    c->peer_port = port;
    c->next = s->conns[b];
    s->conns[b] = c;
    evhttp_connection_set_closecb(evcon, tu_conn_closed, s);
    return c->id;
}

static void tu_conns_clear(struct tu_server *s)
{
    for (size_t b = 0; b < TU_CONN_BUCKETS; b++) {
        while (s->conns[b] != NULL) {
            struct tu_conn *c = s->conns[b];
            s->conns[b] = c->next;
            free(c);
        }
    }
}

/* ---- replies */

static const char *tu_method_name(enum evhttp_cmd_type cmd)
{
    switch (cmd) {
    case EVHTTP_REQ_GET:
        return "GET";
    case EVHTTP_REQ_POST:
        return "POST";
    case EVHTTP_REQ_HEAD:
        return "HEAD";
    case EVHTTP_REQ_PUT:
        return "PUT";
    case EVHTTP_REQ_DELETE:
        return "DELETE";
    case EVHTTP_REQ_OPTIONS:
        return "OPTIONS";
    case EVHTTP_REQ_TRACE:
        return "TRACE";
    case EVHTTP_REQ_CONNECT:
        return "CONNECT";
    case EVHTTP_REQ_PATCH:
        return "PATCH";
    }
    return "UNKNOWN";
}

static void tu_reply_text(struct evhttp_request *req, int code, const char *ctype, const char *text)
{
    struct evbuffer *b = evbuffer_new();
    if (b == NULL) {
        evhttp_send_error(req, 500, NULL);
        return;
    }
    evbuffer_add(b, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", ctype);
    evhttp_send_reply(req, code, NULL, b);
    evbuffer_free(b);
}

static bool tu_status_has_body(int code, enum evhttp_cmd_type cmd)
{
    return cmd != EVHTTP_REQ_HEAD && code >= 200 && code != 204 && code != 304;
}

#define TU_MAX_HEADER_BYTES (1024 * 1024)

/* X-Test-Header and X-Test-Header-Bytes of the request, as response headers. */
static void tu_extra_headers(struct evkeyvalq *in, struct evkeyvalq *out)
{
    struct evkeyval *kv;
    TAILQ_FOREACH(kv, in, next)
    {
        if (strcasecmp(kv->key, "X-Test-Header") != 0)
            continue;
        const char *colon = strchr(kv->value, ':');
        if (colon == NULL || colon == kv->value || colon - kv->value > 128)
            continue;
        char name[129];
        memcpy(name, kv->value, (size_t)(colon - kv->value));
        name[colon - kv->value] = '\0';
        const char *v = colon + 1;
        while (*v == ' ')
            v++;
        evhttp_add_header(out, name, v);
    }
    uint64_t bytes = 0;
    const char *hb = evhttp_find_header(in, "X-Test-Header-Bytes");
    if (hb == NULL || !tu_parse_u64(hb, TU_MAX_HEADER_BYTES, &bytes))
        return;
    char val[81];
    memset(val, 'a', sizeof val - 1);
    val[sizeof val - 1] = '\0';
    for (uint64_t i = 1, done = 0; done < bytes; i++) {
        char name[32];
        int nl = snprintf(name, sizeof name, "X-Pad-%" PRIu64, i);
        size_t line = (size_t)nl + 2 + (sizeof val - 1) + 2; /* "name: " value CR LF */
        evhttp_add_header(out, name, val);
        done += line;
    }
}

/* Sends the answer of an execution (headers were set when it arrived). */
static void tu_reply_exec(struct evhttp_request *req)
{
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    struct evkeyvalq *out = evhttp_request_get_output_headers(req);
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    uint64_t code = 200;
    const char *st = evhttp_find_header(in, "X-Test-Status");
    if (st != NULL && !tu_parse_u64(st, 599, &code))
        code = 200;
    if (code < 200)
        code = 200; /* evhttp cannot send an interim response as the final one */
    struct evbuffer *body = evbuffer_new();
    if (body == NULL) {
        evhttp_send_error(req, 500, NULL);
        return;
    }
    uint64_t size = 0;
    const char *bs = evhttp_find_header(in, "X-Test-Body-Size");
    bool binary = false;
    if (bs != NULL && tu_parse_u64(bs, TU_MAX_BODY_SIZE, &size)) {
        binary = true;
        uint8_t chunk[TU_CHUNK];
        for (uint64_t off = 0; off < size;) {
            size_t n = (size - off) < TU_CHUNK ? (size_t)(size - off) : TU_CHUNK;
            for (size_t i = 0; i < n; i++)
                chunk[i] = test_body_byte(off + i);
            evbuffer_add(body, chunk, n);
            off += n;
        }
    } else {
        struct evbuffer *reqbody = evhttp_request_get_input_buffer(req);
        if (evbuffer_get_length(reqbody) > 0) {
            binary = true;
            evbuffer_add_buffer(body, reqbody);
        } else {
            evbuffer_add_printf(body, "{\"ok\":true,\"exec\":%s}", evhttp_find_header(out, "X-Upstream-Exec"));
        }
    }
    evhttp_add_header(out, "Content-Type", binary ? "application/octet-stream" : "application/json");
    tu_extra_headers(in, out);
    if (cmd == EVHTTP_REQ_HEAD) { /* evhttp sends no Content-Length for HEAD: say what a GET would get */
        char cl[32];
        snprintf(cl, sizeof cl, "%zu", evbuffer_get_length(body));
        evhttp_add_header(out, "Content-Length", cl);
    }
    if (!tu_status_has_body((int)code, cmd))
        evbuffer_drain(body, evbuffer_get_length(body));
    const char *ch = evhttp_find_header(in, "X-Test-Chunked");
    if (ch != NULL && strcmp(ch, "1") == 0 && tu_status_has_body((int)code, cmd)) {
        evhttp_send_reply_start(req, (int)code, NULL);
        struct evbuffer *piece = evbuffer_new();
        while (piece != NULL && evbuffer_get_length(body) > 0) {
            evbuffer_remove_buffer(body, piece, TU_CHUNK);
            evhttp_send_reply_chunk(req, piece);
        }
        if (piece != NULL)
            evbuffer_free(piece);
        evhttp_send_reply_end(req);
    } else {
        evhttp_send_reply(req, (int)code, NULL, body);
    }
    evbuffer_free(body);
}

/* Closes the request's connection without answering; with rst, the peer gets a RST and no FIN. */
static void tu_drop(struct evhttp_request *req, bool rst)
{
    struct evhttp_connection *evcon = evhttp_request_get_connection(req);
    if (evcon == NULL) {
        /* the client already left and evhttp detached the request: it is ours to free */
        evhttp_request_free(req);
        return;
    }
    if (rst) {
        struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
        evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
        if (fd >= 0) {
            struct linger lg = {.l_onoff = 1, .l_linger = 0};
            (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
            /* evhttp_connection_free shuts the socket down for writing (a FIN) before it closes it. To send
             * only a RST, close the connected socket now by putting an unconnected one in its place: evhttp
             * then shuts down and closes that one (epoll forgot the old one when it was closed). */
            int spare = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (spare >= 0) {
                (void)dup2(spare, fd);
                close(spare);
            }
        }
    }
    evhttp_connection_free(evcon); /* frees req too */
}

static void tu_pending_unlink(struct tu_server *s, struct tu_pending *p)
{
    if (p->prev != NULL)
        p->prev->next = p->next;
    else
        s->pending = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
}

/* The write takes effect: its key counts (the look-up sees it) and its X-Sequence is applied to its path. */
static void tu_apply(struct tu_server *s, struct evhttp_request *req)
{
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    const char *key = evhttp_find_header(in, "Idempotency-Key");
    if (key != NULL)
        tu_key_count(s, key);
    const char *auth = evhttp_find_header(in, "Authorization");
    if (key != NULL && auth != NULL && strlen(auth) + strlen(key) + 16 < TU_TENANT_KEY_MAX) {
        char tk[TU_TENANT_KEY_MAX];
        snprintf(tk, sizeof tk, "%s%s\n%s", TU_TENANT_PREFIX, auth, key);
        tu_key_count(s, tk);
    }
    uint64_t seq = 0;
    const char *sq = evhttp_find_header(in, "X-Sequence");
    const char *uri = evhttp_request_get_uri(req);
    if (sq == NULL || uri == NULL || !tu_parse_u64(sq, UINT64_MAX / 2, &seq) || seq == 0)
        return;
    size_t plen = strcspn(uri, "?");
    if (plen > 1000)
        return;
    char pk[1100];
    snprintf(pk, sizeof pk, "%s%.*s", TU_SEQ_PREFIX, (int)plen, uri);
    uint64_t highest = tu_key_max(s, pk, seq);
    if (seq < highest) {
        s->order_violations++;
        tu_log("order_violation", "seq=%" PRIu64 " highest=%" PRIu64, seq, highest);
    }
}

static bool tu_commit_at_end(struct evhttp_request *req)
{
    const char *c = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Test-Commit");
    return c != NULL && strcmp(c, "end") == 0;
}

static void tu_pending_fire(evutil_socket_t fd, short what, void *arg)
{
    struct tu_pending *p = arg;
    struct tu_server *s = p->srv;
    tu_pending_unlink(s, p);
    event_free(p->timer);
    struct evhttp_request *req = p->req;
    enum tu_action act = p->action;
    free(p);
    const char *a = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Test-Action");
    if (tu_commit_at_end(req) && !(a != NULL && strcmp(a, "lost") == 0))
        tu_apply(s, req);
    if (act == TU_ACT_REPLY)
        tu_reply_exec(req);
    else
        tu_drop(req, act == TU_ACT_RESET);
}

static bool tu_defer(struct tu_server *s, struct evhttp_request *req, enum tu_action act, uint64_t delay_ms)
{
    struct tu_pending *p = tu_xcalloc(1, sizeof *p);
    p->srv = s;
    p->req = req;
    p->action = act;
    p->timer = evtimer_new(s->base, tu_pending_fire, p);
    if (p->timer == NULL) {
        free(p);
        return false;
    }
    struct timeval tv = {.tv_sec = (time_t)(delay_ms / 1000), .tv_usec = (suseconds_t)((delay_ms % 1000) * 1000)};
    if (evtimer_add(p->timer, &tv) != 0) {
        event_free(p->timer);
        free(p);
        return false;
    }
    p->next = s->pending;
    if (s->pending != NULL)
        s->pending->prev = p;
    s->pending = p;
    return true;
}

static void tu_record_headers(struct tu_server *s, struct evkeyvalq *in)
{
    size_t len = 0;
    struct evkeyval *kv;
    TAILQ_FOREACH(kv, in, next)
    len += strlen(kv->key) + strlen(kv->value) + 3;
    if (len > TU_LAST_HDRS_MAX)
        len = TU_LAST_HDRS_MAX;
    char *out = tu_xmalloc(len + 1);
    size_t off = 0;
    TAILQ_FOREACH(kv, in, next)
    {
        int n = snprintf(out + off, len + 1 - off, "%s: %s\n", kv->key, kv->value);
        if (n < 0 || (size_t)n >= len + 1 - off) {
            off = len;
            break;
        }
        off += (size_t)n;
    }
    out[off] = '\0';
    free(s->last_hdrs);
    s->last_hdrs = out;
    s->last_hdrs_len = off;
}

static void tu_handle_exec(struct tu_server *s, struct evhttp_request *req)
{
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    struct evkeyvalq *out = evhttp_request_get_output_headers(req);
    struct evhttp_connection *evcon = evhttp_request_get_connection(req);
    const char *a = evhttp_find_header(in, "X-Test-Action");
    bool lost = a != NULL && strcmp(a, "lost") == 0;
    uint64_t exec = lost ? s->exec_total : ++s->exec_total;
    const char *key = evhttp_find_header(in, "Idempotency-Key");
    tu_record_headers(s, in);

    uint64_t conn = evcon ? tu_conn_id(s, evcon) : 0;
    char num[32];
    snprintf(num, sizeof num, "%" PRIu64, exec);
    evhttp_add_header(out, "X-Upstream-Exec", num);
    evhttp_add_header(out, "X-Echo-Method", tu_method_name(evhttp_request_get_command(req)));
    evhttp_add_header(out, "X-Echo-Uri", evhttp_request_get_uri(req));
    snprintf(num, sizeof num, "%" PRIu64, conn);
    evhttp_add_header(out, "X-Conn-Id", num);
    evhttp_add_header(out, "Set-Cookie", "a=1");
    evhttp_add_header(out, "Set-Cookie", "b=2");
    evhttp_add_header(out, "X-Multi", "one");
    evhttp_add_header(out, "X-Multi", "two");
    evhttp_add_header(out, "Connection", "keep-alive, X-Hop");
    evhttp_add_header(out, "X-Hop", "secret");
    const char *ka = evhttp_find_header(in, "X-Test-Keep-Alive");
    if (ka == NULL || *ka)
        evhttp_add_header(out, "Keep-Alive", ka ? ka : "timeout=5");

    uint64_t delay = s->default_delay_ms;
    const char *d = evhttp_find_header(in, "X-Test-Delay-Ms");
    if (d != NULL && !tu_parse_u64(d, TU_MAX_DELAY_MS, &delay))
        delay = s->default_delay_ms;
    enum tu_action act = TU_ACT_REPLY;
    if (a != NULL && (strcmp(a, "close") == 0 || lost))
        act = TU_ACT_CLOSE;
    else if (a != NULL && strcmp(a, "reset") == 0)
        act = TU_ACT_RESET;
    if (!s->quiet)
        tu_log("exec", "n=%" PRIu64 " method=%s conn=%" PRIu64 " delay_ms=%" PRIu64 " action=%s keyed=%d", exec,
               tu_method_name(evhttp_request_get_command(req)), conn, delay,
               act == TU_ACT_REPLY ? "reply" : (act == TU_ACT_CLOSE ? "close" : "reset"), key != NULL);

    if (!lost && (delay == 0 || !tu_commit_at_end(req)))
        tu_apply(s, req); /* else when its answer goes out (tu_pending_fire) */
    /* a drop always goes through the loop: freeing the connection inside its own read callback is not safe */
    if (delay == 0 && act == TU_ACT_REPLY) {
        tu_reply_exec(req);
        return;
    }
    if (!tu_defer(s, req, act, delay))
        evhttp_send_error(req, 500, "timer");
}

/* GET /_lookup?idempotency_key=K[&status=N]: whether key K executed (see the comment at the top). */
static void tu_handle_lookup(struct tu_server *s, struct evhttp_request *req, const char *query)
{
    tu_record_headers(s, evhttp_request_get_input_headers(req));
    s->lookups++;
    struct evkeyvalq q;
    TAILQ_INIT(&q);
    if (evhttp_request_get_command(req) != EVHTTP_REQ_GET || query == NULL || evhttp_parse_query_str(query, &q) != 0) {
        evhttp_clear_headers(&q);
        tu_reply_text(req, 400, "text/plain", "bad look-up\n");
        return;
    }
    const char *k = evhttp_find_header(&q, "idempotency_key");
    const char *st = evhttp_find_header(&q, "status");
    const char *auth = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    uint64_t executed = 0;
    if (k != NULL && auth == NULL) {
        executed = tu_key_get(s, k);
    } else if (k != NULL && strlen(auth) + strlen(k) + 16 < TU_TENANT_KEY_MAX) {
        char tk[TU_TENANT_KEY_MAX];
        snprintf(tk, sizeof tk, "%s%s\n%s", TU_TENANT_PREFIX, auth, k);
        executed = tu_key_get(s, tk);
    }
    struct evkeyvalq *out = evhttp_request_get_output_headers(req);
    evhttp_add_header(out, "Set-Cookie", "lookup=1");
    evhttp_add_header(out, "Set-Cookie2", "lookup2=1");
    if (k != NULL && strlen(k) < 1024) {
        char lk[1100];
        snprintf(lk, sizeof lk, "%s%s", TU_LOOKUP_PREFIX, k); /* per-key look-ups, apart from executions */
        tu_key_count(s, lk);
    }
    uint64_t forced = 0;
    char body[64];
    if (st != NULL && tu_parse_u64(st, 599, &forced) && forced >= 200) {
        tu_reply_text(req, (int)forced, "application/json", "{\"error\":\"look-up failed\"}");
    } else if (executed > 0) {
        snprintf(body, sizeof body, "{\"found\":true,\"exec\":%" PRIu64 "}", executed);
        tu_reply_text(req, 200, "application/json", body);
    } else {
        tu_reply_text(req, 404, "application/json", "{\"found\":false}");
    }
    evhttp_clear_headers(&q);
}

static void tu_handle_test(struct tu_server *s, struct evhttp_request *req, const char *path, const char *query)
{
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    char num[32];
    if (strcmp(path, "/_test/health") == 0) {
        tu_reply_text(req, 200, "text/plain", "ok\n");
    } else if (strcmp(path, "/_test/count") == 0 && cmd == EVHTTP_REQ_GET) {
        uint64_t v = s->exec_total;
        if (query != NULL) {
            struct evkeyvalq q;
            TAILQ_INIT(&q);
            if (evhttp_parse_query_str(query, &q) != 0) {
                evhttp_clear_headers(&q);
                tu_reply_text(req, 400, "text/plain", "bad query\n");
                return;
            }
            const char *k = evhttp_find_header(&q, "key");
            if (k != NULL)
                v = tu_key_get(s, k);
            evhttp_clear_headers(&q);
        }
        snprintf(num, sizeof num, "%" PRIu64, v);
        tu_reply_text(req, 200, "text/plain", num);
    } else if (strcmp(path, "/_test/lookups") == 0 && cmd == EVHTTP_REQ_GET) {
        uint64_t v = s->lookups;
        struct evkeyvalq q;
        TAILQ_INIT(&q);
        if (query != NULL && evhttp_parse_query_str(query, &q) == 0 && evhttp_find_header(&q, "key") != NULL &&
            strlen(evhttp_find_header(&q, "key")) < 1024) {
            char lk[1100];
            snprintf(lk, sizeof lk, "%s%s", TU_LOOKUP_PREFIX, evhttp_find_header(&q, "key"));
            v = tu_key_get(s, lk);
        }
        evhttp_clear_headers(&q);
        snprintf(num, sizeof num, "%" PRIu64, v);
        tu_reply_text(req, 200, "text/plain", num);
    } else if (strcmp(path, "/_test/order-violations") == 0 && cmd == EVHTTP_REQ_GET) {
        snprintf(num, sizeof num, "%" PRIu64, s->order_violations);
        tu_reply_text(req, 200, "text/plain", num);
    } else if (strcmp(path, "/_test/reset") == 0 && cmd == EVHTTP_REQ_POST) {
        s->exec_total = 0;
        s->order_violations = 0;
        s->lookups = 0;
        tu_keys_clear(s);
        free(s->last_hdrs);
        s->last_hdrs = NULL;
        s->last_hdrs_len = 0;
        tu_reply_text(req, 200, "text/plain", "0");
    } else if (strcmp(path, "/_test/forget") == 0 && cmd == EVHTTP_REQ_POST && query != NULL) {
        /* an API that lost a write: key K's executions are forgotten, its look-up says 404 from now on */
        struct evkeyvalq q;
        TAILQ_INIT(&q);
        const char *k = evhttp_parse_query_str(query, &q) == 0 ? evhttp_find_header(&q, "key") : NULL;
        struct tu_key **slot =
            k && s->keys_cap ? tu_key_slot(s->keys, s->keys_cap, k, strlen(k), tu_hash(k, strlen(k))) : NULL;
        if (slot && *slot)
            (*slot)->count = 0;
        evhttp_clear_headers(&q);
        tu_reply_text(req, k ? 200 : 400, "text/plain", k ? "0" : "key?\n");
    } else if (strcmp(path, "/_test/last-headers") == 0 && cmd == EVHTTP_REQ_GET) {
        tu_reply_text(req, 200, "text/plain", s->last_hdrs ? s->last_hdrs : "");
    } else {
        tu_reply_text(req, 404, "text/plain", "unknown test endpoint\n");
    }
}

static void tu_on_request(struct evhttp_request *req, void *arg)
{
    struct tu_server *s = arg;
    const char *uri = evhttp_request_get_uri(req);
    if (strncmp(uri, "/_lookup", 8) == 0 && (uri[8] == '?' || uri[8] == '\0')) {
        tu_handle_lookup(s, req, uri[8] == '?' ? uri + 9 : NULL);
        return;
    }
    if (strncmp(uri, "/_test/", 7) != 0) {
        tu_handle_exec(s, req);
        return;
    }
    const char *qm = strchr(uri, '?');
    size_t plen = qm ? (size_t)(qm - uri) : strlen(uri);
    char path[64];
    if (plen >= sizeof path) {
        tu_reply_text(req, 404, "text/plain", "unknown test endpoint\n");
        return;
    }
    memcpy(path, uri, plen);
    path[plen] = '\0';
    tu_handle_test(s, req, path, qm ? qm + 1 : NULL);
}

/* ---- start-up */

static void tu_raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    rlim_t want = rl.rlim_max;
    if (want == RLIM_INFINITY || want > 1048576)
        want = 1048576;
    if (rl.rlim_cur < want) {
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            tu_log("rlimit_failed", "errno=%d", errno);
    }
}

/* Binds and listens (backlog 4096: evhttp's own bind uses 128, too small for a burst of 1000 connects). */
static evutil_socket_t tu_listen(const char *host, uint16_t port, uint16_t *bound)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST};
    struct addrinfo *res = NULL;
    char pbuf[8];
    snprintf(pbuf, sizeof pbuf, "%u", (unsigned)port);
    int rc = getaddrinfo(host, pbuf, &hints, &res);
    if (rc != 0) {
        tu_log("listen_failed", "host=%s error=\"%s\"", host, gai_strerror(rc));
        return -1;
    }
    evutil_socket_t fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        goto fail;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 4096) != 0)
        goto fail;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
        goto fail;
    if (ss.ss_family == AF_INET)
        *bound = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    else
        *bound = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    freeaddrinfo(res);
    return fd;
fail:
    tu_log("listen_failed", "host=%s port=%u errno=%d error=\"%s\"", host, (unsigned)port, errno, strerror(errno));
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
    return -1;
}

static bool tu_write_port_file(const char *path, uint16_t port)
{
    char tmp[PATH_MAX];
    int n = snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    if (n < 0 || (size_t)n >= sizeof tmp)
        return false;
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return false;
    bool ok = fprintf(f, "%u\n", (unsigned)port) > 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return false;
    }
    return true;
}

static void tu_on_signal(evutil_socket_t sig, short what, void *arg)
{
    struct event_base *base = arg;
    if (!tu_quiet)
        tu_log("stopping", "signal=%d", (int)sig);
    event_base_loopexit(base, NULL);
}

static void tu_usage(FILE *f)
{
    fprintf(f, "usage: testupstream [--host 127.0.0.1] [--port N] [--port-file F] [--delay-ms N] [--quiet]\n"
               "       [--tls-cert F --tls-key F --tls-port-file F [--tls-client-ca F]]\n");
}

/* ---- TLS mode: a second listener (its port in --tls-port-file) serving the same handler over TLS (OpenSSL);
 * with --tls-client-ca it requires a client certificate from that CA. Each handshake's SNI is logged
 * (event=tls_sni name=...). The plain listener stays for the tests' /_test/ calls. */

static int tu_sni_cb(SSL *ssl, int *al, void *arg)
{
    (void)al;
    (void)arg;
    const char *name = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name);
    tu_log("tls_sni", "name=%s", name ? name : "-");
    return SSL_TLSEXT_ERR_OK;
}

static struct bufferevent *tu_tls_bev(struct event_base *base, void *arg)
{
    SSL *ssl = SSL_new(arg);
    return ssl ? bufferevent_openssl_socket_new(base, -1, ssl, BUFFEREVENT_SSL_ACCEPTING, BEV_OPT_CLOSE_ON_FREE) : NULL;
}

static SSL_CTX *tu_tls_ctx(const char *cert, const char *key, const char *client_ca)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (!ctx || SSL_CTX_use_certificate_chain_file(ctx, cert) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1) {
        ERR_print_errors_fp(stderr);
        SSL_CTX_free(ctx);
        return NULL;
    }
    SSL_CTX_set_tlsext_servername_callback(ctx, tu_sni_cb);
    if (client_ca) {
        if (SSL_CTX_load_verify_locations(ctx, client_ca, NULL) != 1) {
            ERR_print_errors_fp(stderr);
            SSL_CTX_free(ctx);
            return NULL;
        }
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    return ctx;
}

int main(int argc, char **argv)
{
    const char *host = "127.0.0.1";
    const char *port_file = NULL;
    uint64_t port = 0;
    const char *tls_cert = NULL, *tls_key = NULL, *tls_port_file = NULL, *tls_client_ca = NULL;
    SSL_CTX *tls_ctx = NULL;
    struct evhttp *tls_http = NULL;
    struct tu_server *s = tu_xcalloc(1, sizeof *s);
    int rc = 1;
    struct event *sigterm = NULL, *sigint = NULL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = (i + 1 < argc) ? argv[i + 1] : NULL;
        if (strcmp(a, "--quiet") == 0) {
            s->quiet = true;
            tu_quiet = true;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            tu_usage(stdout);
            free(s);
            return 0;
        } else if (v != NULL && strcmp(a, "--host") == 0) {
            host = v;
            i++;
        } else if (v != NULL && strcmp(a, "--port") == 0 && tu_parse_u64(v, 65535, &port)) {
            i++;
        } else if (v != NULL && strcmp(a, "--port-file") == 0) {
            port_file = v;
            i++;
        } else if (v != NULL && strcmp(a, "--tls-cert") == 0) {
            tls_cert = v;
            i++;
        } else if (v != NULL && strcmp(a, "--tls-key") == 0) {
            tls_key = v;
            i++;
        } else if (v != NULL && strcmp(a, "--tls-port-file") == 0) {
            tls_port_file = v;
            i++;
        } else if (v != NULL && strcmp(a, "--tls-client-ca") == 0) {
            tls_client_ca = v;
            i++;
        } else if (v != NULL && strcmp(a, "--delay-ms") == 0 &&
                   tu_parse_u64(v, TU_MAX_DELAY_MS, &s->default_delay_ms)) {
            i++;
        } else {
            fprintf(stderr, "testupstream: bad argument '%s'\n", a);
            tu_usage(stderr);
            free(s);
            return 2;
        }
    }

    signal(SIGPIPE, SIG_IGN);
    tu_raise_nofile();
    s->base = event_base_new();
    if (s->base == NULL)
        goto fail;
    s->http = evhttp_new(s->base);
    if (s->http == NULL)
        goto fail;
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_PUT |
                                            EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS | EVHTTP_REQ_TRACE |
                                            EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
    evhttp_set_max_body_size(s->http, TU_MAX_REQ_BODY);
    evhttp_set_max_headers_size(s->http, 256 * 1024);
    evhttp_set_timeout(s->http, TU_IDLE_TIMEOUT_S);
    evhttp_set_gencb(s->http, tu_on_request, s);

    uint16_t bound = 0;
    evutil_socket_t lfd = tu_listen(host, (uint16_t)port, &bound);
    if (lfd < 0)
        goto fail;
    if (evhttp_accept_socket(s->http, lfd) != 0) {
        close(lfd);
        goto fail;
    }
    if (tls_cert && tls_key && tls_port_file) {
        uint16_t tls_bound = 0;
        evutil_socket_t tfd = -1;
        if (!(tls_ctx = tu_tls_ctx(tls_cert, tls_key, tls_client_ca)) || !(tls_http = evhttp_new(s->base)) ||
            (tfd = tu_listen(host, 0, &tls_bound)) < 0 || evhttp_accept_socket(tls_http, tfd) != 0)
            goto fail;
        evhttp_set_allowed_methods(tls_http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_PUT |
                                                 EVHTTP_REQ_DELETE | EVHTTP_REQ_PATCH);
        evhttp_set_max_body_size(tls_http, TU_MAX_REQ_BODY);
        evhttp_set_timeout(tls_http, TU_IDLE_TIMEOUT_S);
        evhttp_set_gencb(tls_http, tu_on_request, s);
        evhttp_set_bevcb(tls_http, tu_tls_bev, tls_ctx);
        if (!tu_write_port_file(tls_port_file, tls_bound))
            goto fail;
    }
    sigterm = evsignal_new(s->base, SIGTERM, tu_on_signal, s->base);
    sigint = evsignal_new(s->base, SIGINT, tu_on_signal, s->base);
    if (sigterm == NULL || sigint == NULL || evsignal_add(sigterm, NULL) != 0 || evsignal_add(sigint, NULL) != 0)
        goto fail;
    if (port_file != NULL && !tu_write_port_file(port_file, bound)) {
        tu_log("port_file_failed", "errno=%d", errno);
        goto fail;
    }
    printf("event=listening port=%u\n", (unsigned)bound);
    fflush(stdout);
    if (!s->quiet)
        tu_log("listening", "host=%s port=%u delay_ms=%" PRIu64, host, (unsigned)bound, s->default_delay_ms);

    if (event_base_dispatch(s->base) < 0)
        goto fail;
    rc = 0;

fail:
    if (rc != 0)
        tu_log("failed", "errno=%d", errno);
    /* requests whose client left are detached from any connection: evhttp_free would not free them */
    while (s->pending != NULL) {
        struct tu_pending *p = s->pending;
        tu_pending_unlink(s, p);
        event_free(p->timer);
        if (evhttp_request_get_connection(p->req) == NULL)
            evhttp_request_free(p->req);
        free(p);
    }
    if (s->http != NULL)
        evhttp_free(s->http);
    if (tls_http != NULL)
        evhttp_free(tls_http);
    SSL_CTX_free(tls_ctx);
    if (sigterm != NULL)
        event_free(sigterm);
    if (sigint != NULL)
        event_free(sigint);
    if (s->base != NULL)
        event_base_free(s->base);
    tu_keys_clear(s);
    tu_conns_clear(s);
    free(s->last_hdrs);
    free(s);
    return rc;
}
