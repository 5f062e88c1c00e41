/* pipeline.h - the request pipeline on the loop thread (claim, guard, forward once, settle the record, answer),
 * and the one table from an upstream result to the answer and what happens to the record. It works with the job's
 * context (job->ctx) and hands the job back through job->done_cb; it never calls the front or the loop. */
#ifndef IDEMGATE_GW_PIPELINE_H
#define IDEMGATE_GW_PIPELINE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/metrics.h"
#include "upstream/upstream.h"

struct gw_job;

/* Loop thread: runs the pipeline for a submitted job (allocating its private state, job->pipe); ends in
 * job->done_cb (set by the front), exactly once. */
void gw_pipeline_run(void *job);
/* Front, on the job's loop thread before suspending it: whether the replay cache answered the job (a replay or a
 * 422, counted). GW_CACHED_QUEUED: a shared prepared answer was queued on conn (only when conn is not NULL),
 * *queued_ok whether MHD_queue_response took it; GW_CACHED_ANSWER: the job holds the answer, for the front to queue;
 * GW_CACHED_NONE: run the pipeline. */
enum gw_cached { GW_CACHED_NONE, GW_CACHED_ANSWER, GW_CACHED_QUEUED };
struct MHD_Connection;
enum gw_cached gw_pipeline_answer_cached(struct gw_job *job, struct MHD_Connection *conn, bool *queued_ok);
/* Loop thread: ends every running job of the context (a struct gw_ctx *, gateway/ctx.h) now (grace expired): upstream
 * transfers are cancelled, their records stay in flight (unknown after the lease), the clients get 503 shutting-down.
 * Jobs waiting for the store finish on their own (every store operation is bounded). */
void gw_pipeline_abort_all(void *ctx);
/* Frees the pipeline's state of a job that was answered (or never run); the front calls it when it frees the
 * job. No-op when job->pipe is NULL. */
void gw_pipeline_free(struct gw_job *job);

/* ---- the outcome table: (upstream result, mode) -> (answer, record action, effect). Both the passthrough and
 * the idempotent paths read it; tests/unit/outcome_test.c walks it against SPEC 1, 4, 7 and 8. */

enum gw_record_action {
    GW_RECORD_NONE,         /* passthrough: there is no record */
    GW_RECORD_COMPLETE,     /* the answer is stored (fenced), then given */
    GW_RECORD_RELEASE,      /* nothing executed: the key is released, a retry executes */
    GW_RECORD_MARK_UNKNOWN, /* sent, no storable answer: the record stays, outcome unknown (never released) */
};

/* What the request did upstream, as far as the gateway knows: the ordering guard settles the resource by it. */
enum gw_effect {
    GW_EFFECT_NONE,    /* nothing executed (nothing sent, or a release status): applied sequence unchanged */
    GW_EFFECT_APPLIED, /* executed and answered */
    GW_EFFECT_UNKNOWN, /* sent, outcome unknown (counts as applied) */
};

struct gw_outcome {
    /* the case */
    bool idempotent; /* a claimed key (enforce, or a shadow request that owns its key); false: passthrough */
    bool started;    /* the transfer started; false: up_send refused it (result and release_status unused) */
    enum up_result result;
    bool release_status; /* UP_OK only: the status is one of the route's release_statuses */
    /* what follows */
    int status;          /* 0: the upstream's own answer; else the gateway's problem */
    const char *problem; /* the problem's name (SPEC 4, 7), NULL with status 0 */
    const char *title;
    const char *detail;
    const char *log_event; /* NULL, or the warn line's event (it carries the upstream's error text) */
    enum gw_record_action record;
    enum gw_effect effect;
    enum cm_outcome outcome; /* idemgate_requests_total's outcome */
};

/* The row for this case; never NULL (a result the table does not name gets the closed-without-answer row, the
 * safe reading: sent, outcome unknown). release_status is read with UP_OK only; result and release_status are
 * ignored when started is false. The row is static. */
const struct gw_outcome *gw_outcome_for(bool idempotent, bool started, enum up_result result, bool release_status);
/* Every row (static), *n their number: for the unit test. */
const struct gw_outcome *gw_outcome_table(size_t *n);

/* ---- the life cycle of a job in the pipeline. */
enum gw_pipe_state {
    GW_PIPE_NEW,        /* submitted, nothing asked yet */
    GW_PIPE_CLAIMING,   /* store_claim sent (the key's record) */
    GW_PIPE_WAITING,    /* on_in_flight: wait: a claim retry is scheduled */
    GW_PIPE_PROBING,    /* on_unknown: probe: asking the upstream (gateway/probe.c) */
    GW_PIPE_GUARDING,   /* store_order_acquire sent (the resource's marker) */
    GW_PIPE_GUARD_WAIT, /* a guard retry is scheduled within hold (in use, or held gap) */
    GW_PIPE_FORWARDING, /* the transfer is running */
    GW_PIPE_RECORDING,  /* store_complete / store_release / store_mark_unknown sent (the key's record) */
    GW_PIPE_UNGUARDING, /* store_order_settle sent (the resource's marker) */
    GW_PIPE_DONE,       /* answered: handed back to the front */
    GW_PIPE__COUNT
};
const char *gw_pipe_state_name(enum gw_pipe_state s);
/* True when the pipeline may go from a to b. */
bool gw_pipe_transition_ok(enum gw_pipe_state a, enum gw_pipe_state b);

#endif
