/* pipeline.c - the request pipeline on the loop thread: claim the key,
 * forward once, store the answer (fenced), then answer; or replay, 409, 422.
 * A job's state lives in struct gw_pipe, private to this file; its life cycle is one explicit state
 * (set_state checks every transition), and what an upstream result means is one table (gw_outcome_for). It works with
 * the job's context (job->ctx) and never calls the front or the loop: the answer goes back through job->done_cb. */
#include "gateway/access.h"
#include "gateway/pipeline.h"

#include <event2/event.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/recent.h"
#include "gateway/cache.h"
#include "gateway/gateway.h"
#include "gateway/ctx.h"
#include "gateway/hints.h"
#include "gateway/owned.h"
#include "gateway/probe.h"
#include "gateway/problem.h"
#include "gateway/spans.h"
#include "store/order.h"
#include "store/store.h"

#define WAIT_BACKOFF_FIRST_MS 20
#define WAIT_BACKOFF_MAX_MS   500

struct renew_ticket;

/* The pipeline's state of one job (loop thread only); the front never sees it. */
struct gw_pipe {
    struct gw_job_link link; /* the loop's list of running jobs */
    struct gw_job *job;
    enum gw_pipe_state state;
    enum cm_outcome outcome; /* the answer's outcome, kept while the record or the marker is settled */
    enum gw_effect effect;   /* what the request did upstream: how the guard settles the resource */
    uint64_t token;          /* fences the key's record */
    uint64_t fence;          /* the claim's fence, sent upstream with forward_token (store_claim_res.fence) */
    uint64_t wait_deadline_ms;
    bool prefer_waited; /* it waited for the first attempt because the client's Prefer: wait asked (job->prefer_wait) */
    uint64_t wait_backoff_ms;
    struct event *timer;       /* wait backoff */
    struct event *renew_timer; /* lease renewal */
    struct up_transfer *transfer;
    struct cm_resp up_resp;            /* upstream answer being stored */
    struct renew_ticket *renew_ticket; /* a lease renewal in flight */
    /* SPEC 8, a paused owner never acts: the request leaves only before send_until_ms (cm_now_ms), the earliest end
     * of the leases it holds (the key's claim, the resource's marker), each counted from the sending of the last
     * statement Postgres confirmed: sent + lease - lease / 4. The upstream reads it at the instant of sending. */
    uint64_t send_until_ms;
    uint64_t key_until_ms;             /* the key's claim (0: not held, or lost) */
    uint64_t order_until_ms;           /* the resource's marker (0: not held, or lost) */
    uint64_t claim_sent_ms;            /* the claim statement was handed to the store then */
    uint64_t order_sent_ms;            /* the guard's acquire was handed to the store then */
    bool bounded;                      /* send_until_ms applies to the request (enforce, a key or a marker held) */
    bool order_owned;                  /* the marker is in this process's table (gateway/owned.c) */
    struct renew_ticket *order_ticket; /* a marker renewal in flight */
    bool probed;                       /* on_unknown: probe asked the upstream once for this request */
    bool owned;                        /* its key is in this process's table of keys in flight (gateway/owned.c) */
    uint64_t started_ms;               /* when the pipeline took the job (bounds a cache entry's life) */
    uint64_t cache_epoch;              /* replay cache epoch taken before the store call (gateway/cache.h) */

    /* ordering guard (SPEC 6; gateway/ordering.c, store/order.h) */
    uint64_t order_token;       /* fences the resource's in-flight marker */
    bool order_held;            /* this job holds the marker (settled before the answer) */
    bool gap_counted;           /* idemgate_sequence_gaps_total counted it once */
    bool ordered_may_wait;      /* the last guard statement was sent within hold (a refusal not final) */
    uint64_t order_deadline_ms; /* hold bound of the in-flight and gap waits */
    uint64_t order_backoff_ms;
    struct event *order_timer;       /* wait backoff */
    struct event *order_renew_timer; /* marker lease renewal */
    /* mode: shadow on a guarded route: the guard is read, never taken (SPEC 10) */
    bool shadow_advance; /* advance the resource's applied sequence once the request executed */
    bool shadow_stale;   /* enforce would have refused it stale: its key's claim goes once it was answered */
};

/* ---- the life cycle */

#define ST(s) (1u << (s))
/* Where each state may go. */
static const unsigned next_states[GW_PIPE__COUNT] = {
    [GW_PIPE_NEW] = ST(GW_PIPE_CLAIMING) | ST(GW_PIPE_GUARDING) | ST(GW_PIPE_FORWARDING) | ST(GW_PIPE_DONE),
    [GW_PIPE_CLAIMING] =
        ST(GW_PIPE_FORWARDING) | ST(GW_PIPE_GUARDING) | ST(GW_PIPE_WAITING) | ST(GW_PIPE_PROBING) | ST(GW_PIPE_DONE),
    [GW_PIPE_WAITING] = ST(GW_PIPE_CLAIMING) | ST(GW_PIPE_DONE),
    [GW_PIPE_PROBING] = ST(GW_PIPE_CLAIMING) | ST(GW_PIPE_DONE),
    [GW_PIPE_GUARDING] = ST(GW_PIPE_FORWARDING) | ST(GW_PIPE_GUARD_WAIT) | ST(GW_PIPE_RECORDING) | ST(GW_PIPE_DONE),
    [GW_PIPE_GUARD_WAIT] = ST(GW_PIPE_GUARDING) | ST(GW_PIPE_RECORDING) | ST(GW_PIPE_DONE),
    [GW_PIPE_FORWARDING] = ST(GW_PIPE_RECORDING) | ST(GW_PIPE_UNGUARDING) | ST(GW_PIPE_DONE),
    [GW_PIPE_RECORDING] = ST(GW_PIPE_UNGUARDING) | ST(GW_PIPE_DONE),
    [GW_PIPE_UNGUARDING] = ST(GW_PIPE_DONE),
    [GW_PIPE_DONE] = 0,
};
/* The states in which a store callback will come back to the job (shutdown waits for them). */
static const unsigned store_states =
    ST(GW_PIPE_CLAIMING) | ST(GW_PIPE_PROBING) | ST(GW_PIPE_GUARDING) | ST(GW_PIPE_RECORDING) | ST(GW_PIPE_UNGUARDING);

const char *gw_pipe_state_name(enum gw_pipe_state s)
{
    static const char *const names[GW_PIPE__COUNT] = {
        "new",        "claiming",   "waiting",   "probing",    "guarding",
        "guard_wait", "forwarding", "recording", "unguarding", "done",
    };
    return (unsigned)s < GW_PIPE__COUNT ? names[s] : "invalid";
}

bool gw_pipe_transition_ok(enum gw_pipe_state a, enum gw_pipe_state b)
{
    return (unsigned)a < GW_PIPE__COUNT && (unsigned)b < GW_PIPE__COUNT && (next_states[a] & ST(b)) != 0;
}

/* Every change of a job's state goes through here. An illegal one is a bug: logged, and fatal unless NDEBUG. */
static void set_state(struct gw_job *job, enum gw_pipe_state s)
{
    struct gw_pipe *p = job->pipe;
    if (!gw_pipe_transition_ok(p->state, s)) {
        cm_log(CM_ERROR, "pipeline_bad_transition", "from=%s to=%s", gw_pipe_state_name(p->state),
               gw_pipe_state_name(s));
#ifndef NDEBUG
        abort();
#endif
    }
    p->state = s;
}

/* ---- the outcome table */

#define PASS   false
#define IDEM   true
#define SENT   true
#define UNSENT false

/* Sent, then closed or reset without a (well-framed) answer: SPEC 4's upstream-no-response, an unknown outcome. */
#define NO_ANSWER(mode, r)                                                                                             \
    {                                                                                                                  \
        mode, SENT, r, false, 502, "upstream-no-response", "No response from upstream",                                \
            (mode) ? "the request was sent but the upstream closed the connection without an answer; its outcome is "  \
                     "unknown"                                                                                         \
                   : "the upstream closed the connection without an answer",                                           \
            "upstream_error", (mode) ? GW_RECORD_MARK_UNKNOWN : GW_RECORD_NONE, GW_EFFECT_UNKNOWN,                     \
            (mode) ? CM_OUT_UNKNOWN : CM_OUT_UPSTREAM_ERROR                                                            \
    }

/* SPEC 8: the lease (the key's claim or the resource's marker) ended before the request could leave: nothing was
 * sent (503 with Retry-After). The record is left to whoever holds it now: the release is fenced by this request's
 * token, so it deletes the claim only when nobody took it over (a renewal Postgres, paused, never confirmed);
 * without it such a claim would lapse into an unknown outcome for a request that never left. */
#define LEASE_LOST(mode)                                                                                               \
    {                                                                                                                  \
        mode, SENT, UP_LEASE_LOST, false, 503, "store-unavailable", "Store unavailable",                               \
            "this gateway lost its lease on the request before it could be sent; nothing was forwarded", "not_sent",   \
            (mode) ? GW_RECORD_RELEASE : GW_RECORD_NONE, GW_EFFECT_NONE, CM_OUT_STORE_UNAVAILABLE                      \
    }

static const struct gw_outcome outcomes[] = {
    /* passthrough: no record; the guard (a keyless request on a guarded route) settles by the effect. SPEC 11: a
     * failure is upstream_error, as no record is left as an unknown outcome to settle */
    {PASS, SENT, UP_OK, false, 0, NULL, NULL, NULL, NULL, GW_RECORD_NONE, GW_EFFECT_APPLIED, CM_OUT_PASSTHROUGH},
    {PASS, SENT, UP_OK, true, 0, NULL, NULL, NULL, NULL, GW_RECORD_NONE, GW_EFFECT_NONE, CM_OUT_PASSTHROUGH},
    {PASS, SENT, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", "Upstream unavailable",
     "the upstream could not be reached", NULL, GW_RECORD_NONE, GW_EFFECT_NONE, CM_OUT_UPSTREAM_ERROR},
    {PASS, SENT, UP_TIMEOUT, false, 504, "upstream-timeout", "Upstream timeout", "the upstream did not answer in time",
     NULL, GW_RECORD_NONE, GW_EFFECT_UNKNOWN, CM_OUT_UPSTREAM_ERROR},
    NO_ANSWER(PASS, UP_NO_RESPONSE),
    {PASS, SENT, UP_TOO_LARGE, false, 502, "upstream-response-too-large", "Upstream response too large",
     "the upstream's answer exceeds max_response", NULL, GW_RECORD_NONE, GW_EFFECT_UNKNOWN, CM_OUT_UPSTREAM_ERROR},
    NO_ANSWER(PASS, UP_CANCELLED),
    NO_ANSWER(PASS, UP_ERROR),
    {PASS, SENT, UP_INVALID_RESPONSE, false, 502, "upstream-invalid-response", "Invalid response from upstream",
     "the upstream's answer is not a valid HTTP response the gateway can pass on", "upstream_invalid_response",
     GW_RECORD_NONE, GW_EFFECT_UNKNOWN, CM_OUT_UPSTREAM_ERROR},
    {PASS, UNSENT, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", "Upstream unavailable",
     "the transfer could not start", NULL, GW_RECORD_NONE, GW_EFFECT_NONE, CM_OUT_UPSTREAM_ERROR},
    LEASE_LOST(PASS),

    /* idempotent: the claimed key's record is completed, released or kept as an unknown outcome (SPEC 11: the
     * outcome unknown exactly when it is kept so; a release status the upstream answered is forwarded) */
    {IDEM, SENT, UP_OK, false, 0, NULL, NULL, NULL, NULL, GW_RECORD_COMPLETE, GW_EFFECT_APPLIED, CM_OUT_FORWARDED},
    {IDEM, SENT, UP_OK, true, 0, NULL, NULL, NULL, NULL, GW_RECORD_RELEASE, GW_EFFECT_NONE, CM_OUT_FORWARDED},
    {IDEM, SENT, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", "Upstream unavailable",
     "the upstream could not be reached; nothing was sent and the key was released", NULL, GW_RECORD_RELEASE,
     GW_EFFECT_NONE, CM_OUT_UPSTREAM_ERROR},
    {IDEM, SENT, UP_TIMEOUT, false, 504, "upstream-timeout", "Upstream timeout",
     "the request was sent but no answer came in time; its outcome is unknown", NULL, GW_RECORD_MARK_UNKNOWN,
     GW_EFFECT_UNKNOWN, CM_OUT_UNKNOWN},
    NO_ANSWER(IDEM, UP_NO_RESPONSE),
    {IDEM, SENT, UP_TOO_LARGE, false, 502, "upstream-response-too-large", "Upstream response too large",
     "the upstream executed the request but its answer exceeds max_response and cannot be stored; the outcome is "
     "recorded as unknown",
     NULL, GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, CM_OUT_UNKNOWN},
    NO_ANSWER(IDEM, UP_CANCELLED),
    NO_ANSWER(IDEM, UP_ERROR),
    {IDEM, SENT, UP_INVALID_RESPONSE, false, 502, "upstream-invalid-response", "Invalid response from upstream",
     "the request was sent but the upstream's answer is not a valid HTTP response; nothing was stored and the "
     "outcome is recorded as unknown",
     "upstream_invalid_response", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, CM_OUT_UNKNOWN},
    {IDEM, UNSENT, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", "Upstream unavailable",
     "the transfer could not start", NULL, GW_RECORD_RELEASE, GW_EFFECT_NONE, CM_OUT_UPSTREAM_ERROR},
    LEASE_LOST(IDEM),
};
#define OUTCOMES_N (sizeof outcomes / sizeof outcomes[0])

const struct gw_outcome *gw_outcome_table(size_t *n)
{
    *n = OUTCOMES_N;
    return outcomes;
}

const struct gw_outcome *gw_outcome_for(bool idempotent, bool started, enum up_result result, bool release_status)
{
    const struct gw_outcome *fallback = NULL;
    for (size_t i = 0; i < OUTCOMES_N; i++) {
        const struct gw_outcome *o = &outcomes[i];
        if (o->idempotent != idempotent || o->started != started)
            continue;
        if (!started)
            return o;
        if (o->result == UP_NO_RESPONSE)
            fallback = o;
        if (o->result == result && (result != UP_OK || o->release_status == release_status))
            return o;
    }
    return fallback; /* a result the table does not name: sent, no answer */
}

/* ---- helpers */

static void claim(struct gw_job *job);
static void shadow_guard(struct gw_job *job);
static void guard_start(struct gw_job *job);
static void guard_stop_timers(struct gw_job *job);
static bool guard_settle(struct gw_job *job, enum cm_outcome outcome);
static bool shadow_settle(struct gw_job *job, enum cm_outcome outcome);
static struct store_order_id guard_id(const struct gw_job *job);
static void guard_settled(void *arg, bool ok);
static void forward_claimed(struct gw_job *job);
static void forward_passthrough(struct gw_job *job);

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
    struct event *ev = event_new(job->ctx->base, -1, EV_PERSIST, cb, job);
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
    return store_id_of(job->route->name, job->scope, job->key, job->key_len);
}

/* This process's table of keys in flight (gateway/owned.c): left once the key's claim is not ours or the job ends. */
static void owned_drop(struct gw_job *job)
{
    if (!job->pipe->owned)
        return;
    struct store_id id = job_id(job);
    gw_owned_drop(&id);
    job->pipe->owned = false;
}

/* The end of a lease Postgres confirmed for a statement handed to the store at sent_ms (SPEC 8): the lease less a
 * quarter of it, on this process's monotonic clock. */
static uint64_t lease_end(uint64_t sent_ms, uint64_t lease_ms)
{
    return sent_ms + lease_ms - lease_ms / 4;
}

/* send_until_ms: the earliest end of the leases the job holds (the key's claim; the resource's marker). */
static void send_bound_update(struct gw_job *job)
{
    struct gw_pipe *p = job->pipe;
    uint64_t b = job->idempotent ? p->key_until_ms : UINT64_MAX;
    if (p->order_held && p->order_until_ms < b)
        b = p->order_until_ms;
    p->send_until_ms = b;
}

static void settle_upstream(struct gw_job *job, const struct gw_outcome *o, struct cm_resp *resp, const char *errmsg);

/* SPEC 8, a paused owner never acts: once its lease ended, a request still waiting for a connection is dropped
 * (nothing sent, 503, the record left to whoever holds it now). One that has started to leave runs on. */
static bool lease_check(struct gw_job *job)
{
    struct gw_pipe *p = job->pipe;
    if (!p->bounded || !p->transfer || cm_now_ms() < p->send_until_ms || !up_drop_unsent(job->ctx->up, p->transfer))
        return false;
    p->transfer = NULL;
    settle_upstream(job, gw_outcome_for(job->idempotent, true, UP_LEASE_LOST, false), NULL,
                    "dropped while it waited for a connection");
    return true; /* the job may be answered and gone */
}

static void marker_drop(struct gw_job *job);

static void stop_timers(struct gw_job *job)
{
    event_clear(&job->pipe->timer);
    event_clear(&job->pipe->renew_timer);
    guard_stop_timers(job);
}

/* A lease renewal in flight refers to its job through a ticket, so that the
 * job can be answered (and freed by the front) before the renewal's callback
 * runs: finish() detaches the ticket and the callback then only frees it. */
struct renew_ticket {
    struct gw_job *job;
    uint64_t sent_ms; /* the renewal was handed to the store then */
    bool marker;      /* of the resource's marker; else of the key's claim */
};

/* The answer is ready: count it and hand the job back to the front. */
static void finish(struct gw_job *job, enum cm_outcome outcome)
{
    struct gw_pipe *p = job->pipe;
    if (shadow_settle(job, outcome) || guard_settle(job, outcome))
        return; /* finish runs again once the key's claim or the resource's marker is settled */
    stop_timers(job);
    owned_drop(job);
    marker_drop(job);
    p->outcome = outcome;
    if (p->renew_ticket) {
        p->renew_ticket->job = NULL;
        p->renew_ticket = NULL;
    }
    if (p->order_ticket) {
        p->order_ticket->job = NULL;
        p->order_ticket = NULL;
    }
    if (p->prefer_waited) { /* RFC 7240: the wait it allowed */
        char v[32];
        snprintf(v, sizeof v, "wait=%" PRIu64, job->prefer_wait_s);
        cm_hdrs_add(&job->resp_hdrs, "Preference-Applied", v);
    }
    gw_job_count(job, outcome);
    gw_trace_outcome(job, outcome);
    gw_ctx_job_remove(job->ctx, &p->link);
    set_state(job, GW_PIPE_DONE);
    job->done_cb(job); /* the front's callback: control goes back up without the pipeline knowing the front */
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
    if (!job->route)
        return false;
    const struct conf_idem *im = &job->route->idem;
    for (size_t i = 0; i < im->release_statuses_n; i++)
        if (im->release_statuses[i] == status)
            return true;
    return false;
}

/* ---- after the upstream answered or failed: one row of the outcome table decides, for both paths */

static void answer_after_store(void *arg, bool ok, long rows)
{
    struct gw_job *job = arg;
    gw_span_end(job, job->ctx->tracer, "complete", 0, !ok);
    finish(job, job->pipe->outcome);
}

/* The completion came back (the replay/complete point): the client gets the upstream's answer either way. */
static void completed(void *arg, bool ok, long rows)
{
    struct gw_job *job = arg;
    gw_span_end(job, job->ctx->tracer, "complete", 0, !ok || rows == 0);
    if (!ok || rows == 0) {
        cm_metric_completion_failure(job->route_index);
        cm_log(CM_ERROR, "completion_failed", "request_id=%s route=%s reason=%s", job->request_id, job->route->name,
               ok ? "fenced_out" : "store_unavailable");
    } else {
        gw_cache_completed(job, &job->pipe->up_resp, job->pipe->started_ms, job->pipe->cache_epoch);
    }
    take_resp(job, &job->pipe->up_resp);
    finish(job, CM_OUT_FORWARDED);
}

/* Applies row o to the job: the answer (the upstream's resp, or the row's problem), then the record's action;
 * resp and errmsg may be NULL when nothing was sent. */
static void settle_upstream(struct gw_job *job, const struct gw_outcome *o, struct cm_resp *resp, const char *errmsg)
{
    struct gw_pipe *p = job->pipe;
    struct store *st = job->ctx->store;
    p->effect = o->effect;
    if (o->log_event)
        cm_log(CM_WARN, o->log_event, "request_id=%s route=%s result=%s detail=\"%s\"", job->request_id,
               job->route ? job->route->name : "-", up_result_name(o->result), errmsg ? errmsg : "");
    if (o->status)
        gw_job_problem(job, o->status, o->problem, o->title, o->detail);
    else if (o->record != GW_RECORD_COMPLETE)
        take_resp(job, resp);
    if (o->status == 503)
        gw_job_retry_after(job, 1000);
    if (o->record == GW_RECORD_NONE) {
        finish(job, o->outcome);
        return;
    }
    /* The lease is renewed until the record is settled (finish() stops it): a completion retried while Postgres
     * restarts must not let it lapse. */
    struct store_id id = job_id(job);
    const struct conf_idem *im = &job->route->idem;
    p->outcome = o->outcome;
    set_state(job, GW_PIPE_RECORDING);
    gw_span_begin(job); /* the record's settling: the complete span */
    switch (o->record) {
    case GW_RECORD_COMPLETE:
        /* SPEC 11: the record keeps the id of the request that executed, as its answer's request id header */
        cm_hdrs_remove(&resp->hdrs, job->conf->request_id_header);
        cm_hdrs_add(&resp->hdrs, job->conf->request_id_header, job->request_id);
        p->up_resp = *resp;
        cm_hdrs_init(&resp->hdrs);
        cm_buf_init(&resp->body, 0);
        if (im->advertise_expiry && !job->shadow) /* stored with the answer: every replay repeats it */
            gw_expiry_advertise(&p->up_resp, cm_wall_ms(), im->retention_ms);
        p->cache_epoch = gw_cache_before_store(job);
        store_complete(st, &id, p->token, &p->up_resp, im->retention_ms, im->lease_ms, completed, job);
        return;
    case GW_RECORD_RELEASE:
        store_release(st, &id, p->token, im->lease_ms, answer_after_store, job);
        return;
    case GW_RECORD_MARK_UNKNOWN:
    default:
        store_mark_unknown(st, &id, p->token, im->lease_ms, im->lease_ms, answer_after_store, job);
        return;
    }
}

static void upstream_done(struct gw_job *job, bool idempotent, enum up_result r, struct cm_resp *resp,
                          const char *errmsg, double secs)
{
    job->pipe->transfer = NULL;
    cm_metric_upstream(job->route_index, job->upstream ? job->upstream->name : NULL, r == UP_OK ? resp->status : 0,
                       secs);
    if (idempotent) /* how long a keyed attempt takes: Retry-After on a key in use (SPEC 11) */
        cm_recent_observe(job->route_index, secs > 0 && secs < 1e9 ? (uint64_t)(secs * 1000.0 + 0.5) : 0, cm_now_ms());
    gw_span_end(job, job->ctx->tracer, "upstream", r == UP_OK ? resp->status : 0, r != UP_OK);
    if (r != UP_CONNECT_FAILED) /* SPEC 11's upstream_ms: it was sent */
        job->upstream_ms = secs * 1000.0;
    if (r == UP_OK && resp)
        job->upstream_status = resp->status;
    settle_upstream(job, gw_outcome_for(idempotent, true, r, r == UP_OK && is_release_status(job, resp->status)), resp,
                    errmsg);
}

static void passthrough_done(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    upstream_done(arg, false, r, resp, errmsg, secs);
}

static void idem_forward_done(void *arg, enum up_result r, struct cm_resp *resp, const char *errmsg, double secs)
{
    upstream_done(arg, true, r, resp, errmsg, secs);
}

/* Sends the job to its configured upstream: the connection goes to the origin parsed from the configuration, the
 * request's own target only becomes the path and query (base path + target), so no target can choose the host.
 * When nothing could be sent (a target up_send refuses, or the transfer could not start), the table's unsent row
 * answers at once. */
static void forward(struct gw_job *job, bool idempotent)
{
    const struct conf_upstream *u = job->upstream;
    struct gw_pipe *p = job->pipe;
    set_state(job, GW_PIPE_FORWARDING);
    if (job->uri != NULL && job->uri[0] == '/') {
        struct cm_buf target;
        cm_buf_init(&target, 64 * 1024);
        if (cm_buf_appendf(&target, "%s%s", u->base_path, job->uri)) {
            struct up_tls tls;
            struct up_origin origin = gw_upstream_origin(u, &tls);
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
                .max_connections = gw_ctx_upstream_max(job->ctx, u),
                .keepalive_ms = u->keepalive_timeout_ms,
                .send_until_ms = p->bounded ? &p->send_until_ms : NULL,
            };
            gw_span_begin(job);
            p->transfer = up_send(job->ctx->up, &req, idempotent ? idem_forward_done : passthrough_done, job);
        }
        cm_buf_free(&target);
    }
    if (!p->transfer)
        settle_upstream(job, gw_outcome_for(idempotent, false, UP_CONNECT_FAILED, false), NULL, NULL);
}

/* The key is ours (and the resource's marker, when guarded): send it, with its fence when the route forwards it
 * (the front removed the client's own header of that name). */
static void forward_claimed(struct gw_job *job)
{
    const char *fence_hdr = job->route->idem.forward_token;
    if (fence_hdr) {
        char v[24];
        snprintf(v, sizeof v, "%" PRIu64, job->pipe->fence);
        cm_hdrs_remove(&job->fwd_hdrs, fence_hdr);
        cm_hdrs_add(&job->fwd_hdrs, fence_hdr, v);
    }
    forward(job, true);
}

/* Passthrough (and shadow requests that do not own their key): forwarded as if key: off. */
static void forward_passthrough(struct gw_job *job)
{
    forward(job, false);
}

/* A renewal's answer moves the lease's end (*until) on, or ends it (rows 0: the record or marker is not ours any
 * more); a request that waits for a connection is dropped once the end passed. */
static void lease_renewed(struct gw_job *job, uint64_t *until, uint64_t sent_ms, bool ok, long rows, const char *what)
{
    if (ok && rows == 0) {
        if (*until != 0)
            cm_log(CM_WARN, "lease_lost", "request_id=%s route=%s of=%s", job->request_id, job->route->name, what);
        *until = 0;
    } else if (ok && *until != 0 && lease_end(sent_ms, job->route->idem.lease_ms) > *until) {
        *until = lease_end(sent_ms, job->route->idem.lease_ms);
    }
    send_bound_update(job);
    (void)lease_check(job);
}

/* The answer to a renewal of the key's claim or of the resource's marker. */
static void renewed(void *arg, bool ok, long rows)
{
    struct renew_ticket *t = arg;
    struct gw_job *job = t->job;
    uint64_t sent = t->sent_ms;
    bool marker = t->marker;
    free(t);
    if (!job)
        return; /* answered meanwhile */
    struct gw_pipe *p = job->pipe;
    *(marker ? &p->order_ticket : &p->renew_ticket) = NULL;
    lease_renewed(job, marker ? &p->order_until_ms : &p->key_until_ms, sent, ok, rows, marker ? "marker" : "key");
}

/* A renewal's ticket (marker: of the resource's marker), or NULL: the previous one still runs, or a pause (SIGSTOP,
 * an overloaded host) outlived the lease and the job was just answered. */
static struct renew_ticket *renew_begin(struct gw_job *job, bool marker)
{
    struct gw_pipe *p = job->pipe;
    struct renew_ticket **slot = marker ? &p->order_ticket : &p->renew_ticket;
    if (lease_check(job) || *slot)
        return NULL;
    struct renew_ticket *t = cm_malloc(sizeof *t);
    t->job = job;
    t->sent_ms = cm_now_ms();
    t->marker = marker;
    *slot = t;
    return t;
}

static void renew_tick(evutil_socket_t fd, short what, void *arg)
{
    struct gw_job *job = arg;
    struct gw_pipe *p = job->pipe;
    struct renew_ticket *t = renew_begin(job, false);
    if (!t)
        return;
    struct store_id id = job_id(job);
    store_renew(job->ctx->store, &id, p->token, job->route->idem.lease_ms, renewed, t);
}

static void wait_tick(evutil_socket_t fd, short what, void *arg)
{
    claim(arg);
}

/* The key is this request's under token: renew its lease until settled, forward once, store what comes back. */
static void forward_owned(struct gw_job *job, uint64_t token, uint64_t fence)
{
    struct gw_pipe *p = job->pipe;
    p->key_until_ms = lease_end(p->claim_sent_ms, job->route->idem.lease_ms);
    p->bounded = !job->shadow; /* shadow forwards everything: the store never stops its requests */
    send_bound_update(job);
    job->pipe->token = token;
    job->pipe->fence = fence;
    job->token = token; /* its access line's */
    job->pipe->renew_timer = renew_every_third(job, renew_tick);
    if (job->ordered && job->shadow)
        shadow_guard(job); /* read, never taken: shadow forwards everything */
    else if (job->ordered)
        guard_start(job); /* SPEC 6: the guard comes after the idempotency record */
    else
        forward_claimed(job);
}

/* ---- mode: shadow: claimed and recorded as enforce would, but every request is forwarded and answered by the
 * upstream; the decision enforce would have taken is counted (and logged unless new). */

static void shadow_decided(struct gw_job *job, enum cm_shadow d)
{
    cm_metric_shadow_decision(job->route_index, d);
    cm_log(CM_INFO, "shadow_decision", "decision=%s route=%s request_id=%s", cm_shadow_name(d), job->route->name,
           job->request_id);
}

static void shadow_claimed(void *arg, struct store_claim_res *res)
{
    struct gw_job *job = arg;
    enum cm_shadow d;
    switch (res->verdict) {
    case STORE_NEW:
        if (!job->ordered) /* a guarded one is new or stale: shadow_guarded counts it */
            cm_metric_shadow_decision(job->route_index, CM_SHADOW_NEW);
        forward_owned(job, res->token, res->fence); /* recorded, so that a later retry can be classified */
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
        cm_log(CM_WARN, "shadow_store_error", "request_id=%s route=%s detail=\"%s\"", job->request_id, job->route->name,
               res->err ? res->err : "");
        forward_passthrough(job);
        return;
    }
    /* SPEC 6: the idempotency record comes first (a retry of an applied request is a replay, never stale) */
    shadow_decided(job, d);
    forward_passthrough(job); /* the record is left as it is: only the first request of a key owns it */
}

/* A guarded shadow request that owns its key: would enforce's guard have refused it stale? The resource's row is
 * read (store_order_peek), never its marker taken, and the request is forwarded either way. */
static void shadow_guarded(void *arg, const struct store_order_peek_res *res)
{
    struct gw_job *job = arg;
    struct gw_pipe *p = job->pipe;
    if (!res->ok) {
        cm_metric_shadow_store_error(job->route_index);
        cm_log(CM_WARN, "shadow_store_error",
               "request_id=%s route=%s detail=\"the ordering guard's row could not be read\"", job->request_id,
               job->route->name);
    } else if (res->stale) {
        /* enforce would have answered 409 stale-sequence and kept no record: the claim goes after the answer */
        shadow_decided(job, CM_SHADOW_STALE);
        p->shadow_stale = true;
        forward_passthrough(job);
        return;
    } else {
        cm_metric_shadow_decision(job->route_index, CM_SHADOW_NEW);
    }
    p->shadow_advance = true;
    forward_claimed(job);
}

static void shadow_guard(struct gw_job *job)
{
    struct store_order_id id = guard_id(job);
    set_state(job, GW_PIPE_GUARDING);
    store_order_peek(store_order_of(job->ctx->store), &id, job->seq, job->key, job->key_len, shadow_guarded, job);
}

/* finish() asks first: a guarded shadow request settles what enforce would have, before its answer (so that the
 * client's next request is judged against it). Its applied sequence advances once it executed (an unknown outcome
 * remembers its key, as the guard's settle does); a stale one's claim is released, as enforce keeps no record of a
 * refused request. true: that statement runs, finish comes again from its callback. */
static bool shadow_settle(struct gw_job *job, enum cm_outcome outcome)
{
    struct gw_pipe *p = job->pipe;
    if (p->shadow_advance) {
        p->shadow_advance = false;
        if (p->effect != GW_EFFECT_NONE) {
            bool unknown = p->effect == GW_EFFECT_UNKNOWN && job->idempotent;
            struct store_order_id id = guard_id(job);
            p->outcome = outcome;
            set_state(job, GW_PIPE_UNGUARDING);
            store_order_advance(store_order_of(job->ctx->store), &id, job->seq, unknown ? job->key : NULL, job->key_len,
                                guard_settled, job);
            return true;
        }
    }
    if (!p->shadow_stale)
        return false;
    p->shadow_stale = false;
    p->outcome = outcome;
    struct store_id kid = job_id(job);
    set_state(job, GW_PIPE_RECORDING);
    store_release(job->ctx->store, &kid, p->token, job->route->idem.lease_ms, answer_after_store, job);
    return true;
}

static void answer_unknown(struct gw_job *job)
{
    gw_job_problem(job, 409, "idempotency-outcome-unknown", "Outcome unknown",
                   "an earlier request with this key was sent upstream but its outcome is unknown; an "
                   "operator must release the key before it can be retried");
    finish(job, CM_OUT_UNKNOWN);
}

static void answer_store_unavailable(struct gw_job *job, const char *detail)
{
    gw_job_problem(job, 503, "store-unavailable", "Store unavailable", detail);
    gw_job_retry_after(job, 1000);
}

/* ---- on_unknown: probe: the upstream is asked whether the unknown outcome executed (gateway/probe.c) */

static void probe_answered(void *arg, enum gw_probe_result r, struct cm_resp *resp)
{
    struct gw_job *job = arg;
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
        answer_store_unavailable(job, "the idempotency store cannot be reached; nothing was forwarded");
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
    job->pipe->probed = true; /* once per request: a second unknown verdict is answered 409 */
    set_state(job, GW_PIPE_PROBING);
    gw_probe_run(job->ctx->probe, job->route_index, &id, &job->probe_hdrs, probe_answered, job);
}

/* The key is in flight (in Postgres, or held by another request of this process): wait (on_in_flight: wait) or 409
 * whose Retry-After estimates when the first attempt (age_ms old) will be done (SPEC 11). */
static void in_flight(struct gw_job *job, uint64_t lease_remaining_ms, uint64_t age_ms)
{
    struct gw_pipe *p = job->pipe;
    const struct conf_idem *im = &job->route->idem;
    /* a client's Prefer: wait the route honours replaces on_in_flight for this request (SPEC 12) */
    if (job->prefer_wait ? job->prefer_wait_ms > 0 : im->on_in_flight == CONF_IN_FLIGHT_WAIT) {
        uint64_t now = cm_now_ms();
        if (!p->wait_deadline_ms) {
            p->wait_deadline_ms = now + (job->prefer_wait ? job->prefer_wait_ms : im->wait_ms);
            p->wait_backoff_ms = WAIT_BACKOFF_FIRST_MS;
            p->prefer_waited = job->prefer_wait;
        }
        if (now < p->wait_deadline_ms) {
            uint64_t d = backoff_next(&p->wait_backoff_ms, now, p->wait_deadline_ms, WAIT_BACKOFF_MAX_MS);
            if (!p->timer)
                p->timer = evtimer_new(job->ctx->base, wait_tick, job);
            set_state(job, GW_PIPE_WAITING);
            timer_arm_ms(p->timer, d);
            return;
        }
    }
    cm_metric_in_flight_conflict(job->route_index);
    gw_job_problem(job, 409, "idempotency-key-in-use", "Idempotency key in use",
                   "a request with this key is still being processed; retry later");
    uint64_t lease_left = lease_remaining_ms < im->lease_ms ? lease_remaining_ms : im->lease_ms;
    gw_job_retry_after(job, cm_recent_wait_ms(job->route_index, age_ms, lease_left, cm_now_ms()));
    finish(job, CM_OUT_IN_FLIGHT);
}

static void answer_mismatch(struct gw_job *job)
{
    cm_metric_parameter_conflict(job->route_index);
    gw_job_problem(job, 422, "idempotency-key-mismatch", "Idempotency key reused with another request",
                   "this key was already used with a different request payload");
}

/* A record's answer from the store or the cache: the stored answer byte for byte (STORE_REPLAY, res->resp moved
 * out), or 422 for another fingerprint (STORE_MISMATCH). The request's outcome. */
static enum cm_outcome answer_record(struct gw_job *job, struct store_claim_res *res)
{
    if (res->verdict != STORE_REPLAY) {
        answer_mismatch(job);
        return CM_OUT_MISMATCH;
    }
    take_resp(job, &res->resp);
    job->replayed = true;
    const char *orig = cm_hdrs_get(&job->resp_hdrs, job->conf->request_id_header);
    if (orig)
        snprintf(job->orig_request_id, sizeof job->orig_request_id, "%s", orig);
    cm_metric_dedup_hit(job->route_index);
    return CM_OUT_REPLAYED;
}

static void claimed(void *arg, struct store_claim_res *res)
{
    struct gw_job *job = arg;
    struct gw_pipe *p = job->pipe;
    const struct conf_idem *im = &job->route->idem;
    if (res->verdict == STORE_NEW)
        job->trace.token = res->token;
    gw_span_end(job, job->ctx->tracer, "claim", 0, res->verdict == STORE_UNAVAILABLE);
    if (res->request_id[0] && res->verdict != STORE_NEW) /* SPEC 11: the request that holds or executed the record */
        snprintf(job->orig_request_id, sizeof job->orig_request_id, "%s", res->request_id);
    switch (res->verdict) {
    case STORE_NEW: {
        struct store_id id = job_id(job);
        p->owned = gw_owned_take(&id, job->fp) == GW_OWNED_TAKEN; /* held here until the job ends */
        forward_owned(job, res->token, res->fence);
        return;
    }
    case STORE_REPLAY: /* the replay point: the stored answer, byte for byte */
        gw_cache_replayed(job, res, p->started_ms, p->cache_epoch);
        finish(job, answer_record(job, res));
        return;
    case STORE_MISMATCH:
        finish(job, answer_record(job, res));
        return;
    case STORE_IN_FLIGHT:
        in_flight(job, res->lease_remaining_ms, res->age_ms);
        return;
    case STORE_UNKNOWN:
        if (im->on_unknown == CONF_UNKNOWN_PROBE && !p->probed) {
            probe_unknown(job);
            return;
        }
        if (im->on_unknown == CONF_UNKNOWN_PROBE) {
            /* the look-up could not take it (GW_PROBE_BUSY): the original attempt may still be running (SPEC 8, the
             * probe waits for it to be over), or another prober holds it: in use */
            in_flight(job, res->lease_remaining_ms, res->age_ms);
            return;
        }
        answer_unknown(job);
        return;
    case STORE_UNAVAILABLE:
    default:
        cm_log(CM_WARN, "store_unavailable", "request_id=%s route=%s detail=\"%s\"", job->request_id, job->route->name,
               res->err ? res->err : "");
        answer_store_unavailable(job, "the idempotency store cannot be reached; nothing was forwarded");
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
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
    req.request_id = job->request_id;
    set_state(job, GW_PIPE_CLAIMING);
    gw_span_begin(job);
    /* A key this process holds in flight is in flight, whatever its lease in Postgres says: its owner is alive
     * (SPEC 8), and asking Postgres could take it over from the owner after an outage longer than the lease. */
    uint64_t held_ms = 0;
    enum gw_held held = job->shadow ? GW_HELD_NO : gw_owned_held_age(&req.id, job->fp, &held_ms);
    if (held == GW_HELD_OTHER) { /* another request's key: 422 whatever its state, as Postgres answers (SPEC 4) */
        answer_mismatch(job);
        finish(job, CM_OUT_MISMATCH);
        return;
    }
    if (held == GW_HELD_SAME) { /* its owner renews the lease: the whole lease is the bound */
        in_flight(job, im->lease_ms, held_ms);
        return;
    }
    /* a completed record held in memory: no store round trip (unless the front just found none) */
    bool asked = job->cache_asked;
    job->cache_asked = false; /* a later claim of the job (after a wait or a probe) looks again */
    struct store_claim_res cached;
    if (!asked && gw_cache_claim(job, NULL, NULL, &cached) != GW_CACHE_MISS) {
        claimed(job, &cached);
        cm_resp_free(&cached.resp);
        return;
    }
    job->pipe->cache_epoch = gw_cache_before_store(job);
    job->pipe->claim_sent_ms = cm_now_ms();
    store_claim(job->ctx->store, &req, job->shadow ? shadow_claimed : claimed, job);
}

/* The front, on the job's loop thread, before it suspends the request: a key whose completed record the replay
 * cache holds is answered here, with what claim() would answer from the cache (the same checks before it, in the
 * same order), without the suspend, the hand-over to the loop and the resume. Anything else goes the whole way. */
enum gw_cached gw_pipeline_answer_cached(struct gw_job *job, struct MHD_Connection *conn, bool *queued_ok)
{
    if (!job->idempotent || job->ordered || job->shadow || atomic_load(&job->ctx->closing) || !up_target_ok(job->uri) ||
        !atomic_load(&job->ctx->schema_ready))
        return GW_CACHED_NONE;
    struct store_id id = job_id(job);
    if (gw_owned_held(&id))
        return GW_CACHED_NONE; /* in flight here: the pipeline answers 409, or 422 for another fingerprint */
    struct store_claim_res cached;
    switch (gw_cache_claim(job, conn, queued_ok, &cached)) {
    case GW_CACHE_MISS:
        job->cache_asked = true;
        return GW_CACHED_NONE;
    case GW_CACHE_QUEUED:
        cm_metric_dedup_hit(job->route_index);
        gw_job_count(job, CM_OUT_REPLAYED);
        gw_trace_outcome(job, CM_OUT_REPLAYED);
        return GW_CACHED_QUEUED;
    default: {
        enum cm_outcome o = answer_record(job, &cached);
        gw_job_count(job, o);
        gw_trace_outcome(job, o);
        cm_resp_free(&cached.resp);
        return GW_CACHED_ANSWER;
    }
    }
}

void gw_pipeline_run(void *arg)
{
    struct gw_job *job = arg;
    struct gw_pipe *p = cm_calloc(1, sizeof *p);
    p->job = job;
    p->state = GW_PIPE_NEW;
    p->effect = GW_EFFECT_UNKNOWN; /* until an upstream result says otherwise (an abort while sending) */
    cm_resp_init(&p->up_resp, 0);
    p->started_ms = cm_now_ms();
    job->pipe = p;
    gw_ctx_job_add(job->ctx, &p->link);
    if (atomic_load(&job->ctx->closing)) {
        gw_job_problem(job, 503, "shutting-down", "Shutting down", "the gateway is stopping");
        finish(job, CM_OUT_OVERLOADED);
        return;
    }
    if (!up_target_ok(job->uri)) {
        /* never "repaired" into something to send: a target the upstream clients refuse goes nowhere */
        gw_job_problem(job, 400, "bad-request", "Bad request", "the request target is not an origin-form path");
        finish(job, CM_OUT_REJECTED);
        return;
    }
    if (!job->idempotent && !job->ordered) {
        forward_passthrough(job);
        return;
    }
    if (!job->idempotent && job->route->idem.mode == CONF_MODE_SHADOW) {
        /* keyless (or an invalid key) on a guarded shadow route: forwarded, no decision; what executed still
         * advances the resource's sequence, as enforce's guard would have */
        job->pipe->shadow_advance = atomic_load(&job->ctx->schema_ready);
        forward_passthrough(job);
        return;
    }
    if (!atomic_load(&job->ctx->schema_ready) && job->shadow) {
        cm_metric_shadow_store_error(job->route_index);
        forward_passthrough(job); /* the store never fails a shadow request */
        return;
    }
    if (!atomic_load(&job->ctx->schema_ready)) {
        answer_store_unavailable(job, "the idempotency store is not ready yet; nothing was forwarded");
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    }
    if (!job->idempotent) {
        guard_start(job); /* keyless on a guarded route: the guard alone */
        return;
    }
    claim(job);
}

void gw_pipeline_free(struct gw_job *job)
{
    struct gw_pipe *p = job->pipe;
    if (!p)
        return;
    event_clear(&p->timer);
    event_clear(&p->renew_timer);
    event_clear(&p->order_timer);
    event_clear(&p->order_renew_timer);
    if (p->renew_ticket)
        p->renew_ticket->job = NULL;
    if (p->order_ticket)
        p->order_ticket->job = NULL;
    owned_drop(job);
    marker_drop(job);
    cm_resp_free(&p->up_resp);
    free(p);
    job->pipe = NULL;
}

static struct gw_job *job_of_link(struct gw_job_link *link)
{
    return ((struct gw_pipe *)((char *)link - offsetof(struct gw_pipe, link)))->job;
}

void gw_pipeline_abort_all(void *arg)
{
    struct gw_ctx *x = arg;
    atomic_store(&x->closing, true);
    /* A completion (release, mark unknown) retried while Postgres is away would keep its client waiting for up to
     * a lease: it gives up now, and its client gets the answer it has (SPEC 4). */
    store_settle_stop(x->store);
    /* Jobs waiting for the store keep going (every store operation is
     * bounded); the others are answered now. */
    struct gw_job_link *link = x->active;
    while (link) {
        struct gw_job_link *next = link->next;
        struct gw_job *job = job_of_link(link);
        struct gw_pipe *p = job->pipe;
        if (!(store_states & ST(p->state))) {
            /* SPEC 11: a claimed key whose transfer was under way is left to become an unknown outcome */
            enum cm_outcome o = p->transfer && job->idempotent ? CM_OUT_UNKNOWN : CM_OUT_OVERLOADED;
            if (p->transfer) {
                up_cancel(x->up, p->transfer);
                p->transfer = NULL;
            }
            gw_job_problem(job, 503, "shutting-down", "Shutting down",
                           "the gateway stopped before this request finished; its outcome is unknown");
            finish(job, o);
        }
        link = next;
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
    event_clear(&job->pipe->order_timer);
    event_clear(&job->pipe->order_renew_timer);
}

/* The resource's marker leaves this process's table (gateway/owned.c) once settled, or when the job ends. */
static void marker_drop(struct gw_job *job)
{
    if (!job->pipe->order_owned)
        return;
    struct store_order_id id = guard_id(job);
    gw_owned_marker_drop(&id);
    job->pipe->order_owned = false;
}

static void guard_settled(void *arg, bool ok)
{
    struct gw_job *job = arg;
    finish(job, job->pipe->outcome);
}

/* finish() asks first: true when the job holds the resource's marker, whose settle now runs (finish comes
 * again from its callback). The outcome table's effect decides: nothing executed (nothing sent, a release status)
 * leaves applied as it was; an answer sets it; anything else (sent, no answer; or ended while sending) may have
 * executed and counts as applied. */
static bool guard_settle(struct gw_job *job, enum cm_outcome outcome)
{
    struct gw_pipe *p = job->pipe;
    if (p->state == GW_PIPE_GUARD_WAIT) {
        /* ended while waiting for the resource (shutdown): nothing was sent, the key's claim goes */
        guard_stop_timers(job);
        p->outcome = outcome;
        if (!job->idempotent)
            return false;
        struct store_id kid = job_id(job);
        set_state(job, GW_PIPE_RECORDING);
        store_release(job->ctx->store, &kid, p->token, job->route->idem.lease_ms, answer_after_store, job);
        return true;
    }
    if (!p->order_held)
        return false;
    p->order_held = false;
    p->outcome = outcome;
    guard_stop_timers(job);
    struct store_order_id id = guard_id(job);
    set_state(job, GW_PIPE_UNGUARDING);
    store_order_settle(store_order_of(job->ctx->store), &id, p->order_token,
                       p->effect == GW_EFFECT_NONE      ? STORE_SETTLE_RELEASED
                       : p->effect == GW_EFFECT_APPLIED ? STORE_SETTLE_APPLIED
                                                        : STORE_SETTLE_UNKNOWN,
                       job->route->idem.lease_ms, guard_settled, job);
    return true;
}

static void guard_renew_tick(evutil_socket_t fd, short what, void *arg)
{
    struct gw_job *job = arg;
    struct renew_ticket *t = renew_begin(job, true);
    if (!t)
        return;
    struct store_order_id id = guard_id(job);
    store_order_renew(store_order_of(job->ctx->store), &id, job->pipe->order_token, job->route->idem.lease_ms, renewed,
                      t);
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
    /* A gap counts once per request; res->gap is set only when it is judged one with nothing lower in flight
     * (store/order.h), never while it waits for a lower one or ends as sequence-in-use (SPEC 6). */
    if (res->gap && !job->pipe->gap_counted) {
        job->pipe->gap_counted = true;
        cm_metric_sequence_gap(job->route_index);
    }
    uint64_t now = cm_now_ms();
    switch (res->verdict) {
    case STORE_ORDER_OK: {
        struct gw_pipe *p = job->pipe;
        struct store_order_id id = guard_id(job);
        p->order_held = true;
        p->order_until_ms = lease_end(p->order_sent_ms, job->route->idem.lease_ms);
        p->order_owned = gw_owned_marker_take(&id) == GW_OWNED_TAKEN; /* held here until settled */
        if (!job->idempotent)
            p->bounded = true; /* keyless: the marker alone */
        send_bound_update(job);
        job->pipe->order_renew_timer = renew_every_third(job, guard_renew_tick);
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
        finish(job, CM_OUT_REJECTED); /* SPEC 11: a stale or gapped sequence is the client's mistake */
        return;
    case STORE_ORDER_IN_USE:
    case STORE_ORDER_GAP:
        if (job->pipe->ordered_may_wait && (res->verdict == STORE_ORDER_IN_USE || o->on_gap == CONF_GAP_HOLD)) {
            /* not final: the statement kept the key's claim; try again after a backoff, within hold */
            uint64_t d =
                backoff_next(&job->pipe->order_backoff_ms, now, job->pipe->order_deadline_ms, GUARD_BACKOFF_MAX_MS);
            if (!job->pipe->order_timer)
                job->pipe->order_timer = evtimer_new(job->ctx->base, guard_wait_tick, job);
            set_state(job, GW_PIPE_GUARD_WAIT);
            timer_arm_ms(job->pipe->order_timer, d);
            return;
        }
        if (res->verdict == STORE_ORDER_IN_USE) {
            cm_metric_in_flight_conflict(job->route_index);
            gw_job_problem(job, 409, "sequence-in-use", "Sequence in use",
                           "another request for this resource is still being processed; retry later");
            gw_job_retry_after(job, res->lease_left_ms < o->hold_ms ? res->lease_left_ms : o->hold_ms);
            finish(job, CM_OUT_IN_FLIGHT);
            return;
        }
        guard_refuse(job, "sequence-gap", "Sequence gap",
                     "an earlier sequence of this resource has not been applied yet; nothing was forwarded",
                     res->applied);
        finish(job, CM_OUT_REJECTED); /* SPEC 11: a stale or gapped sequence is the client's mistake */
        return;
    case STORE_ORDER_UNAVAILABLE:
    default:
        answer_store_unavailable(job, "the ordering guard's store cannot be reached; nothing was forwarded");
        if (job->idempotent) { /* nothing was sent: the key's claim goes */
            struct store_id id = job_id(job);
            job->pipe->outcome = CM_OUT_STORE_UNAVAILABLE;
            set_state(job, GW_PIPE_RECORDING);
            store_release(job->ctx->store, &id, job->pipe->token, job->route->idem.lease_ms, answer_after_store, job);
            return;
        }
        finish(job, CM_OUT_STORE_UNAVAILABLE);
        return;
    }
}

/* Another request of this process holds the resource's marker (gateway/owned.c): it is in flight, whatever its
 * lease in Postgres says (an outage longer than the lease, SPEC 6 and 8), and Postgres is not asked. Within hold
 * the job waits as for Postgres's in-use refusal; after it, 409 sequence-in-use, and the key's claim goes (nothing
 * was sent; Postgres' final refusal deletes it in its statement). */
static void guard_held_here(struct gw_job *job)
{
    struct gw_pipe *p = job->pipe;
    const struct conf_ordering *o = &job->route->ordering;
    uint64_t lease = job->route->idem.lease_ms;
    set_state(job, GW_PIPE_GUARDING);
    if (p->ordered_may_wait) {
        struct store_order_res res = {.verdict = STORE_ORDER_IN_USE, .lease_left_ms = lease};
        guard_done(job, &res);
        return;
    }
    cm_metric_in_flight_conflict(job->route_index);
    gw_job_problem(job, 409, "sequence-in-use", "Sequence in use",
                   "another request for this resource is still being processed; retry later");
    gw_job_retry_after(job, lease < o->hold_ms ? lease : o->hold_ms);
    if (!job->idempotent) {
        finish(job, CM_OUT_IN_FLIGHT);
        return;
    }
    struct store_id kid = job_id(job);
    p->outcome = CM_OUT_IN_FLIGHT;
    set_state(job, GW_PIPE_RECORDING);
    store_release(job->ctx->store, &kid, p->token, lease, answer_after_store, job);
}

static void guard_try(struct gw_job *job)
{
    const struct conf_ordering *o = &job->route->ordering;
    struct store_order_req req;
    memset(&req, 0, sizeof req);
    req.id = guard_id(job);
    job->pipe->ordered_may_wait = cm_now_ms() < job->pipe->order_deadline_ms;
    if (gw_owned_marker_held(&req.id)) {
        guard_held_here(job);
        return;
    }
    req.seq = job->seq;
    req.token = job->pipe->order_token;
    req.lease_ms = job->route->idem.lease_ms;
    req.on_gap = o->on_gap == CONF_GAP_REJECT ? STORE_GAP_REJECT
                 : o->on_gap == CONF_GAP_HOLD ? STORE_GAP_HOLD
                                              : STORE_GAP_ACCEPT;
    req.may_wait = job->pipe->ordered_may_wait = cm_now_ms() < job->pipe->order_deadline_ms;
    if (job->idempotent) {
        req.key = job->key;
        req.key_len = job->key_len;
    }
    set_state(job, GW_PIPE_GUARDING);
    job->pipe->order_sent_ms = cm_now_ms();
    store_order_acquire(store_order_of(job->ctx->store), &req, guard_done, job);
}

static void guard_start(struct gw_job *job)
{
    job->pipe->order_token = job->idempotent ? job->pipe->token : cm_random_token();
    job->pipe->order_deadline_ms = cm_now_ms() + job->route->ordering.hold_ms;
    job->pipe->order_backoff_ms = GUARD_BACKOFF_FIRST_MS;
    guard_try(job);
}
