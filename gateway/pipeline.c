/* pipeline.c - the request pipeline on the loop thread: claim the key,
 * forward once, store the answer (fenced), then answer; or replay, 409, 422. */
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/cache.h"
#include "gateway/gateway.h"
#include "gateway/probe.h"
#include "gateway/problem.h"
#include "store/order.h"
#include "store/store.h"
#include "upstream/upstream.h"

#define WAIT_BACKOFF_FIRST_MS 20
#define WAIT_BACKOFF_MAX_MS   500

static void claim(struct gw_job *job);
static void guard_start(struct gw_job *job);
static void guard_stop_timers(struct gw_job *job);
static bool guard_settle(struct gw_job *job, enum cm_outcome outcome);
static void forward_claimed(struct gw_job *job);
static void forward_passthrough(struct gw_job *job);

static void retry_after(struct gw_job *job, uint64_t ms)
{
    char v[32];
    uint64_t s = (ms + 999) / 1000;
    snprintf(v, sizeof v, "%llu", (unsigned long long)(s ? s : 1));
    cm_hdrs_add(&job->resp_hdrs, "Retry-After", v);
}

/* Frees *ev (NULL is a no-op) and clears it. */
static void event_clear(struct event **ev)
{
    if (*ev) {
        event_free(*ev);
        *ev = NULL;
    }
}

/* Arms ev (a timer) to fire in ms. */
static void timer_arm_ms(struct event *ev, uint64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    event_add(ev, &tv);
}

/* A persistent timer firing every third of the route's lease (at least every millisecond): lease renewals. */
static struct event *renew_every_third(struct gw_job *job, event_callback_fn cb)
{
    uint64_t lease = job->route->idem.lease_ms;
    struct event *ev = event_new(gw_loop_base(job->loop), -1, EV_PERSIST, cb, job);
    timer_arm_ms(ev, lease / 3 ? lease / 3 : 1);
    return ev;
}

/* The next wait of a doubling backoff that ends at deadline: *cur, cut to what is left (0 once it passed); *cur
 * doubles up to max. */
static uint64_t backoff_next(uint64_t *cur, uint64_t now, uint64_t deadline, uint64_t max)
{
    uint64_t d = now < deadline ? (now + *cur > deadline ? deadline - now : *cur) : 0;
    *cur = *cur * 2 > max ? max : *cur * 2;
    return d;
}

static struct store_id job_id(const struct gw_job *job)
{
    struct store_id id;
    id.route = job->route->name;
    memcpy(id.scope, job->scope, sizeof id.scope);
    id.key = job->key;
    id.key_len = job->key_len;
    return id;
}

static void stop_timers(struct gw_job *job)
{
    event_clear(&job->timer);
    event_clear(&job->renew_timer);
    guard_stop_timers(job);
}

/* A lease renewal in flight refers to its job through a ticket, so that the
 * job can be answered (and freed by the front) before the renewal's callback
 * runs: finish() detaches the ticket and the callback then only frees it. */
struct renew_ticket {
    struct gw_job *job;
};

/* The answer is ready: count it and hand the job back to the front. */
static void finish(struct gw_job *job, enum cm_outcome outcome)
{
    if (guard_settle(job, outcome))
        return; /* finish runs again once the resource's marker is settled */
    stop_timers(job);
    job->outcome = outcome;
    if (job->renew_ticket) {
        job->renew_ticket->job = NULL;
        job->renew_ticket = NULL;
    }
    cm_metric_request(job->route_index, outcome);
    gw_loop_job_remove(job->loop, job);
    gw_job_done(job);
}

/* Moves an upstream (or stored) answer into the job's answer. */
static void take_resp(struct gw_job *job, struct cm_resp *r)
{
    cm_hdrs_free(&job->resp_hdrs);
    cm_buf_free(&job->resp_body);
    job->status = r->status;
    job->resp_hdrs = r->hdrs;
    job->resp_body = r->body;
    cm_hdrs_init(&r->hdrs);
    cm_buf_init(&r->body, 0);
}

static bool method_is_idempotent(const char *m)
{
    static const char *const safe[] = {"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"};
    for (size_t i = 0; i < sizeof safe / sizeof safe[0]; i++)
        if (strcmp(m, safe[i]) == 0)
            return true;
    return false;
}

static size_t max_response(const struct gw_job *job)
{
    return job->route ? (size_t)job->route->idem.max_response : (size_t)job->conf->max_response;
}

static bool is_release_status(const struct gw_job *job, int status)
{
    const struct conf_idem *im = &job->route->idem;
    for (size_t i = 0; i < im->release_statuses_n; i++)
        if (im->release_statuses[i] == status)
            return true;
    return false;
}

/* ---- passthrough */

static void passthrough_done(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    struct gw_job *job = arg;
    job->transfer = NULL;
    cm_metric_upstream_seconds(secs);
    switch (r) {
    case UP_OK:
        take_resp(job, resp);
        finish(job, CM_OUT_FORWARDED);
        return;
    case UP_CONNECT_FAILED:
        gw_job_problem(job, 502, "upstream-unavailable", "Upstream unavailable", "the upstream could not be reached");
        finish(job, CM_OUT_UPSTREAM_UNAVAILABLE);
        return;
    case UP_TIMEOUT:
        gw_job_problem(job, 504, "upstream-timeout", "Upstream timeout", "the upstream did not answer in time");
        finish(job, CM_OUT_UPSTREAM_TIMEOUT);
        return;
    case UP_TOO_LARGE:
        gw_job_problem(job, 502, "upstream-response-too-large", "Upstream response too large",
                       "the upstream's answer exceeds max_response");
        finish(job, CM_OUT_ERROR);
        return;
    case UP_INVALID_RESPONSE:
        cm_log(CM_WARN, "upstream_invalid_response", "detail=\"%s\"", errmsg ? errmsg : "");
        gw_job_problem(job, 502, "upstream-invalid-response", "Invalid response from upstream",
                       "the upstream's answer is not a valid HTTP response the gateway can pass on");
        finish(job, CM_OUT_ERROR);
        return;
    default:
        cm_log(CM_WARN, "upstream_error", "result=%s detail=\"%s\"", up_result_name(r), errmsg ? errmsg : "");
        gw_job_problem(job, 502, "upstream-no-response", "No response from upstream",
                       "the upstream closed the connection without an answer");
        finish(job, CM_OUT_UPSTREAM_NO_RESPONSE);
        return;
    }
}

/* Sends the job to its configured upstream: the connection goes to the origin parsed from the configuration, the
 * request's own target only becomes the path and query (base path + target), so no target can choose the host.
 * false: nothing was sent (a target up_send refuses, or the transfer could not start). */
static bool forward(struct gw_job *job, up_done_cb cb)
{
    const struct conf_upstream *u = job->upstream;
    if (job->uri == NULL || job->uri[0] != '/')
        return false;
    struct cm_buf target;
    cm_buf_init(&target, 64 * 1024);
    if (!cm_buf_appendf(&target, "%s%s", u->base_path, job->uri)) {
        cm_buf_free(&target);
        return false;
    }
    struct up_origin origin = {.https = u->https, .host = u->host, .port = u->port, .ip_literal = u->host_is_ip};
    struct up_request req = {
        .method = job->method,
        .origin = &origin,
        .target = target.data,
        .hdrs = &job->fwd_hdrs,
        .body = job->body.data,
        .body_len = job->body.len,
        .connect_timeout_ms = u->connect_timeout_ms,
        .timeout_ms = u->timeout_ms,
        .max_response = max_response(job),
        .max_header_bytes = (size_t)job->conf->max_response_header_bytes,
        .no_resend = job->idempotent || !method_is_idempotent(job->method),
        .max_connections = gw_loop_upstream_max(job->loop, u),
    };
    job->transfer = up_send(gw_loop_upstream(job->loop), &req, cb, job);
    cm_buf_free(&target);
    return job->transfer != NULL;
}

/* ---- idempotent: after the upstream answered or failed */

static void answer_after_store(void *arg, bool ok, long rows)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    finish(job, job->outcome);
}

static void completed(void *arg, bool ok, long rows)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    if (!ok || rows == 0) {
        cm_metric_completion_failure(job->route_index);
        cm_log(CM_ERROR, "completion_failed", "route=%s reason=%s", job->route->name,
               ok ? "fenced_out" : "store_unavailable");
    } else {
        gw_cache_completed(job);
    }
    take_resp(job, &job->up_resp);
    finish(job, CM_OUT_FORWARDED);
}

static void idem_forward_done(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    struct gw_job *job = arg;
    struct store *st = gw_loop_store(job->loop);
    struct store_id id = job_id(job);
    const struct conf_idem *im = &job->route->idem;
    job->transfer = NULL;
    cm_metric_upstream_seconds(secs);
    /* The lease is renewed until the record is settled (finish() stops it):
     * a completion retried while Postgres restarts must not let it lapse. */
    switch (r) {
    case UP_OK:
        if (is_release_status(job, resp->status)) {
            take_resp(job, resp);
            job->outcome = CM_OUT_RELEASED;
            job->store_pending = true;
            store_release(st, &id, job->token, im->lease_ms, answer_after_store, job);
            return;
        }
        job->up_resp = *resp;
        cm_hdrs_init(&resp->hdrs);
        cm_buf_init(&resp->body, 0);
        job->store_pending = true;
        gw_cache_before_store(job);
        store_complete(st, &id, job->token, &job->up_resp, im->retention_ms, im->lease_ms, completed, job);
        return;
    case UP_CONNECT_FAILED:
        gw_job_problem(job, 502, "upstream-unavailable", "Upstream unavailable",
                       "the upstream could not be reached; nothing was sent and the key was released");
        job->outcome = CM_OUT_UPSTREAM_UNAVAILABLE;
        job->store_pending = true;
        store_release(st, &id, job->token, im->lease_ms, answer_after_store, job);
        return;
    case UP_TIMEOUT:
        gw_job_problem(job, 504, "upstream-timeout", "Upstream timeout",
                       "the request was sent but no answer came in time; its outcome is unknown");
        job->outcome = CM_OUT_UPSTREAM_TIMEOUT;
        break;
    case UP_TOO_LARGE:
        gw_job_problem(job, 502, "upstream-response-too-large", "Upstream response too large",
                       "the upstream executed the request but its answer exceeds max_response and cannot be "
                       "stored; the outcome is recorded as unknown");
        job->outcome = CM_OUT_ERROR;
        break;
    case UP_INVALID_RESPONSE:
        cm_log(CM_WARN, "upstream_invalid_response", "route=%s detail=\"%s\"", job->route->name, errmsg ? errmsg : "");
        gw_job_problem(job, 502, "upstream-invalid-response", "Invalid response from upstream",
                       "the request was sent but the upstream's answer is not a valid HTTP response; nothing was "
                       "stored and the outcome is recorded as unknown");
        job->outcome = CM_OUT_ERROR;
        break;
    default:
        cm_log(CM_WARN, "upstream_error", "route=%s result=%s detail=\"%s\"", job->route->name, up_result_name(r),
               errmsg ? errmsg : "");
        gw_job_problem(job, 502, "upstream-no-response", "No response from upstream",
                       "the request was sent but the upstream closed the connection without an answer; its "
                       "outcome is unknown");
        job->outcome = CM_OUT_UPSTREAM_NO_RESPONSE;
        break;
    }
    job->store_pending = true;
    store_mark_unknown(st, &id, job->token, im->lease_ms, im->lease_ms, answer_after_store, job);
}

static void renewed(void *arg, bool ok, long rows)
{
    struct renew_ticket *t = arg;
    struct gw_job *job = t->job;
    free(t);
    if (!job)
        return; /* answered meanwhile */
    job->renew_ticket = NULL;
    if (ok && rows == 0)
        cm_log(CM_WARN, "lease_lost", "route=%s", job->route->name);
}

static void renew_tick(evutil_socket_t fd, short what, void *arg)
{
    struct gw_job *job = arg;
    if (job->renew_ticket)
        return; /* the previous renewal is still running */
    struct renew_ticket *t = cm_malloc(sizeof *t);
    t->job = job;
    job->renew_ticket = t;
    struct store_id id = job_id(job);
    store_renew(gw_loop_store(job->loop), &id, job->token, job->route->idem.lease_ms, renewed, t);
}

static void wait_tick(evutil_socket_t fd, short what, void *arg)
{
    claim(arg);
}

/* The key is this request's under token: renew its lease until settled, forward once, store what comes back. */
static void forward_owned(struct gw_job *job, uint64_t token)
{
    job->token = token;
    job->renew_timer = renew_every_third(job, renew_tick);
    if (job->ordered)
        guard_start(job); /* SPEC 6: the guard comes after the idempotency record */
    else
        forward_claimed(job);
}

/* ---- mode: shadow: claimed and recorded as enforce would, but every request is forwarded and answered by the
 * upstream; the decision enforce would have taken is counted (and logged unless new). */

static void forward_plain(struct gw_job *job)
{
    if (!forward(job, passthrough_done)) {
        gw_job_problem(job, 502, "upstream-unavailable", "Upstream unavailable", "the transfer could not start");
        finish(job, CM_OUT_UPSTREAM_UNAVAILABLE);
    }
}

static void shadow_claimed(void *arg, struct store_claim_res *res)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    enum cm_shadow d;
    switch (res->verdict) {
    case STORE_NEW:
        cm_metric_shadow_decision(job->route_index, CM_SHADOW_NEW);
        forward_owned(job, res->token); /* recorded, so that a later retry can be classified */
        return;
    case STORE_REPLAY:
        d = CM_SHADOW_REPLAY;
        break;
    case STORE_MISMATCH:
        d = CM_SHADOW_MISMATCH;
        break;
    case STORE_IN_FLIGHT:
    case STORE_UNKNOWN: /* enforce would answer 409 (in use, or outcome unknown) */
        d = CM_SHADOW_IN_FLIGHT;
        break;
    case STORE_UNAVAILABLE:
    default:
        /* the store never fails a shadow request: forwarded, no decision */
        cm_metric_shadow_store_error(job->route_index);
        cm_log(CM_WARN, "shadow_store_error", "route=%s detail=\"%s\"", job->route->name, res->err ? res->err : "");
        forward_plain(job);
        return;
    }
    /* TODO(ordering): "stale" needs the ordering guard (SPEC 6); until it is merged no request is classified so */
    cm_metric_shadow_decision(job->route_index, d);
    cm_log(CM_INFO, "shadow_decision", "decision=%s route=%s", cm_shadow_name(d), job->route->name);
    forward_plain(job); /* the record is left as it is: only the first request of a key owns it */
}

static void answer_unknown(struct gw_job *job)
{
    gw_job_problem(job, 409, "idempotency-outcome-unknown", "Outcome unknown",
                   "an earlier request with this key was sent upstream but its outcome is unknown; an "
                   "operator must release the key before it can be retried");
    finish(job, CM_OUT_UNKNOWN);
}

/* ---- on_unknown: probe: the upstream is asked whether the unknown outcome executed (gateway/probe.c) */

static void probe_answered(void *arg, enum gw_probe_result r, struct cm_resp *resp)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    switch (r) {
    case GW_PROBE_FOUND: /* the looked-up answer is the record's answer now: replayed */
        take_resp(job, resp);
        job->replayed = true;
        cm_metric_dedup_hit(job->route_index);
        finish(job, CM_OUT_REPLAYED);
        return;
    case GW_PROBE_ABSENT: /* nothing executed and the record is gone: this retry claims the key afresh */
    case GW_PROBE_BUSY:   /* another prober holds it: the claim answers (in flight, or what it found) */
        claim(job);
        return;
    case GW_PROBE_STORE:
        gw_job_problem(job, 503, "store-unavailable", "Store unavailable",
                       "the idempotency store cannot be reached; nothing was forwarded");
        retry_after(job, 1000);
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    case GW_PROBE_UNRESOLVED:
    default:
        answer_unknown(job);
        return;
    }
}

static void probe_unknown(struct gw_job *job)
{
    struct store_id id = job_id(job);
    job->probed = true; /* once per request: a second unknown verdict is answered 409 */
    job->store_pending = true;
    gw_probe_run(gw_loop_probe(job->loop), job->route_index, &id, probe_answered, job);
}

static void claimed(void *arg, struct store_claim_res *res)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    const struct conf_idem *im = &job->route->idem;
    switch (res->verdict) {
    case STORE_NEW:
        forward_owned(job, res->token);
        return;
    case STORE_REPLAY:
        gw_cache_replayed(job, res);
        take_resp(job, &res->resp);
        job->replayed = true;
        cm_metric_dedup_hit(job->route_index);
        finish(job, CM_OUT_REPLAYED);
        return;
    case STORE_MISMATCH:
        cm_metric_parameter_conflict(job->route_index);
        gw_job_problem(job, 422, "idempotency-key-mismatch", "Idempotency key reused with another request",
                       "this key was already used with a different request payload");
        finish(job, CM_OUT_MISMATCH);
        return;
    case STORE_IN_FLIGHT:
        if (im->on_in_flight == CONF_IN_FLIGHT_WAIT) {
            uint64_t now = cm_now_ms();
            if (!job->wait_deadline_ms) {
                job->wait_deadline_ms = now + im->wait_ms;
                job->wait_backoff_ms = WAIT_BACKOFF_FIRST_MS;
            }
            if (now < job->wait_deadline_ms) {
                uint64_t d = backoff_next(&job->wait_backoff_ms, now, job->wait_deadline_ms, WAIT_BACKOFF_MAX_MS);
                if (!job->timer)
                    job->timer = evtimer_new(gw_loop_base(job->loop), wait_tick, job);
                timer_arm_ms(job->timer, d);
                return;
            }
        }
        cm_metric_in_flight_conflict(job->route_index);
        gw_job_problem(job, 409, "idempotency-key-in-use", "Idempotency key in use",
                       "a request with this key is still being processed; retry later");
        retry_after(job, res->lease_remaining_ms < im->lease_ms ? res->lease_remaining_ms : im->lease_ms);
        finish(job, CM_OUT_IN_FLIGHT);
        return;
    case STORE_UNKNOWN:
        if (im->on_unknown == CONF_UNKNOWN_PROBE && !job->probed) {
            probe_unknown(job);
            return;
        }
        answer_unknown(job);
        return;
    case STORE_UNAVAILABLE:
    default:
        cm_log(CM_WARN, "store_unavailable", "route=%s detail=\"%s\"", job->route->name, res->err ? res->err : "");
        gw_job_problem(job, 503, "store-unavailable", "Store unavailable",
                       "the idempotency store cannot be reached; nothing was forwarded");
        retry_after(job, 1000);
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    }
}

/* The key is ours (and the resource's marker, when guarded): send it. */
static void forward_claimed(struct gw_job *job)
{
    if (!forward(job, idem_forward_done)) {
        gw_job_problem(job, 502, "upstream-unavailable", "Upstream unavailable", "the transfer could not start");
        job->outcome = CM_OUT_UPSTREAM_UNAVAILABLE;
        struct store_id id = job_id(job);
        job->store_pending = true;
        store_release(gw_loop_store(job->loop), &id, job->token, job->route->idem.lease_ms, answer_after_store, job);
    }
}

static void forward_passthrough(struct gw_job *job)
{
    if (!forward(job, passthrough_done)) {
        gw_job_problem(job, 502, "upstream-unavailable", "Upstream unavailable", "the transfer could not start");
        finish(job, CM_OUT_UPSTREAM_UNAVAILABLE);
    }
}

static void claim(struct gw_job *job)
{
    const struct conf_idem *im = &job->route->idem;
    struct store_claim_req req;
    memset(&req, 0, sizeof req);
    req.id = job_id(job);
    req.route_index = job->route_index;
    memcpy(req.fp, job->fp, sizeof req.fp);
    req.lease_ms = im->lease_ms;
    req.retention_ms = im->retention_ms;
    req.takeover_unknown = im->on_unknown == CONF_UNKNOWN_RETRY;
    struct store_claim_res cached;
    if (gw_cache_claim(job, &cached)) { /* a completed record held in memory: no store round trip */
        claimed(job, &cached);
        cm_resp_free(&cached.resp);
        return;
    }
    job->store_pending = true;
    gw_cache_before_store(job);
    store_claim(gw_loop_store(job->loop), &req, job->shadow ? shadow_claimed : claimed, job);
}

void gw_pipeline_run(void *arg)
{
    struct gw_job *job = arg;
    gw_loop_job_add(job->loop, job);
    if (gw_loop_closing(job->loop)) {
        gw_job_problem(job, 503, "shutting-down", "Shutting down", "the gateway is stopping");
        finish(job, CM_OUT_ERROR);
        return;
    }
    if (!up_target_ok(job->uri)) {
        /* never "repaired" into something to send: a target the upstream clients refuse goes nowhere */
        gw_job_problem(job, 400, "bad-request", "Bad request", "the request target is not an origin-form path");
        finish(job, CM_OUT_ERROR);
        return;
    }
    if (!job->idempotent && !job->ordered) {
        forward_passthrough(job);
        return;
    }
    if (!gw_loop_schema_ready(job->loop) && job->shadow) {
        cm_metric_shadow_store_error(job->route_index);
        forward_plain(job); /* the store never fails a shadow request */
        return;
    }
    if (!gw_loop_schema_ready(job->loop)) {
        gw_job_problem(job, 503, "store-unavailable", "Store unavailable",
                       "the idempotency store is not ready yet; nothing was forwarded");
        retry_after(job, 1000);
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    }
    if (!job->idempotent) {
        guard_start(job); /* keyless on a guarded route: the guard alone */
        return;
    }
    claim(job);
}

void gw_pipeline_abort_all(void *arg)
{
    struct gw_loop *l = arg;
    gw_loop_set_closing(l);
    /* Jobs waiting for the store keep going (every store operation is
     * bounded); the others are answered now. */
    struct gw_job *job = gw_loop_first_job(l);
    while (job) {
        struct gw_job *next = job->next_active;
        if (!job->store_pending) {
            if (job->transfer) {
                up_cancel(gw_loop_upstream(l), job->transfer);
                job->transfer = NULL;
            }
            gw_job_problem(job, 503, "shutting-down", "Shutting down",
                           "the gateway stopped before this request finished; its outcome is unknown");
            finish(job, CM_OUT_ERROR);
        }
        job = next;
    }
}

/* ---- the ordering guard (SPEC 6): after the idempotency record, before forwarding */

#define GUARD_BACKOFF_FIRST_MS 10
#define GUARD_BACKOFF_MAX_MS   200

static struct store_order_id guard_id(const struct gw_job *job)
{
    struct store_order_id id;
    id.route = job->route->name;
    memcpy(id.scope, job->scope, sizeof id.scope);
    id.resource = job->resource;
    id.resource_len = job->resource_len;
    return id;
}

static void guard_stop_timers(struct gw_job *job)
{
    event_clear(&job->order_timer);
    event_clear(&job->order_renew_timer);
}

static void guard_settled(void *arg, bool ok)
{
    struct gw_job *job = arg;
    job->store_pending = false;
    finish(job, job->outcome);
}

/* finish() asks first: true when the job holds the resource's marker, whose settle now runs (finish comes
 * again from its callback). Nothing sent (released) leaves applied as it was; anything else may have executed
 * and counts as applied. */
static bool guard_settle(struct gw_job *job, enum cm_outcome outcome)
{
    if (job->order_waiting) {
        /* ended while waiting for the resource (shutdown): nothing was sent, the key's claim goes */
        job->order_waiting = false;
        guard_stop_timers(job);
        job->outcome = outcome;
        if (!job->idempotent)
            return false;
        struct store_id kid = job_id(job);
        job->store_pending = true;
        store_release(gw_loop_store(job->loop), &kid, job->token, job->route->idem.lease_ms, answer_after_store, job);
        return true;
    }
    if (!job->order_held)
        return false;
    job->order_held = false;
    job->outcome = outcome;
    guard_stop_timers(job);
    bool released = outcome == CM_OUT_RELEASED || outcome == CM_OUT_UPSTREAM_UNAVAILABLE ||
                    (outcome == CM_OUT_FORWARDED && !job->idempotent && is_release_status(job, job->status));
    struct store_order_id id = guard_id(job);
    job->store_pending = true;
    store_order_settle(store_order_of(gw_loop_store(job->loop)), &id, job->order_token,
                       released                      ? STORE_SETTLE_RELEASED
                       : outcome == CM_OUT_FORWARDED ? STORE_SETTLE_APPLIED
                                                     : STORE_SETTLE_UNKNOWN,
                       job->route->idem.lease_ms, guard_settled, job);
    return true;
}

static void guard_renew_tick(evutil_socket_t fd, short what, void *arg)
{
    struct gw_job *job = arg;
    struct store_order_id id = guard_id(job);
    store_order_renew(store_order_of(gw_loop_store(job->loop)), &id, job->order_token, job->route->idem.lease_ms);
}

static void guard_try(struct gw_job *job);

static void guard_wait_tick(evutil_socket_t fd, short what, void *arg)
{
    guard_try(arg);
}

/* A refusal answered: the statement deleted the key's claim with it (no record is left). */
static void guard_refuse(struct gw_job *job, const char *name, const char *title, const char *detail, int64_t applied)
{
    char extra[48];
    snprintf(extra, sizeof extra, "\"current\":%lld", (long long)applied);
    gw_job_problem_ext(job, 409, name, title, detail, extra);
}

static void guard_done(void *arg, const struct store_order_res *res)
{
    struct gw_job *job = arg;
    const struct conf_ordering *o = &job->route->ordering;
    job->store_pending = false;
    if (res->gap && !job->gap_counted) {
        job->gap_counted = true;
        cm_metric_sequence_gap(job->route_index);
    }
    uint64_t now = cm_now_ms();
    switch (res->verdict) {
    case STORE_ORDER_OK: {
        job->order_held = true;
        job->order_renew_timer = renew_every_third(job, guard_renew_tick);
        if (job->idempotent)
            forward_claimed(job);
        else
            forward_passthrough(job);
        return;
    }
    case STORE_ORDER_STALE:
        cm_metric_stale_rejection(job->route_index);
        guard_refuse(job, "stale-sequence", "Stale sequence",
                     "a request with this sequence or a higher one was already applied to this resource; nothing "
                     "was forwarded",
                     res->applied);
        finish(job, CM_OUT_ERROR);
        return;
    case STORE_ORDER_IN_USE:
    case STORE_ORDER_GAP:
        if (job->ordered_may_wait && (res->verdict == STORE_ORDER_IN_USE || o->on_gap == CONF_GAP_HOLD)) {
            /* not final: the statement kept the key's claim; try again after a backoff, within hold */
            uint64_t d = backoff_next(&job->order_backoff_ms, now, job->order_deadline_ms, GUARD_BACKOFF_MAX_MS);
            if (!job->order_timer)
                job->order_timer = evtimer_new(gw_loop_base(job->loop), guard_wait_tick, job);
            job->order_waiting = true;
            timer_arm_ms(job->order_timer, d);
            return;
        }
        if (res->verdict == STORE_ORDER_IN_USE) {
            cm_metric_in_flight_conflict(job->route_index);
            gw_job_problem(job, 409, "sequence-in-use", "Sequence in use",
                           "another request for this resource is still being processed; retry later");
            retry_after(job, res->lease_left_ms < o->hold_ms ? res->lease_left_ms : o->hold_ms);
            finish(job, CM_OUT_IN_FLIGHT);
            return;
        }
        guard_refuse(job, "sequence-gap", "Sequence gap",
                     "an earlier sequence of this resource has not been applied yet; nothing was forwarded",
                     res->applied);
        finish(job, CM_OUT_ERROR);
        return;
    case STORE_ORDER_UNAVAILABLE:
    default:
        gw_job_problem(job, 503, "store-unavailable", "Store unavailable",
                       "the ordering guard's store cannot be reached; nothing was forwarded");
        retry_after(job, 1000);
        if (job->idempotent) {
            struct store_id id = job_id(job);
            job->outcome = CM_OUT_STORE_UNAVAILABLE;
            job->store_pending = true;
            store_release(gw_loop_store(job->loop), &id, job->token, job->route->idem.lease_ms, answer_after_store,
                          job);
            return;
        }
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    }
}

static void guard_try(struct gw_job *job)
{
    const struct conf_ordering *o = &job->route->ordering;
    job->order_waiting = false;
    struct store_order_req req;
    memset(&req, 0, sizeof req);
    req.id = guard_id(job);
    req.seq = job->seq;
    req.token = job->order_token;
    req.lease_ms = job->route->idem.lease_ms;
    req.on_gap = o->on_gap == CONF_GAP_REJECT ? STORE_GAP_REJECT
                 : o->on_gap == CONF_GAP_HOLD ? STORE_GAP_HOLD
                                              : STORE_GAP_ACCEPT;
    req.may_wait = job->ordered_may_wait = cm_now_ms() < job->order_deadline_ms;
    if (job->idempotent) {
        req.key = job->key;
        req.key_len = job->key_len;
    }
    job->store_pending = true;
    store_order_acquire(store_order_of(gw_loop_store(job->loop)), &req, guard_done, job);
}

static void guard_start(struct gw_job *job)
{
    job->order_token = job->idempotent ? job->token : cm_random_token();
    job->order_deadline_ms = cm_now_ms() + job->route->ordering.hold_ms;
    job->order_backoff_ms = GUARD_BACKOFF_FIRST_MS;
    guard_try(job);
}
