/* transfer.c - the transfer core every backend uses: the running list, the pools, a transfer's start, delivery of
 * its result, the dispatch bracket and the client's teardown; it never names a backend (the facade fills the
 * client's table) and never parses an answer. */
#include "upstream/transfer.h"

#include <stdlib.h>
#include <time.h>

double up_elapsed(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + (double)(now.tv_nsec - start->tv_nsec) / 1e9;
}

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

bool up_may_send(struct up_transfer *t)
{
    if (t->send_until != NULL && cm_now_ms() >= *t->send_until)
        return false;
    t->leaving = true;
    return true;
}

/* ---- the client's teardown */

/* Stops a running transfer without calling back; pool false: free it rather than pool it. */
void up_stop(struct up_client *c, struct up_transfer *t, bool pool)
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
        c->be[i]->destroy(c->state[i]);
    free(c);
}

void up_client_teardown(struct up_client *c)
{
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
