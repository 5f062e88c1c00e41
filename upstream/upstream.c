/* upstream.c - the upstream facade: the client's creation (it fills the backend table), up_send handing a request
 * to the first backend that takes it (the built-in h1 client for http:// origins at an IP literal, libcurl for the
 * others), up_cancel; never a backend's own state, never the head rules (head.c) or the transfer core (transfer.c). */
#include "upstream/upstream.h"
#include "upstream/curl.h"
#include "upstream/h1.h"
#include "upstream/transfer.h"

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

/* ---- the client */

struct up_client *up_client_create(struct event_base *base, long max_host_connections)
{
    if (base == NULL || max_host_connections < 0)
        return NULL;
    struct up_client *c = cm_calloc(1, sizeof *c);
    c->base = base;
    c->max_host = max_host_connections;
    for (size_t i = 0; i < UP_BE_N; i++)
        c->be[i] = up_backends[i];
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

void up_client_destroy(struct up_client *c)
{
    if (c != NULL)
        up_client_teardown(c);
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
        struct up_transfer *t = c->be[i]->send(c->state[i], req, head, with_body, cb, arg, &taken);
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
