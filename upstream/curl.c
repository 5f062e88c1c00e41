/* curl.c - the libcurl backend: one multi handle driven by the loop's libevent base, for the origins the built-in
 * client does not take (https, host names). It classifies every failure by whether the request may have reached
 * the upstream, stops libcurl's silent re-send on a dead reused connection, and drops a parked connection that
 * became readable (libcurl 7.88 checks only for a close before reuse). It refuses the framing h1.c refuses (libcurl
 * takes the last of two Content-Lengths, reads "2x" as 2, passes any three-digit status, waits on a 101's tunnel),
 * and keeps a connection only after an answer framed by a non-zero Content-Length: after any other answer libcurl
 * drops extra bytes of the same read without a word and would reuse the connection. Never the built-in client's
 * sockets. */
#include <curl/curl.h>
#include <event2/event.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "upstream/curl.h"
#include "upstream/head.h"
#include "upstream/transfer.h"

struct up_curl;

/* A transfer of this backend and its easy handle stay paired: after the callback both go back to the pool, and the
 * options that never change (callbacks, their data pointers, protocol settings) are set once, when the pair is
 * made. */
struct curl_xfer {
    struct up_transfer b;
    CURL *easy;
    CURLU *cu;                     /* the URL, set part by part (up_set_url) */
    struct curl_slist *hdr_list;   /* nodes and text in hdr_mem (libcurl only reads the list) */
    struct curl_slist *connect_to; /* tls.server_name: "NAME:PORT:HOST:PORT", or NULL */
    char *hdr_mem;
    size_t hdr_cap;
    void *body;          /* our copy of the request body (CURLOPT_POSTFIELDS does not copy) */
    bool refused_resend; /* our prereq callback refused libcurl's second send */
    bool lease_lost;     /* our prereq callback refused the first send: the request's send_until_ms passed */
    bool head;           /* a HEAD request: its answer has no body */
    /* the response head being read, as h1.c frames it */
    bool want_status; /* the next header line is a status line (first, or after a 1xx head) */
    bool have_length; /* a Content-Length line was seen in this head; length holds its value */
    bool have_te;     /* a Transfer-Encoding line was seen in this head */
    uint64_t length;
    const char *malformed; /* a constant: the answer's framing is one h1 refuses (UP_ERROR) */
    bool had_postfields;   /* the easy handle holds a CURLOPT_POSTFIELDS pointer from an earlier request */
    unsigned prereq_calls; /* times libcurl was about to send the request */
    char errbuf[CURL_ERROR_SIZE];
};

/* The backend's state: the multi handle, its timer, the sockets it watches, idle transfers. */
struct up_curl {
    struct up_client *cl;
    struct event_base *base;
    CURLM *multi;
    struct event *timer;
    struct up_sock **socks; /* indexed by fd */
    size_t socks_n;
    struct up_transfer *pool; /* idle transfers, linked by next */
    size_t pool_n;
    bool tls_defaults; /* default_ca and default_capath were read (from the first easy handle) */
    char *default_ca;  /* libcurl's built-in CA bundle and path, restored on a transfer without tls.ca */
    char *default_capath;
};

/* One socket of curl's, watched by libevent. Sockets that curl opened through up_open_socket ("ours") are
 * closed through up_close_socket, so when curl stops watching one (its connection goes idle in the cache) its
 * read registration can stay in place: the next request on that connection then costs no epoll_ctl. */
struct up_sock {
    struct up_curl *c;
    curl_socket_t fd;
    struct event *ev;
    short kind;   /* events registered with libevent; 0: none */
    bool watched; /* curl waits on this socket; false: parked (idle in curl's connection cache) */
    bool ours;    /* opened by up_open_socket; its close goes through up_close_socket */
};

static pthread_once_t up_global_once = PTHREAD_ONCE_INIT;
static CURLcode up_global_rc = CURLE_FAILED_INIT;

static void up_global_init(void)
{
    up_global_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ---- libevent <-> curl glue */

static bool up_check_done(struct up_curl *c);

static void up_socket_action(struct up_curl *c, curl_socket_t fd, int ev_bitmask)
{
    int running = 0;
    CURLMcode mc = curl_multi_socket_action(c->multi, fd, ev_bitmask, &running);
    if (mc != CURLM_OK)
        cm_log(CM_ERROR, "upstream_multi_error", "error=\"%s\"", curl_multi_strerror(mc));
    up_check_done(c);
}

static struct up_sock *up_sock_find(const struct up_curl *c, curl_socket_t fd)
{
    return fd >= 0 && (size_t)fd < c->socks_n ? c->socks[fd] : NULL;
}

static struct up_sock *up_sock_new(struct up_curl *c, curl_socket_t fd, bool ours)
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

static void up_sock_free(struct up_curl *c, struct up_sock *s)
{
    if (c->socks[s->fd] == s)
        c->socks[s->fd] = NULL;
    if (s->ev != NULL)
        event_free(s->ev); /* deletes it first when pending */
    free(s);
}

static void up_on_socket_event(evutil_socket_t fd, short kind, void *arg);
static void up_sock_poison(int fd);

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

/* An idle connection that became readable will not be used again: reads what is waiting (bounded) and shuts the
 * socket down, so that libcurl's liveness check before reuse sees the close. libcurl still owns and closes fd. */
static void up_sock_poison(int fd)
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
    struct up_curl *c = userp;
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
    struct up_curl *c = clientp;
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
    struct up_curl *c = clientp;
    struct up_sock *s = up_sock_find(c, fd);
    if (s != NULL)
        up_sock_free(c, s);
    return close(fd);
}

/* CURLMOPT_TIMERFUNCTION: one libevent timer; curl is called back from the loop, never from here. */
static int up_curl_timer_cb(CURLM *multi, long timeout_ms, void *userp)
{
    struct up_curl *c = userp;
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
    struct curl_xfer *t = clientp;
    if (t->prereq_calls == 0 && !up_may_send(&t->b)) {
        t->lease_lost = true; /* nothing left: SPEC 8, the sender's lease ended while it waited */
        return CURL_PREREQFUNC_ABORT;
    }
    t->prereq_calls++;
    if (t->prereq_calls > 1 && t->b.no_resend) {
        t->refused_resend = true;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

/* The answer's framing is malformed (h1.c's STEP_ERROR): the transfer stops (0 from the header callback), the
 * connection is closed with it, and the result is UP_ERROR. */
static size_t up_malformed(struct curl_xfer *t, const char *why)
{
    t->malformed = why;
    return 0;
}

/* The framing headers of the head being read, as h1_framing_header takes them: every Content-Length line is 1 to 19
 * digits and all of them the same number (libcurl would take the last one, and "2x" or "2, 2" as 2). false:
 * malformed. p is a header line up_header_line accepted (it has a colon). */
static bool up_curl_framing(struct curl_xfer *t, const char *p, size_t len)
{
    size_t nl, vl;
    const char *v;
    if (!up_header_split(p, len, &nl, &v, &vl))
        return true;
    if (nl == 14 && strncasecmp(p, "Content-Length", 14) == 0) {
        if (!up_content_length(v, vl, &t->have_length, &t->length))
            return false;
    } else if (nl == 17 && strncasecmp(p, "Transfer-Encoding", 17) == 0) {
        t->have_te = true;
    }
    return true;
}

/* Whether the connection may be reused after the answer whose final head just ended. libcurl 7.88 notices extra
 * bytes read with an answer (and closes) only after a body framed by Content-Length; after a bodiless answer (HEAD,
 * 204, 304, Content-Length: 0) or a chunked one it drops them and caches the connection (transfer.c: "Excess
 * found ... (zero-length body)", "Leftovers after chunking" are only logged). Those connections are not kept: no
 * API tells whether the read that ended them held more. */
static bool up_curl_reusable(const struct curl_xfer *t)
{
    int st = t->b.resp.status;
    return !t->head && st != 204 && st != 304 && !t->have_te && t->have_length && t->length > 0;
}

/* One header line per call (CRLF included), status lines and the blank line ending each block included; trailers
 * of a chunked body after the final head. The checks and their order are h1_parse's: the status line's form
 * (malformed), then up_status_line / up_header_line (invalid), then the framing headers (malformed). */
static size_t up_header_cb(char *p, size_t size, size_t nitems, void *userdata)
{
    struct curl_xfer *t = userdata;
    size_t n = size * nitems;
    size_t len = n;
    while (len > 0 && (p[len - 1] == '\n' || p[len - 1] == '\r'))
        len--;
    if (t->b.hdrs_final)
        return up_header_line(&t->b, p, len) ? n : 0; /* a trailer: ignored */
    if (t->want_status) {
        if (!up_status_form_ok(p, len))
            return up_malformed(t, "malformed status line");
        t->want_status = false;
        t->have_length = t->have_te = false;
        t->length = 0;
        return up_status_line(&t->b, p, len) ? n : 0;
    }
    if (len == 0) {
        int st = t->b.resp.status;
        if (st < 200) {
            /* libcurl would read a 101's tunnel as a body to the close */
            if (st == 101)
                return up_malformed(t, "unexpected 101 Switching Protocols");
            t->want_status = true; /* an interim answer: the final head follows */
            return n;
        }
        (void)up_header_line(&t->b, p, 0);
        /* read by libcurl when the transfer is done (multi_done), not before: set now, it closes this connection */
        if (!up_curl_reusable(t))
            curl_easy_setopt(t->easy, CURLOPT_FORBID_REUSE, 1L);
        return n;
    }
    if (!up_header_line(&t->b, p, len))
        return 0;
    return up_curl_framing(t, p, len) ? n : up_malformed(t, "malformed Content-Length");
}

static size_t up_write_cb(char *p, size_t size, size_t nmemb, void *userdata)
{
    struct curl_xfer *t = userdata;
    size_t n = size * nmemb;
    if (!cm_buf_append(&t->b.resp.body, p, n)) {
        t->b.too_large = true;
        return 0; /* CURLE_WRITE_ERROR */
    }
    return n;
}

/* ---- transfers */

/* A transfer that is no longer in the multi handle: back to the pool with its easy handle, or freed. */
static void up_curl_release(void *state, struct up_transfer *bt, bool pool)
{
    struct up_curl *c = state;
    struct curl_xfer *t = (struct curl_xfer *)bt;
    free(t->body);
    t->body = NULL;
    cm_resp_free(&t->b.resp);
    up_trim_buf(&t->hdr_mem, &t->hdr_cap);
    if (pool && t->easy != NULL && up_pool_put(c->cl, &c->pool, &c->pool_n, &t->b)) {
        t->hdr_list = NULL;
        return;
    }
    if (t->easy != NULL)
        curl_easy_cleanup(t->easy);
    if (t->cu != NULL)
        curl_url_cleanup(t->cu);
    curl_slist_free_all(t->connect_to);
    free(t->hdr_mem);
    free(t);
}

static enum up_result up_classify(const struct curl_xfer *t, CURLcode rc)
{
    if (t->b.invalid)
        return UP_INVALID_RESPONSE;
    if (t->malformed != NULL)
        return UP_ERROR; /* as h1.c: malformed framing, the request was sent */
    if (rc == CURLE_OK)
        return t->b.resp.status >= 200 ? UP_OK : UP_ERROR;
    if (t->b.too_large)
        return UP_TOO_LARGE;
    if (t->refused_resend)
        return UP_NO_RESPONSE;
    if (t->lease_lost)
        return UP_LEASE_LOST;
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

/* Builds the header list in t->hdr_mem (one block: list nodes, then their text; reused by the next request on
 * this transfer): the caller's headers in order, and empty entries that switch off what libcurl would add on its
 * own (Accept: * / *; with a body also Expect: 100-continue and a form Content-Type). Returns false on a header
 * that cannot be sent safely (CR/LF in a value, a bad name). */
static bool up_build_headers(struct curl_xfer *t, const struct cm_hdrs *h, bool with_body)
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
static struct curl_xfer *up_transfer_get(struct up_curl *c)
{
    const char *what = "easy handle";
    if (c->pool != NULL) {
        struct curl_xfer *t = (struct curl_xfer *)c->pool;
        c->pool = t->b.next;
        c->pool_n--;
        t->b.next = NULL;
        return t;
    }
    struct curl_xfer *t = cm_calloc(1, sizeof *t);
    t->b.be = &up_curl_backend;
    t->b.bs = c;
    t->cu = curl_url();
    CURL *e = t->easy = curl_easy_init();
    if (e == NULL || t->cu == NULL)
        goto fail;
    if (!c->tls_defaults) { /* what a transfer without tls.ca goes back to */
        char *ca = NULL, *capath = NULL;
        (void)curl_easy_getinfo(e, CURLINFO_CAINFO, &ca);
        (void)curl_easy_getinfo(e, CURLINFO_CAPATH, &capath);
        c->default_ca = ca ? cm_strdup(ca) : NULL;
        c->default_capath = capath ? cm_strdup(capath) : NULL;
        c->tls_defaults = true;
    }
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
static bool up_set_url(struct curl_xfer *t, const struct up_origin *o, const char *target)
{
    char host[UP_MAX_HOST + 3], port[8];
    /* with tls.server_name the URL names it (SNI, verification), CURLOPT_CONNECT_TO keeps the address */
    const char *h = o->https && o->tls && o->tls->server_name ? o->tls->server_name : o->host;
    size_t hl = strlen(h);
    if (hl == 0 || hl > UP_MAX_HOST)
        return false;
    bool v6 = h == o->host && o->ip_literal && memchr(o->host, ':', hl) != NULL;
    snprintf(host, sizeof host, v6 ? "[%s]" : "%s", h);
    snprintf(port, sizeof port, "%u", (unsigned)o->port);
    const char *q = strchr(target, '?');
    char *path = q != NULL ? cm_strndup(target, (size_t)(q - target)) : NULL; /* the path without its query */
    bool ok = curl_url_set(t->cu, CURLUPART_SCHEME, o->https ? "https" : "http", 0) == CURLUE_OK &&
              curl_url_set(t->cu, CURLUPART_HOST, host, 0) == CURLUE_OK &&
              curl_url_set(t->cu, CURLUPART_PORT, port, 0) == CURLUE_OK &&
              curl_url_set(t->cu, CURLUPART_PATH, path != NULL ? path : target, 0) == CURLUE_OK &&
              curl_url_set(t->cu, CURLUPART_QUERY, q != NULL && q[1] != '\0' ? q + 1 : NULL, 0) == CURLUE_OK;
    free(path);
    return ok;
}

/* Every TLS option of the transfer, set on each send (a pooled handle may have served another upstream). */
static bool up_set_tls(struct up_curl *c, struct curl_xfer *t, const struct up_origin *o)
{
    CURL *e = t->easy;
    const struct up_tls *tls = o->https ? o->tls : NULL;
    curl_slist_free_all(t->connect_to);
    t->connect_to = NULL;
    if (tls && tls->server_name) {
        char entry[2 * UP_MAX_HOST + 32];
        bool v6 = o->ip_literal && strchr(o->host, ':') != NULL;
        snprintf(entry, sizeof entry, v6 ? "%s:%u:[%s]:%u" : "%s:%u:%s:%u", tls->server_name, (unsigned)o->port,
                 o->host, (unsigned)o->port);
        if (!(t->connect_to = curl_slist_append(NULL, entry)))
            return false;
    }
    bool verify = !tls || tls->verify;
    return curl_easy_setopt(e, CURLOPT_CONNECT_TO, t->connect_to) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_CAINFO, tls && tls->ca ? tls->ca : c->default_ca) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_CAPATH, tls && tls->ca ? NULL : c->default_capath) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_SSLCERT, tls ? tls->cert : NULL) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_SSLKEY, tls ? tls->key : NULL) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, verify ? 1L : 0L) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, verify ? 2L : 0L) == CURLE_OK &&
           curl_easy_setopt(e, CURLOPT_SSLVERSION, (long)CURL_SSLVERSION_TLSv1_2) == CURLE_OK;
}

/* Drains finished transfers and runs their callbacks. Returns true when the client was destroyed meanwhile. */
static bool up_check_done(struct up_curl *c)
{
    struct up_client *cl = c->cl;
    CURLMsg *msg;
    int left = 0;
    up_dispatch_begin(cl);
    while (!cl->destroy_deferred && (msg = curl_multi_info_read(c->multi, &left)) != NULL) {
        if (msg->msg != CURLMSG_DONE)
            continue;
        CURL *easy = msg->easy_handle;
        CURLcode rc = msg->data.result; /* msg is invalid once the handle is removed */
        char *priv = NULL;
        curl_easy_getinfo(easy, CURLINFO_PRIVATE, &priv);
        struct curl_xfer *t = (struct curl_xfer *)(void *)priv;
        curl_multi_remove_handle(c->multi, easy);
        if (t == NULL)
            continue;
        enum up_result r = up_classify(t, rc);
        if (r == UP_OK) {
            long status = 0;
            if (curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status) == CURLE_OK && status > 0)
                t->b.resp.status = (int)status;
        }
        const char *err = "ok";
        if (rc != CURLE_OK)
            err = t->errbuf[0] ? t->errbuf : curl_easy_strerror(rc);
        if (r == UP_NO_RESPONSE && t->refused_resend)
            err = "connection closed without a response; libcurl's re-send was refused";
        if (r == UP_ERROR && t->malformed != NULL)
            err = t->malformed;
        up_deliver(cl, &t->b, r, err);
    }
    return up_dispatch_end(cl);
}

/* ---- the backend table */

static void *up_curl_create(struct up_client *cl)
{
    pthread_once(&up_global_once, up_global_init);
    if (up_global_rc != CURLE_OK) {
        cm_log(CM_ERROR, "upstream_init_failed", "error=\"%s\"", curl_easy_strerror(up_global_rc));
        return NULL;
    }
    struct up_curl *c = cm_calloc(1, sizeof *c);
    c->cl = cl;
    c->base = cl->base;
    c->multi = curl_multi_init();
    c->timer = evtimer_new(c->base, up_on_timer, c);
    if (c->multi == NULL || c->timer == NULL)
        goto fail;
    long max_host = cl->max_host;
    /* the connection cache defaults to 4 x the handles in use, which shrinks it right after a burst */
    long maxconnects = max_host > 0 ? max_host * 4 : 1024;
    if (curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, up_curl_socket_cb) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_SOCKETDATA, c) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, up_curl_timer_cb) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_TIMERDATA, c) != CURLM_OK ||
        curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, max_host) != CURLM_OK ||
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

static struct up_transfer *up_curl_send(void *state, const struct up_request *req, bool head, bool with_body,
                                        up_done_cb cb, void *arg, bool *taken)
{
    struct up_curl *c = state;
    const char *what = "request";
    *taken = true; /* the last backend: everything that reaches it is its own */
    struct curl_xfer *t = up_transfer_get(c);
    if (t == NULL)
        return NULL;
    CURL *e = t->easy;
    t->refused_resend = t->lease_lost = false;
    t->prereq_calls = 0;
    t->head = head;
    t->want_status = true;
    t->have_length = t->have_te = false;
    t->length = 0;
    t->malformed = NULL;
    t->errbuf[0] = '\0';
    up_transfer_begin(c->cl, &t->b, req, cb, arg);

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
    if (!up_set_tls(c, t, req->origin)) {
        what = "tls";
        goto fail;
    }
    UP_SET(e, CURLOPT_CONNECTTIMEOUT_MS, (long)req->connect_timeout_ms);
    UP_SET(e, CURLOPT_TIMEOUT_MS, (long)req->timeout_ms);
    /* whole seconds for libcurl, at least one; it has no use for a server's Keep-Alive: timeout= */
    UP_SET(e, CURLOPT_MAXAGE_CONN,
           req->keepalive_ms > 0 ? (long)(req->keepalive_ms >= 1000 ? req->keepalive_ms / 1000 : 1)
                                 : UP_MAX_IDLE_REUSE_S);
    UP_SET(e, CURLOPT_HTTPHEADER, t->hdr_list);
    UP_SET(e, CURLOPT_FORBID_REUSE, 0L); /* the header callback sets it for this transfer only */
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
    return &t->b;
fail:
    cm_log(CM_WARN, "upstream_send_failed", "step=%s", what);
    up_unlink(c->cl, &t->b);
    up_curl_release(c, &t->b, true);
    return NULL;
}

static void up_curl_cancel(void *state, struct up_transfer *bt)
{
    struct up_curl *c = state;
    curl_multi_remove_handle(c->multi, ((struct curl_xfer *)bt)->easy);
}

static void up_curl_destroy(void *state)
{
    struct up_curl *c = state;
    while (c->pool != NULL) {
        struct up_transfer *t = c->pool;
        c->pool = t->next;
        up_curl_release(c, t, false);
    }
    c->pool_n = 0;
    /* closes the cached connections through up_close_socket (c must still be valid) */
    curl_multi_cleanup(c->multi);
    for (size_t fd = 0; fd < c->socks_n; fd++)
        if (c->socks[fd] != NULL)
            up_sock_free(c, c->socks[fd]);
    free(c->socks);
    event_free(c->timer);
    free(c->default_ca);
    free(c->default_capath);
    free(c);
}

const struct up_backend up_curl_backend = {
    .name = "curl",
    .create = up_curl_create,
    .send = up_curl_send,
    .cancel = up_curl_cancel,
    .release = up_curl_release,
    .destroy = up_curl_destroy,
};
