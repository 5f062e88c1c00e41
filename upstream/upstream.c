/* upstream.c - the upstream facade: up_send hands a request to the first backend that takes it (the built-in h1
 * client for http:// origins at an IP literal, libcurl for the others), and the code both backends share: result
 * delivery, the response head validation, the header rules, the running list and the pools. */
#include "upstream/upstream.h"
#include "upstream/internal.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* Asked in this order: h1 takes what it can, libcurl the rest. */
static const struct up_backend *const up_backends[UP_BE_N] = {
    [UP_BE_H1] = &up_h1_backend,
    [UP_BE_CURL] = &up_curl_backend,
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
    case UP_LEASE_LOST:
        return "lease_lost";
    }
    return "unknown";
}

double up_elapsed(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + (double)(now.tv_nsec - start->tv_nsec) / 1e9;
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

bool up_status_form_ok(const char *p, size_t n)
{
    return n >= 12 && memcmp(p, "HTTP/1.", 7) == 0 && (p[7] == '0' || p[7] == '1') && p[8] == ' ' && p[9] >= '1' &&
           p[9] <= '5' && p[10] >= '0' && p[10] <= '9' && p[11] >= '0' && p[11] <= '9' && (n == 12 || p[12] == ' ');
}

bool up_header_split(const char *p, size_t len, size_t *name_len, const char **value, size_t *value_len)
{
    const char *colon = memchr(p, ':', len);
    if (colon == NULL)
        return false;
    size_t nl = (size_t)(colon - p);
    const char *v = colon + 1;
    size_t vl = len - nl - 1;
    while (vl > 0 && (*v == ' ' || *v == '\t')) {
        v++;
        vl--;
    }
    while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\t'))
        vl--;
    *name_len = nl;
    *value = v;
    *value_len = vl;
    return true;
}

bool up_content_length(const char *v, size_t vl, bool *have, uint64_t *length)
{
    uint64_t x;
    if (!cm_parse_digits(v, vl, 19, &x) || (*have && *length != x))
        return false;
    *have = true;
    *length = x;
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
    t->cb = NULL;
    t->arg = NULL;
    t->prev = NULL;
    t->next = *pool;
    *pool = t;
    (*n)++;
    return true;
}

void up_trim_buf(char **mem, size_t *cap)
{
    if (*cap > UP_HDR_MEM_KEEP) {
        free(*mem);
        *mem = NULL;
        *cap = 0;
    }
}

void up_transfer_begin(struct up_client *c, struct up_transfer *t, const struct up_request *req, up_done_cb cb,
                       void *arg)
{
    t->c = c;
    t->cb = cb;
    t->arg = arg;
    t->no_resend = req->no_resend;
    t->hdr_bytes = 0;
    t->max_head = req->max_header_bytes > 0 ? req->max_header_bytes : UP_DEFAULT_MAX_HEAD;
    t->invalid_why = NULL;
    t->invalid = t->hdrs_final = t->too_large = t->done = t->leaving = false;
    t->send_until = req->send_until_ms;
    cm_resp_init(&t->resp, req->max_response);
    cm_buf_init_counted(&t->resp.body, req->max_response); /* SPEC 7 limits.buffers: full, it is too large */
    clock_gettime(CLOCK_MONOTONIC, &t->start);
    up_link(c, t);
}

static void up_destroy_now(struct up_client *c);

void up_dispatch_begin(struct up_client *c)
{
    c->dispatching++;
}

bool up_dispatch_end(struct up_client *c)
{
    c->dispatching--;
    if (c->destroy_deferred && c->dispatching == 0) {
        up_destroy_now(c);
        return true;
    }
    return false;
}

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
    up_dispatch_begin(c);
    t->cb(t->arg, r, &t->resp, err, up_elapsed(&t->start));
    t->be->release(t->bs, t, true);
    return up_dispatch_end(c);
}

/* ---- the client */

struct up_client *up_client_create(struct event_base *base, long max_host_connections)
{
    if (base == NULL || max_host_connections < 0)
        return NULL;
    struct up_client *c = cm_calloc(1, sizeof *c);
    c->base = base;
    c->max_host = max_host_connections;
    for (size_t i = 0; i < UP_BE_N; i++) {
        c->state[i] = up_backends[i]->create(c);
        if (c->state[i] == NULL) {
            cm_log(CM_ERROR, "upstream_init_failed", "backend=%s", up_backends[i]->name);
            while (i-- > 0)
                up_backends[i]->destroy(c->state[i]);
            free(c);
            return NULL;
        }
    }
    return c;
}

/* Stops a running transfer without calling back; pool false: free it rather than pool it. */
static void up_stop(struct up_client *c, struct up_transfer *t, bool pool)
{
    t->be->cancel(t->bs, t);
    up_unlink(c, t);
    t->be->release(t->bs, t, pool);
}

static void up_destroy_now(struct up_client *c)
{
    c->closing = true;
    while (c->transfers != NULL)
        up_stop(c, c->transfers, false);
    for (size_t i = 0; i < UP_BE_N; i++)
        up_backends[i]->destroy(c->state[i]);
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

/* The length and framing are the backend's (from the body it sends), hop-by-hop headers never travel. One compare
 * for most names (dispatch on the first letter). */
enum up_hdr_kind up_hdr_kind(const char *name)
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

struct up_transfer *up_send(struct up_client *c, const struct up_request *req, up_done_cb cb, void *arg)
{
    if (c == NULL || req == NULL || cb == NULL || req->method == NULL || req->origin == NULL ||
        req->origin->host == NULL || req->origin->port == 0 || !up_target_ok(req->target) ||
        (req->body == NULL && req->body_len > 0) || c->destroy_deferred)
        return NULL;
    /* SPEC 7: a HEAD's answer has no body, whatever the request carried; the request's own body is not sent (a
     * server that does not read a HEAD's body, as libevent's evhttp does not, would take it for the next request) */
    bool head = strcmp(req->method, "HEAD") == 0;
    bool with_body = !head && up_has_body(req);
    for (size_t i = 0; i < UP_BE_N; i++) {
        bool taken = false;
        struct up_transfer *t = up_backends[i]->send(c->state[i], req, head, with_body, cb, arg, &taken);
        if (taken)
            return t;
    }
    return NULL;
}

void up_cancel(struct up_client *c, struct up_transfer *t)
{
    if (c == NULL || t == NULL || t->done)
        return;
    up_stop(c, t, true);
}

bool up_may_send(struct up_transfer *t)
{
    if (t->send_until != NULL && cm_now_ms() >= *t->send_until)
        return false;
    t->leaving = true;
    return true;
}

bool up_drop_unsent(struct up_client *c, struct up_transfer *t)
{
    if (c == NULL || t == NULL || t->done || t->leaving)
        return false;
    up_stop(c, t, true);
    return true;
}

size_t up_active(const struct up_client *c)
{
    return c ? c->active : 0;
}
