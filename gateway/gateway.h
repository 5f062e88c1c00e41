/* gateway.h - the gateway room's internal API: the I/O loop thread, the job
 * that carries one client request from the HTTP front to the pipeline and
 * back, the pipeline, the front and the admin listener. */
#ifndef IDEMGATE_GATEWAY_H
#define IDEMGATE_GATEWAY_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "common/metrics.h"
#include "conf/conf.h"
#include "gateway/idem.h"

struct event_base;
struct up_client;
struct store;
struct gw_loop;
struct renew_ticket;
struct gw_jwt;

/* ---- the configuration in force: immutable and reference-counted. Each loop holds the one it serves new requests
 * with; each request takes a reference when the front accepts its head and drops it when the request is freed, so
 * a request finishes under the configuration it started with and the old one goes with its last request. */
struct gw_conf {
    struct conf *conf;  /* owned */
    struct gw_jwt *jwt; /* the verifier of jwt:CLAIM scopes, NULL without a jwt: block; owned */
    size_t *route_slot; /* metrics slot of each route (cm_metrics_route of its name), conf->routes_n entries */
    atomic_long refs;
};
/* Loads and validates file completely (conf_load, then its JWT keys). Returns the handle with one reference, or
 * NULL + *err "FILE:LINE: KEY: ..." or the key loader's message (heap, caller frees). */
struct gw_conf *gw_conf_load(const char *file, char **err);
/* Gives each route its metrics slot (by name; cm_metrics_route). Call once the configuration is going to serve,
 * before any loop has it. */
void gw_conf_label(struct gw_conf *c);
/* Another reference to c (any thread); returns c. */
struct gw_conf *gw_conf_ref(struct gw_conf *c);
/* Drops a reference (any thread); the last one frees the handle and its conf. NULL is a no-op. */
void gw_conf_unref(struct gw_conf *c);
struct gw_probe;

/* ---- the I/O loop: one thread running libevent, owning its HTTP daemon
 * (gateway/front.c), the curl multi handle, its share of the Postgres pool
 * and the Redis context. */

/* Creates the loop (event base, upstream client, store). NULL + *err on failure. */
struct gw_loop *gw_loop_create(const struct conf *conf, size_t nloops, char **err);
/* Starts the loop thread. Returns false on failure. */
bool gw_loop_start(struct gw_loop *l) CM_MUST_CHECK;
/* Runs fn(arg) on the loop thread soon. Safe from any thread. */
void gw_loop_submit(struct gw_loop *l, void (*fn)(void *), void *arg);
/* Stops the thread (pending submissions are run first, best effort) and
 * frees everything. NULL is a no-op. */
void gw_loop_destroy(struct gw_loop *l);
struct event_base *gw_loop_base(struct gw_loop *l);
struct up_client *gw_loop_upstream(struct gw_loop *l);
/* This loop's share of an upstream's max_connections (the bound holds over all loops together). */
size_t gw_loop_upstream_max(const struct gw_loop *l, const struct conf_upstream *u);
struct store *gw_loop_store(struct gw_loop *l);
/* The loop's on_unknown: probe look-ups and sweeper (gateway/probe.h). */
struct gw_probe *gw_loop_probe(struct gw_loop *l);
/* The start-time configuration (this loop's share of the pool): what the store and the loop were built from. */
const struct conf *gw_loop_conf(struct gw_loop *l);
/* Loop thread only: the configuration new requests are served with (no reference is taken). */
struct gw_conf *gw_loop_current(struct gw_loop *l);
/* Set once the schema exists; idempotent requests get 503 until then. */
void gw_loop_set_schema_ready(struct gw_loop *l, bool ready);
bool gw_loop_schema_ready(struct gw_loop *l);
/* True when every loop of the process (this one alone when it has no group) has its schema and heard from
 * Postgres within the last second (store_postgres_healthy). Thread-safe. */
bool gw_loop_postgres_ready(struct gw_loop *l);
/* After this, new jobs are answered 503 at once (shutdown past the grace). */
void gw_loop_set_closing(struct gw_loop *l);
bool gw_loop_closing(struct gw_loop *l);
/* Jobs between submit and finish (for graceful shutdown). */
size_t gw_loop_jobs(struct gw_loop *l);
/* Loop thread only: the list of running jobs. */
struct gw_job;
void gw_loop_job_add(struct gw_loop *l, struct gw_job *job);
void gw_loop_job_remove(struct gw_loop *l, struct gw_job *job);
struct gw_job *gw_loop_first_job(struct gw_loop *l);
/* Loop thread only: ends every running job now (grace expired): upstream
 * transfers are cancelled, their records stay in flight (unknown after the
 * lease), the clients get 503 shutting-down. */
void gw_pipeline_abort_all(void *loop);

/* A set of loops (one per CPU by default): each serves the connections its
 * HTTP daemon accepted, with its own upstream client, Redis context and pool
 * share. */
struct gw_loops {
    struct gw_loop **v;
    size_t n;
};
/* Creates n loops (at most conf->pool). NULL + *err on failure. */
struct gw_loops *gw_loops_create(const struct conf *conf, size_t n, char **err);
/* Before gw_loops_start: every loop serves new requests with c (each takes a reference). */
void gw_loops_install(struct gw_loops *ls, struct gw_conf *c);
bool gw_loops_start(struct gw_loops *ls) CM_MUST_CHECK;
/* Running loops: each swaps to c on its own thread, between two events (each takes a reference and drops its old
 * one); waits up to timeout_ms for all of them. Returns false when a loop did not swap in time (it still will). */
bool gw_loops_swap(struct gw_loops *ls, struct gw_conf *c, uint64_t timeout_ms) CM_MUST_CHECK;
void gw_loops_destroy(struct gw_loops *ls); /* NULL is a no-op */
size_t gw_loops_jobs(struct gw_loops *ls);
void gw_loops_set_schema_ready(struct gw_loops *ls, bool ready);
/* Submits gw_pipeline_abort_all to every loop. */
void gw_loops_abort_all(struct gw_loops *ls);

/* ---- a job: one client request in the pipeline. Built by the front, run by
 * the pipeline and answered by the front after resume, all on the loop thread
 * whose HTTP daemon accepted the connection. */
struct gw_job {
    /* request (immutable once submitted) */
    const struct conf *conf;
    const struct conf_route *route; /* NULL: default upstream */
    size_t route_index;             /* or CM_ROUTE_DEFAULT */
    const struct conf_upstream *upstream;
    char *method;
    char *uri;               /* raw request target: path[?query] */
    char *path;              /* raw path, no query */
    char *query;             /* raw query without '?', "" when none */
    struct cm_hdrs fwd_hdrs; /* headers to forward (filtered, X-Forwarded-* added) */
    struct cm_buf body;
    bool idempotent;
    bool shadow; /* mode: shadow: claimed and recorded, but the client always gets the upstream's answer */
    char key[GW_KEY_MAX + 1];
    size_t key_len;
    uint8_t scope[32];
    uint8_t fp[32];
    uint64_t started_ms;

    /* answer (written by the pipeline before gw_job_finish) */
    int status;
    struct cm_hdrs resp_hdrs;
    struct cm_buf resp_body;
    bool replayed;
    enum cm_outcome outcome;

    /* front bookkeeping */
    void *conn; /* struct MHD_Connection * */
    atomic_bool done;
    bool submitted;
    bool answered;
    struct gw_loop *loop;
    void (*finish)(struct gw_job *job); /* set by the front: resumes the connection */

    /* pipeline state (loop thread only) */
    uint64_t token;
    uint64_t wait_deadline_ms;
    uint64_t wait_backoff_ms;
    struct event *timer;       /* wait backoff */
    struct event *renew_timer; /* lease renewal */
    struct up_transfer *transfer;
    struct cm_resp up_resp;                   /* upstream answer being stored */
    struct renew_ticket *renew_ticket;        /* a lease renewal in flight */
    bool store_pending;                       /* a store callback will come back to this job */
    bool probed;                              /* on_unknown: probe asked the upstream once for this request */
    uint64_t cache_epoch;                     /* replay cache epoch taken before the completion (gateway/cache.h) */
    struct gw_job *next_active, *prev_active; /* loop's list of running jobs */

    /* ordering guard (SPEC 6; gateway/ordering.c, store/order.h) */
    bool ordered;   /* the route's guard covers this request */
    int64_t seq;    /* its sequence, parsed by the front */
    char *resource; /* the resource instance (normalized path, heap, freed by the front) */
    size_t resource_len;
    uint64_t order_token;       /* fences the resource's in-flight marker */
    bool order_held;            /* this job holds the marker (settled before the answer) */
    bool order_waiting;         /* a guard retry is scheduled (the key's claim is still held) */
    bool gap_counted;           /* idemgate_sequence_gaps_total counted it once */
    bool ordered_may_wait;      /* the last guard statement was sent within hold (a refusal not final) */
    uint64_t order_deadline_ms; /* hold bound of the in-flight and gap waits */
    uint64_t order_backoff_ms;
    struct event *order_timer;       /* wait backoff */
    struct event *order_renew_timer; /* marker lease renewal */
};

/* Fills the answer with the gateway error, written in the route's errors format (problem+json without a route);
 * gateway/problem.c. extra: NULL or more JSON members ("\"current\":11"). Every error the pipeline and the front
 * answer goes through here. */
void gw_job_problem(struct gw_job *job, int status, const char *name, const char *title, const char *detail);
void gw_job_problem_ext(struct gw_job *job, int status, const char *name, const char *title, const char *detail,
                        const char *extra);
/* Loop thread: runs the pipeline for a submitted job; ends in gw_job_done. */
void gw_pipeline_run(void *job);
/* Loop thread: the answer is ready; hands the job back to the front. */
void gw_job_done(struct gw_job *job);

/* ---- the HTTP front (libmicrohttpd). */
struct gw_front;
/* Starts listening per conf (port 0: any free port). NULL + *err on failure. */
struct gw_front *gw_front_start(const struct conf *conf, struct gw_loops *loops, char **err);
uint16_t gw_front_port(const struct gw_front *f);
/* Requests handed to the loop whose answer has not been queued yet. */
long gw_front_suspended(struct gw_front *f);
/* Stops accepting new connections (existing ones are served). */
void gw_front_quiesce(struct gw_front *f);
/* Stops the daemon; every suspended connection must have been resumed. */
void gw_front_stop(struct gw_front *f);

/* ---- the admin listener. */
struct gw_admin;
struct gw_admin *gw_admin_start(const struct conf *conf, struct gw_loop *loop, char **err);
uint16_t gw_admin_port(const struct gw_admin *a);
void gw_admin_stop(struct gw_admin *a);
size_t gw_admin_jobs(struct gw_admin *a);

/* Formats an MHD log message as one key=value line. */
void gw_mhd_log(void *cls, const char *fmt, va_list ap);

#endif
