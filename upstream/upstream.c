/* upstream.c - forwarding with one libcurl multi handle driven by libevent; classifies every failure by whether
 * the request may have reached the upstream, and stops libcurl's silent re-send on a dead reused connection. */
#include "upstream/upstream.h"
#include "upstream/internal.h"

#include <event2/event.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* One socket of curl's, watched by libevent. Sockets that curl opened through up_open_socket ("ours") are
 * closed through up_close_socket, so when curl stops watching one (its connection goes idle in the cache) its
 * read registration can stay in place: the next request on that connection then costs no epoll_ctl. */
struct up_sock {
    struct up_client *c;
    curl_socket_t fd;
    struct event *ev;
    short kind;   /* events registered with libevent; 0: none */
    bool watched; /* curl waits on this socket; false: parked (idle in curl's connection cache) */
    bool ours;    /* opened by up_open_socket; its close goes through up_close_socket */
};

const char *up_result_name(enum up_result r)
{
    switch (r) {
    case UP_OK:
        return "ok";
    case UP_CONNECT_FAILED:
        return "connect_failed";
    case UP_TIMEOUT:
        return "timeout";
    case UP_NO_RESPONSE:
        return "no_response";
    case UP_TOO_LARGE:
        return "too_large";
    case UP_CANCELLED:
        return "cancelled";
    case UP_ERROR:
        return "error";
    case UP_INVALID_RESPONSE:
        return "invalid_response";
    }
    return "unknown";
}

static pthread_once_t up_global_once = PTHREAD_ONCE_INIT;
static CURLcode up_global_rc = CURLE_FAILED_INIT;

static void up_global_init(void)
{
    up_global_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

double up_elapsed(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + (double)(now.tv_nsec - start->tv_nsec) / 1e9;
}

/* ---- libevent <-> curl glue */

static bool up_check_done(struct up_client *c);

static void up_socket_action(struct up_client *c, curl_socket_t fd, int ev_bitmask)
{
    int running = 0;
    CURLMcode mc = curl_multi_socket_action(c->multi, fd, ev_bitmask, &running);
    if (mc != CURLM_OK)
        cm_log(CM_ERROR, "upstream_multi_error", "error=\"%s\"", curl_multi_strerror(mc));
    up_check_done(c);
}

static struct up_sock *up_sock_find(const struct up_client *c, curl_socket_t fd)
{
    return fd >= 0 && (size_t)fd < c->socks_n ? c->socks[fd] : NULL;
}

static struct up_sock *up_sock_new(struct up_client *c, curl_socket_t fd, bool ours)
{
    if ((size_t)fd >= c->socks_n) {
        size_t n = c->socks_n ? c->socks_n : 256;
        while (n <= (size_t)fd)
            n *= 2;
        c->socks = cm_realloc(c->socks, n * sizeof *c->socks);
        memset(c->socks + c->socks_n, 0, (n - c->socks_n) * sizeof *c->socks);
        c->socks_n = n;
    }
    struct up_sock *s = cm_calloc(1, sizeof *s);
    s->c = c;
    s->fd = fd;
    s->ours = ours;
    c->socks[fd] = s;
    return s;
}

static void up_sock_free(struct up_client *c, struct up_sock *s)
{
    if (c->socks[s->fd] == s)
        c->socks[s->fd] = NULL;
    if (s->ev != NULL)
        event_free(s->ev); /* deletes it first when pending */
    free(s);
}

static void up_on_socket_event(evutil_socket_t fd, short kind, void *arg);

/* Registers exactly kind (EV_READ/EV_WRITE, 0: nothing) for s; only touches libevent when kind changes. */
static int up_sock_set(struct up_sock *s, short kind)
{
    if (kind == s->kind)
        return 0;
    if (s->kind != 0) {
        event_del(s->ev);
        s->kind = 0;
    }
    if (kind == 0)
        return 0;
    int rc;
    if (s->ev == NULL) {
        s->ev = event_new(s->c->base, s->fd, (short)(kind | EV_PERSIST), up_on_socket_event, s);
        rc = s->ev != NULL ? 0 : -1;
    } else {
        rc = event_assign(s->ev, s->c->base, s->fd, (short)(kind | EV_PERSIST), up_on_socket_event, s);
    }
    if (rc == 0)
        rc = event_add(s->ev, NULL);
    if (rc != 0)
        return -1;
    s->kind = kind;
    return 0;
}

static void up_on_socket_event(evutil_socket_t fd, short kind, void *arg)
{
    struct up_sock *s = arg;
    if (!s->watched) {
        /* A parked idle connection became readable: the server closed it, or sent bytes nobody asked for (the
         * rest of an earlier answer), which the next request on it would read as its own answer. libcurl 7.88
         * checks a cached connection before reuse only for a close (recv(MSG_PEEK) == 0), so the bytes are read
         * away and the socket shut down: curl then sees the close and drops the connection. */
        up_sock_set(s, 0);
        up_sock_poison(fd);
        return;
    }
    int action = ((kind & EV_READ) ? CURL_CSELECT_IN : 0) | ((kind & EV_WRITE) ? CURL_CSELECT_OUT : 0);
    up_socket_action(s->c, fd, action); /* s may be gone after this */
}

void up_sock_poison(int fd)
{
    char junk[4096];
    for (int i = 0; i < 16 && recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0; i++)
        ;
    (void)shutdown(fd, SHUT_RDWR);
}

static void up_on_timer(evutil_socket_t fd, short kind, void *arg)
{
    up_socket_action(arg, CURL_SOCKET_TIMEOUT, 0);
}

/* CURLMOPT_SOCKETFUNCTION: mirror what curl waits for, per socket, with as few libevent changes as possible. */
static int up_curl_socket_cb(CURL *easy, curl_socket_t fd, int what, void *userp, void *socketp)
{
    struct up_client *c = userp;
    struct up_sock *s = socketp != NULL ? socketp : up_sock_find(c, fd);
    if (what == CURL_POLL_REMOVE) {
        if (s == NULL)
            return 0;
        s->watched = false;
        if (!s->ours) {
            up_sock_free(c, s); /* e.g. the resolver's socketpair: closed without telling us */
            return 0;
        }
        /* parked: a read registration may stay (no epoll_ctl now nor when the connection is reused) */
        if ((s->kind & EV_WRITE) != 0)
            up_sock_set(s, 0);
        return 0;
    }
    if (s == NULL)
        s = up_sock_new(c, fd, false);
    if (!s->watched || socketp == NULL) {
        s->watched = true;
        curl_multi_assign(c->multi, fd, s);
    }
    short kind = (short)(((what & CURL_POLL_IN) ? EV_READ : 0) | ((what & CURL_POLL_OUT) ? EV_WRITE : 0));
    if (up_sock_set(s, kind) != 0) {
        cm_log(CM_ERROR, "upstream_event_failed", "fd=%d", (int)fd);
        return -1;
    }
    return 0;
}

/* CURLOPT_OPENSOCKETFUNCTION: the connection sockets, so that we know their close goes through
 * up_close_socket. */
static curl_socket_t up_open_socket(void *clientp, curlsocktype purpose, struct curl_sockaddr *a)
{
    struct up_client *c = clientp;
    curl_socket_t fd = socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
    if (fd == CURL_SOCKET_BAD)
        return CURL_SOCKET_BAD;
    struct up_sock *s = up_sock_find(c, fd);
    if (s != NULL) {
        /* a stale entry for a descriptor that was closed behind our back (the resolver's socketpair): its
         * registration, if any, is dropped (epoll forgot the old descriptor already) */
        up_sock_set(s, 0);
        s->ours = true;
        s->watched = false;
    } else {
        up_sock_new(c, fd, true);
    }
    return fd;
}

/* CURLOPT_CLOSESOCKETFUNCTION: curl has already stopped watching fd (CURL_POLL_REMOVE); drop our state first,
 * so that the registration is deleted while the descriptor still exists. */
static int up_close_socket(void *clientp, curl_socket_t fd)
{
    struct up_client *c = clientp;
    struct up_sock *s = up_sock_find(c, fd);
    if (s != NULL)
        up_sock_free(c, s);
    return close(fd);
}

/* CURLMOPT_TIMERFUNCTION: one libevent timer; curl is called back from the loop, never from here. */
static int up_curl_timer_cb(CURLM *multi, long timeout_ms, void *userp)
{
    struct up_client *c = userp;
    if (timeout_ms < 0) {
        evtimer_del(c->timer);
        return 0;
    }
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    return evtimer_add(c->timer, &tv) == 0 ? 0 : -1;
}

/* ---- per-transfer curl callbacks */

/* Called by libcurl once the connection is ready, right before it sends the request: once per send. A second
 * call for the same transfer is libcurl re-sending on its own (Curl_retry_request after a reused connection died
 * without a response byte), which the upstream may then execute twice. */
static int up_prereq_cb(void *clientp, char *primary_ip, char *local_ip, int primary_port, int local_port)
{
    struct up_transfer *t = clientp;
    t->prereq_calls++;
    if (t->prereq_calls > 1 && t->no_resend) {
        t->refused_resend = true;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

static bool up_is_ws(char ch)
{
    return ch == ' ' || ch == '\t';
}

bool up_invalid(struct up_transfer *t, const char *why)
{
    t->invalid = true;
    t->invalid_why = why;
    return false;
}

bool up_status_line(struct up_transfer *t, const char *p, size_t len)
{
    /* a new response head (after 100 Continue, or a retried send): start over */
    cm_hdrs_free(&t->resp.hdrs);
    cm_hdrs_init(&t->resp.hdrs);
    t->hdr_bytes = len + 2;
    t->hdrs_final = false;
    if (t->hdr_bytes > t->max_head)
        return up_invalid(t, "response head over max_response_header_bytes");
    if (!cm_field_value_ok(p, len))
        return up_invalid(t, "control byte in the status line");
    const char *sp = memchr(p, ' ', len);
    t->resp.status = 0;
    if (sp != NULL && (size_t)(sp - p) + 4 <= len) {
        int st = 0;
        for (int i = 1; i <= 3 && sp[i] >= '0' && sp[i] <= '9'; i++)
            st = st * 10 + (sp[i] - '0');
        t->resp.status = st;
    }
    return true;
}

bool up_header_line(struct up_transfer *t, const char *p, size_t len)
{
    if (len == 0) {
        if (t->resp.status >= 200)
            t->hdrs_final = true;
        return true;
    }
    if (t->hdrs_final)
        return true; /* a trailer after a chunked body: not part of the stored head */
    t->hdr_bytes += len + 2;
    if (t->hdr_bytes > t->max_head)
        return up_invalid(t, "response head over max_response_header_bytes");
    /* obs-fold (RFC 9112 5.2: a proxy may reject it): the front would have to rewrite the value */
    if (up_is_ws(p[0]))
        return up_invalid(t, "obs-fold line in the response head");
    const char *colon = memchr(p, ':', len);
    if (colon == NULL)
        return up_invalid(t, "response header line without a colon");
    /* no whitespace before the colon either (RFC 9112 5.1): the name must be a token as it stands */
    size_t nlen = (size_t)(colon - p);
    if (!cm_token_ok(p, nlen))
        return up_invalid(t, "response header name is not a token");
    const char *v = colon + 1;
    size_t vlen = len - (size_t)(v - p);
    while (vlen > 0 && up_is_ws(*v)) {
        v++;
        vlen--;
    }
    while (vlen > 0 && up_is_ws(v[vlen - 1]))
        vlen--;
    if (!cm_field_value_ok(v, vlen))
        return up_invalid(t, "control byte in a response header value");
    /* the gateway's own marker: a replay carries exactly one, and it is never the upstream's */
    if (nlen == sizeof UP_REPLAYED_HDR - 1 && strncasecmp(p, UP_REPLAYED_HDR, nlen) == 0)
        return true;
    cm_hdrs_addn(&t->resp.hdrs, p, nlen, v, vlen);
    return true;
}

/* One header line per call (CRLF included), status lines and the blank line ending each block included. */
static size_t up_header_cb(char *p, size_t size, size_t nitems, void *userdata)
{
    struct up_transfer *t = userdata;
    size_t n = size * nitems;
    size_t len = n;
    while (len > 0 && (p[len - 1] == '\n' || p[len - 1] == '\r'))
        len--;
    if (!t->hdrs_final && len >= 5 && memcmp(p, "HTTP/", 5) == 0)
        return up_status_line(t, p, len) ? n : 0;
    return up_header_line(t, p, len) ? n : 0;
}

static size_t up_write_cb(char *p, size_t size, size_t nmemb, void *userdata)
{
    struct up_transfer *t = userdata;
    size_t n = size * nmemb;
    if (!cm_buf_append(&t->resp.body, p, n)) {
        t->too_large = true;
        return 0; /* CURLE_WRITE_ERROR */
    }
    return n;
}

/* ---- transfers */

void up_link(struct up_client *c, struct up_transfer *t)
{
    t->prev = NULL;
    t->next = c->transfers;
    if (c->transfers != NULL)
        c->transfers->prev = t;
    c->transfers = t;
    c->active++;
}

void up_unlink(struct up_client *c, struct up_transfer *t)
{
    if (t->prev != NULL)
        t->prev->next = t->next;
    else
        c->transfers = t->next;
    if (t->next != NULL)
        t->next->prev = t->prev;
    t->prev = t->next = NULL;
    c->active--;
}

bool up_pool_put(struct up_client *c, struct up_transfer **pool, size_t *n, struct up_transfer *t)
{
    if (*n >= UP_POOL_MAX || c->destroy_deferred)
        return false;
    if (t->hdr_cap > UP_HDR_MEM_KEEP) {
        free(t->hdr_mem);
        t->hdr_mem = NULL;
        t->hdr_cap = 0;
    }
    t->cb = NULL;
    t->arg = NULL;
    t->prev = NULL;
    t->next = *pool;
    *pool = t;
    (*n)++;
    return true;
}

/* Releases a transfer that is no longer in the multi handle: back to the pool with its easy handle, or freed. */
static void up_transfer_free(struct up_client *c, struct up_transfer *t)
{
    if (t->h1) {
        h1_transfer_free(c, t);
        return;
    }
    free(t->body);
    t->body = NULL;
    cm_resp_free(&t->resp);
    if (c != NULL && t->easy != NULL && up_pool_put(c, &c->pool, &c->pool_n, t)) {
        t->hdr_list = NULL;
        return;
    }
    if (t->easy != NULL)
        curl_easy_cleanup(t->easy);
    if (t->cu != NULL)
        curl_url_cleanup(t->cu);
    free(t->hdr_mem);
    free(t);
}

static enum up_result up_classify(const struct up_transfer *t, CURLcode rc)
{
    if (t->invalid)
        return UP_INVALID_RESPONSE;
    if (rc == CURLE_OK)
        return t->resp.status >= 200 ? UP_OK : UP_ERROR;
    if (t->too_large)
        return UP_TOO_LARGE;
    if (t->refused_resend)
        return UP_NO_RESPONSE;
    if (t->prereq_calls == 0)
        return UP_CONNECT_FAILED; /* refused, unresolvable, connect timeout, queued too long: nothing was sent */
    switch (rc) {
    case CURLE_OPERATION_TIMEDOUT:
        return UP_TIMEOUT;
    case CURLE_WEIRD_SERVER_REPLY: /* e.g. "Nul byte in header": refused by libcurl before our header callback */
        return UP_INVALID_RESPONSE;
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_ABORTED_BY_CALLBACK:
    /* sent once, then libcurl's own re-send could not connect: the first send may have been executed */
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return UP_NO_RESPONSE;
    default:
        return UP_ERROR;
    }
}

static void up_destroy_now(struct up_client *c);

bool up_deliver(struct up_client *c, struct up_transfer *t, enum up_result r, const char *err)
{
    up_unlink(c, t);
    t->done = true;
    if (r == UP_OK)
        cm_hdrs_strip_hop_by_hop(&t->resp.hdrs);
    else if (r == UP_TOO_LARGE)
        err = "response over its cap";
    else if (r == UP_INVALID_RESPONSE && t->invalid_why != NULL)
        err = t->invalid_why;
    c->dispatching++;
    t->cb(t->arg, r, &t->resp, err, up_elapsed(&t->start));
    c->dispatching--;
    up_transfer_free(c, t);
    if (c->destroy_deferred && c->dispatching == 0) {
        up_destroy_now(c);
        return true;
    }
    return false;
}

/* Drains finished transfers and runs their callbacks. Returns true when the client was destroyed meanwhile. */
static bool up_check_done(struct up_client *c)
{
    CURLMsg *msg;
    int left = 0;
    c->dispatching++;
    while (!c->destroy_deferred && (msg = curl_multi_info_read(c->multi, &left)) != NULL) {
        if (msg->msg != CURLMSG_DONE)
            continue;
        CURL *easy = msg->easy_handle;
        CURLcode rc = msg->data.result; /* msg is invalid once the handle is removed */
        char *priv = NULL;
        curl_easy_getinfo(easy, CURLINFO_PRIVATE, &priv);
        struct up_transfer *t = (struct up_transfer *)(void *)priv;
        curl_multi_remove_handle(c->multi, easy);
        if (t == NULL)
            continue;
        enum up_result r = up_classify(t, rc);
        if (r == UP_OK) {
            long status = 0;
            if (curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status) == CURLE_OK && status > 0)
                t->resp.status = (int)status;
        }
        const char *err = "ok";
        if (rc != CURLE_OK)
            err = t->errbuf[0] ? t->errbuf : curl_easy_strerror(rc);
        if (r == UP_NO_RESPONSE && t->refused_resend)
            err = "connection closed without a response; libcurl's re-send was refused";
        up_deliver(c, t, r, err);
    }
    c->dispatching--;
    if (c->destroy_deferred && c->dispatching == 0) {
        up_destroy_now(c);
        return true;
    }
    return false;
}

struct up_client *up_client_create(struct event_base *base, long max_host_connections)
{
    pthread_once(&up_global_once, up_global_init);
    if (up_global_rc != CURLE_OK) {
        cm_log(CM_ERROR, "upstream_init_failed", "error=\"%s\"", curl_easy_strerror(up_global_rc));
        return NULL;
    }
    if (base == NULL || max_host_connections < 0)
        return NULL;
    struct up_client *c = cm_calloc(1, sizeof *c);
    c->base = base;
    c->max_host = max_host_connections;
    c->multi = curl_multi_init();
    c->timer = evtimer_new(base, up_on_timer, c);
    if (c->multi == NULL || c->timer == NULL)
        goto fail;
    /* the connection cache defaults to 4 x the handles in use, which shrinks it right after a burst */
    long maxconnects = max_host_connections > 0 ? max_host_connections * 4 : 1024;
    if (curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, up_curl_socket_cb) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_SOCKETDATA, c) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, up_curl_timer_cb) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_TIMERDATA, c) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, max_host_connections) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, maxconnects) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_NOTHING) != CURLM_OK)
        goto fail;
    return c;
fail:
    cm_log(CM_ERROR, "upstream_init_failed", "error=\"multi handle\"");
    if (c->timer != NULL)
        event_free(c->timer);
    if (c->multi != NULL)
        curl_multi_cleanup(c->multi);
    free(c);
    return NULL;
}

/* Stops a running transfer without calling back; c == NULL: free it rather than pool it. */
static void up_stop(struct up_client *c, struct up_transfer *t, bool pool)
{
    if (t->h1)
        h1_abort(c, t);
    else
        curl_multi_remove_handle(c->multi, t->easy);
    up_unlink(c, t);
    up_transfer_free(pool ? c : NULL, t);
}

static void up_destroy_now(struct up_client *c)
{
    c->closing = true;
    while (c->transfers != NULL)
        up_stop(c, c->transfers, false);
    h1_destroy(c);
    while (c->pool != NULL) {
        struct up_transfer *t = c->pool;
        c->pool = t->next;
        up_transfer_free(NULL, t);
    }
    c->pool_n = 0;
    /* closes the cached connections through up_close_socket (c must still be valid) */
    curl_multi_cleanup(c->multi);
    for (size_t fd = 0; fd < c->socks_n; fd++)
        if (c->socks[fd] != NULL)
            up_sock_free(c, c->socks[fd]);
    free(c->socks);
    event_free(c->timer);
    free(c);
}

void up_client_destroy(struct up_client *c)
{
    if (c == NULL)
        return;
    if (c->dispatching > 0) {
        /* called from a done callback: cancel the rest now, free when the dispatch loop unwinds */
        c->destroy_deferred = true;
        c->closing = true;
        while (c->transfers != NULL)
            up_stop(c, c->transfers, false);
        return;
    }
    up_destroy_now(c);
}

/* Methods are case-sensitive (RFC 9110 9.1): "post" is not POST, "head" is not HEAD. */
static bool up_has_body(const struct up_request *req)
{
    if (req->body_len > 0)
        return true;
    return strcmp(req->method, "POST") == 0 || strcmp(req->method, "PUT") == 0 || strcmp(req->method, "PATCH") == 0;
}

bool up_target_ok(const char *target)
{
    if (target == NULL || target[0] != '/')
        return false;
    size_t i = 0;
    for (; target[i] != '\0' && i <= UP_MAX_TARGET; i++) {
        unsigned char ch = (unsigned char)target[i];
        if (ch <= 0x20 || ch >= 0x7f || ch == '#')
            return false;
    }
    return i <= UP_MAX_TARGET;
}

bool up_token_ok(const char *s, size_t *len)
{
    *len = strlen(s);
    return cm_token_ok(s, *len);
}

bool up_value_ok(const char *s, size_t *len)
{
    *len = strlen(s);
    return cm_field_value_ok(s, *len);
}

enum up_hdr_kind { UP_HDR_SEND, UP_HDR_SKIP, UP_HDR_ACCEPT, UP_HDR_CTYPE };

/* What up_build_headers does with a header: the length and framing are libcurl's (from the body we hand it),
 * hop-by-hop headers never travel. One compare for most names (dispatch on the first letter). */
static enum up_hdr_kind up_hdr_kind(const char *name)
{
    switch (name[0] | 0x20) {
    case 'a':
        return strcasecmp(name, "Accept") == 0 ? UP_HDR_ACCEPT : UP_HDR_SEND;
    case 'c':
        if (strcasecmp(name, "Content-Length") == 0)
            return UP_HDR_SKIP;
        if (strcasecmp(name, "Content-Type") == 0)
            return UP_HDR_CTYPE;
        break;
    case 'e':
        return strcasecmp(name, "Expect") == 0 ? UP_HDR_SKIP : UP_HDR_SEND;
    default:
        break;
    }
    return cm_is_hop_by_hop(name) ? UP_HDR_SKIP : UP_HDR_SEND;
}

bool up_hdr_skipped(const char *name)
{
    return up_hdr_kind(name) == UP_HDR_SKIP;
}

/* Builds the header list in t->hdr_mem (one block: list nodes, then their text; reused by the next request on
 * this transfer): the caller's headers in order, and empty entries that switch off what libcurl would add on its
 * own (Accept: * / *; with a body also Expect: 100-continue and a form Content-Type). Returns false on a header
 * that cannot be sent safely (CR/LF in a value, a bad name). */
static bool up_build_headers(struct up_transfer *t, const struct cm_hdrs *h, bool with_body)
{
    size_t n = h ? h->n : 0;
    size_t nodes = 3, text = sizeof "Expect:" + sizeof "Accept:" + sizeof "Content-Type:";
    for (size_t i = 0; i < n; i++) {
        size_t nl, vl;
        if (!up_token_ok(h->v[i].name, &nl) || !up_value_ok(h->v[i].value, &vl))
            return false;
        nodes++;
        text += nl + vl + 3; /* "Name: value\0" or "Name;\0" */
    }
    size_t need = nodes * sizeof(struct curl_slist) + text;
    if (need > t->hdr_cap) {
        free(t->hdr_mem);
        t->hdr_mem = cm_malloc(need);
        t->hdr_cap = need;
    }
    struct curl_slist *node = (struct curl_slist *)(void *)t->hdr_mem, *first = NULL, *last = NULL;
    char *out = t->hdr_mem + nodes * sizeof(struct curl_slist);
    bool have_accept = false, have_ctype = false;
    for (size_t i = 0; i < n + 3; i++) {
        const char *line;
        if (i < n) {
            const char *name = h->v[i].name, *value = h->v[i].value;
            enum up_hdr_kind k = up_hdr_kind(name);
            if (k == UP_HDR_SKIP)
                continue;
            have_accept = have_accept || k == UP_HDR_ACCEPT;
            have_ctype = have_ctype || k == UP_HDR_CTYPE;
            /* "Name:" would make libcurl drop the header; "Name;" sends it with an empty value */
            size_t nl = strlen(name), vl = strlen(value);
            char *o = out;
            memcpy(o, name, nl);
            o += nl;
            if (vl > 0) {
                *o++ = ':';
                *o++ = ' ';
                memcpy(o, value, vl);
                o += vl;
            } else {
                *o++ = ';';
            }
            *o++ = '\0';
            line = out;
            out = o;
        } else if (i == n && with_body) {
            line = "Expect:";
        } else if (i == n + 1 && !have_accept) {
            line = "Accept:";
        } else if (i == n + 2 && with_body && !have_ctype) {
            line = "Content-Type:";
        } else {
            continue;
        }
        node->data = (char *)line;
        node->next = NULL;
        if (last != NULL)
            last->next = node;
        else
            first = node;
        last = node++;
    }
    t->hdr_list = first;
    return true;
}

#define UP_SET(e, opt, val)                                                                                            \
    do {                                                                                                               \
        if (curl_easy_setopt(e, opt, val) != CURLE_OK) {                                                               \
            what = #opt;                                                                                               \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* A transfer from the pool, or a new one with its easy handle and the options that never change. */
static struct up_transfer *up_transfer_get(struct up_client *c)
{
    const char *what = "easy handle";
    if (c->pool != NULL) {
        struct up_transfer *t = c->pool;
        c->pool = t->next;
        c->pool_n--;
        t->next = NULL;
        return t;
    }
    struct up_transfer *t = cm_calloc(1, sizeof *t);
    t->c = c;
    t->cu = curl_url();
    CURL *e = t->easy = curl_easy_init();
    if (e == NULL || t->cu == NULL)
        goto fail;
    UP_SET(e, CURLOPT_PRIVATE, (void *)t);
    UP_SET(e, CURLOPT_ERRORBUFFER, t->errbuf);
    UP_SET(e, CURLOPT_NOSIGNAL, 1L);
    UP_SET(e, CURLOPT_PROTOCOLS_STR, "http,https");
    UP_SET(e, CURLOPT_PATH_AS_IS, 1L); /* forward the path unchanged, no "/../" squashing */
    UP_SET(e, CURLOPT_PROXY, "");      /* never a proxy from the environment */
    UP_SET(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    UP_SET(e, CURLOPT_FOLLOWLOCATION, 0L);
    UP_SET(e, CURLOPT_HTTP_CONTENT_DECODING, 0L); /* bodies are stored as sent */
    UP_SET(e, CURLOPT_MAXAGE_CONN, UP_MAX_IDLE_REUSE_S);
    UP_SET(e, CURLOPT_TCP_KEEPALIVE, 1L);
    UP_SET(e, CURLOPT_BUFFERSIZE, UP_RECV_BUFFER);
    UP_SET(e, CURLOPT_PREREQFUNCTION, up_prereq_cb);
    UP_SET(e, CURLOPT_PREREQDATA, (void *)t);
    UP_SET(e, CURLOPT_HEADERFUNCTION, up_header_cb);
    UP_SET(e, CURLOPT_HEADERDATA, (void *)t);
    UP_SET(e, CURLOPT_WRITEFUNCTION, up_write_cb);
    UP_SET(e, CURLOPT_WRITEDATA, (void *)t);
    UP_SET(e, CURLOPT_OPENSOCKETFUNCTION, up_open_socket);
    UP_SET(e, CURLOPT_OPENSOCKETDATA, (void *)c);
    UP_SET(e, CURLOPT_CLOSESOCKETFUNCTION, up_close_socket);
    UP_SET(e, CURLOPT_CLOSESOCKETDATA, (void *)c);
    return t;
fail:
    cm_log(CM_WARN, "upstream_send_failed", "step=%s", what);
    if (t->easy != NULL)
        curl_easy_cleanup(t->easy);
    if (t->cu != NULL)
        curl_url_cleanup(t->cu);
    free(t);
    return NULL;
}

/* The transfer's URL handle set part by part from the configured origin and the target: nothing in the target
 * can become a scheme, a user, a host or a port (a URL string glued together and parsed again could). false: a
 * part was refused. */
static bool up_set_url(struct up_transfer *t, const struct up_origin *o, const char *target)
{
    char host[UP_MAX_HOST + 3], port[8], path[UP_MAX_TARGET + 1];
    size_t hl = strlen(o->host);
    if (hl == 0 || hl > UP_MAX_HOST)
        return false;
    bool v6 = o->ip_literal && memchr(o->host, ':', hl) != NULL;
    snprintf(host, sizeof host, v6 ? "[%s]" : "%s", o->host);
    snprintf(port, sizeof port, "%u", (unsigned)o->port);
    const char *q = strchr(target, '?');
    size_t pl = q != NULL ? (size_t)(q - target) : strlen(target);
    memcpy(path, target, pl);
    path[pl] = '\0';
    return curl_url_set(t->cu, CURLUPART_SCHEME, o->https ? "https" : "http", 0) == CURLUE_OK &&
           curl_url_set(t->cu, CURLUPART_HOST, host, 0) == CURLUE_OK &&
           curl_url_set(t->cu, CURLUPART_PORT, port, 0) == CURLUE_OK &&
           curl_url_set(t->cu, CURLUPART_PATH, path, 0) == CURLUE_OK &&
           curl_url_set(t->cu, CURLUPART_QUERY, q != NULL && q[1] != '\0' ? q + 1 : NULL, 0) == CURLUE_OK;
}

struct up_transfer *up_send(struct up_client *c, const struct up_request *req, up_done_cb cb, void *arg)
{
    const char *what = "request";
    if (c == NULL || req == NULL || cb == NULL || req->method == NULL || req->origin == NULL ||
        req->origin->host == NULL || req->origin->port == 0 || !up_target_ok(req->target) ||
        (req->body == NULL && req->body_len > 0) || c->destroy_deferred)
        return NULL;
    bool head = strcmp(req->method, "HEAD") == 0 && req->body_len == 0;
    bool with_body = !head && up_has_body(req);
    bool taken = false;
    struct up_transfer *t = h1_send(c, req, head, with_body, cb, arg, &taken);
    if (taken)
        return t;
    t = up_transfer_get(c);
    if (t == NULL)
        return NULL;
    CURL *e = t->easy;
    t->cb = cb;
    t->arg = arg;
    t->no_resend = req->no_resend;
    t->hdr_bytes = 0;
    t->max_head = req->max_header_bytes > 0 ? req->max_header_bytes : UP_DEFAULT_MAX_HEAD;
    t->hdrs_final = t->too_large = t->refused_resend = t->done = t->invalid = false;
    t->invalid_why = NULL;
    t->prereq_calls = 0;
    t->errbuf[0] = '\0';
    cm_resp_init(&t->resp, req->max_response);
    clock_gettime(CLOCK_MONOTONIC, &t->start);

    if (!up_build_headers(t, req->hdrs, with_body)) {
        what = "headers";
        goto fail;
    }
    if (!up_set_url(t, req->origin, req->target)) {
        what = "url";
        goto fail;
    }
    UP_SET(e, CURLOPT_URL, NULL); /* no URL string of an earlier request is used again: the handle below is */
    UP_SET(e, CURLOPT_CURLU, t->cu);
    UP_SET(e, CURLOPT_CONNECTTIMEOUT_MS, (long)req->connect_timeout_ms);
    UP_SET(e, CURLOPT_TIMEOUT_MS, (long)req->timeout_ms);
    UP_SET(e, CURLOPT_HTTPHEADER, t->hdr_list);
    /* The method options of the previous request on this handle are all overwritten here. */
    if (!with_body && t->had_postfields) {
        UP_SET(e, CURLOPT_POSTFIELDS, NULL); /* no pointer to a freed body stays behind */
        UP_SET(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)-1);
        t->had_postfields = false;
    }
    if (head) {
        UP_SET(e, CURLOPT_CUSTOMREQUEST, NULL);
        UP_SET(e, CURLOPT_NOBODY, 1L);
    } else {
        UP_SET(e, CURLOPT_NOBODY, 0L);
        if (with_body) {
            t->body = cm_malloc(req->body_len);
            if (req->body_len > 0)
                memcpy(t->body, req->body, req->body_len);
            UP_SET(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req->body_len);
            UP_SET(e, CURLOPT_POSTFIELDS, t->body);
            t->had_postfields = true;
        } else {
            UP_SET(e, CURLOPT_HTTPGET, 1L);
        }
        UP_SET(e, CURLOPT_CUSTOMREQUEST, req->method);
    }

    CURLMcode mc = curl_multi_add_handle(c->multi, e);
    if (mc != CURLM_OK) {
        what = curl_multi_strerror(mc);
        goto fail;
    }
    up_link(c, t);
    return t;
fail:
    cm_log(CM_WARN, "upstream_send_failed", "step=%s", what);
    up_transfer_free(c, t);
    return NULL;
}

void up_cancel(struct up_client *c, struct up_transfer *t)
{
    if (c == NULL || t == NULL || t->done)
        return;
    up_stop(c, t, true);
}

size_t up_active(const struct up_client *c)
{
    return c ? c->active : 0;
}
